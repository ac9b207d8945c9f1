//! The CUDA backend: the layer operations of [`Backend`] over a [`Batch`] of several sequences,
//! composed from the kernels (`kernels/cuda/*.cu`), with the CPU backend's cast points (the
//! kernels round to bf16 where transformers does; see `kernels/include/ornith_kernels.h`).
//!
//! * Weights are uploaded once, straight from the shard mmap ([`load`]), after a memory plan
//!   ([`plan::MemoryPlan`]) sized the state pools and was checked against free memory.
//! * State lives in pools: per Gated DeltaNet layer a conv `[slots][3][conv_dim]` bf16 and a
//!   recurrent `[slots][Hv][dk][dv]` f32 state ([`CudaGdnPool`]); per attention layer K and V
//!   `[blocks][KV_BLOCK][Hkv][hd]` bf16 ([`CudaKvPool`]), a sequence's position `p` in cache row
//!   `table[p / KV_BLOCK] · KV_BLOCK + p % KV_BLOCK` of its block table.
//! * The residual stream is `h` plus a pending `delta` (the last layer output): the next
//!   RMSNorm kernel adds it in (`h = bf16(h + delta)`) while normalising, so no separate add runs.
//! * A step's rows split into the **decode group** — the leading sequences of one row each (the
//!   engine puts decode rows first) — and the **prefill sequences** after it. The group's
//!   row-wise ops (RMSNorm, every Linear as GEMVs of at most 8 rows, router, MoE GEMV with one
//!   grid z per row) run over all its rows at once, and each mixer (conv, recurrent delta rule,
//!   q/k norm + RoPE, split-K attention) is one launch over the group reading each row's
//!   position, state slot and block table from the device ([`StepBufs::desc`]). Every kernel
//!   computes a row from that row's inputs only, the multi-row GEMVs give the single-row
//!   kernels' bits, and the attention split length of a row comes from its own position: a
//!   sequence's logits do not depend on the other rows of the step (batch invariance).
//! * Each prefill sequence runs as one sequence: its rows in chunks of [`plan::CHUNK`] (=
//!   `engine::PREFILL_CHUNK`); a chunk of more than 8 rows runs the prefill kernels
//!   (tensor-core GEMMs, chunked gated delta rule, causal flash attention over its blocks, MoE
//!   grouped by expert), a shorter one the decode kernels with its position
//!   `pos0 + t`, one block table and its slot's state.
//! * A decode step ([`Batch::is_decode`]) is captured as a CUDA graph once per number of
//!   sequences and replayed ([`Backend::step`]): the kernels read ids, positions, slots and block
//!   tables from the static description `desc` written before each replay, the attention splits
//!   a row over at most [`plan::MAX_SPLITS`] (the kernels derive each row's split length from its
//!   position) on a grid fixed by the GPU, and the step's activations and logits live in static
//!   buffers sized for the pool's slots. With profiling on (`ornith-bench`), or
//!   `set_decode_graph(false)`, the same launches run eagerly.
pub mod decode_bytes;
mod load;
mod moe;
mod ops;
pub mod plan;

use crate::cuda::gemm::{grouped_fp8_tile_rows, grouped_tile_rows, tile_offsets_len};
use crate::cuda::moe::{combine_params, router_params, Fp8ExpertFfn};
use crate::cuda::nvfp4::Fp4W;
use crate::cuda::CudaContext;
use crate::engine::{Capacity, PoolRequest};
use crate::graph::*;
use crate::weights::Checkpoint;
use anyhow::{bail, ensure, Context, Result};
use cudarc::driver::CudaSlice;
use half::bf16;
use model_spec::{ExpertLayout, Precision};
use ops::{at, use_prefill, Ptr, XIn};
use ornith_kernels::bindings::*;
use plan::{MemoryPlan, ScratchSizes, ATTN_ROWS, CHUNK, GROUPED_MOE_ROWS, ROUTE_SORT_TOKENS};
use std::cell::Cell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

const _: () = assert!(KV_BLOCK == ORNITH_KV_BLOCK as usize, "graph::KV_BLOCK must match the kernels' ORNITH_KV_BLOCK");

/// A Linear on the device: BF16 weights (`scale` and `fp4` None), E4M3 codes with f32 per-row
/// scales (`scale`), or NVFP4A16 codes `[out, in/2]` with their scale bytes and tables (`fp4`).
pub struct DevLinear {
    pub out_features: usize,
    pub in_features: usize,
    w: CudaSlice<u8>,
    scale: Option<CudaSlice<f32>>,
    fp4: Option<Fp4Dev>,
}

/// The group scales of an NVFP4A16 matrix: E4M3 bytes `[out, in/16]` and the dequantisation
/// table (`cuda::nvfp4::fp4_table`) of each global scale, table `k` serving rows
/// `k · tab_rows ..` (a fused gate|up has two).
pub struct Fp4Dev {
    ws: CudaSlice<u8>,
    tab: CudaSlice<u8>,
    tab_rows: usize,
}

/// A Linear of precision `P`. `dev` is None only for the shared expert's `up_proj`, whose rows
/// live in the shared `gate_proj`'s fused `[2I, H]` matrix, for `shared_expert_gate`, whose
/// row is the last of the router's fused `[E + 1, H]` matrix, for the Gated DeltaNet's
/// `in_proj_z|b|a`, whose rows follow `in_proj_qkv`'s in one matrix, and for attention's
/// `k_proj|v_proj`, whose rows follow `q_proj`'s (see `load`).
pub struct CudaLinear<P: Prec> {
    dev: Option<DevLinear>,
    _p: PhantomData<P>,
}

impl<P: Prec> CudaLinear<P> {
    fn dev(&self, what: &str) -> Result<&DevLinear> {
        self.dev.as_ref().ok_or_else(|| anyhow::anyhow!("{what}: this Linear is stored fused into another one"))
    }
}

/// The routed experts of one layer, packed: `gu [E, 2I, H]` (gate rows then up rows per
/// expert), `dn [E, H, I]`: E4M3 codes (FP8) or NVFP4A16 codes `[E, 2I, H/2]`, `[E, H, I/2]` in
/// the kernels' order, with their scales.
pub struct CudaExperts<G: Prec, U: Prec, D: Prec> {
    gu: CudaSlice<u8>,
    dn: CudaSlice<u8>,
    scales: ExpertScales,
    experts: usize,
    _p: PhantomData<(G, U, D)>,
}

/// The routed experts' scales as their precision stores them. FP8: f32 per-row scales
/// `gus [E, 2I]`, `dns [E, H]`. NVFP4A16: E4M3 group scale bytes `gus [E, 2I, H/16]`,
/// `dns [E, H, I/16]` and the dequantisation tables `gut [E, 2]` (gate, up) and `dnt [E, 1]`
/// (`cuda::nvfp4::TAB_BYTES` each).
pub enum ExpertScales {
    Fp8 { gus: CudaSlice<f32>, dns: CudaSlice<f32> },
    Nvfp4 { gus: CudaSlice<u8>, dns: CudaSlice<u8>, gut: CudaSlice<u8>, dnt: CudaSlice<u8> },
}

/// A small vector as bf16 and as the same values in f32 (kernels take one or the other).
pub struct CudaVector {
    bf: CudaSlice<u16>,
    f: CudaSlice<f32>,
}

/// Hidden states `[t, hidden]`: `h` plus, for the first `pending` rows, a `delta` still to add.
/// A decode step's rows live in the backend's static [`StepBufs`] (shared `Arc`s).
pub struct CudaAct {
    pub t: usize,
    h: Arc<CudaSlice<u16>>,
    delta: Arc<CudaSlice<u16>>,
    pending: Cell<usize>,
    /// Set by a last-row logits call that added the pending delta to some rows only: the
    /// states are no longer one consistent residual stream.
    spent: Cell<bool>,
}

impl CudaAct {
    fn new(t: usize, h: Arc<CudaSlice<u16>>, delta: Arc<CudaSlice<u16>>) -> Self {
        CudaAct { t, h, delta, pending: Cell::new(0), spent: Cell::new(false) }
    }
}

