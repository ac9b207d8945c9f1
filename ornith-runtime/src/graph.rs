//! Building blocks of the typed model graph that `ornith_macros::model!` emits.
//!
//! The macro decides, from the checkpoint's spec, the type of every layer: a Gated DeltaNet or a
//! gated full-attention mixer, and the precision (`Fp8`, `Nvfp4` or `Bf16`) of every Linear as a type
//! parameter. Backends implement [`Backend`] at the level of layer operations over a [`Batch`]
//! (rows of several sequences: one decode token of some, a prefill chunk of others); the
//! generated `forward` is a straight line of calls into it, with no match on layer kind.
//! A backend's `Linear<P>` branches on `P::KIND`, a constant, so the precision choice is made
//! at compile time by monomorphisation.

use crate::weights::Checkpoint;
use model_spec::{ExpertLayout, Precision};

/// A Linear precision known at compile time.
pub trait Prec: 'static + Send + Sync {
    const KIND: Precision;
    const NAME: &'static str;
}

/// BF16 weights, BF16 activations, fp32 accumulation.
pub struct Bf16;
/// compressed-tensors W8A8: E4M3 weights × per-channel scale, per-token dynamic E4M3 activations.
pub struct Fp8;
/// compressed-tensors NVFP4A16: E2M1 weights, an E4M3 scale per 16 weights divided by an F32
/// global scale, BF16 activations (`model_spec::Precision::Nvfp4` states the dequantisation).
pub struct Nvfp4;

impl Prec for Bf16 {
    const KIND: Precision = Precision::Bf16;
    const NAME: &'static str = "BF16";
}
impl Prec for Fp8 {
    const KIND: Precision = Precision::Fp8;
    const NAME: &'static str = "FP8";
}
impl Prec for Nvfp4 {
    const KIND: Precision = Precision::Nvfp4;
    const NAME: &'static str = "NVFP4";
}

/// Model dimensions with config.json's names (the macro writes one `DIMS`).
pub use model_spec::Dims;

/// Gated DeltaNet mixer weights (`linear_attn`).
pub struct GatedDeltaNet<B: Backend, Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec> {
    pub in_proj_qkv: B::Linear<Qkv>,
    pub in_proj_z: B::Linear<Z>,
    pub in_proj_b: B::Linear<Bt>,
    pub in_proj_a: B::Linear<A>,
    /// `conv1d.weight` `[conv_dim, 1, K]` as `[conv_dim, K]`.
    pub conv1d: B::Vector,
    pub dt_bias: B::Vector,
    pub a_log: B::Vector,
    /// Gated RMSNorm weight (plain, not zero-centred) `[dv]`.
    pub norm: B::Vector,
    pub out_proj: B::Linear<O>,
}

/// Gated full-attention mixer weights (`self_attn`).
pub struct GatedAttention<B: Backend, Q: Prec, K: Prec, V: Prec, O: Prec> {
    /// `[heads · 2 · head_dim, hidden]`: per head 256 query rows then 256 gate rows.
    pub q_proj: B::Linear<Q>,
    pub k_proj: B::Linear<K>,
    pub v_proj: B::Linear<V>,
    pub o_proj: B::Linear<O>,
    pub q_norm: B::Vector,
    pub k_norm: B::Vector,
}

/// Sparse MoE block: router, routed experts, gated shared expert.
pub struct SparseMoe<B: Backend, R: Prec, Eg: Prec, Eu: Prec, Ed: Prec, Sg: Prec, Su: Prec, Sd: Prec, Sgate: Prec> {
    pub gate: B::Linear<R>,
    pub experts: B::Experts<Eg, Eu, Ed>,
    pub shared_gate_proj: B::Linear<Sg>,
    pub shared_up_proj: B::Linear<Su>,
    pub shared_down_proj: B::Linear<Sd>,
    pub shared_expert_gate: B::Linear<Sgate>,
}

/// One decoder layer: pre-norm mixer with residual, pre-norm MoE with residual.
pub struct DecoderLayer<B: Backend, M, F> {
    pub input_layernorm: B::Vector,
    pub mixer: M,
    pub post_attention_layernorm: B::Vector,
    pub mlp: F,
}

