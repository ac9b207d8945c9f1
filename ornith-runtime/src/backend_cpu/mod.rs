//! The CPU backend — the reference every other backend is tested against. It composes the
//! slice operations of [`crate::cpu`] into the layer operations of [`Backend`], copying
//! transformers' cast points (docs/ARCHITECTURE.md §3, §6).

mod load;

pub use load::{available_memory, check_host_memory, plan_pools, PoolSizes};

use crate::cpu::{self, attention, conv, gdn, linear::LinearWeight, moe, norm};
use crate::graph::*;
use crate::weights::Checkpoint;
use anyhow::{ensure, Result};
use half::bf16;
use model_spec::{ExpertLayout, Precision};
use std::marker::PhantomData;

/// Multi-threaded CPU execution (rayon's global pool).
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend {
    /// How FP8 Linears are computed; [`Fp8Arith::Exact`] unless a test asks otherwise.
    pub fp8: Fp8Arith,
}

/// FP8 W8A8 arithmetic.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Arith {
    /// The engine's: E4M3 products exact in fp32, accumulated, times `sx · sw` (as the CUDA
    /// kernels and vLLM's scaled_mm compute it).
    #[default]
    Exact,
    /// transformers' simulation (dequantise weights and activations to bf16, bf16 matmul):
    /// only to show, in tests, that the remaining gap to the oracle is these roundings.
    OracleFakeQuant,
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend::default()
    }
}

/// A Linear `[out, in]`: BF16 weights in `w`, or E4M3 codes in `w8` with per-channel `scale`,
/// or NVFP4 packed codes in `w8` with E4M3 group scales in `scale8` and the global scale `global`.
pub struct CpuLinear<P: Prec> {
    pub out_features: usize,
    pub in_features: usize,
    w: Vec<bf16>,
    w8: Vec<u8>,
    scale: Vec<f32>,
    scale8: Vec<u8>,
    global: f32,
    _p: PhantomData<P>,
}

impl<P: Prec> CpuLinear<P> {
    /// The weight in the CPU ops' form; `P::KIND` is a constant, so this is resolved at
    /// compile time for each Linear of the graph.
    pub fn weight(&self, arith: Fp8Arith) -> LinearWeight<'_> {
        match (P::KIND, arith) {
            (Precision::Bf16, _) => LinearWeight::Bf16(&self.w),
            (Precision::Fp8, Fp8Arith::Exact) => LinearWeight::Fp8 { w: &self.w8, scale: &self.scale },
            (Precision::Fp8, Fp8Arith::OracleFakeQuant) => {
                LinearWeight::Fp8FakeQuant { w: &self.w8, scale: &self.scale }
            }
            (Precision::Nvfp4, _) => LinearWeight::Nvfp4 { packed: &self.w8, scale: &self.scale8, global: self.global },
        }
    }

    /// `y = x @ W^T` for `t` rows.
    pub fn apply(&self, b: &CpuBackend, x: &[bf16], t: usize) -> Vec<bf16> {
        let mut y = vec![bf16::ZERO; t * self.out_features];
        self.weight(b.fp8).apply(x, t, self.in_features, self.out_features, &mut y);
        y
    }

    /// BF16 weights, for the ops that take a plain matrix (router, shared-expert gate, lm_head).
    fn bf16_weight(&self, what: &str) -> Result<&[bf16]> {
        ensure!(P::KIND == Precision::Bf16, "{what} must be BF16 (the checkpoint stores it as {})", P::NAME);
        Ok(&self.w)
    }
}

/// The routed experts of one layer.
pub struct CpuExperts<G: Prec, U: Prec, D: Prec> {
    gate: Vec<CpuLinear<G>>,
    up: Vec<CpuLinear<U>>,
    down: Vec<CpuLinear<D>>,
}

/// Hidden states `[t, hidden]`.
pub struct CpuAct {
    pub t: usize,
    pub data: Vec<bf16>,
}

