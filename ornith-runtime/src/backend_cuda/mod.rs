//! The CUDA backend: the layer operations of [`Backend`] composed from the decode kernels
//! (`kernels/cuda/*.cu`), with the CPU backend's cast points (the kernels round to bf16 where
//! transformers does; see `kernels/include/ornith_kernels.h`).
//!
//! * Weights are uploaded once, straight from the shard mmap ([`load`]), after a memory plan
//!   ([`plan::MemoryPlan`]) was checked against the device's free memory.
//! * The residual stream is `h` plus a pending `delta` (the last layer output): the next
//!   RMSNorm kernel adds it in (`h = bf16(h + delta)`) while normalising, so no separate add runs.
//! * Prefill runs each layer in chunks of [`plan::CHUNK`] tokens. A chunk of more than 8 rows
//!   runs the prefill kernels ([`prefill_ops`]): tensor-core GEMMs for every Linear, the chunked
//!   gated delta rule, causal flash attention over the cache, and the MoE grouped by expert
//!   (counting sort, grouped FP8 GEMMs, shared expert as plain GEMMs). A chunk of up to 8 rows
//!   (decode, short tails) runs the decode kernels: GEMV, the recurrent delta rule, split-K
//!   attention, the per-slot MoE GEMV. Both paths round at the same points as the CPU backend.
//! * Decode (`Backend::decode_step`) is captured once per sequence state as a CUDA graph and
//!   replayed: the decode kernels that depend on the token or the position read them from a
//!   device buffer written before each replay (`DecodeBufs`), the attention split count is fixed
//!   (the kernel derives the split length from the position), and the step's activations live in
//!   static buffers. With profiling on (`ornith-bench`), or `set_decode_graph(false)`, the same
//!   launches run eagerly.
mod load;
mod ops;
pub mod plan;
mod prefill_ops;
pub mod profile;

use crate::cuda::CudaContext;
use crate::engine::SamplingParams;
use crate::graph::*;
use crate::weights::Checkpoint;
use anyhow::{bail, ensure, Context, Result};
use cudarc::driver::CudaSlice;
use half::bf16;
use model_spec::ExpertLayout;
use ops::{at, Ptr, XIn};
use ornith_kernels::bindings::*;
use plan::{MemoryPlan, ScratchSizes, ATTN_ROWS, CHUNK};
use prefill_ops::use_prefill;
use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// A Linear on the device: BF16 weights (`scale` None) or E4M3 codes with f32 per-row scales.
pub struct DevLinear {
    pub out_features: usize,
    pub in_features: usize,
    w: CudaSlice<u8>,
    scale: Option<CudaSlice<f32>>,
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
/// expert), `dn [E, H, I]`, E4M3, with f32 scales `gus [E, 2I]`, `dns [E, H]`.
pub struct CudaExperts<G: Prec, U: Prec, D: Prec> {
    gu: CudaSlice<u8>,
    gus: CudaSlice<f32>,
    dn: CudaSlice<u8>,
    dns: CudaSlice<f32>,
    experts: usize,
    _p: PhantomData<(G, U, D)>,
}

/// A small vector as bf16 and as the same values in f32 (kernels take one or the other).
pub struct CudaVector {
    bf: CudaSlice<u16>,
    f: CudaSlice<f32>,
}

/// Hidden states `[t, hidden]`: `h` plus, for the first `pending` rows, a `delta` still to add.
/// A decode step's one row lives in the backend's static [`DecodeBufs`] (shared `Arc`s).
pub struct CudaAct {
    pub t: usize,
    h: Arc<CudaSlice<u16>>,
    delta: Arc<CudaSlice<u16>>,
    pending: Cell<usize>,
}

/// Static buffers of the decode step, so that a captured graph sees the same addresses at every
/// replay: `io = [token id, position]` (written before each step), the residual row `h` and the
/// pending `delta`.
struct DecodeBufs {
    io: CudaSlice<i32>,
    h: Arc<CudaSlice<u16>>,
    delta: Arc<CudaSlice<u16>>,
}

/// The decode step of one sequence state, captured as a CUDA graph on first use, and the
/// address of the embedding table it was captured with (a graph bakes in every weight address,
/// so a different model recaptures).
pub struct CudaDecodeGraph {
    graph: Option<SendGraph>,
    key: u64,
    /// Whether the captured launches carry the programmatic-dependent-launch attribute.
    pdl: bool,
    /// The kernel left out of the capture (`CudaBackend::set_skip_kernel`).
    skip: Option<&'static str>,
}

/// The embedding table `[vocab, hidden]` BF16, and a number unique to this load: a captured decode
/// graph bakes in every weight address of the model it was captured with, so it is keyed by
/// this number (an address could be reused by a later load).
pub struct CudaEmbedding {
    table: CudaSlice<u8>,
    id: u64,
}

/// Marks the backend as issuing a decode step for as long as it lives; on drop (also when the
/// step panics) it leaves that mode and closes a capture still open.
struct DecodeMode<'a> {
    b: &'a CudaBackend,
    capturing: bool,
}

impl<'a> DecodeMode<'a> {
    fn enter(b: &'a CudaBackend) -> Self {
        b.decoding.store(true, Relaxed);
        DecodeMode { b, capturing: false }
    }
}