/// Tokens per K/V block. Every full-attention layer keeps its K/V in a pool of such blocks; a
/// sequence's block table maps its positions `[i·KV_BLOCK, (i+1)·KV_BLOCK)` to block `table[i]`,
/// so sequences of any length share one pool.
pub const KV_BLOCK: usize = 256;

/// The rows one sequence contributes to a step: tokens at positions `pos .. pos + len`, its
/// recurrent state in `slot` of every Gated DeltaNet pool, its K/V in `blocks` of every
/// attention pool (`blocks` covers at least `pos + len` positions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqRows {
    pub slot: usize,
    pub pos: usize,
    pub len: usize,
    pub blocks: Vec<u32>,
}

/// One forward step over several sequences. The rows are laid out sequence after sequence in
/// `seqs` order; `ids` holds one token per row. A sequence with `len == 1` past its prompt is a
/// decode row; one with more rows (or its first) is a prefill chunk. Each row's arithmetic
/// depends only on its own sequence (batch invariance): a backend may group rows into one
/// kernel only where that holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    pub ids: Vec<u32>,
    pub seqs: Vec<SeqRows>,
    /// Logits of every row (tests) instead of each sequence's last row (serving).
    pub all_rows: bool,
}

impl Batch {
    /// A batch of one sequence.
    pub fn single(ids: &[u32], slot: usize, pos: usize, blocks: Vec<u32>, all_rows: bool) -> Self {
        Batch { ids: ids.to_vec(), seqs: vec![SeqRows { slot, pos, len: ids.len(), blocks }], all_rows }
    }
    /// Rows of the step.
    pub fn rows(&self) -> usize {
        self.ids.len()
    }
    /// Whether every sequence contributes exactly one row (a decode step a backend may record
    /// and replay for this number of sequences).
    pub fn is_decode(&self) -> bool {
        !self.all_rows && self.seqs.iter().all(|s| s.len == 1)
    }
    /// First row of each sequence.
    pub fn row_starts(&self) -> Vec<usize> {
        let mut r = 0;
        self.seqs
            .iter()
            .map(|s| {
                let r0 = r;
                r += s.len;
                r0
            })
            .collect()
    }
    /// Rows of the logits a forward over this batch returns.
    pub fn logit_rows(&self) -> usize {
        if self.all_rows {
            self.rows()
        } else {
            self.seqs.len()
        }
    }
    /// Checks the layout: rows add up, no empty sequence, no slot twice, tables cover the rows
    /// and stay inside pools of `slots` slots and `blocks` blocks, positions fit `max_context`.
    pub fn validate(&self, slots: usize, blocks: usize, max_context: usize) -> anyhow::Result<()> {
        anyhow::ensure!(!self.seqs.is_empty(), "a step of no sequences");
        let rows: usize = self.seqs.iter().map(|s| s.len).sum();
        anyhow::ensure!(rows == self.ids.len(), "the batch has {} ids for {rows} rows", self.ids.len());
        let mut seen = std::collections::HashSet::new();
        for s in &self.seqs {
            anyhow::ensure!(s.len > 0, "a sequence with no rows in the batch");
            anyhow::ensure!(s.slot < slots, "state slot {} outside the pool of {slots}", s.slot);
            anyhow::ensure!(seen.insert(s.slot), "state slot {} used twice in one step", s.slot);
            let end = s.pos + s.len;
            anyhow::ensure!(end <= max_context, "sequence of {end} tokens exceeds the context of {max_context}");
            anyhow::ensure!(
                s.blocks.len() * KV_BLOCK >= end,
                "a block table of {} blocks cannot hold {end} positions",
                s.blocks.len()
            );
            if let Some(b) = s.blocks.iter().find(|&&b| b as usize >= blocks) {
                anyhow::bail!("K/V block {b} outside the pool of {blocks}");
            }
        }
        Ok(())
    }
}

/// Which logits row to sample for one sequence, how, and at which step of its random stream;
/// with penalties, the tokens they apply to (the backend penalises the row first:
/// [`crate::sampling::penalize`]); with `logprobs`, what to report of the row as the model gave
/// it (before the penalties); with `mask`, the only ids it may draw.
#[derive(Debug, Clone, PartialEq)]
pub struct RowSample {
    pub row: usize,
    pub params: crate::engine::SamplingParams,
    pub step: u64,
    pub penalties: Option<std::sync::Arc<crate::sampling::PenaltyState>>,
    pub logprobs: Option<WantLogprobs>,
    /// The ids a grammar allows (structured output): the others' logits become −∞ after the
    /// penalties, so only allowed ids can come out.
    pub mask: Option<std::sync::Arc<crate::engine::TokenMask>>,
}