/// Conv state `[slots][K-1, conv_dim]` bf16 (pre-conv rows, oldest first) and recurrent state
/// `[slots][Hv, dk, dv]` f32 of one Gated DeltaNet layer.
pub struct CpuGdnPool {
    pub conv: Vec<bf16>,
    pub ssm: Vec<f32>,
    slots: usize,
}

impl CpuGdnPool {
    fn slot(&mut self, slot: usize) -> (&mut [bf16], &mut [f32]) {
        let (c, s) = (self.conv.len() / self.slots, self.ssm.len() / self.slots);
        (&mut self.conv[slot * c..][..c], &mut self.ssm[slot * s..][..s])
    }
}

/// K after norm and RoPE, V raw, of one attention layer: `[blocks][KV_BLOCK][Hkv, head_dim]` bf16.
pub struct CpuKvPool {
    pub k: Vec<bf16>,
    pub v: Vec<bf16>,
    blocks: usize,
}

impl CpuKvPool {
    /// Element offset of position `p` of a sequence with block table `table` (`row` = Hkv·hd).
    fn at(table: &[u32], p: usize, row: usize) -> usize {
        (table[p / KV_BLOCK] as usize * KV_BLOCK + p % KV_BLOCK) * row
    }
}

/// Logits `[rows, vocab]` as bf16 values widened to f32 (HF returns bf16 logits).
pub struct CpuLogits {
    pub rows: usize,
    pub vocab: usize,
    pub data: Vec<f32>,
}

fn gdn_dims(d: &Dims) -> gdn::GdnDims {
    gdn::GdnDims {
        hk: d.linear_num_key_heads,
        hv: d.linear_num_value_heads,
        dk: d.linear_key_head_dim,
        dv: d.linear_value_head_dim,
    }
}

fn eps(d: &Dims) -> f32 {
    d.rms_norm_eps as f32
}

impl CpuBackend {
    /// Gated DeltaNet over a batch: projections over every row, the conv and the delta rule per
    /// sequence from its slot (`gated_delta_rule` takes the recurrent form for one row and the
    /// chunked form for more), then the gated norm and `out_proj` over every row.
    fn gdn_layer<Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec>(
        &self,
        d: &Dims,
        norm_w: &[bf16],
        w: &GatedDeltaNet<Self, Qkv, Z, Bt, A, O>,
        pool: &mut CpuGdnPool,
        batch: &Batch,
        h: &mut CpuAct,
    ) -> Result<()> {
        let (t, hs) = (h.t, d.hidden_size);
        let mut x = vec![bf16::ZERO; t * hs];
        norm::rms_norm(&h.data, norm_w, hs, eps(d), &mut x);
        let qkv = w.in_proj_qkv.apply(self, &x, t);
        let z = w.in_proj_z.apply(self, &x, t);
        let b = w.in_proj_b.apply(self, &x, t);
        let a = w.in_proj_a.apply(self, &x, t);
        let c = d.conv_dim();
        let a_log: Vec<f32> = w.a_log.iter().map(|v| v.to_f32()).collect();
        let gd = gdn_dims(d);
        let (vd, hv) = (d.value_dim(), d.linear_num_value_heads);
        let mut o = vec![bf16::ZERO; t * vd];
        for (s, r0) in batch.seqs.iter().zip(batch.row_starts()) {
            let n = s.len;
            let (conv_st, ssm) = pool.slot(s.slot);
            let mut y = vec![bf16::ZERO; n * c];
            conv::conv_silu(&qkv[r0 * c..][..n * c], n, c, &w.conv1d, d.linear_conv_kernel_dim, conv_st, &mut y);
            gdn::gated_delta_rule(
                &y,
                &b[r0 * hv..][..n * hv],
                &a[r0 * hv..][..n * hv],
                &a_log,
                &w.dt_bias,
                n,
                gd,
                ssm,
                &mut o[r0 * vd..][..n * vd],
            );
        }
        let mut on = vec![bf16::ZERO; t * vd];
        norm::gated_rms_norm(&o, &z, &w.norm, d.linear_value_head_dim, eps(d), &mut on);
        let out = w.out_proj.apply(self, &on, t);
        norm::add_into(&mut h.data, &out);
        Ok(())
    }

