//! The CPU backend — the reference every other backend is tested against. It composes the
//! slice operations of [`crate::cpu`] into the layer operations of [`Backend`], copying
//! transformers' cast points (docs/ARCHITECTURE.md §3, §6).

mod load;

pub use load::{available_memory, check_host_memory};

use crate::cpu::{self, attention, conv, gdn, linear::LinearWeight, moe, norm};
use crate::engine::SamplingParams;
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

/// A Linear `[out, in]`: BF16 weights in `w`, or E4M3 codes in `w8` with per-channel `scale`.
pub struct CpuLinear<P: Prec> {
    pub out_features: usize,
    pub in_features: usize,
    w: Vec<bf16>,
    w8: Vec<u8>,
    scale: Vec<f32>,
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

/// Conv state `[K-1, conv_dim]` (pre-conv rows, bf16) and recurrent state `[Hv, dk, dv]` (fp32).
pub struct CpuGdnState {
    pub conv: Vec<bf16>,
    pub ssm: Vec<f32>,
}

/// K/V after norm and RoPE (K) / raw (V), `[pos, Hkv, head_dim]`, grown as tokens arrive.
pub struct CpuKvCache {
    pub k: Vec<bf16>,
    pub v: Vec<bf16>,
    pub max_context: usize,
}

/// Logits `[rows, vocab]` as bf16 values widened to f32 (HF returns bf16 logits).
pub struct CpuLogits {
    pub rows: usize,
    pub vocab: usize,
    pub data: Vec<f32>,
}

fn gdn_dims(d: &ModelDims) -> gdn::GdnDims {
    gdn::GdnDims {
        hk: d.linear_num_key_heads,
        hv: d.linear_num_value_heads,
        dk: d.linear_key_head_dim,
        dv: d.linear_value_head_dim,
    }
}

fn eps(d: &ModelDims) -> f32 {
    d.rms_norm_eps as f32
}

impl CpuBackend {
    /// Shared body of the Gated DeltaNet layer; `gated_delta_rule` picks the recurrent form for
    /// one token and the chunked form otherwise.
    fn gdn_layer<Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec>(
        &self,
        d: &ModelDims,
        norm_w: &[bf16],
        w: &GatedDeltaNet<Self, Qkv, Z, Bt, A, O>,
        st: &mut CpuGdnState,
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
        let mut y = vec![bf16::ZERO; t * c];
        conv::conv_silu(&qkv, t, c, &w.conv1d, d.conv_kernel, &mut st.conv, &mut y);
        let a_log: Vec<f32> = w.a_log.iter().map(|v| v.to_f32()).collect();
        let gd = gdn_dims(d);
        let mut o = vec![bf16::ZERO; t * d.value_dim()];
        gdn::gated_delta_rule(&y, &b, &a, &a_log, &w.dt_bias, t, gd, &mut st.ssm, &mut o);
        let mut on = vec![bf16::ZERO; t * d.value_dim()];
        norm::gated_rms_norm(&o, &z, &w.norm, d.linear_value_head_dim, eps(d), &mut on);
        let out = w.out_proj.apply(self, &on, t);
        norm::add_into(&mut h.data, &out);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_layer<Q: Prec, K: Prec, V: Prec, O: Prec>(
        &self,
        d: &ModelDims,
        norm_w: &[bf16],
        w: &GatedAttention<Self, Q, K, V, O>,
        cache: &mut CpuKvCache,
        pos: usize,
        h: &mut CpuAct,
    ) -> Result<()> {
        let (t, hs) = (h.t, d.hidden_size);
        let (nh, nkv, hd) = (d.num_attention_heads, d.num_key_value_heads, d.head_dim);
        ensure!(
            cache.k.len() == pos * nkv * hd,
            "K/V cache holds {} positions, expected {pos}",
            cache.k.len() / (nkv * hd)
        );
        ensure!(pos + t <= cache.max_context, "K/V cache of {} tokens is full", cache.max_context);
        let mut x = vec![bf16::ZERO; t * hs];
        norm::rms_norm(&h.data, norm_w, hs, eps(d), &mut x);
        let qg = w.q_proj.apply(self, &x, t);
        let mut q = vec![bf16::ZERO; t * nh * hd];
        let mut gate = vec![bf16::ZERO; t * nh * hd];
        attention::split_q_gate(&qg, t, nh, hd, &mut q, &mut gate);
        let mut k = w.k_proj.apply(self, &x, t);
        let v = w.v_proj.apply(self, &x, t);
        // q/k RMSNorm per head (zero-centred), then partial RoPE.
        let mut qn = vec![bf16::ZERO; q.len()];
        norm::rms_norm(&q, &w.q_norm, hd, eps(d), &mut qn);
        let mut kn = vec![bf16::ZERO; k.len()];
        norm::rms_norm(&k, &w.k_norm, hd, eps(d), &mut kn);
        k = kn;
        let theta = d.rope_theta as f32;
        attention::apply_rope(&mut qn, t, nh, hd, d.rotary_dim, pos, theta);
        attention::apply_rope(&mut k, t, nkv, hd, d.rotary_dim, pos, theta);
        cache.k.extend_from_slice(&k);
        cache.v.extend_from_slice(&v);
        let mut o = vec![bf16::ZERO; t * nh * hd];
        attention::attention(&qn, t, pos, &cache.k, &cache.v, nh, nkv, hd, &mut o);
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
    type GdnState = CpuGdnState;
    type KvCache = CpuKvCache;
    type Logits = CpuLogits;
    type DecodeGraph = ();

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

    fn new_gdn_state(&self, d: &ModelDims) -> Result<CpuGdnState> {
        Ok(CpuGdnState {
            conv: vec![bf16::ZERO; (d.conv_kernel - 1) * d.conv_dim()],
            ssm: vec![0.0; d.linear_num_value_heads * d.linear_key_head_dim * d.linear_value_head_dim],
        })
    }

    fn new_kv_cache(&self, _d: &ModelDims, max_context: usize) -> Result<CpuKvCache> {
        Ok(CpuKvCache { k: Vec::new(), v: Vec::new(), max_context })
    }

    fn reset_gdn_state(&self, s: &mut CpuGdnState) {
        s.conv.fill(bf16::ZERO);
        s.ssm.fill(0.0);
    }

    fn reset_kv_cache(&self, c: &mut CpuKvCache) {
        c.k.clear();
        c.v.clear();
    }

    fn new_decode_graph(&self) -> Result<()> {
        Ok(())
    }

    /// The CPU backend records nothing: every step runs `step`.
    fn decode_step(
        &self,
        _g: &mut (),
        _t: &Vec<bf16>,
        _id: u32,
        _pos: usize,
        step: &mut dyn FnMut() -> Result<CpuLogits>,
    ) -> Result<CpuLogits> {
        step()
    }

    fn embed(&self, d: &ModelDims, table: &Vec<bf16>, ids: &[u32]) -> Result<CpuAct> {
        let mut data = vec![bf16::ZERO; ids.len() * d.hidden_size];
        cpu::embed::embed(ids, table, d.hidden_size, &mut data)?;
        Ok(CpuAct { t: ids.len(), data })
    }

    fn gated_deltanet_prefill<Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec>(
        &self,
        d: &ModelDims,
        norm: &Vec<bf16>,
        w: &GatedDeltaNet<Self, Qkv, Z, Bt, A, O>,
        state: &mut CpuGdnState,
        h: &mut CpuAct,
    ) -> Result<()> {
        self.gdn_layer(d, norm, w, state, h)
    }

    fn gated_deltanet_decode<Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec>(
        &self,
        d: &ModelDims,
        norm: &Vec<bf16>,
        w: &GatedDeltaNet<Self, Qkv, Z, Bt, A, O>,
        state: &mut CpuGdnState,
        h: &mut CpuAct,
    ) -> Result<()> {
        ensure!(h.t == 1, "decode runs one token, got {}", h.t);
        self.gdn_layer(d, norm, w, state, h)
    }

    fn attention_prefill<Q: Prec, K: Prec, V: Prec, O: Prec>(
        &self,
        d: &ModelDims,
        norm: &Vec<bf16>,
        w: &GatedAttention<Self, Q, K, V, O>,
        cache: &mut CpuKvCache,
        pos: usize,
        h: &mut CpuAct,
    ) -> Result<()> {
        self.attention_layer(d, norm, w, cache, pos, h)
    }

    fn attention_decode<Q: Prec, K: Prec, V: Prec, O: Prec>(
        &self,
        d: &ModelDims,
        norm: &Vec<bf16>,
        w: &GatedAttention<Self, Q, K, V, O>,
        cache: &mut CpuKvCache,
        pos: usize,
        h: &mut CpuAct,
    ) -> Result<()> {
        ensure!(h.t == 1, "decode runs one token, got {}", h.t);
        self.attention_layer(d, norm, w, cache, pos, h)
    }

    fn sparse_moe<R: Prec, Eg: Prec, Eu: Prec, Ed: Prec, Sg: Prec, Su: Prec, Sd: Prec, Sgate: Prec>(
        &self,
        d: &ModelDims,
        norm_w: &Vec<bf16>,
        w: &SparseMoe<Self, R, Eg, Eu, Ed, Sg, Su, Sd, Sgate>,
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
            shared_inter: d.shared_intermediate_size,
            shared_gate: w.shared_expert_gate.bf16_weight("mlp.shared_expert_gate")?,
            top_k: d.top_k,
        };
        let mut out = vec![bf16::ZERO; t * hs];
        moe::moe(&x, t, hs, &wts, &mut out);
        norm::add_into(&mut h.data, &out);
        Ok(())
    }

    fn logits<P: Prec>(
        &self,
        d: &ModelDims,
        norm_w: &Vec<bf16>,
        lm_head: &CpuLinear<P>,
        h: &CpuAct,
        all_rows: bool,
    ) -> Result<CpuLogits> {
        let hs = d.hidden_size;
        let (rows, src) = if all_rows { (h.t, &h.data[..]) } else { (1, &h.data[(h.t - 1) * hs..]) };
        let mut x = vec![bf16::ZERO; rows * hs];
        norm::rms_norm(src, norm_w, hs, eps(d), &mut x);
        let y = lm_head.apply(self, &x, rows);
        Ok(CpuLogits { rows, vocab: d.vocab_size, data: y.iter().map(|v| v.to_f32()).collect() })
    }

    fn sample(&self, logits: &CpuLogits, n: usize, params: &SamplingParams, step: u64) -> Result<u32> {
        ensure!(n > 0 && n <= logits.vocab, "sampling {n} of {} logits", logits.vocab);
        let last = &logits.data[(logits.rows - 1) * logits.vocab..][..n];
        crate::sampling::sample(&crate::sampling::bf16_bits(last), params, step)
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
    use crate::graph::Backend;

    /// The lm_head's padding rows (columns `n..`) never come out, whatever their logits, in any
    /// sampling mode; a row without a finite candidate is an error.
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
                assert!(b.sample(&l, 10, p, step).unwrap() < 10, "{p:?}");
            }
        }
        assert_eq!(b.sample(&l, 10, &modes[0], 0).unwrap(), 3);
        let nan = CpuLogits { rows: 1, vocab: 4, data: vec![f32::NAN, f32::NAN, 7.0, 7.0] };
        assert!(b.sample(&nan, 2, &modes[0], 0).is_err());
        assert!(b.sample(&nan, 2, &modes[1], 0).is_err());
        assert!(b.sample(&l, 17, &modes[0], 0).is_err());
    }
}