/// The log-probabilities a row reports ([`crate::logprobs::token_logprobs`]): of the token the
/// sequence outputs — `forced` when the engine replaces the draw with a forced token, else the
/// draw — and of the `top` most likely candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WantLogprobs {
    pub top: usize,
    pub forced: Option<u32>,
}

/// One sampled row: the drawn id and, where the row asked, its log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub id: u32,
    pub logprobs: Option<Box<crate::logprobs::TokenLogprobs>>,
}

impl Sampled {
    pub fn id(id: u32) -> Self {
        Sampled { id, logprobs: None }
    }
}

/// A compute backend at the level of layer operations. Each method documents the math in the
/// CPU backend, which is the reference.
pub trait Backend: Sized + Send {
    /// A weight matrix `[out, in]` of precision `P`.
    type Linear<P: Prec>: Send + Sync;
    /// The packed routed experts of one layer.
    type Experts<G: Prec, U: Prec, D: Prec>: Send + Sync;
    /// A small parameter vector (norm weights, conv taps, A_log, dt_bias): bf16 values (rounded at
    /// load from the stored BF16/F32, as transformers does loading the model in bf16; a backend
    /// may also keep their exact f32 widening).
    type Vector: Send + Sync;
    /// The embedding table `[vocab, hidden]` (BF16).
    type Embedding: Send + Sync;
    /// Hidden states `[rows, hidden]` (BF16) of one step.
    type Act;
    /// Conv state and fp32 recurrent state of one Gated DeltaNet layer, for every state slot.
    type GdnPool: Send;
    /// The K/V blocks of one full-attention layer ([`KV_BLOCK`] positions each).
    type KvPool: Send;
    /// Logits `[rows, vocab]` of one step, readable by [`Backend::sample`] and the host.
    type Logits;
    /// What a backend keeps to replay decode steps (the CUDA backend: one captured CUDA graph
    /// per number of sequences). One per set of pools.
    type StepGraphs: Send;

    // ---- loading: every tensor by its exact checkpoint name -------------------------
    fn load_linear<P: Prec>(
        &self,
        ck: &Checkpoint,
        module: &str,
        out_features: usize,
        in_features: usize,
    ) -> anyhow::Result<Self::Linear<P>>;
    #[allow(clippy::too_many_arguments)]
    fn load_experts<G: Prec, U: Prec, D: Prec>(
        &self,
        ck: &Checkpoint,
        module: &str,
        layout: ExpertLayout,
        num_experts: usize,
        intermediate: usize,
        hidden: usize,
    ) -> anyhow::Result<Self::Experts<G, U, D>>;
    /// Loads a vector (BF16 or F32 on disk) whose element count is `shape.iter().product()`.
    fn load_vector(&self, ck: &Checkpoint, name: &str, shape: &[usize]) -> anyhow::Result<Self::Vector>;
    fn load_embedding(
        &self,
        ck: &Checkpoint,
        name: &str,
        vocab: usize,
        hidden: usize,
    ) -> anyhow::Result<Self::Embedding>;

    // ---- state pools ----------------------------------------------------------------------
    /// Recurrent state for `slots` sequences, zeroed.
    fn new_gdn_pool(&self, d: &Dims, slots: usize) -> anyhow::Result<Self::GdnPool>;
    /// `blocks` K/V blocks (contents undefined until written).
    fn new_kv_pool(&self, d: &Dims, blocks: usize) -> anyhow::Result<Self::KvPool>;
    /// Zeroes one slot's conv and recurrent state (a new sequence starts from it).
    fn clear_slot(&self, p: &mut Self::GdnPool, slot: usize) -> anyhow::Result<()>;
    /// Copies row `from` of a recurrent pool (conv and recurrent state) to row `to` (a prefix
    /// cache snapshot is a copy of a sequence's row; a sequence resumes from a copy of one).
    fn copy_slot(&self, p: &mut Self::GdnPool, from: usize, to: usize) -> anyhow::Result<()>;
    fn new_step_graphs(&self) -> anyhow::Result<Self::StepGraphs>;