/// Static buffers of a step, so that a captured decode graph sees the same addresses at every
/// replay. `desc` (int32, written by [`Backend::step`] before each step) holds, with `R` =
/// the pool's slots and `W` = [`MemoryPlan::table_width`]: the decode group's token ids
/// `[R]` at 0, positions `[R]` at `R`, state slots `[R]` at `2R`, then one block table row `[W]`
/// per sequence of the step (sequence order) at `3R`. `h`, `delta`: a decode step's residual
/// rows `[R, hidden]`; `logits`: the serving logits `[R, vocab]` (one row per sequence).
struct StepBufs {
    desc: CudaSlice<i32>,
    h: Arc<CudaSlice<u16>>,
    delta: Arc<CudaSlice<u16>>,
    logits: Arc<CudaSlice<u16>>,
}

/// The decode steps captured over one set of pools: a CUDA graph per number of sequences.
pub struct CudaStepGraphs {
    graphs: HashMap<usize, StepGraph>,
}

/// One captured decode step, with what it was captured with: the embedding load id (a graph
/// bakes in every weight address, and an address could be reused by a later load) and which
/// launches carry the programmatic-dependent-launch attribute; and, while the bench ablates
/// a kernel ([`CudaBackend::set_ablated_kernel`]), the graph edited without that kernel's nodes.
struct StepGraph {
    graph: SendGraph,
    key: u64,
    pdl: crate::cuda::Pdl,
    ablated: Option<(&'static str, crate::cuda::graph_edit::EditedGraph)>,
}

/// The embedding table `[vocab, hidden]` BF16, and a number unique to this load (the key of
/// the captured graphs).
pub struct CudaEmbedding {
    table: CudaSlice<u8>,
    id: u64,
}

/// The description of which batch `desc` holds, for as long as a step runs; on drop (also when
/// the step panics) it forgets it and closes a capture still open.
struct StepScope<'a> {
    b: &'a CudaBackend,
    capturing: bool,
}

impl<'a> StepScope<'a> {
    fn enter(b: &'a CudaBackend, batch: &Batch) -> Self {
        b.described.set(Some(batch as *const Batch as usize));
        StepScope { b, capturing: false }
    }
}

impl Drop for StepScope<'_> {
    fn drop(&mut self) {
        if self.capturing {
            let _ = self.b.cx.stream().end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        }
        self.b.described.set(None);
    }
}

/// A captured graph, movable to another thread with the pools that own it.
struct SendGraph(cudarc::driver::CudaGraph);
// SAFETY: cudarc's `CudaGraph` is not `Send` only because it holds raw driver handles
// (CUgraph, CUgraphExec), which the CUDA driver allows to be used from any thread once the
// context is bound (every launch binds it first). It is not `Sync`: a graph is replayed only
// through `&mut CudaStepGraphs`, so never from two threads at once.
unsafe impl Send for SendGraph {}

/// Conv state `[slots][3][conv_dim]` bf16 (oldest first) and recurrent state
/// `[slots][Hv][dk][dv]` f32 of one Gated DeltaNet layer.
pub struct CudaGdnPool {
    conv: CudaSlice<u16>,
    ssm: CudaSlice<f32>,
    slots: usize,
}

/// Copies row `from` (of `n` elements) of `buf` to row `to`, on the stream (ordered after the
/// step that wrote it).
fn copy_row<T: cudarc::driver::DeviceRepr>(
    st: &std::sync::Arc<cudarc::driver::CudaStream>,
    buf: &mut CudaSlice<T>,
    n: usize,
    from: usize,
    to: usize,
) -> Result<()> {
    if from == to {
        return Ok(());
    }
    let at = from.max(to) * n;
    let (lo, mut hi) = buf.split_at_mut(at);
    if from < to {
        st.memcpy_dtod(&lo.slice(from * n..(from + 1) * n), &mut hi.slice_mut(0..n))?;
    } else {
        let mut lo = lo;
        st.memcpy_dtod(&hi.slice(0..n), &mut lo.slice_mut(to * n..(to + 1) * n))?;
    }
    Ok(())
}

/// K (normed, rotated) and V `[blocks][KV_BLOCK][Hkv][head_dim]` bf16 of one attention layer.
/// Positions past a sequence's end are never read (attention masks by position).
pub struct CudaKvPool {
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    blocks: usize,
}

/// Logits `[rows, vocab]` bf16 on the device. Serving logits (one row per sequence) live in a
/// buffer the next forward call overwrites; read or sample them before running the model again.
pub struct CudaLogits {
    pub rows: usize,
    pub vocab: usize,
    buf: Arc<CudaSlice<u16>>,
}

/// Scratch of one prefill chunk (sizes in [`ScratchSizes`]; a decode group has at most
/// `CHUNK` rows, so it fits too).
struct Scratch {
    xb: CudaSlice<u16>,
    xq: CudaSlice<u8>,
    xs: CudaSlice<f32>,
    proj: CudaSlice<u16>,
    conv: CudaSlice<u16>,
    o: CudaSlice<u16>,
    on: CudaSlice<u16>,
    qg: CudaSlice<u16>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    q: CudaSlice<u16>,
    part_o: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    rlog: CudaSlice<u16>,
    idx: CudaSlice<i32>,
    wt: CudaSlice<f32>,
    gu: CudaSlice<u16>,
    aq: CudaSlice<u8>,
    asc: CudaSlice<f32>,
    ys: CudaSlice<u16>,
    /// Greedy sampling: the argmax of each row `[R]` and the logits row of each `[R]`.
    amax: CudaSlice<i32>,
    amax_rows: CudaSlice<i32>,
    /// MoE prefill: expert-sorted row bookkeeping (`OrnithMoeSortParams`).
    group_offsets: CudaSlice<i32>,
    tile_offsets: CudaSlice<i32>,
    row_token: CudaSlice<i32>,
    row_of: CudaSlice<i32>,
    /// Grouped decode MoE: the assignment of each expert-sorted row and each block row's expert
    /// and range (`moe_sort`'s optional outputs; row_info 4 i32 per row).
    row_assign: CudaSlice<i32>,
    row_info: CudaSlice<i32>,
    /// Two-phase chunked gated delta rule workspace (`ScratchSizes::gdn_work`).
    gdn_work: CudaSlice<f32>,
}