    /// Gated attention over a batch: projections and q/k norms over every row; per sequence,
    /// partial RoPE at its own positions, K/V written into its blocks and causal attention over
    /// its positions gathered in order; output gate and `o_proj` over every row.
    fn attention_layer<Q: Prec, K: Prec, V: Prec, O: Prec>(
        &self,
        d: &Dims,
        norm_w: &[bf16],
        w: &GatedAttention<Self, Q, K, V, O>,
        pool: &mut CpuKvPool,
        batch: &Batch,
        h: &mut CpuAct,
    ) -> Result<()> {
        let (t, hs) = (h.t, d.hidden_size);
        let (nh, nkv, hd) = (d.num_attention_heads, d.num_key_value_heads, d.head_dim);
        let mut x = vec![bf16::ZERO; t * hs];
        norm::rms_norm(&h.data, norm_w, hs, eps(d), &mut x);
        let qg = w.q_proj.apply(self, &x, t);
        let mut q = vec![bf16::ZERO; t * nh * hd];
        let mut gate = vec![bf16::ZERO; t * nh * hd];
        attention::split_q_gate(&qg, t, nh, hd, &mut q, &mut gate);
        let k = w.k_proj.apply(self, &x, t);
        let v = w.v_proj.apply(self, &x, t);
        // q/k RMSNorm per head (zero-centred), then partial RoPE.
        let mut qn = vec![bf16::ZERO; q.len()];
        norm::rms_norm(&q, &w.q_norm, hd, eps(d), &mut qn);
        let mut kn = vec![bf16::ZERO; k.len()];
        norm::rms_norm(&k, &w.k_norm, hd, eps(d), &mut kn);
        let theta = d.rope_theta as f32;
        let row = nkv * hd;
        let mut o = vec![bf16::ZERO; t * nh * hd];
        for (s, r0) in batch.seqs.iter().zip(batch.row_starts()) {
            let n = s.len;
            let qs = &mut qn[r0 * nh * hd..][..n * nh * hd];
            let ks = &mut kn[r0 * row..][..n * row];
            attention::apply_rope(qs, n, nh, hd, d.rotary_dim, s.pos, theta);
            attention::apply_rope(ks, n, nkv, hd, d.rotary_dim, s.pos, theta);
            for i in 0..n {
                let at = CpuKvPool::at(&s.blocks, s.pos + i, row);
                pool.k[at..at + row].copy_from_slice(&ks[i * row..][..row]);
                pool.v[at..at + row].copy_from_slice(&v[(r0 + i) * row..][..row]);
            }
            let total = s.pos + n;
            let (mut kc, mut vc) = (Vec::with_capacity(total * row), Vec::with_capacity(total * row));
            for p in 0..total {
                let at = CpuKvPool::at(&s.blocks, p, row);
                kc.extend_from_slice(&pool.k[at..at + row]);
                vc.extend_from_slice(&pool.v[at..at + row]);
            }
            attention::attention(qs, n, s.pos, &kc, &vc, nh, nkv, hd, &mut o[r0 * nh * hd..][..n * nh * hd]);
        }
        attention::output_gate(&mut o, &gate);
        let out = w.o_proj.apply(self, &o, t);
        norm::add_into(&mut h.data, &out);
        Ok(())
    }
}

impl Backend for CpuBackend {
    type Linear<P: Prec> = CpuLinear<P>;
    type Experts<G: Prec, U: Prec, D: Prec> = CpuExperts<G, U, D>;
    type Vector = Vec<bf16>;
    type Embedding = Vec<bf16>;
    type Act = CpuAct;
    type GdnPool = CpuGdnPool;
    type KvPool = CpuKvPool;
    type Logits = CpuLogits;
    type StepGraphs = ();

    fn load_linear<P: Prec>(
        &self,
        ck: &Checkpoint,
        module: &str,
        out_features: usize,
        in_features: usize,
    ) -> Result<CpuLinear<P>> {
        self.linear(ck, module, out_features, in_features)
    }