    // ---- one step ---------------------------------------------------------------------
    /// Runs one forward step over `batch` (already validated against the pools). `run` issues
    /// the step's operations (embed, every layer, `logits`) and returns the logits. For a decode
    /// batch ([`Batch::is_decode`]) a backend may run `run` once while recording it and replay
    /// the recording on later calls with the same number of sequences and the same `table`
    /// instead of calling `run` (the CUDA backend captures a CUDA graph; its kernels read ids,
    /// positions, slots and block tables from device memory this method fills). `run` must
    /// therefore issue the same operations for every decode batch of one size, with all
    /// host-side checks done before. The CPU backend just calls `run`.
    fn step(
        &self,
        g: &mut Self::StepGraphs,
        table: &Self::Embedding,
        batch: &Batch,
        run: &mut dyn FnMut() -> anyhow::Result<Self::Logits>,
    ) -> anyhow::Result<Self::Logits>;

    // ---- layer operations (over every row of the step) ----------------------------------
    fn embed(&self, d: &Dims, table: &Self::Embedding, batch: &Batch) -> anyhow::Result<Self::Act>;

    /// `h = h + GDN(RMSNorm(h))`: each sequence's rows continue from its slot of `pool`
    /// (chunked form for a prefill chunk, recurrent form for one token).
    fn gated_deltanet<Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec>(
        &self,
        d: &Dims,
        norm: &Self::Vector,
        w: &GatedDeltaNet<Self, Qkv, Z, Bt, A, O>,
        pool: &mut Self::GdnPool,
        batch: &Batch,
        h: &mut Self::Act,
    ) -> anyhow::Result<()>;

    /// `h = h + Attn(RMSNorm(h))`: each sequence's rows at positions `pos .. pos + len` write
    /// their K/V into its blocks and attend causally over its positions `0 ..= p`.
    fn attention<Q: Prec, K: Prec, V: Prec, O: Prec>(
        &self,
        d: &Dims,
        norm: &Self::Vector,
        w: &GatedAttention<Self, Q, K, V, O>,
        pool: &mut Self::KvPool,
        batch: &Batch,
        h: &mut Self::Act,
    ) -> anyhow::Result<()>;

    /// `h = h + MoE(RMSNorm(h))`, row by row.
    #[allow(clippy::too_many_arguments)]
    fn sparse_moe<R: Prec, Eg: Prec, Eu: Prec, Ed: Prec, Sg: Prec, Su: Prec, Sd: Prec, Sgate: Prec>(
        &self,
        d: &Dims,
        norm: &Self::Vector,
        w: &SparseMoe<Self, R, Eg, Eu, Ed, Sg, Su, Sd, Sgate>,
        batch: &Batch,
        h: &mut Self::Act,
    ) -> anyhow::Result<()>;

    /// Final RMSNorm and lm_head on each sequence's last row (or, with `batch.all_rows`, on
    /// every row): `[batch.logit_rows(), vocab]`.
    fn logits<P: Prec>(
        &self,
        d: &Dims,
        norm: &Self::Vector,
        lm_head: &Self::Linear<P>,
        batch: &Batch,
        h: &Self::Act,
    ) -> anyhow::Result<Self::Logits>;

    /// Samples one token from the first `n` columns of each requested row of `logits` where the
    /// backend runs (`crate::sampling` semantics, bit for bit; `n` is the tokenizer's vocabulary,
    /// so the lm_head's padding rows never come out). A row without a finite logit is an error.
    /// Rows that ask for log-probabilities get them from their first `n` columns before any
    /// penalty edits them.
    fn sample(&self, logits: &Self::Logits, n: usize, rows: &[RowSample]) -> anyhow::Result<Vec<Sampled>>;

    /// Logits as host f32, row-major `[rows, vocab]` (tests).
    fn logits_to_host(&self, logits: &Self::Logits) -> anyhow::Result<Vec<f32>>;

    /// Hidden states as host f32 (tests, observers).
    fn act_to_host(&self, h: &Self::Act) -> anyhow::Result<Vec<f32>>;
}
