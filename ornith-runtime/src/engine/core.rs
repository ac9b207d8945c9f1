//! The engine proper: admission, the step scheduler, sequence bookkeeping.
//!
//! A step is built as follows:
//! 1. **Admission**, first come first served: the oldest waiting request starts when a state slot
//!    and the K/V blocks for its whole length (prompt + `max_tokens`) are free. Reserving the whole
//!    length up front means a running sequence never runs out of blocks, so nothing is ever
//!    preempted or recomputed (which would change its tokens). A request that could never fit is
//!    refused at `submit`.
//! 2. **Decode rows**: one token of every sequence past its prompt.
//! 3. **Prefill chunks**, oldest sequence first, while the step's prefill rows stay within
//!    `max_batch_tokens` (decode rows are not counted: they run as their own group; the first
//!    chunk of a step is always taken, so prefill always progresses and a running sequence
//!    waits at most one chunk) — or within `idle_batch_tokens` when the step has no decode row:
//!    then no running sequence waits on the step, and a longer one (the CUDA MoE over several
//!    chunks at once) brings the first token sooner. A chunk ends at the next absolute multiple of
//!    [`PREFILL_CHUNK`] or at the prompt's end: the same chunks for a prompt whatever else runs.
//!    A sequence takes further chunks of its prompt while the step holds them, up to a boundary
//!    where the prefix cache may keep a snapshot (the state there exists only between steps);
//!    the backend runs each chunk as it would alone.
//!
//! After the step, each sequence that produced logits (decode rows, last prompt chunks) samples
//! one token on the backend, its `n`-th with step `n` of its seeded stream.
//!
//! **The prefix cache** (`prefix`): each full prompt chunk a sequence prefills is entered in the
//! cache with its K/V blocks, and at some chunk boundaries (`prefix::keeps_snapshot`) the
//! sequence's recurrent state is copied to a snapshot slot. Admission looks the prompt up and
//! starts the sequence after the deepest cached snapshot: its block table begins with the cached
//! chunks' blocks (shared, reference-counted) and its state slot is loaded from the snapshot. When
//! the oldest waiting request shares more full chunks with a sequence still prefilling them than
//! the cache holds, it waits until that sequence reaches them (and keeps a snapshot there) rather
//! than compute the same chunks beside it.

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::constrain::{Active, Constraint, TokenMask};
use super::force::{Forced, Forcing};
use super::pool::{BlockPool, SlotPool};
use super::prefix::{chunk_keys, keeps_snapshot, CacheStats, PrefixCache, CHUNK_BLOCKS};
use super::{Penalties, Runner, SamplingParams, PREFILL_CHUNK};
use crate::graph::{Batch, RowSample, SeqRows, WantLogprobs, KV_BLOCK};

/// A sequence's grammar mask for the step (None: its constraint has not started), or why its
/// grammar cannot go on.
type MaskOrDead = Result<Option<Arc<TokenMask>>, String>;

/// What the engine needs of one request (the front end has rendered and tokenized it).
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    /// At least 1; `prompt.len() + max_tokens` must fit the engine's context.
    pub max_tokens: u64,
    pub params: SamplingParams,
    /// Applied to the logits before sampling (greedy too), over the prompt and the tokens
    /// generated so far.
    pub penalties: Penalties,
    /// Sampling one of these ends the sequence (the token is still reported).
    pub stop_ids: Vec<u32>,
    /// Tokens the output must continue with once a trigger holds (a forced tool call, a
    /// thinking budget: [`Forcing`]).
    pub force: Vec<Forcing>,
    /// Report each output token's log-probability and this many most likely candidates
    /// ([`crate::logprobs`]; at most [`crate::logprobs::MAX_TOP_LOGPROBS`]).
    pub logprobs: Option<usize>,
    /// Draws restricted to what a grammar allows ([`Constraint`]: structured output).
    pub constraint: Option<Constraint>,
}

/// Why the engine ended a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// It sampled a stop id (the last token event).
    Stop,
    /// It reached `max_tokens`.
    Length,
}