impl Drop for DecodeMode<'_> {
    fn drop(&mut self) {
        if self.capturing {
            let _ = self.b.cx.stream().end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        }
        self.b.decoding.store(false, Relaxed);
    }
}

/// A captured graph, movable to another thread with the sequence state that owns it.
struct SendGraph(cudarc::driver::CudaGraph);
// SAFETY: cudarc's `CudaGraph` is not `Send` only because it holds raw driver handles
// (CUgraph, CUgraphExec), which the CUDA driver allows to be used from any thread once the
// context is bound (every launch binds it first). It is not `Sync`: a graph is replayed only
// through `&mut DecodeGraph`, so never from two threads at once.
unsafe impl Send for SendGraph {}

/// Conv state `[3, conv_dim]` bf16 (oldest first) and recurrent state `[Hv, dk, dv]` f32.
pub struct CudaGdnState {
    conv: CudaSlice<u16>,
    ssm: CudaSlice<f32>,
}

/// K (normed, rotated) and V `[max_context, Hkv, head_dim]` bf16. The positions written are
/// the generated `State::pos` (one count for every layer, kept by the generated code; a replayed
/// decode graph could not update a count kept here).
pub struct CudaKvCache {
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    max_context: usize,
}

/// Logits `[rows, vocab]` bf16 on the device. Serving logits (one row) live in a buffer the next
/// forward call overwrites; read or sample them before running the model again.
pub struct CudaLogits {
    pub rows: usize,
    pub vocab: usize,
    buf: Arc<CudaSlice<u16>>,
}

/// Scratch of one prefill chunk (sizes in [`ScratchSizes`]).
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
    amax: CudaSlice<i32>,
    /// MoE prefill: expert-sorted row bookkeeping (`OrnithMoeSortParams`).
    group_offsets: CudaSlice<i32>,
    tile_offsets: CudaSlice<i32>,
    row_token: CudaSlice<i32>,
    row_of: CudaSlice<i32>,
    /// Two-phase chunked gated delta rule workspace (`ScratchSizes::gdn_work`).
    gdn_work: CudaSlice<f32>,
    logits1: Arc<CudaSlice<u16>>,
}

/// The CUDA backend on device 0.
pub struct CudaBackend {
    cx: CudaContext,
    dims: ModelDims,
    sz: ScratchSizes,
    s: Scratch,
    plan: MemoryPlan,
    progress: Mutex<load::Progress>,
    prof: Mutex<Option<Vec<profile::Launch>>>,
    /// An error from a method that cannot return one (state resets), reported by the next call.
    deferred: Mutex<Option<anyhow::Error>>,
    dec: DecodeBufs,
    /// True while a decode step's operations are issued (static buffers, device position).
    decoding: AtomicBool,
    /// Capture and replay decode steps (default); false runs them eagerly.
    graphs: AtomicBool,
    /// A kernel whose launches are not issued (`ornith-bench`'s in-graph ablation; None normally).
    skip: Mutex<Option<&'static str>>,
    /// The device sampler's buffers (one row).
    sampler: Mutex<crate::cuda::sample::SampleScratch>,
}