    fn load_experts<G: Prec, U: Prec, D: Prec>(
        &self,
        ck: &Checkpoint,
        module: &str,
        layout: ExpertLayout,
        num_experts: usize,
        intermediate: usize,
        hidden: usize,
    ) -> Result<CpuExperts<G, U, D>> {
        self.experts(ck, module, layout, num_experts, intermediate, hidden)
    }

    /// Vectors are rounded to bf16 as transformers does when it loads the model in bf16
    /// (A_log and the gated-norm weight are stored F32 but cast at load).
    fn load_vector(&self, ck: &Checkpoint, name: &str, shape: &[usize]) -> Result<Vec<bf16>> {
        Ok(self.vector(ck, name, shape)?.into_iter().map(bf16::from_f32).collect())
    }

    fn load_embedding(&self, ck: &Checkpoint, name: &str, vocab: usize, hidden: usize) -> Result<Vec<bf16>> {
        self.embedding(ck, name, vocab, hidden)
    }

    fn new_gdn_pool(&self, d: &Dims, slots: usize) -> Result<CpuGdnPool> {
        let (conv, ssm) = d.gdn_state_elems();
        Ok(CpuGdnPool { conv: vec![bf16::ZERO; slots * conv], ssm: vec![0.0; slots * ssm], slots })
    }

    fn new_kv_pool(&self, d: &Dims, blocks: usize) -> Result<CpuKvPool> {
        let n = blocks * KV_BLOCK * d.num_key_value_heads * d.head_dim;
        Ok(CpuKvPool { k: vec![bf16::ZERO; n], v: vec![bf16::ZERO; n], blocks })
    }

    fn clear_slot(&self, p: &mut CpuGdnPool, slot: usize) -> Result<()> {
        ensure!(slot < p.slots, "state slot {slot} outside the pool of {}", p.slots);
        let (c, s) = p.slot(slot);
        c.fill(bf16::ZERO);
        s.fill(0.0);
        Ok(())
    }

    fn copy_slot(&self, p: &mut CpuGdnPool, from: usize, to: usize) -> Result<()> {
        ensure!(from < p.slots && to < p.slots, "state rows {from} -> {to} outside the pool of {}", p.slots);
        let (c, s) = (p.conv.len() / p.slots, p.ssm.len() / p.slots);
        p.conv.copy_within(from * c..(from + 1) * c, to * c);
        p.ssm.copy_within(from * s..(from + 1) * s, to * s);
        Ok(())
    }

    fn new_step_graphs(&self) -> Result<()> {
        Ok(())
    }

    fn step(
        &self,
        _g: &mut (),
        _t: &Vec<bf16>,
        _batch: &Batch,
        run: &mut dyn FnMut() -> Result<CpuLogits>,
    ) -> Result<CpuLogits> {
        run()
    }

    fn embed(&self, d: &Dims, table: &Vec<bf16>, batch: &Batch) -> Result<CpuAct> {
        let ids = &batch.ids;
        let mut data = vec![bf16::ZERO; ids.len() * d.hidden_size];
        cpu::embed::embed(ids, table, d.hidden_size, &mut data)?;
        Ok(CpuAct { t: ids.len(), data })
    }

    fn gated_deltanet<Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec>(
        &self,
        d: &Dims,
        norm: &Vec<bf16>,
        w: &GatedDeltaNet<Self, Qkv, Z, Bt, A, O>,
        pool: &mut CpuGdnPool,
        batch: &Batch,
        h: &mut CpuAct,
    ) -> Result<()> {
        self.gdn_layer(d, norm, w, pool, batch, h)
    }

    fn attention<Q: Prec, K: Prec, V: Prec, O: Prec>(
        &self,
        d: &Dims,
        norm: &Vec<bf16>,
        w: &GatedAttention<Self, Q, K, V, O>,
        pool: &mut CpuKvPool,
        batch: &Batch,
        h: &mut CpuAct,
    ) -> Result<()> {
        ensure!(
            batch.seqs.iter().flat_map(|s| &s.blocks).all(|&b| (b as usize) < pool.blocks),
            "a block table points outside the K/V pool of {} blocks",
            pool.blocks
        );
        self.attention_layer(d, norm, w, pool, batch, h)
    }