/// The CUDA backend on device 0.
pub struct CudaBackend {
    cx: CudaContext,
    dims: Dims,
    sz: ScratchSizes,
    s: Scratch,
    plan: MemoryPlan,
    cap: Capacity,
    progress: Mutex<load::Progress>,
    /// An error from a method that cannot return one, reported by the next call.
    deferred: Mutex<Option<anyhow::Error>>,
    dec: StepBufs,
    /// The address of the batch whose description `dec.desc` holds, while a step runs
    /// ([`StepScope`]); outside a step every operation writes its batch's description itself.
    described: Cell<Option<usize>>,
    /// Capture and replay decode steps (default); false runs them eagerly.
    graphs: AtomicBool,
    /// `ornith-bench`'s in-graph ablation: decode replays run the captured graph without this
    /// kernel's nodes, and how many nodes were removed (None normally).
    ablation: Mutex<Option<(&'static str, Option<usize>)>>,
    /// The device sampler's buffers (one row per slot).
    sampler: Mutex<crate::cuda::sample::SampleScratch>,
}

/// Where the rows of one mixer launch take their sequence from.
#[derive(Clone, Copy)]
enum Rows {
    /// The decode group (rows `0..n` of the step): row t is the next token of sequence t, with
    /// its position, slot and block table (row t of the tables) in `desc`.
    Group,
    /// Rows of one sequence at positions `pos ..`, its state in `slot`, its block table row
    /// `table` (a sequence index) of `desc`.
    Seq { slot: usize, pos: usize, table: usize },
}

/// Decode-group rows of `batch`: its leading sequences of one row each.
fn group_rows(batch: &Batch) -> usize {
    batch.seqs.iter().take_while(|s| s.len == 1).count()
}

/// The row ranges of a row-wise op: the decode group at once (GEMVs), then each later sequence
/// in chunks of [`CHUNK`]; `(first row, rows, prefill kernels)`.
fn segments(batch: &Batch) -> Vec<(usize, usize, bool)> {
    let g = group_rows(batch);
    let mut v = Vec::new();
    if g > 0 {
        v.push((0, g, false));
    }
    for (s, r) in batch.seqs.iter().zip(batch.row_starts()).skip(g) {
        for c0 in (0..s.len).step_by(CHUNK) {
            let n = CHUNK.min(s.len - c0);
            v.push((r + c0, n, use_prefill(n)));
        }
    }
    v
}

/// The row ranges of an MoE block: those of [`segments`], with consecutive prefill chunks (of one
/// sequence or of several) merged while they fit `max_rows` rows (the MoE scratch,
/// [`plan::moe_rows`]): one router GEMM, one pair of grouped expert GEMMs and one combine over
/// them, with fuller expert tiles. Every row's bits are those of its chunk alone (each output
/// row's sums, quantisation and combine are its own).
fn moe_segments(batch: &Batch, max_rows: usize) -> Vec<(usize, usize, bool)> {
    let mut v: Vec<(usize, usize, bool)> = Vec::new();
    for (r0, n, prefill) in segments(batch) {
        match v.last_mut() {
            Some((a, m, true)) if prefill && *a + *m == r0 && *m + n <= max_rows => *m += n,
            _ => v.push((r0, n, prefill)),
        }
    }
    v
}

impl CudaBackend {
    /// Checks the model's shapes against the kernels, sizes the state pools for `req`
    /// ([`plan::MemoryPlan::new`]: weights, K/V blocks, recurrent slots, scratch and step
    /// buffers) and checks the whole plan against free device memory before allocating, then
    /// allocates scratch and the step buffers. Weights are uploaded by `Compiled::load`
    /// through the `load_*` methods, which then creates pools of `Capacity` size.
    pub fn new(
        cx: CudaContext,
        ck: &Checkpoint,
        dims: &Dims,
        req: &PoolRequest,
        quiet: bool,
    ) -> Result<(Self, Capacity)> {
        plan::check_dims(dims)?;
        ensure!(req.max_context >= 1, "the context must hold at least one token");
        let (driver_free, total) = cx.driver().mem_get_info()?;
        let integrated =
            cx.driver().attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED)? != 0;
        let meminfo = if integrated { std::fs::read_to_string("/proc/meminfo").ok() } else { None };
        let (free, source) = plan::usable_free(driver_free as u64, integrated, meminfo.as_deref());
        let (plan, cap) = MemoryPlan::new(ck, dims, req, free, source)?;
        plan.check(free, source, total as u64, cx.device_name())?;
        let sz = ScratchSizes::new(dims, req.max_batch_tokens);
        let r = cap.slots;
        let s = Scratch::new(&cx, dims, &sz, r)?;
        let sampler = Mutex::new(crate::cuda::sample::SampleScratch::new(&cx, r, dims.vocab_size)?);
        let dec = StepBufs {
            desc: cx.alloc(plan::desc_len(r, plan.table_width()))?,
            h: Arc::new(cx.alloc(r * dims.hidden_size)?),
            delta: Arc::new(cx.alloc(r * dims.hidden_size)?),
            logits: Arc::new(cx.alloc(r * dims.vocab_size)?),
        };
        let b = CudaBackend {
            cx,
            dims: *dims,
            sz,
            s,
            plan,
            cap,
            progress: Mutex::new(load::Progress::new(plan.weights, quiet)),
            deferred: Mutex::new(None),
            dec,
            described: Cell::new(None),
            graphs: AtomicBool::new(true),
            ablation: Mutex::new(None),
            sampler,
        };
        Ok((b, cap))
    }

    /// Capture decode steps as CUDA graphs and replay them (true, the default), or run every
    /// decode launch eagerly (false: the comparison in the tests and the bench).
    pub fn set_decode_graph(&self, on: bool) {
        self.graphs.store(on, Relaxed);
    }

    /// Measurement only (`ornith-bench`'s in-graph ablation): while set, a decode step replays
    /// its captured graph edited without the nodes that launch kernel `name` (cloned once per
    /// kernel, [`CudaContext::graph_without`](crate::cuda::CudaContext)), so the step's time
    /// shows what that kernel costs inside the graph. Nothing is left out of the capture: the
    /// launches, and the graph's key, are the same as without it. Results are garbage while it
    /// is set (every buffer stays valid: static scratch, clamped expert indices, device-held
    /// positions); eager steps ignore it.
    pub fn set_ablated_kernel(&self, name: Option<&'static str>) {
        *self.ablation.lock().unwrap_or_else(|e| e.into_inner()) = name.map(|n| (n, None));
    }

    /// The nodes removed from the last decode graph replayed under [`Self::set_ablated_kernel`]
    /// (the ablated kernel's launches in one step).
    pub fn ablated_nodes(&self) -> Option<usize> {
        let a = *self.ablation.lock().unwrap_or_else(|e| e.into_inner());
        a.and_then(|a| a.1)
    }

    /// Replays the graph of `n`-sequence decode steps in `g`, capturing `run` into it first when
    /// it holds none for this model and these settings.
    fn replay(
        &self,
        scope: &mut StepScope,
        g: &mut CudaStepGraphs,
        table: &CudaEmbedding,
        n: usize,
        run: &mut dyn FnMut() -> Result<CudaLogits>,
    ) -> Result<CudaLogits> {
        let (key, pdl) = (table.id, self.cx.pdl());
        let fresh = g.graphs.get(&n).is_some_and(|c| c.key == key && c.pdl == pdl);
        if !fresh {
            g.graphs.remove(&n);
            let st = self.cx.stream();
            // Thread-local mode: a synchronising call on this thread fails the capture. An
            // allocation or a free would NOT fail (stream-ordered ones become graph nodes), so
            // a decode step allocates nothing: `embed` and `logits` use the static buffers there.
            st.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            scope.capturing = true;
            let r = run();
            let end = st.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
            scope.capturing = false;
            let l = r.context("capturing the decode step")?;
            ensure!(
                l.rows == n && Arc::ptr_eq(&l.buf, &self.dec.logits),
                "a decode step's logits must be the static rows"
            );
            let graph = end
                .context("instantiating the decode graph")?
                .ok_or_else(|| anyhow::anyhow!("the captured decode step is empty"))?;
            graph.upload()?;
            g.graphs.insert(n, StepGraph { graph: SendGraph(graph), key, pdl, ablated: None });
        }
        let sg = g.graphs.get_mut(&n).expect("captured above");
        let mut ablation = self.ablation.lock().unwrap_or_else(|e| e.into_inner());
        match ablation.as_mut() {
            None => sg.graph.0.launch()?,
            Some((kernel, removed)) => {
                if sg.ablated.as_ref().map(|a| a.0) != Some(*kernel) {
                    sg.ablated = None;
                    sg.ablated = Some((*kernel, self.cx.graph_without(&sg.graph.0, kernel)?));
                }
                let edited = &sg.ablated.as_ref().expect("edited above").1;
                *removed = Some(edited.removed);
                self.cx.launch_graph(edited)?;
            }
        }
        Ok(CudaLogits { rows: n, vocab: self.dims.vocab_size, buf: self.dec.logits.clone() })
    }