impl CudaBackend {
    /// Checks the model's shapes against the kernels, plans every allocation for a context of
    /// `max_context` tokens and checks it against free device memory, then allocates scratch.
    /// Weights are uploaded by `Model::load` through the `load_*` methods.
    pub fn new(cx: CudaContext, ck: &Checkpoint, dims: &ModelDims, max_context: usize, quiet: bool) -> Result<Self> {
        plan::check_dims(dims)?;
        ensure!(max_context >= 1, "the context must hold at least one token");
        let plan = MemoryPlan::new(ck, dims, max_context);
        let (driver_free, total) = cx.driver().mem_get_info()?;
        let integrated =
            cx.driver().attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED)? != 0;
        let meminfo = if integrated { std::fs::read_to_string("/proc/meminfo").ok() } else { None };
        let (free, source) = plan::usable_free(driver_free as u64, integrated, meminfo.as_deref());
        plan.check(free, source, total as u64, cx.device_name())?;
        let sz = ScratchSizes::new(dims);
        let s = Scratch::new(&cx, dims, &sz)?;
        let sampler = Mutex::new(crate::cuda::sample::SampleScratch::new(&cx, 1, dims.vocab_size)?);
        let dec = DecodeBufs {
            io: cx.alloc(2)?,
            h: Arc::new(cx.alloc(dims.hidden_size)?),
            delta: Arc::new(cx.alloc(dims.hidden_size)?),
        };
        Ok(CudaBackend {
            cx,
            dims: *dims,
            sz,
            s,
            plan,
            progress: Mutex::new(load::Progress::new(plan.weights, quiet)),
            prof: Mutex::new(None),
            deferred: Mutex::new(None),
            dec,
            decoding: AtomicBool::new(false),
            graphs: AtomicBool::new(true),
            skip: Mutex::new(None),
            sampler,
        })
    }

    /// Capture decode steps as CUDA graphs and replay them (true, the default), or run every
    /// decode launch eagerly (false: the comparison in the tests and the bench).
    pub fn set_decode_graph(&self, on: bool) {
        self.graphs.store(on, Relaxed);
    }

    /// Measurement only (`ornith-bench`'s in-graph ablation): launches of kernel `name` are not
    /// issued, so a decode graph captured now shows what that kernel costs inside the graph.
    /// Results are garbage while it is set (every buffer stays valid: static scratch, clamped expert
    /// indices, device-held positions). A captured graph keeps the setting it was captured with.
    pub fn set_skip_kernel(&self, name: Option<&'static str>) {
        *self.skip.lock().unwrap_or_else(|e| e.into_inner()) = name;
    }

    /// Replays `g`, capturing `step` into it first when it holds no graph for this model.
    fn replay(
        &self,
        mode: &mut DecodeMode,
        g: &mut CudaDecodeGraph,
        table: &CudaEmbedding,
        step: &mut dyn FnMut() -> Result<CudaLogits>,
    ) -> Result<CudaLogits> {
        let (key, pdl) = (table.id, self.cx.pdl());
        let skip = *self.skip.lock().unwrap_or_else(|e| e.into_inner());
        if g.graph.is_none() || g.key != key || g.pdl != pdl || g.skip != skip {
            g.graph = None;
            let st = self.cx.stream();
            // Thread-local mode: a synchronising call on this thread fails the capture. An
            // allocation or a free would NOT fail (stream-ordered ones become graph nodes), so
            // the decode path allocates nothing: `embed` and `logits` use static buffers there
            // (and assert it).
            st.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            mode.capturing = true;
            let r = step();
            let end = st.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
            mode.capturing = false;
            r.context("capturing the decode step")?;
            let graph = end
                .context("instantiating the decode graph")?
                .ok_or_else(|| anyhow::anyhow!("the captured decode step is empty"))?;
            graph.upload()?;
            *g = CudaDecodeGraph { graph: Some(SendGraph(graph)), key, pdl, skip };
        }
        g.graph.as_ref().expect("captured above").0.launch()?;
        Ok(CudaLogits { rows: 1, vocab: self.dims.vocab_size, buf: self.s.logits1.clone() })
    }

    pub fn context(&self) -> &CudaContext {
        &self.cx
    }
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    /// Starts timing every launch (until [`Self::profile_end`]).
    pub fn profile_begin(&self) {
        *self.prof.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
    }

    /// The launches since [`Self::profile_begin`], with their event-measured times.
    pub fn profile_end(&self) -> Result<Vec<profile::KernelTime>> {
        let l = self.prof.lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or_default();
        self.cx.synchronize()?;
        profile::collect(l)
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
        Ok(CudaAct {
            t: data.len() / hs,
            h: Arc::new(self.cx.upload(&b)?),
            delta: Arc::new(self.cx.alloc(b.len())?),
            pending: Cell::new(0),
        })
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

    /// RMSNorm of rows `r0 .. r0 + n` of `h` into the scratch `xb`/`xq` (adding the pending delta).
    fn norm_rows(&self, h: &CudaAct, w: &CudaVector, r0: usize, n: usize) -> Result<XIn> {
        let hs = self.dims.hidden_size;
        let add = (h.pending.get() > r0).then(|| at(self, &h.delta, r0 * hs));
        let (xq, xs) = (at(self, &self.s.xq, 0), at(self, &self.s.xs, 0));
        self.k_rmsnorm(
            at(self, &h.h, r0 * hs),
            add,
            at(self, &w.bf, 0),
            at(self, &self.s.xb, 0),
            Some((xq, xs)),
            n,
            hs,
            self.eps(),
        )?;
        Ok(XIn { bf: at(self, &self.s.xb, 0), q8: Some((xq, xs)), stride: hs })
    }

    fn q8_scratch(&self) -> (Ptr, Ptr) {
        (at(self, &self.s.xq, 0), at(self, &self.s.xs, 0))
    }

    fn lin<P: Prec>(&self, l: &CudaLinear<P>, what: &str, x: XIn, y: Ptr, y_stride: usize, n: usize) -> Result<()> {
        self.linear_rows(l.dev(what)?.all(self), x, self.q8_scratch(), y, y_stride, n)
    }

    /// Every layer starts with a fully pending or fully applied residual.
    fn layer_start(&self, h: &CudaAct) -> Result<()> {
        self.check_deferred()?;
        let p = h.pending.get();
        ensure!(p == 0 || p == h.t, "hidden states used after a last-row logits call");
        Ok(())
    }

    fn gdn_layer<Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec>(
        &self,
        norm: &CudaVector,
        w: &GatedDeltaNet<Self, Qkv, Z, Bt, A, O>,
        st: &mut CudaGdnState,
        h: &mut CudaAct,
    ) -> Result<()> {
        self.layer_start(h)?;
        let d = &self.dims;
        let (hs, cd, vd, hv, hk) =
            (d.hidden_size, d.conv_dim(), d.value_dim(), d.linear_num_value_heads, d.linear_num_key_heads);
        let pw = self.sz.proj_w;
        let s = &self.s;
        for r0 in (0..h.t).step_by(CHUNK) {
            let n = CHUNK.min(h.t - r0);
            let x = self.norm_rows(h, norm, r0, n)?;
            let proj = at(self, &s.proj, 0);
            let (z_at, b_at) = (proj + 2 * cd as u64, proj + 2 * (cd + vd) as u64);
            if w.in_proj_z.dev.is_none() {
                // Loaded fused (`load::gdn_in_proj`): one Linear writes the whole row.
                self.lin(&w.in_proj_qkv, "in_proj_qkv|z|b|a", x, proj, pw, n)?;
            } else {
                self.lin(&w.in_proj_qkv, "in_proj_qkv", x, proj, pw, n)?;
                self.lin(&w.in_proj_z, "in_proj_z", x, z_at, pw, n)?;
                self.lin(&w.in_proj_b, "in_proj_b", x, b_at, pw, n)?;
                self.lin(&w.in_proj_a, "in_proj_a", x, b_at + 2 * hv as u64, pw, n)?;
            }
            let conv = if use_prefill(n) { Self::k_conv_chunk } else { Self::k_conv }; // bit-identical forms
            conv(self, proj, at(self, &w.conv1d.bf, 0), at(self, &st.conv, 0), at(self, &s.conv, 0), n, cd, pw)?;
            let gp = OrnithGdnParams {
                qkv: at(self, &s.conv, 0) as _,
                ba: b_at as _,
                a_log: at(self, &w.a_log.f, 0) as _,
                dt_bias: at(self, &w.dt_bias.bf, 0) as _,
                state: at(self, &st.ssm, 0) as _,
                o: at(self, &s.o, 0) as _,
                tokens: n as i32,
                k_heads: hk as i32,
                v_heads: hv as i32,
                qkv_stride: cd as i32,
                ba_stride: pw as i32,
                a_offset: hv as i32,
                work: at(self, &s.gdn_work, 0) as _,
            };
            // The chunked form (chunks of 64 inside the kernel) and the recurrent form compute the
            // same delta rule in fp32; they differ in summation order only.
            if use_prefill(n) {
                self.k_gdn_chunked(gp)?;
            } else {
                self.k_gdn(gp)?;
            }
            self.k_gated_norm(
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
            let on = XIn { bf: at(self, &s.on, 0), q8: None, stride: vd };
            self.lin(&w.out_proj, "out_proj", on, at(self, &h.delta, r0 * hs), hs, n)?;
        }
        h.pending.set(h.t);
        Ok(())
    }

    fn attention_layer<Q: Prec, K: Prec, V: Prec, O: Prec>(
        &self,
        norm: &CudaVector,
        w: &GatedAttention<Self, Q, K, V, O>,
        cache: &mut CudaKvCache,
        pos: usize,
        h: &mut CudaAct,
    ) -> Result<()> {
        self.layer_start(h)?;
        let d = &self.dims;
        let (hs, nh, nkv, hd) = (d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim);
        ensure!(pos + h.t <= cache.max_context, "K/V cache of {} tokens is full", cache.max_context);
        // A decode step reads its position from the device (the same launches serve every
        // position of a captured graph); prefill passes it by value.
        let pos_dev = if self.decoding.load(Relaxed) {
            ensure!(h.t == 1, "a decode step runs one token, got {}", h.t);
            at(self, &self.dec.io, 1) as *const i32
        } else {
            std::ptr::null()
        };
        let s = &self.s;
        for r0 in (0..h.t).step_by(CHUNK) {
            let n = CHUNK.min(h.t - r0);
            let x = self.norm_rows(h, norm, r0, n)?;
            let (qn, kn) = (nh * 2 * hd, nkv * hd);
            let (qg, kp, vp) = (at(self, &s.qg, 0), at(self, &s.k, 0), at(self, &s.v, 0));
            let (kp, vp) = if w.k_proj.dev.is_none() {
                // Loaded fused as `[q; k; v]` (`load::linear`): one token's row [q | k | v] in one
                // launch into `qg` (room for CHUNK rows of q); more rows, one launch per part
                // (the attention kernels read q, k and v with their own row strides).
                let f = w.q_proj.dev("q_proj|k_proj|v_proj")?;
                if n == 1 {
                    self.linear_rows(f.all(self), x, self.q8_scratch(), qg, qn + 2 * kn, 1)?;
                    (qg + 2 * qn as u64, qg + 2 * (qn + kn) as u64)
                } else {
                    self.linear_rows(f.rows(self, 0, qn), x, self.q8_scratch(), qg, qn, n)?;
                    self.linear_rows(f.rows(self, qn, kn), x, self.q8_scratch(), kp, kn, n)?;
                    self.linear_rows(f.rows(self, qn + kn, kn), x, self.q8_scratch(), vp, kn, n)?;
                    (kp, vp)
                }
            } else {
                self.lin(&w.q_proj, "q_proj", x, qg, qn, n)?;
                self.lin(&w.k_proj, "k_proj", x, kp, kn, n)?;
                self.lin(&w.v_proj, "v_proj", x, vp, kn, n)?;
                (kp, vp)
            };
            let p0 = pos + r0;
            self.k_qk_rope(OrnithQkRopeParams {
                qg: qg as _,
                k: kp as _,
                v: vp as _,
                q_norm: at(self, &w.q_norm.bf, 0) as _,
                k_norm: at(self, &w.k_norm.bf, 0) as _,
                q_out: at(self, &s.q, 0) as _,
                k_cache: at(self, &cache.k, 0) as _,
                v_cache: at(self, &cache.v, 0) as _,
                tokens: n as i32,
                pos0: p0 as i32,
                q_heads: nh as i32,
                kv_heads: nkv as i32,
                head_dim: hd as i32,
                rot: d.rotary_dim as i32,
                max_seq: cache.max_context as i32,
                theta: d.rope_theta as f32,
                eps: self.eps(),
                pos_dev,
            })?;
            if use_prefill(n) {
                self.k_flash_attn(OrnithFlashAttnParams {
                    q: at(self, &s.q, 0) as _,
                    k_cache: at(self, &cache.k, 0) as _,
                    v_cache: at(self, &cache.v, 0) as _,
                    qg: at(self, &s.qg, 0) as _,
                    out: at(self, &s.on, 0) as _,
                    tokens: n as i32,
                    pos0: p0 as i32,
                    q_heads: nh as i32,
                    kv_heads: nkv as i32,
                    scale: 1.0 / (hd as f32).sqrt(),
                })?;
            } else {
                for a0 in (0..n).step_by(ATTN_ROWS) {
                    let m = ATTN_ROWS.min(n - a0);
                    // Device-position form: a fixed grid of MAX_SPLITS splits, the kernel derives
                    // split_for's length (identical splits, so identical results).
                    let (split_len, splits) =
                        if pos_dev.is_null() { plan::split_for(p0 + a0 + m) } else { (0, plan::MAX_SPLITS) };
                    self.k_attention(OrnithAttnParams {
                        q: at(self, &s.q, a0 * nh * hd) as _,
                        k_cache: at(self, &cache.k, 0) as _,
                        v_cache: at(self, &cache.v, 0) as _,
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
                        pos_dev,
                        min_split: plan::MIN_SPLIT as i32,
                    })?;
                }
            }
            let att = XIn { bf: at(self, &s.on, 0), q8: None, stride: nh * hd };
            self.lin(&w.o_proj, "o_proj", att, at(self, &h.delta, r0 * hs), hs, n)?;
        }
        h.pending.set(h.t);
        Ok(())
    }

    /// The MoE of `n` prefill rows grouped by expert, after the router (`s.rlog`, `s.idx`,
    /// `s.wt`), from the FP8 rows `x` of the post-attention norm, into `out [n, hidden]`:
    /// sort the `n·k` (token, slot) assignments by expert; grouped FP8 gate|up GEMM (row r reads
    /// token `row_token[r]`); SwiGLU + requantisation; grouped FP8 down GEMM; the shared expert
    /// as plain GEMMs on rows `n·k ..` of the same scratch; the combine
    /// `out = bf16(bf16(Σ_j bf16(y_j · w_j)) + bf16(bf16(sigmoid(g)) · y_shared))` — the cast
    /// points of `cpu::moe::moe` and of the decode chain.
    fn moe_grouped<G: Prec, U: Prec, D: Prec>(
        &self,
        ex: &CudaExperts<G, U, D>,
        sh: SharedExpert,
        x: (ops::Ptr, ops::Ptr),
        n: usize,
        out: ops::Ptr,
    ) -> Result<()> {
        let d = &self.dims;
        let (hs, e, k, inter) = (d.hidden_size, ex.experts, d.top_k, d.moe_intermediate_size);
        let s = &self.s;
        let nk = n * k;
        let (go, to, rt, ro) = (
            at(self, &s.group_offsets, 0),
            at(self, &s.tile_offsets, 0),
            at(self, &s.row_token, 0),
            at(self, &s.row_of, 0),
        );
        let (gu, aq, asc, ys) = (at(self, &s.gu, 0), at(self, &s.aq, 0), at(self, &s.asc, 0), at(self, &s.ys, 0));
        self.k_moe_sort(OrnithMoeSortParams {
            idx: at(self, &s.idx, 0) as _,
            group_offsets: go as _,
            tile_offsets: to as _,
            row_token: rt as _,
            row_of: ro as _,
            tokens: n as i32,
            top_k: k as i32,
            experts: e as i32,
        })?;
        self.k_gemm_grouped(OrnithGemmParams {
            a: x.0 as _,
            a_scale: x.1 as _,
            a_rows: rt as _,
            w: at(self, &ex.gu, 0) as _,
            w_scale: at(self, &ex.gus, 0) as _,
            y: gu as _,
            group_offsets: go as _,
            tile_offsets: to as _,
            rows: nk as i32,
            in_: hs as i32,
            out: (2 * inter) as i32,
            a_stride: hs as i32,
            y_stride: (2 * inter) as i32,
            groups: e as i32,
        })?;
        self.k_swiglu_ct(gu, aq, asc, nk, inter)?;
        self.k_gemm_grouped(OrnithGemmParams {
            a: aq as _,
            a_scale: asc as _,
            a_rows: std::ptr::null(),
            w: at(self, &ex.dn, 0) as _,
            w_scale: at(self, &ex.dns, 0) as _,
            y: ys as _,
            group_offsets: go as _,
            tile_offsets: to as _,
            rows: nk as i32,
            in_: inter as i32,
            out: hs as i32,
            a_stride: inter as i32,
            y_stride: hs as i32,
            groups: e as i32,
        })?;
        // Shared expert: rows nk .. nk + n of the slot scratch (sized for n·(k + 1) rows).
        let (sgu, saq, sas, sy) = (
            gu + (2 * nk * 2 * inter) as u64,
            aq + (nk * inter) as u64,
            asc + (4 * nk) as u64,
            ys + (2 * nk * hs) as u64,
        );
        self.k_gemm_fp8(x.0, x.1, sh.gu, sh.gus, sgu, n, hs, 2 * inter, hs, 2 * inter)?;
        self.k_swiglu_ct(sgu, saq, sas, n, inter)?;
        self.k_gemm_fp8(saq, sas, sh.dn, sh.dns, sy, n, inter, hs, inter, hs)?;
        let rw = self.sz.rlog_w;
        self.k_combine_prefill(OrnithMoeCombinePrefillParams {
            ys: ys as _,
            row_of: ro as _,
            weight: at(self, &s.wt, 0) as _,
            shared_y: sy as _,
            gate_logit: (at(self, &s.rlog, 0) + 2 * e as u64) as _,
            out: out as _,
            tokens: n as i32,
            top_k: k as i32,
            hidden: hs as i32,
            gate_stride: rw as i32,
        })
    }
}

/// Device addresses of the shared expert's fused gate|up `[2I, H]` and down `[H, I]` (FP8 + scales).
#[derive(Clone, Copy)]
struct SharedExpert {
    gu: ops::Ptr,
    gus: ops::Ptr,
    dn: ops::Ptr,
    dns: ops::Ptr,
}

impl Scratch {
    fn new(cx: &CudaContext, d: &ModelDims, z: &ScratchSizes) -> Result<Self> {
        let c = CHUNK;
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
            rlog: cx.alloc(c * z.rlog_w)?,
            idx: cx.alloc(c * d.top_k)?,
            wt: cx.alloc(c * d.top_k)?,
            gu: cx.alloc(c * z.slots * 2 * d.moe_intermediate_size)?,
            aq: cx.alloc(z.aq)?,
            asc: cx.alloc(z.asc)?,
            ys: cx.alloc(c * z.slots * d.hidden_size)?,
            amax: cx.alloc(1)?,
            group_offsets: cx.alloc(d.num_experts + 1)?,
            tile_offsets: cx.alloc(d.num_experts + 1)?,
            row_token: cx.alloc(c * d.top_k)?,
            row_of: cx.alloc(c * d.top_k)?,
            gdn_work: cx.alloc(z.gdn_work)?,
            logits1: Arc::new(cx.alloc(d.vocab_size)?),
        })
    }
}