    fn sparse_moe<R: Prec, Eg: Prec, Eu: Prec, Ed: Prec, Sg: Prec, Su: Prec, Sd: Prec, Sgate: Prec>(
        &self,
        d: &Dims,
        norm_w: &Vec<bf16>,
        w: &SparseMoe<Self, R, Eg, Eu, Ed, Sg, Su, Sd, Sgate>,
        _batch: &Batch,
        h: &mut CpuAct,
    ) -> Result<()> {
        let (t, hs) = (h.t, d.hidden_size);
        let mut x = vec![bf16::ZERO; t * hs];
        norm::rms_norm(&h.data, norm_w, hs, eps(d), &mut x);
        let experts: Vec<moe::Mlp<'_>> = (0..w.experts.gate.len())
            .map(|e| moe::Mlp {
                gate: w.experts.gate[e].weight(self.fp8),
                up: w.experts.up[e].weight(self.fp8),
                down: w.experts.down[e].weight(self.fp8),
            })
            .collect();
        let wts = moe::MoeWeights {
            router: w.gate.bf16_weight("the router mlp.gate")?,
            experts: &experts,
            moe_inter: d.moe_intermediate_size,
            shared: moe::Mlp {
                gate: w.shared_gate_proj.weight(self.fp8),
                up: w.shared_up_proj.weight(self.fp8),
                down: w.shared_down_proj.weight(self.fp8),
            },
            shared_inter: d.shared_expert_intermediate_size,
            shared_gate: w.shared_expert_gate.bf16_weight("mlp.shared_expert_gate")?,
            top_k: d.num_experts_per_tok,
        };
        let mut out = vec![bf16::ZERO; t * hs];
        moe::moe(&x, t, hs, &wts, &mut out);
        norm::add_into(&mut h.data, &out);
        Ok(())
    }

    fn logits<P: Prec>(
        &self,
        d: &Dims,
        norm_w: &Vec<bf16>,
        lm_head: &CpuLinear<P>,
        batch: &Batch,
        h: &CpuAct,
    ) -> Result<CpuLogits> {
        let hs = d.hidden_size;
        let src: Vec<bf16> = if batch.all_rows {
            h.data.clone()
        } else {
            batch
                .seqs
                .iter()
                .zip(batch.row_starts())
                .flat_map(|(s, r0)| h.data[(r0 + s.len - 1) * hs..][..hs].iter().copied())
                .collect()
        };
        let rows = src.len() / hs;
        let mut x = vec![bf16::ZERO; rows * hs];
        norm::rms_norm(&src, norm_w, hs, eps(d), &mut x);
        let y = lm_head.apply(self, &x, rows);
        Ok(CpuLogits { rows, vocab: d.vocab_size, data: y.iter().map(|v| v.to_f32()).collect() })
    }

    fn sample(&self, logits: &CpuLogits, n: usize, rows: &[RowSample]) -> Result<Vec<Sampled>> {
        ensure!(n > 0 && n <= logits.vocab, "sampling {n} of {} logits", logits.vocab);
        rows.iter()
            .map(|r| {
                ensure!(r.row < logits.rows, "sampling row {} of {}", r.row, logits.rows);
                let l = &logits.data[r.row * logits.vocab..][..n];
                let mut bits = crate::sampling::bf16_bits(l);
                let raw = r.logprobs.map(|_| bits.clone());
                if let Some(p) = &r.penalties {
                    crate::sampling::apply_penalties(&mut bits, p);
                }
                if let Some(m) = &r.mask {
                    m.apply(&mut bits);
                }
                let id = crate::sampling::sample(&bits, &r.params, r.step)?;
                let logprobs = r
                    .logprobs
                    .zip(raw)
                    .map(|(w, raw)| Box::new(crate::logprobs::token_logprobs(&raw, w.forced.unwrap_or(id), w.top)));
                Ok(Sampled { id, logprobs })
            })
            .collect()
    }

    fn logits_to_host(&self, logits: &CpuLogits) -> Result<Vec<f32>> {
        Ok(logits.data.clone())
    }