    pub fn context(&self) -> &CudaContext {
        &self.cx
    }
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }
    /// The pool sizes the memory plan chose (what `Compiled::load` should be given).
    pub fn capacity(&self) -> Capacity {
        self.cap
    }

    /// Starts timing every launch (until [`Self::profile_end`]; [`CudaContext::profile_begin`]).
    /// Decode steps run eagerly meanwhile (events cannot bracket launches inside a graph).
    pub fn profile_begin(&self) {
        self.cx.profile_begin();
    }

    /// The launches since [`Self::profile_begin`], with their event-measured times.
    pub fn profile_end(&self) -> Result<Vec<crate::cuda::profile::KernelTime>> {
        self.cx.profile_end()
    }

    /// Hidden states from host values (bf16-exact f32, `[t, hidden]`): tests feed both backends
    /// the same layer input.
    pub fn act_from_host(&self, data: &[f32]) -> Result<CudaAct> {
        let hs = self.dims.hidden_size;
        ensure!(
            !data.is_empty() && data.len().is_multiple_of(hs),
            "act_from_host: {} values is not a whole number of rows of {hs}",
            data.len()
        );
        let b: Vec<u16> = data.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        Ok(CudaAct::new(data.len() / hs, Arc::new(self.cx.upload(&b)?), Arc::new(self.cx.alloc(b.len())?)))
    }

    fn check_deferred(&self) -> Result<()> {
        match self.deferred.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn eps(&self) -> f32 {
        self.dims.rms_norm_eps as f32
    }

    /// Writes `batch`'s description into `dec.desc` (layout at [`StepBufs`]) unless a step over
    /// this very batch already did. Checks that the step fits the static buffers: at most
    /// `slots` sequences, positions inside the planned context.
    fn describe(&self, batch: &Batch) -> Result<()> {
        if self.described.get() == Some(batch as *const Batch as usize) {
            return Ok(());
        }
        self.upload_desc(batch)
    }

    fn upload_desc(&self, batch: &Batch) -> Result<()> {
        let (r, w) = (self.cap.slots, self.plan.table_width());
        let n = batch.seqs.len();
        ensure!(n <= r, "a step of {n} sequences exceeds the {r} state slots the backend was sized for (--max-seqs)");
        let g = group_rows(batch);
        let mut v = vec![0i32; 3 * r + n * w];
        for (i, s) in batch.seqs.iter().enumerate() {
            let end = s.pos + s.len;
            ensure!(
                end <= self.plan.max_context,
                "a sequence of {end} tokens exceeds the context of {} the memory plan was made for (--max-context)",
                self.plan.max_context
            );
            let need = end.div_ceil(KV_BLOCK);
            ensure!(s.blocks.len() >= need, "a block table of {} blocks cannot hold {end} positions", s.blocks.len());
            for (j, &b) in s.blocks[..need].iter().enumerate() {
                v[3 * r + i * w + j] = i32::try_from(b).context("K/V block index")?;
            }
            if i < g {
                v[i] = batch.ids[i] as i32;
                v[r + i] = s.pos as i32;
                v[2 * r + i] = s.slot as i32;
            }
        }
        // SAFETY: `v` fits the `desc_len(r, w)` elements of the buffer (n <= r); a copy from
        // pageable host memory returns once the bytes are staged, so `v` may be dropped after.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(self.cx.addr(&self.dec.desc), &v, self.cx.stream().cu_stream())
        }?;
        Ok(())
    }

    /// Device address of `desc` column block `k` (0 ids, 1 positions, 2 slots) of the group.
    fn desc_at(&self, k: usize) -> Ptr {
        at(self, &self.dec.desc, k * self.cap.slots)
    }
    /// Device address of the block table row of sequence `i` of the step.
    fn table_at(&self, i: usize) -> Ptr {
        at(self, &self.dec.desc, 3 * self.cap.slots + i * self.plan.table_width())
    }

    /// RMSNorm of rows `r0 .. r0 + n` of `h` into the scratch `xb`/`xq` (adding the pending delta).
    fn norm_rows(&self, h: &CudaAct, w: &CudaVector, r0: usize, n: usize) -> Result<XIn> {
        Ok(self.norm_rows_for(h, w, r0, n, false)?.0)
    }

    /// The one place that decides whether a layer's input norm runs as its own kernel or in the
    /// prologue of the layer's first decode products (`fusable`: the caller's consumers and the
    /// writer of its next delta take the prologue and the fold, i.e. are decode products (BF16,
    /// FP8 or NVFP4) or `moe_combine`). Fused for one row (`ORNITH_NORM_ROWS`) of a hidden size the
    /// prologue takes: the input is then `XIn::norm` (every consuming product computes the row's
    /// norm itself, with `rmsnorm_residual`'s arithmetic: the same bits) and nothing is written
    /// to `h`; the second value is then `Some(rows of h)` when a delta is pending, which the
    /// layer's writer of the next delta must fold into `h` before it overwrites the delta
    /// (`rmsnorm_residual` would have). Otherwise the norm kernel runs (and folds) as before.
    fn norm_rows_for(
        &self,
        h: &CudaAct,
        w: &CudaVector,
        r0: usize,
        n: usize,
        fusable: bool,
    ) -> Result<(XIn, Option<Ptr>)> {
        let hs = self.dims.hidden_size;
        let add = (h.pending.get() > r0).then(|| at(self, &h.delta, r0 * hs));
        if fusable && n == ORNITH_NORM_ROWS as usize && hs <= crate::cuda::gemv::NORM_MAX_HIDDEN {
            let norm = OrnithNormIn {
                res: at(self, &h.h, r0 * hs) as _,
                add: add.map_or(std::ptr::null(), |a| a as _),
                weight: at(self, &w.bf, 0) as _,
                eps: self.eps(),
            };
            let x = XIn { bf: 0, q8: None, stride: hs, norm: Some(norm) };
            return Ok((x, add.map(|_| at(self, &h.h, r0 * hs))));
        }
        let (xq, xs) = (at(self, &self.s.xq, 0), at(self, &self.s.xs, 0));
        self.cx.k_rmsnorm(
            at(self, &h.h, r0 * hs),
            add,
            at(self, &w.bf, 0),
            Some(at(self, &self.s.xb, 0)),
            Some((xq, xs)),
            n,
            hs,
            self.eps(),
        )?;
        Ok((XIn { bf: at(self, &self.s.xb, 0), q8: Some((xq, xs)), stride: hs, norm: None }, None))
    }

    fn q8_scratch(&self) -> (Ptr, Ptr) {
        (at(self, &self.s.xq, 0), at(self, &self.s.xs, 0))
    }

    /// `n` rows of a Linear: the prefill GEMM when `prefill` (a chunk of one sequence of more
    /// than 8 rows), else GEMVs of at most 8 rows (a row's bits as the single-row kernel's).
    #[allow(clippy::too_many_arguments)]
    fn lin<P: Prec>(
        &self,
        l: &CudaLinear<P>,
        what: &str,
        x: XIn,
        y: Ptr,
        y_stride: usize,
        n: usize,
        prefill: bool,
    ) -> Result<()> {
        self.linear_rows(l.dev(what)?.all(self), x, self.q8_scratch(), y, y_stride, n, prefill, None)
    }

    /// [`Self::lin`] into the pending delta, folding the previous delta into the residual first
    /// when the layer's norm ran in a prologue (`fold`, from [`Self::norm_rows_for`]).
    #[allow(clippy::too_many_arguments)]
    fn lin_delta<P: Prec>(
        &self,
        l: &CudaLinear<P>,
        what: &str,
        x: XIn,
        h: &CudaAct,
        r0: usize,
        n: usize,
        prefill: bool,
        fold: Option<Ptr>,
    ) -> Result<()> {
        let hs = self.dims.hidden_size;
        let y = at(self, &h.delta, r0 * hs);
        self.linear_rows(l.dev(what)?.all(self), x, self.q8_scratch(), y, hs, n, prefill, fold)
    }

    /// Every layer starts with a fully pending or fully applied residual.
    fn layer_start(&self, h: &CudaAct, batch: &Batch) -> Result<()> {
        self.check_deferred()?;
        let p = h.pending.get();
        ensure!(!h.spent.get() && (p == 0 || p == h.t), "hidden states used after a last-row logits call");
        ensure!(h.t == batch.rows(), "hidden states of {} rows for a batch of {}", h.t, batch.rows());
        self.describe(batch)
    }

    /// Rows `r0 .. r0 + n` of a Gated DeltaNet layer (`rows`: whose state they continue).
    #[allow(clippy::too_many_arguments)]
    fn gdn_rows<Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec>(
        &self,
        norm: &CudaVector,
        w: &GatedDeltaNet<Self, Qkv, Z, Bt, A, O>,
        pool: &CudaGdnPool,
        rows: Rows,
        r0: usize,
        n: usize,
        h: &CudaAct,
    ) -> Result<()> {
        let d = &self.dims;
        let (cd, vd, hv, hk) = (d.conv_dim(), d.value_dim(), d.linear_num_value_heads, d.linear_num_key_heads);
        let (conv_stride, ssm_stride) = plan::gdn_slot_elems(d);
        let pw = self.sz.proj_w;
        let s = &self.s;
        let prefill = matches!(rows, Rows::Seq { .. }) && use_prefill(n);
        // Fusable: every decode product (BF16, FP8, NVFP4) takes the norm prologue and the fold.
        let (x, fold) = self.norm_rows_for(h, norm, r0, n, !prefill)?;
        let proj = at(self, &s.proj, 0);
        let (z_at, b_at) = (proj + 2 * cd as u64, proj + 2 * (cd + vd) as u64);
        if w.in_proj_z.dev.is_none() {
            // Loaded fused (`load::gdn_in_proj`): one Linear writes the whole row.
            self.lin(&w.in_proj_qkv, "in_proj_qkv|z|b|a", x, proj, pw, n, prefill)?;
        } else {
            self.lin(&w.in_proj_qkv, "in_proj_qkv", x, proj, pw, n, prefill)?;
            self.lin(&w.in_proj_z, "in_proj_z", x, z_at, pw, n, prefill)?;
            self.lin(&w.in_proj_b, "in_proj_b", x, b_at, pw, n, prefill)?;
            self.lin(&w.in_proj_a, "in_proj_a", x, b_at + 2 * hv as u64, pw, n, prefill)?;
        }
        // The group's state: slot[t] of the pool (per-row form); one sequence's: its slot.
        let (conv_st, ssm_st, slot) = match rows {
            Rows::Group => (at(self, &pool.conv, 0), at(self, &pool.ssm, 0), Some(self.desc_at(2))),
            Rows::Seq { slot, .. } => {
                (at(self, &pool.conv, slot * conv_stride), at(self, &pool.ssm, slot * ssm_stride), None)
            }
        };
        let (cw, co) = (at(self, &w.conv1d.bf, 0), at(self, &s.conv, 0));
        if prefill {
            self.cx.k_conv_chunk(proj, cw, conv_st, co, n, cd, pw)?; // bit-identical to conv1d_silu
        } else {
            self.cx.k_conv(proj, cw, conv_st, co, n, cd, pw, slot.map(|p| (p, conv_stride)))?;
        }
        let gp = OrnithGdnParams {
            qkv: co as _,
            ba: b_at as _,
            a_log: at(self, &w.a_log.f, 0) as _,
            dt_bias: at(self, &w.dt_bias.bf, 0) as _,
            state: ssm_st as _,
            o: at(self, &s.o, 0) as _,
            tokens: n as i32,
            k_heads: hk as i32,
            v_heads: hv as i32,
            qkv_stride: cd as i32,
            ba_stride: pw as i32,
            a_offset: hv as i32,
            work: at(self, &s.gdn_work, 0) as _,
            slot: slot.map_or(std::ptr::null(), |p| p as _),
            state_stride: ssm_stride as i32,
        };
        // The chunked form (chunks of 64 inside the kernel) and the recurrent form compute the
        // same delta rule in fp32; they differ in summation order only.
        if prefill {
            ensure!(n <= CHUNK, "gdn two-phase: {n} tokens > the workspace's {CHUNK}");
            self.cx.k_gdn_chunked(gp)?;
        } else {
            self.cx.k_gdn(gp)?;
        }
        // The decode products take the gated norm into the BF16 output projection's prologue (one
        // launch, K split by head: gemv.cu's gdn_out_proj); the prefill GEMM reads its rows.
        if !prefill && O::KIND == Precision::Bf16 && d.linear_value_head_dim == ORNITH_GDN_OUT_DIM as usize {
            let ow = w.out_proj.dev("out_proj")?.all(self);
            ensure!(
                ow.in_features == vd && ow.split_rows == ow.out_features && ow.scale.is_none() && ow.fp4.is_none(),
                "out_proj: a BF16 [{}, {vd}] alone",
                ow.out_features
            );
            let hs = d.hidden_size;
            return self.cx.k_gdn_out(
                (at(self, &s.o, 0), vd),
                (z_at, pw),
                at(self, &w.norm.bf, 0),
                ow.w,
                (at(self, &h.delta, r0 * hs), hs),
                fold,
                n,
                hv,
                ow.out_features,
                self.eps(),
            );
        }
        self.cx.k_gated_norm(
            at(self, &s.o, 0),
            z_at,
            at(self, &w.norm.bf, 0),
            at(self, &s.on, 0),
            n,
            hv,
            d.linear_value_head_dim,
            pw,
            self.eps(),
        )?;
        let on = XIn { bf: at(self, &s.on, 0), q8: None, stride: vd, norm: None };
        self.lin_delta(&w.out_proj, "out_proj", on, h, r0, n, prefill, fold)
    }

    /// Rows `r0 .. r0 + n` of an attention layer (`rows`: whose positions and blocks; `pos`:
    /// the rows' positions as the host knows them, for the profile's byte counts only).
    #[allow(clippy::too_many_arguments)]
    fn attention_rows<Q: Prec, K: Prec, V: Prec, O: Prec>(
        &self,
        norm: &CudaVector,
        w: &GatedAttention<Self, Q, K, V, O>,
        pool: &CudaKvPool,
        rows: Rows,
        r0: usize,
        n: usize,
        h: &CudaAct,
        pos: &[usize],
    ) -> Result<()> {
        let d = &self.dims;
        let (nh, nkv, hd) = (d.num_attention_heads, d.num_key_value_heads, d.head_dim);
        let tw = self.plan.table_width();
        // The group reads each row's position and block table row from `desc` (the same launches
        // serve every step of a captured graph); one sequence passes its first position by value.
        let (pos_dev, table, p0) = match rows {
            Rows::Group => (self.desc_at(1), self.table_at(0), 0),
            Rows::Seq { pos, table, .. } => (0, self.table_at(table), pos),
        };
        let prefill = matches!(rows, Rows::Seq { .. }) && use_prefill(n);
        let s = &self.s;
        // Fusable: every decode product (BF16, FP8, NVFP4) takes the norm prologue and the fold.
        let (x, fold) = self.norm_rows_for(h, norm, r0, n, !prefill)?;
        let (qn, kn) = (nh * 2 * hd, nkv * hd);
        let (qg, kp, vp) = (at(self, &s.qg, 0), at(self, &s.k, 0), at(self, &s.v, 0));
        let (kp, vp) = if w.k_proj.dev.is_none() {
            // Loaded fused as `[q; k; v]` (`load::linear`): one row [q | k | v] in one launch
            // into `qg` (room for CHUNK rows of q); more rows, one launch per part (the
            // attention kernels read q, k and v with their own row strides; a GEMV row's bits
            // do not depend on which weight rows the launch covers).
            let f = w.q_proj.dev("q_proj|k_proj|v_proj")?;
            if n == 1 {
                self.linear_rows(f.all(self), x, self.q8_scratch(), qg, qn + 2 * kn, 1, false, None)?;
                (qg + 2 * qn as u64, qg + 2 * (qn + kn) as u64)
            } else {
                self.linear_rows(f.rows(self, 0, qn), x, self.q8_scratch(), qg, qn, n, prefill, None)?;
                self.linear_rows(f.rows(self, qn, kn), x, self.q8_scratch(), kp, kn, n, prefill, None)?;
                self.linear_rows(f.rows(self, qn + kn, kn), x, self.q8_scratch(), vp, kn, n, prefill, None)?;
                (kp, vp)
            }
        } else {
            self.lin(&w.q_proj, "q_proj", x, qg, qn, n, prefill)?;
            self.lin(&w.k_proj, "k_proj", x, kp, kn, n, prefill)?;
            self.lin(&w.v_proj, "v_proj", x, vp, kn, n, prefill)?;
            (kp, vp)
        };
        let pos_ptr = |a0: usize| if pos_dev == 0 { std::ptr::null() } else { (pos_dev + 4 * a0 as u64) as *const i32 };
        self.cx.k_qk_rope(OrnithQkRopeParams {
            qg: qg as _,
            k: kp as _,
            v: vp as _,
            q_norm: at(self, &w.q_norm.bf, 0) as _,
            k_norm: at(self, &w.k_norm.bf, 0) as _,
            q_out: at(self, &s.q, 0) as _,
            k_cache: at(self, &pool.k, 0) as _,
            v_cache: at(self, &pool.v, 0) as _,
            tokens: n as i32,
            pos0: p0 as i32,
            q_heads: nh as i32,
            kv_heads: nkv as i32,
            head_dim: hd as i32,
            rot: d.rotary_dim as i32,
            theta: d.rope_theta as f32,
            eps: self.eps(),
            pos_dev: pos_ptr(0),
            table: table as _,
            table_stride: tw as i32,
        })?;
        // An FP8 o_proj's input codes: for one decode row the product quantises the row in its
        // prologue (gemv_fp8_quant, via linear_rows); for more, the decode combine's last block
        // per row does (quantize_fp8_rows' bits either way, one launch fewer per layer).
        let quant_in_combine = !prefill && O::KIND == Precision::Fp8 && n > 1;
        let (xq, xs) = self.q8_scratch();
        if prefill {
            self.cx.k_flash_attn(OrnithFlashAttnParams {
                q: at(self, &s.q, 0) as _,
                k_cache: at(self, &pool.k, 0) as _,
                v_cache: at(self, &pool.v, 0) as _,
                qg: at(self, &s.qg, 0) as _,
                out: at(self, &s.on, 0) as _,
                tokens: n as i32,
                pos0: p0 as i32,
                q_heads: nh as i32,
                kv_heads: nkv as i32,
                scale: 1.0 / (hd as f32).sqrt(),
                table: table as _,
            })?;
        } else {
            // ATTN_ROWS rows per launch (the split partials are sized for that many).
            const _: () = assert!(ATTN_ROWS <= crate::cuda::attention::ATT_MAX_ROWS);
            for a0 in (0..n).step_by(ATTN_ROWS) {
                let m = ATTN_ROWS.min(n - a0);
                // Device-position form: MAX_SPLITS splits at most (the partials' stride), the
                // kernels derive each row's split_for length from its own position; one
                // sequence: the host's split_for over the launch's last row (identical splits,
                // identical results).
                let (split_len, splits, tab) = match rows {
                    Rows::Group => (0, plan::MAX_SPLITS, table + (4 * a0 * tw) as u64),
                    Rows::Seq { .. } => {
                        let (l, s) = plan::split_for(p0 + a0 + m);
                        (l, s, table)
                    }
                };
                self.cx.k_attention(
                    OrnithAttnParams {
                        q: at(self, &s.q, a0 * nh * hd) as _,
                        k_cache: at(self, &pool.k, 0) as _,
                        v_cache: at(self, &pool.v, 0) as _,
                        qg: at(self, &s.qg, a0 * nh * 2 * hd) as _,
                        part_o: at(self, &s.part_o, 0) as _,
                        part_ml: at(self, &s.part_ml, 0) as _,
                        out: at(self, &s.on, a0 * nh * hd) as _,
                        tokens: m as i32,
                        pos0: (p0 + a0) as i32,
                        q_heads: nh as i32,
                        kv_heads: nkv as i32,
                        head_dim: hd as i32,
                        split_len: split_len as i32,
                        splits: splits as i32,
                        scale: 1.0 / (hd as f32).sqrt(),
                        pos_dev: pos_ptr(a0),
                        min_split: plan::MIN_SPLIT as i32,
                        table: tab as _,
                        table_stride: tw as i32,
                        out_q8: if quant_in_combine { (xq + (a0 * nh * hd) as u64) as _ } else { std::ptr::null_mut() },
                        out_scale: if quant_in_combine { (xs + (a0 * 4) as u64) as _ } else { std::ptr::null_mut() },
                        ticket: std::ptr::null_mut(), // the launcher's
                    },
                    pos[a0..a0 + m].iter().map(|&x| x + 1).sum(),
                )?;
            }
        }
        let q8 = quant_in_combine.then_some((xq, xs));
        let att = XIn { bf: at(self, &s.on, 0), q8, stride: nh * hd, norm: None };
        self.lin_delta(&w.o_proj, "o_proj", att, h, r0, n, prefill, fold)
    }
}

