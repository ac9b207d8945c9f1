//! The engine: many sequences at once on one backend.
//!
//! * [`Runner`] is what the generated model offers the engine: pools of sequence state (recurrent
//!   slots, K/V blocks) and one forward step over a [`Batch`](crate::graph::Batch) followed by
//!   per-row sampling on the backend.
//! * [`Engine`] (in `core`) owns a runner, the slot and block pools' bookkeeping and the
//!   scheduler: each step carries one decode token of every running sequence, then prefill chunks
//!   of admitted ones within a token budget. Requests are admitted first come, first served when a
//!   slot and the blocks for their whole length are free, so a running sequence never waits for
//!   memory and is never preempted: its tokens do not depend on what else runs (batch invariance).
//! * [`EngineThread`] (in `thread`) runs an engine on a thread of its own: `submit` returns a
//!   handle, events (token, finish, error) come back on a channel, `cancel` frees a sequence at
//!   once. The JSONL front end and the HTTP server (`http`) drive it.

mod constrain;
mod core;
mod force;
mod pool;
pub mod prefix;
mod thread;

pub use self::constrain::{Constraint, Grammar, TokenMask};
pub use self::core::{drain, Engine, EngineConfig, EngineStats, Event, EventKind, Finish, GenRequest, SubmitError};
pub use self::force::{Forcing, Trigger};
pub use self::pool::{BlockPool, SlotPool};
pub use self::prefix::CacheStats;
pub use self::thread::{EngineClient, EngineGauges, EngineThread, PoolUsage};

use crate::graph::{Batch, RowSample, Sampled};

/// Prefill runs in chunks whose boundaries sit at absolute multiples of this many positions of
/// the sequence, whatever else is in the step: a prompt's chunks are always the same, so its
/// logits do not depend on when it was scheduled. (The CUDA backend's scratch is sized for one
/// chunk.)
pub const PREFILL_CHUNK: usize = 2048;

/// Sampling settings of one request (OpenAI / vLLM semantics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 means disabled.
    pub top_k: usize,
    /// 1.0 means disabled; must be in (0, 1].
    pub top_p: f32,
    /// 0.0 means disabled.
    pub min_p: f32,
    /// Seed of the request's random stream; the same seed reproduces the same output.
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0 }
    }
}

/// Repetition, frequency and presence penalties of one request (vLLM's and OpenAI's semantics;
/// the math is [`crate::sampling::penalize`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    /// Subtracted from the logit of every token the request has generated (OpenAI's
    /// `presence_penalty`, -2..=2; 0 disables).
    pub presence: f32,
    /// Times the number of times the request has generated the token, subtracted from its logit
    /// (OpenAI's `frequency_penalty`, -2..=2; 0 disables).
    pub frequency: f32,
    /// The logit of every token in the prompt or the output divided by it when positive,
    /// multiplied when not (HF's and vLLM's `repetition_penalty`, > 0; 1 disables).
    pub repetition: f32,
}

impl Penalties {
    pub const NONE: Penalties = Penalties { presence: 0.0, frequency: 0.0, repetition: 1.0 };

    /// Whether these change any logit.
    pub fn active(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0 || self.repetition != 1.0
    }
}

/// The size of a runner's pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Sequences whose recurrent state the pools hold at once.
    pub slots: usize,
    /// K/V blocks of [`KV_BLOCK`](crate::graph::KV_BLOCK) positions.
    pub blocks: usize,
    /// Recurrent-state snapshots of the prefix cache (state-pool rows after the `slots`
    /// sequences'; 0: no prefix cache).
    pub snapshots: usize,
}

/// A loaded model with its state pools (the generated `Compiled<B>`).
pub trait Runner: Send {
    fn capacity(&self) -> Capacity;
    /// The model's context window (`max_position_embeddings`).
    fn window(&self) -> usize;
    /// Vocabulary rows of the lm_head (logit count).
    fn vocab_size(&self) -> usize;
    /// Zeroes a recurrent-state slot before a new sequence uses it.
    fn clear_slot(&mut self, slot: usize) -> anyhow::Result<()>;
    /// Copies the recurrent state (every Gated DeltaNet layer's conv and recurrent state) of
    /// row `from` to row `to`; rows are the `slots` sequences' and then the `snapshots`.
    fn copy_slot(&mut self, from: usize, to: usize) -> anyhow::Result<()>;
    /// Runs one forward step over `batch`, then samples each of `rows` from the first `n`
    /// logits of its row; returns the sampled ids (with log-probabilities where a row asks) in
    /// `rows` order.
    fn run(&mut self, batch: &Batch, n: usize, rows: &[RowSample]) -> anyhow::Result<Vec<Sampled>>;
}

/// What the command line asks of the pools; the backend's memory plan turns it into a
/// [`Capacity`] before anything is allocated (and refuses what cannot fit, saying why).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolRequest {
    /// `--max-seqs`: sequences at once (None: what the plan chooses).
    pub max_seqs: Option<usize>,
    /// The CUDA plan's choice when `max_seqs` is None: as many sequences as fit, up to this
    /// (`cli::default_seqs`: more for the throughput front ends). The CPU plan keeps its own.
    pub default_seqs: usize,
    /// `--kv-budget`: bytes of K/V blocks (None: what the plan chooses).
    pub kv_budget: Option<u64>,
    /// The longest sequence (prompt + output) one request may have; the pool holds at least one.
    pub max_context: usize,
    /// `--prefix-cache-bytes`: bytes of recurrent-state snapshots (None: what the plan chooses,
    /// at most [`DEFAULT_PREFIX_CACHE_BYTES`]; 0 disables the prefix cache).
    pub prefix_cache: Option<u64>,
    /// The prefill rows of the longest step (`--max-batch-tokens`, or the longer step the engine
    /// takes when no sequence decodes: `cli::idle_step_rows`). The CUDA backend runs each MoE
    /// block over up to that many prefill rows at once (several chunks, of one sequence or of
    /// several: fuller expert tiles) and sizes that scratch for them
    /// (`backend_cuda::plan::moe_rows`).
    pub max_batch_tokens: usize,
}

/// The default snapshot budget: 4 GiB, 64 snapshots at the 35B shapes (≈ 63 MiB each), a few
/// conversations' last turns and a shared system prompt or two.
pub const DEFAULT_PREFIX_CACHE_BYTES: u64 = 4 << 30;

/// Snapshots a prefix cache of `budget` bytes holds (None: the default, within `room` bytes the
/// plan leaves, of which it takes at most a quarter) at `slot_bytes` each.
pub fn snapshots_for(budget: Option<u64>, slot_bytes: u64, room: u64) -> usize {
    let bytes = budget.unwrap_or_else(|| DEFAULT_PREFIX_CACHE_BYTES.min(room / 4));
    ((bytes / slot_bytes.max(1)) as usize).min(MAX_SNAPSHOTS)
}

/// The most snapshots a prefix cache keeps (its bookkeeping scans them on eviction).
pub const MAX_SNAPSHOTS: usize = 4096;