    fn act_to_host(&self, h: &CpuAct) -> Result<Vec<f32>> {
        Ok(h.data.iter().map(|v| v.to_f32()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::SamplingParams;
    use crate::graph::Backend;

    /// The lm_head's padding rows (columns `n..`) never come out, whatever their logits, in any
    /// sampling mode; a row without a finite candidate is an error.
    fn row(p: &SamplingParams, step: u64) -> RowSample {
        RowSample { row: 0, params: *p, step, penalties: None, logprobs: None, mask: None }
    }

    #[test]
    fn padding_rows_are_never_sampled() {
        let b = CpuBackend::new();
        let mut data = vec![0.0f32; 16];
        data[3] = 1.0;
        data[12] = 100.0; // a padding row with a huge logit
        data[15] = f32::INFINITY;
        let l = CpuLogits { rows: 1, vocab: 16, data };
        let modes = [
            SamplingParams::greedy(),
            SamplingParams { temperature: 1.0, top_k: 20, top_p: 0.95, min_p: 0.0, seed: 1 },
            SamplingParams { temperature: 0.7, top_k: 0, top_p: 0.8, min_p: 0.0, seed: 2 },
            SamplingParams { temperature: 5.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 3 },
        ];
        for p in &modes {
            for step in 0..500 {
                assert!(b.sample(&l, 10, &[row(p, step)]).unwrap()[0].id < 10, "{p:?}");
            }
        }
        assert_eq!(b.sample(&l, 10, &[row(&modes[0], 0)]).unwrap(), [Sampled::id(3)]);
        let nan = CpuLogits { rows: 1, vocab: 4, data: vec![f32::NAN, f32::NAN, 7.0, 7.0] };
        assert!(b.sample(&nan, 2, &[row(&modes[0], 0)]).is_err());
        assert!(b.sample(&nan, 2, &[row(&modes[1], 0)]).is_err());
        assert!(b.sample(&l, 17, &[row(&modes[0], 0)]).is_err());
        assert!(b.sample(&l, 10, &[RowSample { row: 1, ..row(&modes[0], 0) }]).is_err());
    }

    /// Log-probabilities come from the row as the model gave it: before the penalties that
    /// change the draw, over the candidate columns only, of the forced token when one is forced.
    #[test]
    fn logprobs_are_the_models_before_penalties() {
        let b = CpuBackend::new();
        // Candidates 0..4 (column 4 is padding, larger than all).
        let l = CpuLogits { rows: 1, vocab: 5, data: vec![1.0, 4.0, 2.0, 3.5, 9.0] };
        let raw = crate::sampling::bf16_bits(&l.data[..4]);
        let want = |t: u32, top: usize| Box::new(crate::logprobs::token_logprobs(&raw, t, top));
        let greedy = SamplingParams::greedy();
        let mut r = row(&greedy, 0);
        r.logprobs = Some(WantLogprobs { top: 2, forced: None });
        let s = b.sample(&l, 4, std::slice::from_ref(&r)).unwrap();
        assert_eq!(s[0], Sampled { id: 1, logprobs: Some(want(1, 2)) });
        assert_eq!(s[0].logprobs.as_ref().unwrap().top.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 3]);
        // A repetition penalty on token 1 makes 3 the argmax; the reported figures are the raw row's.
        let mut st = crate::sampling::PenaltyState::new(
            crate::engine::Penalties { repetition: 4.0, ..crate::engine::Penalties::NONE },
            &[1],
        );
        st.add_output(1);
        r.penalties = Some(std::sync::Arc::new(st));
        let s = b.sample(&l, 4, std::slice::from_ref(&r)).unwrap();
        assert_eq!(s[0], Sampled { id: 3, logprobs: Some(want(3, 2)) });
        // A forced token: its probability under the model, whatever was drawn.
        r.logprobs = Some(WantLogprobs { top: 0, forced: Some(0) });
        let s = b.sample(&l, 4, &[r]).unwrap();
        assert_eq!(s[0], Sampled { id: 3, logprobs: Some(want(0, 0)) });
    }
}