impl Scratch {
    /// Scratch of one chunk (the MoE's of `z.moe_rows` rows), and the greedy sampler's `rows`
    /// results.
    fn new(cx: &CudaContext, d: &Dims, z: &ScratchSizes, rows: usize) -> Result<Self> {
        let (c, m) = (CHUNK, z.moe_rows);
        Ok(Scratch {
            xb: cx.alloc(z.xb)?,
            xq: cx.alloc(z.xq)?,
            xs: cx.alloc(z.xs)?,
            proj: cx.alloc(c * z.proj_w)?,
            conv: cx.alloc(z.conv)?,
            o: cx.alloc(z.o)?,
            on: cx.alloc(z.o)?,
            qg: cx.alloc(z.qg)?,
            k: cx.alloc(z.kv)?,
            v: cx.alloc(z.kv)?,
            q: cx.alloc(c * d.num_attention_heads * d.head_dim)?,
            part_o: cx.alloc(z.part_o)?,
            part_ml: cx.alloc(z.part_ml)?,
            rlog: cx.alloc(m * z.rlog_w)?,
            idx: cx.alloc(m * d.num_experts_per_tok)?,
            wt: cx.alloc(m * d.num_experts_per_tok)?,
            gu: cx.alloc(m * z.slots * 2 * d.moe_intermediate_size)?,
            aq: cx.alloc(z.aq)?,
            asc: cx.alloc(z.asc)?,
            ys: cx.alloc(m * z.slots * d.hidden_size)?,
            amax: cx.alloc(rows)?,
            amax_rows: cx.alloc(rows)?,
            group_offsets: cx.alloc(d.num_experts + 1)?,
            tile_offsets: cx.alloc(tile_offsets_len(d.num_experts))?,
            row_token: cx.alloc(m * d.num_experts_per_tok)?,
            row_of: cx.alloc(m * d.num_experts_per_tok)?,
            row_assign: cx.alloc(m * d.num_experts_per_tok)?,
            row_info: cx.alloc(4 * d.num_experts)?,
            gdn_work: cx.alloc(z.gdn_work)?,
        })
    }
}