#[derive(Debug, Clone, PartialEq)]
pub enum EventKind {
    /// The request was admitted: its first `cached_tokens` prompt tokens come from the prefix
    /// cache (not prefilled).
    Admitted { cached_tokens: usize },
    /// The next sampled token.
    Token(u32),
    /// The log-probabilities of the token the next `Token` event carries (requests with
    /// `logprobs` only).
    Logprobs(Box<crate::logprobs::TokenLogprobs>),
    /// The sequence ended; its memory is free.
    Finished(Finish),
    /// The request was refused, or the step that carried it failed (`engine_error`) or panicked
    /// (`internal_error`); the sequence is gone and its memory free.
    Error { code: &'static str, message: String },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// The id the request was submitted with.
    pub id: u64,
    pub kind: EventKind,
}

/// A request refused at submission (it is not queued).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmitError {
    /// `context_length_exceeded` or `invalid_request`.
    pub code: &'static str,
    pub message: String,
}

#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// Prefill rows per step, beside one decode row of every running sequence (see the module doc).
    pub max_batch_tokens: usize,
    /// Prefill rows of a step with no decode row (at least `max_batch_tokens`): `serve` on CUDA
    /// takes the throughput front ends' longer step there (`cli::idle_step_rows`).
    pub idle_batch_tokens: usize,
    /// Longest sequence (prompt + output) one request may have.
    pub max_context: usize,
    /// Ids `0..sample_vocab` are sampled (the tokenizer's; the lm_head has padding rows).
    pub sample_vocab: usize,
}

/// Counters since the engine started.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub steps: u64,
    pub decode_rows: u64,
    pub prefill_rows: u64,
    pub sampled: u64,
    pub finished: u64,
    pub failed: u64,
    pub cancelled: u64,
    /// Most sequences running in one step.
    pub peak_running: usize,
    /// Time inside the runner's forward steps.
    pub busy: Duration,
    pub cache: CacheStats,
}

struct Seq {
    id: u64,
    req: GenRequest,
    slot: usize,
    blocks: Vec<u32>,
    /// Tokens in the state.
    pos: usize,
    /// The last sampled token, not yet in the state (the sequence is decoding).
    last: Option<u32>,
    n_out: u64,
    /// The tokens its penalties apply to (None: no penalties). Shared with the step's
    /// [`RowSample`] while the backend samples; updated (copy on write) after.
    pen: Option<std::sync::Arc<crate::sampling::PenaltyState>>,
    /// Its forced tokens (None: the request has no [`Forcing`]).
    forced: Option<Forced>,
    /// Its grammar (None: unconstrained).
    constrained: Option<Active>,
    /// Prefix-cache chunks this sequence uses (resumed after, or entered while prefilling).
    chain: Vec<usize>,
    /// False once a chunk could not be entered (a hash collision): no later chunk is either.
    caching: bool,
    /// Boundaries a waiting request asked this sequence to keep a snapshot at.
    wanted: Vec<usize>,
    /// The prompt's chunk keys (empty without a prefix cache).
    keys: Vec<u64>,
}

pub struct Engine {
    runner: Box<dyn Runner>,
    cfg: EngineConfig,
    slots: SlotPool,
    blocks: BlockPool,
    /// Id, request, its prompt's chunk keys (empty without a prefix cache).
    waiting: VecDeque<(u64, GenRequest, Vec<u64>)>,
    /// In admission order.
    running: Vec<Seq>,
    cache: PrefixCache,
    stats: EngineStats,
}

fn blocks_for(req: &GenRequest) -> usize {
    // The last sampled token is never fed back, so prompt + max_tokens - 1 positions are written.
    (req.prompt.len() + req.max_tokens as usize - 1).div_ceil(KV_BLOCK)
}

