//! Building blocks of the typed model graph that `ornith_macros::model!` emits.
//!
//! The macro decides, from the checkpoint's spec, the type of every layer: a Gated DeltaNet or a
//! gated full-attention mixer, and the precision (`Fp8` or `Bf16`) of every Linear as a type
//! parameter. Backends implement [`Backend`] at the level of layer operations; the generated
//! `prefill` and `decode_step` are straight lines of calls into it, with no match on layer kind.
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

impl Prec for Bf16 {
    const KIND: Precision = Precision::Bf16;
    const NAME: &'static str = "BF16";
}
impl Prec for Fp8 {
    const KIND: Precision = Precision::Fp8;
    const NAME: &'static str = "FP8";
}

/// Model dimensions as compile-time constants (the macro writes one `DIMS`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelDims {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub conv_kernel: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub moe_intermediate_size: usize,
    pub shared_intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
}

impl ModelDims {
    pub const fn key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    pub const fn value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    pub const fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

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

/// A compute backend at the level of layer operations. Each method documents the math in the
/// CPU backend, which is the reference.
pub trait Backend: Sized + Send + Sync {
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
    /// Hidden states `[T, hidden]` (BF16).
    type Act;
    /// Conv state and recurrent state of one Gated DeltaNet layer.
    type GdnState: Send;
    /// K/V cache of one full-attention layer.
    type KvCache: Send;
    /// Logits of the last position, host-readable.
    type Logits;
    /// What a backend keeps between decode steps of one sequence to replay them (the CUDA
    /// backend: one captured CUDA graph of the whole step). One per [`State`](crate) of the
    /// generated model.
    type DecodeGraph: Send;

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

    // ---- state ------------------------------------------------------------------------
    fn new_gdn_state(&self, d: &ModelDims) -> anyhow::Result<Self::GdnState>;
    fn new_kv_cache(&self, d: &ModelDims, max_context: usize) -> anyhow::Result<Self::KvCache>;
    fn reset_gdn_state(&self, s: &mut Self::GdnState);
    fn reset_kv_cache(&self, c: &mut Self::KvCache);
    fn new_decode_graph(&self) -> anyhow::Result<Self::DecodeGraph>;

    // ---- one decode step ----------------------------------------------------------------
    /// Runs one decode step of token `id` at position `pos`. `step` issues the step's
    /// operations (embed, every layer's `*_decode`, `logits` of the last row) and returns the
    /// logits. A backend may run `step` once while recording it and replay the recording on
    /// later calls with the same `g` and `table` instead of calling `step` (the CUDA backend
    /// captures a CUDA graph; its decode kernels read the token and the position from device
    /// memory this method fills). `step` must therefore issue the same operations at every
    /// position, with all host-side checks done before (the generated `decode_step` checks the
    /// context length). The CPU backend just calls `step`.
    fn decode_step(
        &self,
        g: &mut Self::DecodeGraph,
        table: &Self::Embedding,
        id: u32,
        pos: usize,
        step: &mut dyn FnMut() -> anyhow::Result<Self::Logits>,
    ) -> anyhow::Result<Self::Logits>;

    // ---- layer operations -------------------------------------------------------------
    fn embed(&self, d: &ModelDims, table: &Self::Embedding, ids: &[u32]) -> anyhow::Result<Self::Act>;

    /// `h = h + GDN(RMSNorm(h))` over T tokens continuing from `state` (chunked form).
    fn gated_deltanet_prefill<Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec>(
        &self,
        d: &ModelDims,
        norm: &Self::Vector,
        w: &GatedDeltaNet<Self, Qkv, Z, Bt, A, O>,
        state: &mut Self::GdnState,
        h: &mut Self::Act,
    ) -> anyhow::Result<()>;
    /// Same for one token (recurrent form).
    fn gated_deltanet_decode<Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec>(
        &self,
        d: &ModelDims,
        norm: &Self::Vector,
        w: &GatedDeltaNet<Self, Qkv, Z, Bt, A, O>,
        state: &mut Self::GdnState,
        h: &mut Self::Act,
    ) -> anyhow::Result<()>;

    /// `h = h + Attn(RMSNorm(h))` for tokens at positions `pos .. pos + T`, appending to `cache`.
    #[allow(clippy::too_many_arguments)]
    fn attention_prefill<Q: Prec, K: Prec, V: Prec, O: Prec>(
        &self,
        d: &ModelDims,
        norm: &Self::Vector,
        w: &GatedAttention<Self, Q, K, V, O>,
        cache: &mut Self::KvCache,
        pos: usize,
        h: &mut Self::Act,
    ) -> anyhow::Result<()>;
    fn attention_decode<Q: Prec, K: Prec, V: Prec, O: Prec>(
        &self,
        d: &ModelDims,
        norm: &Self::Vector,
        w: &GatedAttention<Self, Q, K, V, O>,
        cache: &mut Self::KvCache,
        pos: usize,
        h: &mut Self::Act,
    ) -> anyhow::Result<()>;

    /// `h = h + MoE(RMSNorm(h))`.
    #[allow(clippy::too_many_arguments)]
    fn sparse_moe<R: Prec, Eg: Prec, Eu: Prec, Ed: Prec, Sg: Prec, Su: Prec, Sd: Prec, Sgate: Prec>(
        &self,
        d: &ModelDims,
        norm: &Self::Vector,
        w: &SparseMoe<Self, R, Eg, Eu, Ed, Sg, Su, Sd, Sgate>,
        h: &mut Self::Act,
    ) -> anyhow::Result<()>;

    /// Final RMSNorm and lm_head: on the last row of `h` (`all_rows` false, serving) or on
    /// every row (`all_rows` true, tests).
    fn logits<P: Prec>(
        &self,
        d: &ModelDims,
        norm: &Self::Vector,
        lm_head: &Self::Linear<P>,
        h: &Self::Act,
        all_rows: bool,
    ) -> anyhow::Result<Self::Logits>;

    /// Samples the next token from the first `n` columns of the last row of `logits` where the
    /// backend runs (`crate::sampling` semantics, bit for bit; `n` is the tokenizer's vocabulary,
    /// so the lm_head's padding rows never come out; `step` feeds the counter-based random
    /// stream). A row without a finite logit is an error.
    fn sample(
        &self,
        logits: &Self::Logits,
        n: usize,
        params: &crate::engine::SamplingParams,
        step: u64,
    ) -> anyhow::Result<u32>;

    /// Logits as host f32, row-major `[rows, vocab]` (tests).
    fn logits_to_host(&self, logits: &Self::Logits) -> anyhow::Result<Vec<f32>>;

    /// Hidden states as host f32 (tests, observers).
    fn act_to_host(&self, h: &Self::Act) -> anyhow::Result<Vec<f32>>;
}