impl Backend for CudaBackend {
    type Linear<P: Prec> = CudaLinear<P>;
    type Experts<G: Prec, U: Prec, D: Prec> = CudaExperts<G, U, D>;
    type Vector = CudaVector;
    type Embedding = CudaEmbedding;
    type Act = CudaAct;
    type GdnPool = CudaGdnPool;
    type KvPool = CudaKvPool;
    type Logits = CudaLogits;
    type StepGraphs = CudaStepGraphs;

    fn load_linear<P: Prec>(
        &self,
        ck: &Checkpoint,
        module: &str,
        out_features: usize,
        in_features: usize,
    ) -> Result<CudaLinear<P>> {
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
    ) -> Result<CudaExperts<G, U, D>> {
        self.experts(ck, module, layout, num_experts, intermediate, hidden)
    }

    fn load_vector(&self, ck: &Checkpoint, name: &str, shape: &[usize]) -> Result<CudaVector> {
        self.vector(ck, name, shape)
    }

    fn load_embedding(&self, ck: &Checkpoint, name: &str, vocab: usize, hidden: usize) -> Result<CudaEmbedding> {
        static LOADS: AtomicU64 = AtomicU64::new(1);
        Ok(CudaEmbedding { table: self.embedding(ck, name, vocab, hidden)?, id: LOADS.fetch_add(1, Relaxed) })
    }

    /// Pools of at most the planned slots (the step buffers are sized for them).
    fn new_gdn_pool(&self, d: &Dims, slots: usize) -> Result<CudaGdnPool> {
        ensure!(
            (1..=self.cap.slots + self.cap.snapshots).contains(&slots),
            "a recurrent pool of {slots} rows: the memory plan was made for 1..={} (--max-seqs, --prefix-cache-bytes)",
            self.cap.slots + self.cap.snapshots
        );
        let (c, s) = plan::gdn_slot_elems(d);
        let st = self.cx.stream();
        Ok(CudaGdnPool { conv: st.alloc_zeros(slots * c)?, ssm: st.alloc_zeros(slots * s)?, slots })
    }

    fn new_kv_pool(&self, d: &Dims, blocks: usize) -> Result<CudaKvPool> {
        ensure!(
            blocks >= 1 && blocks <= self.cap.blocks,
            "a K/V pool of {blocks} blocks: the memory plan was made for 1..={} (--kv-budget)",
            self.cap.blocks
        );
        let n = blocks * KV_BLOCK * d.num_key_value_heads * d.head_dim;
        Ok(CudaKvPool { k: self.cx.alloc(n)?, v: self.cx.alloc(n)?, blocks })
    }