impl Backend for CudaBackend {
    type Linear<P: Prec> = CudaLinear<P>;
    type Experts<G: Prec, U: Prec, D: Prec> = CudaExperts<G, U, D>;
    type Vector = CudaVector;
    type Embedding = CudaEmbedding;
    type Act = CudaAct;
    type GdnState = CudaGdnState;
    type KvCache = CudaKvCache;
    type Logits = CudaLogits;
    type DecodeGraph = CudaDecodeGraph;

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

    fn new_gdn_state(&self, d: &ModelDims) -> Result<CudaGdnState> {
        let st = self.cx.stream();
        Ok(CudaGdnState {
            conv: st.alloc_zeros(3 * d.conv_dim())?,
            ssm: st.alloc_zeros(d.linear_num_value_heads * d.linear_key_head_dim * d.linear_value_head_dim)?,
        })
    }

    fn new_kv_cache(&self, d: &ModelDims, max_context: usize) -> Result<CudaKvCache> {
        ensure!(
            max_context <= self.plan.max_context,
            "a K/V cache of {max_context} tokens exceeds the {} tokens the memory plan was checked for",
            self.plan.max_context
        );
        let n = max_context * d.num_key_value_heads * d.head_dim;
        Ok(CudaKvCache { k: self.cx.alloc(n)?, v: self.cx.alloc(n)?, max_context })
    }