/// Full chunks that prompts `a` and `b` (with their chunk keys) begin with alike, counting only
/// chunks that end before `a`'s last token.
fn common_chunks(a: &[u32], ka: &[u64], b: &[u32], kb: &[u64]) -> usize {
    let same = |k: usize| {
        let r = k * PREFILL_CHUNK..(k + 1) * PREFILL_CHUNK;
        ka[k] == kb[k] && a[r.clone()] == b[r]
    };
    let mut k = 0;
    while k < ka.len() && k < kb.len() && (k + 1) * PREFILL_CHUNK < a.len() && same(k) {
        k += 1;
    }
    k
}

impl Engine {
    pub fn new(runner: Box<dyn Runner>, cfg: EngineConfig) -> anyhow::Result<Self> {
        let cap = runner.capacity();
        anyhow::ensure!(cfg.max_batch_tokens >= 1, "--max-batch-tokens must be at least 1");
        anyhow::ensure!(
            cfg.idle_batch_tokens >= cfg.max_batch_tokens,
            "the prefill rows of a step with no decode row ({}) must be at least --max-batch-tokens ({})",
            cfg.idle_batch_tokens,
            cfg.max_batch_tokens
        );
        anyhow::ensure!(
            cfg.sample_vocab > 0 && cfg.sample_vocab <= runner.vocab_size(),
            "the tokenizer has {} tokens but the lm_head has {} rows: a tokenizer with more tokens than the model's logits cannot be served",
            cfg.sample_vocab,
            runner.vocab_size()
        );
        let fit = cap.blocks * KV_BLOCK;
        anyhow::ensure!(cfg.max_context >= 2, "a context of {} tokens leaves no room for output", cfg.max_context);
        anyhow::ensure!(
            cfg.max_context <= runner.window() && cfg.max_context <= fit,
            "a context of {} tokens exceeds the model's window ({}) or the K/V pool ({fit} tokens)",
            cfg.max_context,
            runner.window()
        );
        Ok(Engine {
            cache: PrefixCache::new(cap.snapshots),
            slots: SlotPool::new(cap.slots),
            blocks: BlockPool::new(cap.blocks),
            runner,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: EngineStats::default(),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }
    pub fn max_context(&self) -> usize {
        self.cfg.max_context
    }
    pub fn stats(&self) -> EngineStats {
        EngineStats { cache: self.cache.stats.clone(), ..self.stats.clone() }
    }
    /// Sequences admitted and not finished.
    pub fn running(&self) -> usize {
        self.running.len()
    }
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
    /// (free slots, total slots, free blocks, total blocks). Blocks the prefix cache holds
    /// count as used.
    pub fn pool_usage(&self) -> (usize, usize, usize, usize) {
        (self.slots.free(), self.slots.total(), self.blocks.free(), self.blocks.total())
    }
    /// (cached chunks, snapshots held, snapshot capacity) of the prefix cache.
    pub fn cache_usage(&self) -> (usize, usize, usize) {
        self.cache.usage()
    }
    /// The prefix cache's counters (what [`stats`](Self::stats) has, without copying the rest).
    pub fn cache_stats(&self) -> &CacheStats {
        &self.cache.stats
    }
    /// Empties the prefix cache of everything no running sequence uses (tests: pools must come
    /// back whole).
    pub fn evict_cache(&mut self) {
        self.cache.make_room(self.blocks.total(), &mut self.blocks);
    }
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Queues a request under `id` (unique among the queued and running ones).
    pub fn submit(&mut self, id: u64, req: GenRequest) -> Result<(), SubmitError> {
        let invalid = |m: String| SubmitError { code: "invalid_request", message: m };
        if self.waiting.iter().any(|(w, _, _)| *w == id) || self.running.iter().any(|s| s.id == id) {
            return Err(invalid(format!("request id {id} is already in the engine")));
        }
        if req.prompt.is_empty() {
            return Err(invalid("the prompt has no tokens".into()));
        }
        if req.max_tokens == 0 {
            return Err(invalid("max_tokens must be at least 1".into()));
        }
        let v = self.runner.vocab_size();
        if let Some(bad) = req.prompt.iter().find(|&&t| t as usize >= v) {
            return Err(invalid(format!("token id {bad} is outside the vocabulary (size {v})")));
        }
        let (window, n) = (self.cfg.max_context, req.prompt.len() as u64);
        if n.saturating_add(req.max_tokens) > window as u64 {
            return Err(SubmitError {
                code: "context_length_exceeded",
                message: format!(
                    "This model's maximum context length is {window} tokens. However, you requested {} tokens ({n} in the input, {} in the output).",
                    n + req.max_tokens,
                    req.max_tokens
                ),
            });
        }
        // max_context <= blocks * KV_BLOCK (checked in new), so every admitted length fits the pool.
        let keys = if self.cache.enabled() { chunk_keys(&req.prompt) } else { Vec::new() };
        self.waiting.push_back((id, req, keys));
        Ok(())
    }

    /// Drops a queued or running sequence and frees its memory. False if `id` is unknown
    /// (already finished).
    pub fn cancel(&mut self, id: u64) -> bool {
        if let Some(i) = self.waiting.iter().position(|(w, _, _)| *w == id) {
            self.waiting.remove(i);
            self.stats.cancelled += 1;
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.release(s);
            self.stats.cancelled += 1;
            return true;
        }
        false
    }

    fn release(&mut self, s: Seq) {
        self.slots.give(s.slot);
        self.blocks.give(s.blocks);
        self.cache.release(&s.chain, &mut self.blocks);
    }

    /// The state-pool row of snapshot `snap`: snapshots follow the sequences' slots.
    fn snapshot_row(&self, snap: usize) -> usize {
        self.slots.total() + snap
    }

    /// A sequence still prefilling the chunks that `prompt` shares with it beyond what the cache
    /// holds (`cached` chunks): its index and the boundary to wait for.
    fn inflight_prefix(&self, prompt: &[u32], keys: &[u64], cached: usize) -> Option<(usize, usize)> {
        self.running.iter().enumerate().find_map(|(i, r)| {
            if r.last.is_some() || !r.caching {
                return None;
            }
            let k = common_chunks(prompt, keys, &r.req.prompt, &r.keys);
            (k > cached && r.pos < k * PREFILL_CHUNK).then_some((i, k * PREFILL_CHUNK))
        })
    }

    fn admit(&mut self, events: &mut Vec<Event>) {
        while let Some((_, req, keys)) = self.waiting.front() {
            if self.slots.free() == 0 {
                break;
            }
            let m = self.cache.lookup(&req.prompt, keys);
            if self.cache.enabled() {
                if let Some((i, boundary)) = self.inflight_prefix(&req.prompt, keys, m.resume) {
                    if !self.running[i].wanted.contains(&boundary) {
                        self.running[i].wanted.push(boundary);
                    }
                    break;
                }
            }
            let shared = &m.path[..m.resume];
            let need = blocks_for(req) - m.resume * CHUNK_BLOCKS;
            self.cache.acquire(shared);
            if !self.cache.make_room(need, &mut self.blocks) {
                self.cache.release(shared, &mut self.blocks);
                break;
            }
            let (id, mut req, keys) = self.waiting.pop_front().expect("front exists");
            let constrained = req.constraint.take().map(Active::new);
            let slot = self.slots.take().expect("a slot is free");
            let mut blocks = self.cache.blocks(shared);
            self.blocks.retain(&blocks);
            blocks.extend(self.blocks.take(need).expect("the blocks are free"));
            let pos = m.cached_tokens();
            let (chain, caching, wanted) = (shared.to_vec(), true, Vec::new());
            let pen = req
                .penalties
                .active()
                .then(|| std::sync::Arc::new(crate::sampling::PenaltyState::new(req.penalties, &req.prompt)));
            let forced = (!req.force.is_empty()).then(|| Forced::new(&req.force));
            let s = Seq {
                id,
                req,
                slot,
                blocks,
                pos,
                last: None,
                n_out: 0,
                pen,
                forced,
                constrained,
                chain,
                caching,
                wanted,
                keys,
            };
            let loaded = match shared.last() {
                Some(&node) => {
                    let snap = self.cache.snapshot(node).expect("a resumable chunk has a snapshot");
                    self.runner.copy_slot(self.snapshot_row(snap), slot)
                }
                None => self.runner.clear_slot(slot),
            };
            if let Err(e) = loaded {
                events.push(Event { id, kind: EventKind::Error { code: "engine_error", message: format!("{e:#}") } });
                self.stats.failed += 1;
                self.release(s);
                continue;
            }
            if self.cache.enabled() && s.req.prompt.len() > PREFILL_CHUNK {
                let c = &mut self.cache.stats;
                if pos > 0 {
                    c.hits += 1;
                    c.cached_tokens += pos as u64;
                } else {
                    c.misses += 1;
                }
            }
            events.push(Event { id, kind: EventKind::Admitted { cached_tokens: pos } });
            self.running.push(s);
        }
    }

    /// Whether a step of sequence `s` must end at chunk boundary `b` (inside its prompt): the
    /// prefix cache may keep a snapshot of the state there (`keeps_snapshot`). The chunk ending
    /// at `b` can already be cached (`shared`) only if it is the sequence's next chunk: a later
    /// chunk's parent is not cached before this step runs.
    fn snapshot_boundary(&self, s: &Seq, b: usize) -> bool {
        if !(s.caching && self.cache.enabled()) {
            return false;
        }
        let first = b == (s.pos / PREFILL_CHUNK + 1) * PREFILL_CHUNK;
        let k = b / PREFILL_CHUNK - 1;
        let shared =
            first && self.cache.contains(s.chain.last().copied(), s.keys[k], &s.req.prompt[b - PREFILL_CHUNK..b]);
        keeps_snapshot(b, s.req.prompt.len(), shared, s.wanted.contains(&b))
    }

    /// Sequence `i` has just prefilled the full chunk ending at `pos`: enters the chunk in the
    /// prefix cache and, where the policy keeps one and the sequence's state is the state at
    /// `pos` (the step ended there), copies its state to a snapshot.
    fn cache_chunk(&mut self, i: usize, pos: usize) -> anyhow::Result<()> {
        let s = &self.running[i];
        let len = s.req.prompt.len();
        let state_here = s.pos == pos;
        let (tokens, blocks) =
            (&s.req.prompt[pos - PREFILL_CHUNK..pos], &s.blocks[(pos - PREFILL_CHUNK) / KV_BLOCK..pos / KV_BLOCK]);
        let k = s.keys[pos / PREFILL_CHUNK - 1];
        let Some((node, shared)) = self.cache.insert(s.chain.last().copied(), k, tokens, blocks, &mut self.blocks)
        else {
            self.running[i].caching = false;
            return Ok(());
        };
        let s = &mut self.running[i];
        s.chain.push(node);
        let wanted = s.wanted.contains(&pos);
        if !state_here || self.cache.snapshot(node).is_some() || !keeps_snapshot(pos, len, shared, wanted) {
            return Ok(());
        }
        let Some(snap) = self.cache.new_snapshot(node, &mut self.blocks) else { return Ok(()) };
        let slot = self.running[i].slot;
        if let Err(e) = self.runner.copy_slot(slot, self.snapshot_row(snap)) {
            self.cache.drop_snapshot(node, &mut self.blocks);
            return Err(e.context("saving a prefix-cache snapshot"));
        }
        Ok(())
    }

    /// Runs one step: admits what fits, runs decode rows and prefill chunks, samples. Returns the
    /// events of the step (nothing when there is no work).
    pub fn step(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        self.admit(&mut events);
        if self.running.is_empty() {
            return events;
        }
        self.stats.peak_running = self.stats.peak_running.max(self.running.len());
        // (index into running, rows, samples)
        let mut members: Vec<(usize, usize, bool)> = Vec::new();
        let mut batch = Batch::default();
        let mut decode_rows = 0usize;
        for (i, s) in self.running.iter().enumerate() {
            if let Some(t) = s.last {
                batch.ids.push(t);
                batch.seqs.push(SeqRows { slot: s.slot, pos: s.pos, len: 1, blocks: s.blocks.clone() });
                members.push((i, 1, true));
                decode_rows += 1;
            }
        }
        // Prefill rows of the step: `max_batch_tokens` whatever the decode rows (they run as their
        // own group, not in the prefill's MoE segment); `idle_batch_tokens` when there are none.
        let budget = if decode_rows == 0 { self.cfg.idle_batch_tokens } else { self.cfg.max_batch_tokens };
        let mut used = 0usize;
        let mut took_chunk = false;
        for (i, s) in self.running.iter().enumerate() {
            if s.last.is_some() {
                continue;
            }
            let next_end = |p: usize| ((p / PREFILL_CHUNK + 1) * PREFILL_CHUNK).min(s.req.prompt.len());
            let mut end = next_end(s.pos);
            if took_chunk && used + end - s.pos > budget {
                break;
            }
            // More chunks of the same prompt while the step holds them and the boundary between
            // is not one where the prefix cache may keep a snapshot (the state there is gone once
            // the step runs past it).
            while end < s.req.prompt.len() && used + next_end(end) - s.pos <= budget && !self.snapshot_boundary(s, end)
            {
                end = next_end(end);
            }
            let len = end - s.pos;
            took_chunk = true;
            used += len;
            batch.ids.extend_from_slice(&s.req.prompt[s.pos..end]);
            batch.seqs.push(SeqRows { slot: s.slot, pos: s.pos, len, blocks: s.blocks.clone() });
            members.push((i, len, end == s.req.prompt.len()));
        }
        // The grammars' masks of the rows that sample (none where a token is forced: the draw
        // is dropped), one sequence per thread; a grammar that cannot go on fails its sequence
        // after the step.
        let n = self.cfg.sample_vocab;
        let sampling: std::collections::HashSet<usize> = members.iter().filter(|m| m.2).map(|m| m.0).collect();
        let computed: Vec<(usize, MaskOrDead)> = self
            .running
            .par_iter_mut()
            .enumerate()
            .filter(|(i, s)| sampling.contains(i) && s.constrained.is_some())
            .filter(|(_, s)| s.forced.as_ref().and_then(|f| f.peek()).is_none())
            .map(|(i, s)| {
                let a = s.constrained.as_mut().expect("filtered above");
                (i, a.mask(n).map_err(|e| format!("structured output: {e:#}")))
            })
            .collect();
        let mut masks: HashMap<usize, Arc<TokenMask>> = HashMap::new();
        let mut dead: HashMap<usize, String> = HashMap::new();
        for (i, r) in computed {
            match r {
                Ok(Some(m)) => {
                    masks.insert(i, m);
                }
                Ok(None) => {}
                Err(e) => {
                    dead.insert(i, e);
                }
            }
        }
        let rows: Vec<RowSample> = members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.2)
            .map(|(row, &(i, _, _))| {
                let s = &self.running[i];
                let logprobs = s.req.logprobs.map(|top| WantLogprobs {
                    top: top.min(crate::logprobs::MAX_TOP_LOGPROBS),
                    forced: s.forced.as_ref().and_then(|f| f.peek()),
                });
                let mask = masks.get(&i).cloned();
                RowSample { row, params: s.req.params, step: s.n_out, penalties: s.pen.clone(), logprobs, mask }
            })
            .collect();
        let t0 = Instant::now();
        let out = match catch_unwind(AssertUnwindSafe(|| self.runner.run(&batch, n, &rows))) {
            Ok(Ok(v)) if v.len() == rows.len() => Ok(v),
            Ok(Ok(v)) => {
                Err(("engine_error", format!("the backend sampled {} tokens for {} rows", v.len(), rows.len())))
            }
            Ok(Err(e)) => Err(("engine_error", format!("{e:#}"))),
            Err(p) => Err((
                "internal_error",
                format!(
                    "the engine panicked: {}",
                    p.downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "no message".into())
                ),
            )),
        };
        // The rows' shares of the penalty states go, so that adding the sampled tokens below
        // updates them in place.
        drop(rows);
        self.stats.busy += t0.elapsed();
        self.stats.steps += 1;
        self.stats.decode_rows += decode_rows as u64;
        self.stats.prefill_rows += used as u64;
        let mut done = vec![false; self.running.len()];
        match out {
            Err((code, message)) => {
                for &(i, _, _) in &members {
                    let kind = EventKind::Error { code, message: message.clone() };
                    events.push(Event { id: self.running[i].id, kind });
                    done[i] = true;
                    self.stats.failed += 1;
                }
            }
            Ok(toks) => {
                let mut toks = toks.into_iter();
                for &(i, len, samples) in &members {
                    let s = &mut self.running[i];
                    let prefill = s.last.is_none();
                    let from = s.pos;
                    s.pos += len;
                    // Each full chunk the step prefilled, in order (a sequence that stops caching
                    // at one stops there).
                    let mut failed = None;
                    for b in (from / PREFILL_CHUNK + 1..=s.pos / PREFILL_CHUNK).map(|c| c * PREFILL_CHUNK) {
                        if !(prefill && self.running[i].caching && self.cache.enabled()) {
                            break;
                        }
                        if let Err(e) = self.cache_chunk(i, b) {
                            failed = Some(e);
                            break;
                        }
                    }
                    if let Some(e) = failed {
                        let kind = EventKind::Error { code: "engine_error", message: format!("{e:#}") };
                        events.push(Event { id: self.running[i].id, kind });
                        done[i] = true;
                        self.stats.failed += 1;
                        if samples {
                            toks.next();
                        }
                        continue;
                    }
                    let s = &mut self.running[i];
                    if !samples {
                        continue;
                    }
                    let drawn = toks.next().expect("one token per sampled row");
                    let t = s.forced.as_mut().map_or(drawn.id, |f| f.next(drawn.id));
                    let grammar = match dead.remove(&i) {
                        Some(e) => Err(e),
                        None => s
                            .constrained
                            .as_mut()
                            .map_or(Ok(()), |a| a.output(t).map_err(|e| format!("structured output: {e:#}"))),
                    };
                    if let Err(message) = grammar {
                        events.push(Event { id: s.id, kind: EventKind::Error { code: "engine_error", message } });
                        done[i] = true;
                        self.stats.failed += 1;
                        continue;
                    }
                    s.n_out += 1;
                    if let Some(p) = &mut s.pen {
                        std::sync::Arc::make_mut(p).add_output(t);
                    }
                    self.stats.sampled += 1;
                    if let Some(lp) = drawn.logprobs {
                        events.push(Event { id: s.id, kind: EventKind::Logprobs(lp) });
                    }
                    events.push(Event { id: s.id, kind: EventKind::Token(t) });
                    let finish = if s.req.stop_ids.contains(&t) {
                        Some(Finish::Stop)
                    } else if s.n_out >= s.req.max_tokens {
                        Some(Finish::Length)
                    } else {
                        None
                    };
                    match finish {
                        Some(f) => {
                            events.push(Event { id: s.id, kind: EventKind::Finished(f) });
                            done[i] = true;
                            self.stats.finished += 1;
                        }
                        None => s.last = Some(t),
                    }
                }
            }
        }
        let old = std::mem::take(&mut self.running);
        for (s, done) in old.into_iter().zip(done) {
            if done {
                self.release(s);
            } else {
                self.running.push(s);
            }
        }
        events
    }
}

/// The ids of a finished sequence's events, for tests: runs `engine` until it has no work and
/// collects every token by id, and the error messages.
pub fn drain(engine: &mut Engine) -> (HashMap<u64, Vec<u32>>, HashMap<u64, String>) {
    let (mut toks, mut errs) = (HashMap::new(), HashMap::new());
    while engine.has_work() {
        for e in engine.step() {
            match e.kind {
                EventKind::Token(t) => toks.entry(e.id).or_insert_with(Vec::new).push(t),
                EventKind::Error { message, .. } => {
                    errs.insert(e.id, message);
                }
                EventKind::Finished(_) | EventKind::Admitted { .. } | EventKind::Logprobs(_) => {}
            }
        }
    }
    (toks, errs)
}