    fn clear_slot(&self, p: &mut CudaGdnPool, slot: usize) -> Result<()> {
        ensure!(slot < p.slots, "state slot {slot} outside the pool of {}", p.slots);
        let (c, s) = plan::gdn_slot_elems(&self.dims);
        let st = self.cx.stream();
        st.memset_zeros(&mut p.conv.slice_mut(slot * c..(slot + 1) * c)).context("clearing the conv state")?;
        st.memset_zeros(&mut p.ssm.slice_mut(slot * s..(slot + 1) * s)).context("clearing the recurrent state")?;
        Ok(())
    }

    fn copy_slot(&self, p: &mut CudaGdnPool, from: usize, to: usize) -> Result<()> {
        ensure!(from < p.slots && to < p.slots, "state rows {from} -> {to} outside the pool of {}", p.slots);
        let (c, s) = plan::gdn_slot_elems(&self.dims);
        let st = self.cx.stream();
        copy_row(st, &mut p.conv, c, from, to).context("copying the conv state")?;
        copy_row(st, &mut p.ssm, s, from, to).context("copying the recurrent state")?;
        Ok(())
    }

    fn new_step_graphs(&self) -> Result<CudaStepGraphs> {
        Ok(CudaStepGraphs { graphs: HashMap::new() })
    }

    /// Writes the batch description to `desc`, then, for a decode batch, replays the graph of
    /// that many sequences (capturing `run` first if `g` holds none, or one of another model);
    /// other batches run eagerly. Profiling runs every step eagerly (events cannot bracket
    /// launches inside a graph).
    fn step(
        &self,
        g: &mut CudaStepGraphs,
        table: &CudaEmbedding,
        batch: &Batch,
        run: &mut dyn FnMut() -> Result<CudaLogits>,
    ) -> Result<CudaLogits> {
        self.check_deferred()?;
        self.upload_desc(batch)?;
        let mut scope = StepScope::enter(self, batch);
        if batch.is_decode() && !self.cx.profiling() && self.graphs.load(Relaxed) {
            self.replay(&mut scope, g, table, batch.seqs.len(), run)
        } else {
            run()
        }
    }

    fn embed(&self, d: &Dims, table: &CudaEmbedding, batch: &Batch) -> Result<CudaAct> {
        let table = &table.table;
        self.check_deferred()?;
        let t = batch.rows();
        ensure!(t > 0, "embedding of no tokens");
        if let Some(bad) = batch.ids.iter().find(|&&i| i as usize >= d.vocab_size) {
            bail!("token id {bad} is outside the vocabulary of {}", d.vocab_size);
        }
        if batch.is_decode() {
            // A decode step: the ids are in `desc` (written by `step`); the rows go to the
            // static buffers (no allocation, so the step can be captured).
            self.describe(batch)?;
            let (h, delta) = (self.dec.h.clone(), self.dec.delta.clone());
            self.cx.k_embed(self.desc_at(0), at(self, table, 0), at(self, &h, 0), t, d.hidden_size, d.vocab_size)?;
            return Ok(CudaAct::new(t, h, delta));
        }
        let ids32: Vec<i32> = batch.ids.iter().map(|&i| i as i32).collect();
        let dev_ids = self.cx.upload(&ids32)?;
        let h = Arc::new(self.cx.alloc::<u16>(t * d.hidden_size)?);
        let delta = Arc::new(self.cx.alloc::<u16>(t * d.hidden_size)?);
        self.cx.k_embed(at(self, &dev_ids, 0), at(self, table, 0), at(self, &h, 0), t, d.hidden_size, d.vocab_size)?;
        // `dev_ids` is freed stream-ordered after the gather that reads it.
        Ok(CudaAct::new(t, h, delta))
    }

    fn gated_deltanet<Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec>(
        &self,
        _d: &Dims,
        norm: &CudaVector,
        w: &GatedDeltaNet<Self, Qkv, Z, Bt, A, O>,
        pool: &mut CudaGdnPool,
        batch: &Batch,
        h: &mut CudaAct,
    ) -> Result<()> {
        self.layer_start(h, batch)?;
        if let Some(s) = batch.seqs.iter().find(|s| s.slot >= pool.slots) {
            bail!("state slot {} outside the pool of {}", s.slot, pool.slots);
        }
        let g = group_rows(batch);
        if g > 0 {
            self.gdn_rows(norm, w, pool, Rows::Group, 0, g, h)?;
        }
        for (i, (s, r)) in batch.seqs.iter().zip(batch.row_starts()).enumerate().skip(g) {
            for c0 in (0..s.len).step_by(CHUNK) {
                let n = CHUNK.min(s.len - c0);
                self.gdn_rows(norm, w, pool, Rows::Seq { slot: s.slot, pos: s.pos + c0, table: i }, r + c0, n, h)?;
            }
        }
        h.pending.set(h.t);
        Ok(())
    }

    fn attention<Q: Prec, K: Prec, V: Prec, O: Prec>(
        &self,
        _d: &Dims,
        norm: &CudaVector,
        w: &GatedAttention<Self, Q, K, V, O>,
        pool: &mut CudaKvPool,
        batch: &Batch,
        h: &mut CudaAct,
    ) -> Result<()> {
        self.layer_start(h, batch)?;
        for s in &batch.seqs {
            let need = (s.pos + s.len).div_ceil(KV_BLOCK);
            if let Some(b) = s.blocks[..need.min(s.blocks.len())].iter().find(|&&b| b as usize >= pool.blocks) {
                bail!("K/V block {b} outside the pool of {}", pool.blocks);
            }
        }
        let g = group_rows(batch);
        if g > 0 {
            let pos: Vec<usize> = batch.seqs[..g].iter().map(|s| s.pos).collect();
            self.attention_rows(norm, w, pool, Rows::Group, 0, g, h, &pos)?;
        }
        for (i, (s, r)) in batch.seqs.iter().zip(batch.row_starts()).enumerate().skip(g) {
            for c0 in (0..s.len).step_by(CHUNK) {
                let n = CHUNK.min(s.len - c0);
                self.attention_rows(
                    norm,
                    w,
                    pool,
                    Rows::Seq { slot: s.slot, pos: s.pos + c0, table: i },
                    r + c0,
                    n,
                    h,
                    &(s.pos + c0..s.pos + c0 + n).collect::<Vec<_>>(),
                )?;
            }
        }
        h.pending.set(h.t);
        Ok(())
    }

    fn sparse_moe<R: Prec, Eg: Prec, Eu: Prec, Ed: Prec, Sg: Prec, Su: Prec, Sd: Prec, Sgate: Prec>(
        &self,
        d: &Dims,
        norm: &CudaVector,
        w: &SparseMoe<Self, R, Eg, Eu, Ed, Sg, Su, Sd, Sgate>,
        batch: &Batch,
        h: &mut CudaAct,
    ) -> Result<()> {
        self.layer_start(h, batch)?;
        if Eg::KIND == Precision::Nvfp4 {
            return self.sparse_moe_nvfp4(d, norm, w, batch, h);
        }
        self.sparse_moe_fp8(d, norm, w, batch, h)
    }

    fn logits<P: Prec>(
        &self,
        d: &Dims,
        norm: &CudaVector,
        lm_head: &CudaLinear<P>,
        batch: &Batch,
        h: &CudaAct,
    ) -> Result<CudaLogits> {
        self.layer_start(h, batch)?;
        let v = d.vocab_size;
        let rows = batch.logit_rows();
        if batch.all_rows {
            // Not a decode step (`is_decode` is false with all_rows), so it may allocate.
            let buf = Arc::new(self.cx.alloc::<u16>(rows * v)?);
            for (r0, n, prefill) in segments(batch) {
                let x = self.norm_rows(h, norm, r0, n)?;
                self.lin(lm_head, "lm_head", x, at(self, &buf, r0 * v), v, n, prefill)?;
            }
            h.pending.set(0);
            return Ok(CudaLogits { rows, vocab: v, buf });
        }
        // Each sequence's last row, into row i (sequence order) of the static logits: the
        // decode group's rows 0..g at once, then each later sequence's last row alone.
        ensure!(rows <= self.cap.slots, "logits of {rows} sequences: the buffers hold {}", self.cap.slots);
        let buf = self.dec.logits.clone();
        let g = group_rows(batch);
        if g > 0 {
            let x = self.norm_rows(h, norm, 0, g)?;
            self.lin(lm_head, "lm_head", x, at(self, &buf, 0), v, g, false)?;
        }
        for (i, (s, r)) in batch.seqs.iter().zip(batch.row_starts()).enumerate().skip(g) {
            let x = self.norm_rows(h, norm, r + s.len - 1, 1)?;
            self.lin(lm_head, "lm_head", x, at(self, &buf, i * v), v, 1, false)?;
        }
        // The rows normalised above now hold h + delta; the others (prefill rows) do not.
        if g == batch.seqs.len() {
            h.pending.set(0);
        } else if h.pending.get() > 0 {
            h.spent.set(true);
        }
        Ok(CudaLogits { rows, vocab: v, buf })
    }