    fn reset_gdn_state(&self, s: &mut CudaGdnState) {
        let st = self.cx.stream();
        if let Err(e) = st.memset_zeros(&mut s.conv).and_then(|_| st.memset_zeros(&mut s.ssm)) {
            *self.deferred.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(anyhow::Error::new(e).context("clearing the recurrent state"));
        }
    }

    /// Positions past the sequence are never read (attention masks by position), so no
    /// clearing is needed.
    fn reset_kv_cache(&self, _c: &mut CudaKvCache) {}

    fn new_decode_graph(&self) -> Result<CudaDecodeGraph> {
        Ok(CudaDecodeGraph { graph: None, key: 0, pdl: false, skip: None })
    }

    /// Writes `[id, pos]` to the device, then replays the captured step, capturing it first if
    /// `g` holds none (or one of another model). Profiling runs the step eagerly (events cannot
    /// bracket launches inside a graph).
    fn decode_step(
        &self,
        g: &mut CudaDecodeGraph,
        table: &CudaEmbedding,
        id: u32,
        pos: usize,
        step: &mut dyn FnMut() -> Result<CudaLogits>,
    ) -> Result<CudaLogits> {
        self.check_deferred()?;
        ensure!(
            (id as usize) < self.dims.vocab_size,
            "token id {id} is outside the vocabulary of {}",
            self.dims.vocab_size
        );
        let p = i32::try_from(pos).map_err(|_| anyhow::anyhow!("position {pos} does not fit the kernels' int32"))?;
        let io = [id as i32, p];
        // SAFETY: `io` is 8 bytes into the 2-element device buffer; a copy from pageable host
        // memory returns once the bytes are staged, so the stack array may go out of scope.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(self.cx.addr(&self.dec.io), &io, self.cx.stream().cu_stream())
        }?;
        let profiling = self.prof.lock().unwrap_or_else(|e| e.into_inner()).is_some();
        let mut mode = DecodeMode::enter(self);
        if profiling || !self.graphs.load(Relaxed) {
            step()
        } else {
            self.replay(&mut mode, g, table, step)
        }
    }

    fn embed(&self, d: &ModelDims, table: &CudaEmbedding, ids: &[u32]) -> Result<CudaAct> {
        let table = &table.table;
        self.check_deferred()?;
        ensure!(!ids.is_empty(), "embedding of no tokens");
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= d.vocab_size) {
            bail!("token id {bad} is outside the vocabulary of {}", d.vocab_size);
        }
        let t = ids.len();
        if self.decoding.load(Relaxed) {
            // A decode step: the token was written to `dec.io` by `decode_step`; the row goes to
            // the static buffers (no allocation, so the step can be captured).
            ensure!(t == 1, "a decode step embeds one token, got {t}");
            let (h, delta) = (self.dec.h.clone(), self.dec.delta.clone());
            self.k_embed(
                at(self, &self.dec.io, 0),
                at(self, table, 0),
                at(self, &h, 0),
                1,
                d.hidden_size,
                d.vocab_size,
            )?;
            return Ok(CudaAct { t, h, delta, pending: Cell::new(0) });
        }
        let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let dev_ids = self.cx.upload(&ids32)?;
        let h = Arc::new(self.cx.alloc::<u16>(t * d.hidden_size)?);
        let delta = Arc::new(self.cx.alloc::<u16>(t * d.hidden_size)?);
        self.k_embed(at(self, &dev_ids, 0), at(self, table, 0), at(self, &h, 0), t, d.hidden_size, d.vocab_size)?;
        // `dev_ids` is freed stream-ordered after the gather that reads it.
        Ok(CudaAct { t, h, delta, pending: Cell::new(0) })
    }

    fn gated_deltanet_prefill<Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec>(
        &self,
        _d: &ModelDims,
        norm: &CudaVector,
        w: &GatedDeltaNet<Self, Qkv, Z, Bt, A, O>,
        state: &mut CudaGdnState,
        h: &mut CudaAct,
    ) -> Result<()> {
        self.gdn_layer(norm, w, state, h)
    }

    fn gated_deltanet_decode<Qkv: Prec, Z: Prec, Bt: Prec, A: Prec, O: Prec>(
        &self,
        _d: &ModelDims,
        norm: &CudaVector,
        w: &GatedDeltaNet<Self, Qkv, Z, Bt, A, O>,
        state: &mut CudaGdnState,
        h: &mut CudaAct,
    ) -> Result<()> {
        ensure!(h.t == 1, "decode runs one token, got {}", h.t);
        self.gdn_layer(norm, w, state, h)
    }

    fn attention_prefill<Q: Prec, K: Prec, V: Prec, O: Prec>(
        &self,
        _d: &ModelDims,
        norm: &CudaVector,
        w: &GatedAttention<Self, Q, K, V, O>,
        cache: &mut CudaKvCache,
        pos: usize,
        h: &mut CudaAct,
    ) -> Result<()> {
        self.attention_layer(norm, w, cache, pos, h)
    }

    fn attention_decode<Q: Prec, K: Prec, V: Prec, O: Prec>(
        &self,
        _d: &ModelDims,
        norm: &CudaVector,
        w: &GatedAttention<Self, Q, K, V, O>,
        cache: &mut CudaKvCache,
        pos: usize,
        h: &mut CudaAct,
    ) -> Result<()> {
        ensure!(h.t == 1, "decode runs one token, got {}", h.t);
        self.attention_layer(norm, w, cache, pos, h)
    }

    fn sparse_moe<R: Prec, Eg: Prec, Eu: Prec, Ed: Prec, Sg: Prec, Su: Prec, Sd: Prec, Sgate: Prec>(
        &self,
        d: &ModelDims,
        norm: &CudaVector,
        w: &SparseMoe<Self, R, Eg, Eu, Ed, Sg, Su, Sd, Sgate>,
        h: &mut CudaAct,
    ) -> Result<()> {
        self.layer_start(h)?;
        ensure!(w.shared_up_proj.dev.is_none(), "shared_expert.up_proj must be fused into gate_proj");
        let (hs, e, k, inter) = (d.hidden_size, w.experts.experts, d.top_k, d.moe_intermediate_size);
        let (sgu, sdn) = (w.shared_gate_proj.dev("shared gate_up")?, w.shared_down_proj.dev("shared down")?);
        let (sgu_s, sdn_s) = match (&sgu.scale, &sdn.scale) {
            (Some(a), Some(b)) => (a, b),
            _ => bail!("the CUDA MoE kernel needs an FP8 shared expert"),
        };
        ensure!(
            w.shared_expert_gate.dev.is_none() && w.gate.dev("mlp.gate")?.out_features == e + 1,
            "mlp.gate must hold the router and shared_expert_gate rows as one [E + 1, H] matrix"
        );
        let slots = k + 1;
        let rw = self.sz.rlog_w;
        let s = &self.s;
        let rl = at(self, &s.rlog, 0);
        for r0 in (0..h.t).step_by(CHUNK) {
            let n = CHUNK.min(h.t - r0);
            let x = self.norm_rows(h, norm, r0, n)?;
            let (xq, xs) = x.q8.expect("norm_rows quantises");
            // Router logits in columns 0..E, the shared-expert gate logit in column E (one Linear).
            self.lin(&w.gate, "mlp.gate", x, rl, rw, n)?;
            self.k_router(rl, at(self, &s.idx, 0), at(self, &s.wt, 0), n, e, k, rw)?;
            if use_prefill(n) {
                let sh = SharedExpert {
                    gu: at(self, &sgu.w, 0),
                    gus: at(self, sgu_s, 0),
                    dn: at(self, &sdn.w, 0),
                    dns: at(self, sdn_s, 0),
                };
                self.moe_grouped(&w.experts, sh, (xq, xs), n, at(self, &h.delta, r0 * hs))?;
                continue;
            }
            self.k_moe_gemv(OrnithMoeGemvParams {
                xq: xq as _,
                xs: xs as _,
                idx: at(self, &s.idx, 0) as _,
                w: at(self, &w.experts.gu, 0) as _,
                ws: at(self, &w.experts.gus, 0) as _,
                shared_w: at(self, &sgu.w, 0) as _,
                shared_ws: at(self, sgu_s, 0) as _,
                y: at(self, &s.gu, 0) as _,
                tokens: n as i32,
                top_k: k as i32,
                experts: e as i32,
                in_: hs as i32,
                out: (2 * inter) as i32,
                x_tok_stride: hs as i32,
                x_slot_stride: 0,
                xs_tok_stride: 1,
                xs_slot_stride: 0,
            })?;
            self.k_swiglu(at(self, &s.gu, 0), at(self, &s.aq, 0), at(self, &s.asc, 0), n * slots, inter)?;
            self.k_moe_gemv(OrnithMoeGemvParams {
                xq: at(self, &s.aq, 0) as _,
                xs: at(self, &s.asc, 0) as _,
                idx: at(self, &s.idx, 0) as _,
                w: at(self, &w.experts.dn, 0) as _,
                ws: at(self, &w.experts.dns, 0) as _,
                shared_w: at(self, &sdn.w, 0) as _,
                shared_ws: at(self, sdn_s, 0) as _,
                y: at(self, &s.ys, 0) as _,
                tokens: n as i32,
                top_k: k as i32,
                experts: e as i32,
                in_: inter as i32,
                out: hs as i32,
                x_tok_stride: (slots * inter) as i32,
                x_slot_stride: inter as i32,
                xs_tok_stride: slots as i32,
                xs_slot_stride: 1,
            })?;
            self.k_combine(
                at(self, &s.ys, 0),
                at(self, &s.wt, 0),
                rl + 2 * e as u64,
                at(self, &h.delta, r0 * hs),
                n,
                k,
                hs,
                rw,
            )?;
        }
        h.pending.set(h.t);
        Ok(())
    }

    fn logits<P: Prec>(
        &self,
        d: &ModelDims,
        norm: &CudaVector,
        lm_head: &CudaLinear<P>,
        h: &CudaAct,
        all_rows: bool,
    ) -> Result<CudaLogits> {
        self.check_deferred()?;
        let v = d.vocab_size;
        let (first, rows) = if all_rows { (0, h.t) } else { (h.t - 1, 1) };
        // A decode step must not allocate (it may be being captured: see `replay`).
        ensure!(!(all_rows && self.decoding.load(Relaxed)), "a decode step asks for the last row's logits only");
        let buf = if all_rows { Arc::new(self.cx.alloc::<u16>(rows * v)?) } else { self.s.logits1.clone() };
        for r0 in (0..rows).step_by(CHUNK) {
            let n = CHUNK.min(rows - r0);
            let x = self.norm_rows(h, norm, first + r0, n)?;
            self.lin(lm_head, "lm_head", x, at(self, &buf, r0 * v), v, n)?;
        }
        // The rows normalised above now hold h + delta; earlier rows (last-row call) do not.
        if h.pending.get() > 0 {
            h.pending.set(first);
        }
        Ok(CudaLogits { rows, vocab: v, buf })
    }

    fn sample(&self, logits: &CudaLogits, n: usize, params: &SamplingParams, step: u64) -> Result<u32> {
        let v = logits.vocab;
        ensure!(n > 0 && n <= v, "sampling {n} of {v} logits");
        let last = (logits.rows - 1) * v;
        if crate::sampling::is_greedy(params) {
            self.k_argmax(at(self, &logits.buf, last), at(self, &self.s.amax, 0), n)?;
            let mut i = [0i32];
            self.cx.stream().memcpy_dtoh(&self.s.amax, &mut i)?;
            ensure!(i[0] >= 0, crate::sampling::NO_FINITE_LOGIT);
            return Ok(i[0] as u32);
        }
        let mut s = self.sampler.lock().unwrap_or_else(|e| e.into_inner());
        self.cx.sample_rows(&logits.buf, last, v, n, &[(*params, step)], &mut s)?;
        Ok(self.cx.sampled_ids(&s, 1)?[0])
    }

    fn logits_to_host(&self, logits: &CudaLogits) -> Result<Vec<f32>> {
        let n = logits.rows * logits.vocab;
        let mut b = vec![0u16; n];
        self.cx.stream().memcpy_dtoh(&logits.buf.slice(0..n), &mut b)?;
        Ok(b.iter().map(|&x| bf16::from_bits(x).to_f32()).collect())
    }

    /// `h`, with the pending delta added in bf16 as the next RMSNorm kernel would.
    fn act_to_host(&self, h: &CudaAct) -> Result<Vec<f32>> {
        let hs = self.dims.hidden_size;
        let hv = self.cx.download(&h.h)?;
        let dv = self.cx.download(&h.delta)?;
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