    /// Greedy rows by one argmax launch, the others by one `sample_rows` launch, each over all
    /// of its rows at once; the ids come back in `rows` order.
    fn sample(&self, logits: &CudaLogits, n: usize, rows: &[RowSample]) -> Result<Vec<Sampled>> {
        self.check_deferred()?;
        let v = logits.vocab;
        ensure!(n > 0 && n <= v, "sampling {n} of {v} logits");
        ensure!(rows.len() <= self.cap.slots, "sampling {} rows: the sampler holds {}", rows.len(), self.cap.slots);
        if let Some(r) = rows.iter().find(|r| r.row >= logits.rows) {
            bail!("sampling row {} of {} logits rows", r.row, logits.rows);
        }
        // Rows that report log-probabilities or carry a grammar's mask: their candidates as the
        // model gave them, copied to the host before any penalty edits them. Log-probabilities
        // are computed there (`logprobs::token_logprobs`), and a masked row is sampled there by
        // the reference sampler — penalties, mask, `sampling::sample` — which the device sampler
        // matches bit for bit.
        let mut raw: Vec<Option<Vec<u16>>> = vec![None; rows.len()];
        for (i, r) in rows.iter().enumerate() {
            if r.logprobs.is_some() || r.mask.is_some() {
                let mut b = vec![0u16; n];
                self.cx.stream().memcpy_dtoh(&logits.buf.slice(r.row * v..r.row * v + n), &mut b)?;
                raw[i] = Some(b);
            }
        }
        // Penalties edit their rows' logits first, for the argmax and the draw alike.
        if rows.iter().any(|r| r.penalties.is_some()) {
            let mut s = self.sampler.lock().unwrap_or_else(|e| e.into_inner());
            for r in rows.iter().filter(|r| r.mask.is_none()) {
                if let Some(st) = &r.penalties {
                    self.cx.apply_penalties(&logits.buf, v, r.row, n, st, &mut s)?;
                }
            }
        }
        let mut out = vec![0u32; rows.len()];
        let host: Vec<(usize, u32)> = {
            use rayon::prelude::*;
            (0..rows.len())
                .into_par_iter()
                .filter_map(|i| Some((i, rows[i].mask.as_ref()?, raw[i].as_ref()?)))
                .map(|(i, m, raw)| {
                    let r = &rows[i];
                    let mut bits = raw.clone();
                    if let Some(st) = &r.penalties {
                        crate::sampling::apply_penalties(&mut bits, st);
                    }
                    m.apply(&mut bits);
                    Ok((i, crate::sampling::sample(&bits, &r.params, r.step)?))
                })
                .collect::<Result<_>>()?
        };
        for (i, id) in host {
            out[i] = id;
        }
        let (greedy, drawn): (Vec<usize>, Vec<usize>) = (0..rows.len())
            .filter(|&i| rows[i].mask.is_none())
            .partition(|&i| crate::sampling::is_greedy(&rows[i].params));
        if !greedy.is_empty() {
            let lr: Vec<i32> = greedy.iter().map(|&i| rows[i].row as i32).collect();
            let (idx, lrows) = (at(self, &self.s.amax, 0), at(self, &self.s.amax_rows, 0));
            // SAFETY: at most `cap.slots` rows (checked above), the scratch's length; a copy from
            // pageable host memory returns once the bytes are staged.
            unsafe { cudarc::driver::result::memcpy_htod_async(lrows, &lr, self.cx.stream().cu_stream()) }?;
            self.cx.k_argmax(at(self, &logits.buf, 0), idx, lr.len(), n, v, Some(lrows))?;
            let mut ids = vec![0i32; lr.len()];
            self.cx.stream().memcpy_dtoh(&self.s.amax.slice(0..lr.len()), &mut ids)?;
            for (&i, &id) in greedy.iter().zip(&ids) {
                ensure!(id >= 0, crate::sampling::NO_FINITE_LOGIT);
                out[i] = id as u32;
            }
        }
        if !drawn.is_empty() {
            let req: Vec<(usize, crate::engine::SamplingParams, u64)> =
                drawn.iter().map(|&i| (rows[i].row, rows[i].params, rows[i].step)).collect();
            let mut s = self.sampler.lock().unwrap_or_else(|e| e.into_inner());
            self.cx.sample_rows(&logits.buf, v, n, &req, &mut s)?;
            for (&i, id) in drawn.iter().zip(self.cx.sampled_ids(&s, req.len())?) {
                out[i] = id;
            }
        }
        Ok(out
            .into_iter()
            .zip(rows.iter().zip(raw))
            .map(|(id, (r, raw))| {
                let logprobs = r
                    .logprobs
                    .zip(raw)
                    .map(|(w, raw)| Box::new(crate::logprobs::token_logprobs(&raw, w.forced.unwrap_or(id), w.top)));
                Sampled { id, logprobs }
            })
            .collect())
    }

    fn logits_to_host(&self, logits: &CudaLogits) -> Result<Vec<f32>> {
        let n = logits.rows * logits.vocab;
        let mut b = vec![0u16; n];
        self.cx.stream().memcpy_dtoh(&logits.buf.slice(0..n), &mut b)?;
        Ok(b.iter().map(|&x| bf16::from_bits(x).to_f32()).collect())
    }

    /// `h`, with the pending delta added in bf16 as the next RMSNorm kernel would.
    fn act_to_host(&self, h: &CudaAct) -> Result<Vec<f32>> {
        ensure!(!h.spent.get(), "hidden states read after a last-row logits call");
        let hs = self.dims.hidden_size;
        let n = h.t * hs;
        let mut hv = vec![0u16; n];
        let mut dv = vec![0u16; n];
        self.cx.stream().memcpy_dtoh(&h.h.slice(0..n), &mut hv)?;
        self.cx.stream().memcpy_dtoh(&h.delta.slice(0..n), &mut dv)?;
        let pend = h.pending.get() * hs;
        Ok(hv
            .iter()
            .zip(&dv)
            .enumerate()
            .map(|(i, (&a, &b))| {
                let a = bf16::from_bits(a).to_f32();
                if i < pend {
                    bf16::from_f32(a + bf16::from_bits(b).to_f32()).to_f32()
                } else {
                    a
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(lens: &[usize]) -> Batch {
        let seqs: Vec<SeqRows> =
            lens.iter().enumerate().map(|(i, &len)| SeqRows { slot: i, pos: 10, len, blocks: vec![0; 64] }).collect();
        Batch { ids: vec![0; lens.iter().sum()], seqs, all_rows: false }
    }

    /// The leading one-row sequences form the decode group (one segment of GEMV rows); every
    /// later sequence runs alone, in chunks of CHUNK (prefill kernels above 8 rows), a one-row
    /// sequence after a prefill chunk included.
    #[test]
    fn decode_group_then_sequences_in_chunks() {
        let b = batch(&[1, 1, 3000, 1, 5, 9]);
        assert_eq!(group_rows(&b), 2);
        assert_eq!(
            segments(&b),
            vec![
                (0, 2, false),
                (2, CHUNK, true),
                (2 + CHUNK, 3000 - CHUNK, true),
                (3002, 1, false),
                (3003, 5, false),
                (3008, 9, true)
            ]
        );
        assert_eq!(group_rows(&batch(&[4, 1])), 0);
        assert_eq!(segments(&batch(&[1; 13])), vec![(0, 13, false)]);
    }
}
