//! Launchers of gdn.cu and gdn_chunk.cu: the causal conv + SiLU (sequential and token-parallel),
//! the gated delta rule (recurrent, and chunked in two phases for prefill) and the gated RMSNorm.
//!
//! One launcher per kernel (see [`super`]): device addresses and shapes (or the kernel's parameter
//! struct) in, the kernel's assumptions checked, grid, block, shared memory and bytes computed,
//! launched through [`CudaContext::launch`]; the CUDA backend calls these. After them, the
//! slice-based wrappers the kernel tests call, which check buffer lengths (and device-held
//! tables and slots) and convert slices to addresses. The math is in
//! `kernels/include/ornith_kernels.h`; bf16 tensors are `CudaSlice<u16>` (bit patterns), FP8
//! E4M3 codes `CudaSlice<u8>`.
use super::{i32of, need, CudaContext, Launch, Ptr};
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use ornith_kernels::bindings::*;

type Bf = CudaSlice<u16>;

/// Inputs of [`CudaContext::gdn_recurrent`].
pub struct GdnArgs<'a> {
    pub qkv: &'a Bf,
    pub ba: &'a Bf,
    pub a_log: &'a CudaSlice<f32>,
    pub dt_bias: &'a Bf,
    pub tokens: usize,
    pub k_heads: usize,
    pub v_heads: usize,
    pub qkv_stride: usize,
    pub ba_stride: usize,
    pub a_offset: usize,
    /// Per-row sequences (`gdn_recurrent` only): token t's state slot.
    pub slots: Option<&'a CudaSlice<i32>>,
}

/// `GdnPrepSmem` / `GdnScanSmem` of the two-phase chunked form (`gdn_chunk.cu`).
pub(crate) const GDN_PREP_SMEM: u32 = 4 * (2 * 64 * 129 + 2 * 64);

pub(crate) const GDN_SCAN_SMEM: u32 = 4 * (64 * 132 + 8704 + 128 * 16 + 4 * 64 * 16 + 2 * 64);

/// Value columns per `gdn_chunk_scan` block (`GS_C`): grid (v_heads, 128 / GDN_SCAN_COLS).
pub const GDN_SCAN_COLS: usize = 16;

/// fp32 workspace of the two-phase chunked gated delta rule for `tokens` tokens and `v_heads`
/// heads: per (head, 64-token chunk) A' [64][68], QKd [64][68], e^G [64], e^(G_last - G) [64].
pub fn gdn_work_len(tokens: usize, v_heads: usize) -> usize {
    v_heads * tokens.div_ceil(64) * ORNITH_GDN_WORK_PER_CHUNK as usize
}

/// Tokens per block of `conv1d_silu_chunk` (`CONV_TT` in `gdn.cu`).
pub const CONV_TT: usize = 32;

/// Rows (token, head) per block of `gated_rmsnorm`, one warp each (`GN_ROWS` in gdn.cu).
const GATED_NORM_ROWS: usize = 8;
impl CudaContext {
    /// Causal depthwise conv (kernel 4) + SiLU of `t` tokens of one sequence in order (state
    /// `[3, channels]` at `state`), or with `slots = Some((slot, stride))` one token of each of
    /// `t` sequences, token i continuing the state at `state + slot[i] · stride` (one grid row
    /// per token).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_conv(
        &self,
        x: Ptr,
        w: Ptr,
        state: Ptr,
        y: Ptr,
        t: usize,
        channels: usize,
        x_stride: usize,
        slots: Option<(Ptr, usize)>,
    ) -> Result<()> {
        ensure!(
            t > 0 && channels > 0 && x_stride >= channels,
            "conv: tokens {t}, channels {channels}, stride {x_stride}"
        );
        i32of("conv channels * 4", channels * 4)?;
        let p = OrnithConvParams {
            x: x as _,
            w: w as _,
            state: state as _,
            y: y as _,
            tokens: i32of("tokens", t)?,
            channels: channels as i32,
            x_stride: i32of("x_stride", x_stride)?,
            slot: slots.map_or(std::ptr::null(), |s| s.0 as _),
            state_stride: slots.map_or(Ok(0), |s| i32of("conv state stride", s.1))?,
        };
        let rows = if slots.is_some() { t as u32 } else { 1 };
        let bytes = channels * (8 + 12) + t * channels * 4;
        let l = Launch::new("conv1d_silu", (channels.div_ceil(256) as u32, rows, 1), 256, bytes as u64);
        // A decode group's blocks load their weights and states before the wait (gdn.cu), so they
        // take the PDL attribute; one sequence's launch does not (H200, twentieth session in
        // docs/PERF-2026-12-early.md: 8 sequences 1,435 -> 1,450 tok/s with it, batch 1 386 -> 380).
        self.launch(if slots.is_some() { l.weights_first() } else { l }, p)
    }

    /// The shape checks of both gated delta rule forms (dk = dv = 128): `p.v_heads` a multiple
    /// of `p.k_heads`, the q|k|v row inside its stride, b then a (`a_offset` after b) inside theirs.
    pub(crate) fn gdn_checks(p: &OrnithGdnParams) -> Result<()> {
        ensure!(
            p.tokens > 0 && p.k_heads > 0 && p.v_heads > 0 && p.v_heads % p.k_heads == 0 && p.v_heads <= 65535,
            "gdn: v_heads {} must be a multiple of k_heads {}",
            p.v_heads,
            p.k_heads
        );
        let width = (2 * p.k_heads + p.v_heads) * 128;
        ensure!(p.qkv_stride >= width, "gdn: qkv stride {} < {width}", p.qkv_stride);
        ensure!(
            p.ba_stride >= p.a_offset + p.v_heads && p.a_offset >= p.v_heads,
            "gdn: b/a layout (a_offset {}, stride {})",
            p.a_offset,
            p.ba_stride
        );
        Ok(())
    }

    /// Recurrent gated delta rule (see `OrnithGdnParams`): `p.tokens` tokens of one sequence, or
    /// with `p.slot` one token of each of `p.tokens` sequences (grid z = tokens; every state is
    /// read and written once).
    pub(crate) fn k_gdn(&self, p: OrnithGdnParams) -> Result<()> {
        Self::gdn_checks(&p)?;
        ensure!(p.slot.is_null() || p.state_stride > 0, "gdn: per-row slots need the state stride");
        let (t, hv, hk) = (p.tokens as usize, p.v_heads as usize, p.k_heads as usize);
        let states = if p.slot.is_null() { 1 } else { t };
        let bytes = states * hv * 128 * 128 * 4 * 2 + t * ((2 * hk * 128 + hv * 128) * 2 + 4 * hv + hv * 128 * 2);
        // The blocks load their states before the wait (gdn.cu): the PDL attribute (H200, batch 1
        // 381 -> 386 tok/s; docs/PERF-2026-12-early.md twentieth session).
        self.launch(Launch::new("gdn_recurrent", (hv as u32, 4, states as u32), 128, bytes as u64).weights_first(), p)
    }

    /// Gated RMSNorm per (token, head) over `dim <= 128`: `y = rmsnorm(o) · w · silu(z)`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gated_norm(
        &self,
        o: Ptr,
        z: Ptr,
        w: Ptr,
        y: Ptr,
        t: usize,
        heads: usize,
        dim: usize,
        z_stride: usize,
        eps: f32,
    ) -> Result<()> {
        ensure!(
            t > 0 && heads > 0 && dim > 0 && dim <= 128 && z_stride >= heads * dim,
            "gated_rmsnorm: dim {dim} <= 128, z stride {z_stride} >= heads {heads} x dim"
        );
        let p = OrnithGatedNormParams {
            o: o as _,
            z: z as _,
            weight: w as _,
            y: y as _,
            tokens: i32of("tokens", t)?,
            heads: heads as i32,
            dim: dim as i32,
            z_stride: i32of("z stride", z_stride)?,
            eps,
        };
        i32of("gated_rmsnorm rows", t * heads)?;
        let bytes = t * heads * dim * 6 + dim * 2;
        // One warp per (t, head) row, GATED_NORM_ROWS rows per block (GN_ROWS in gdn.cu).
        let blocks = (t * heads).div_ceil(GATED_NORM_ROWS);
        self.launch(Launch::new("gated_rmsnorm", (blocks as u32, 1, 1), 32 * GATED_NORM_ROWS as u32, bytes as u64), p)
    }

    /// Causal depthwise conv (kernel 4) + SiLU of `t` tokens of one sequence, token-parallel:
    /// the same inputs, outputs and state update as [`CudaContext::k_conv`], bit for bit (see
    /// `gdn.cu`). Bytes: x and y once, w, and the state read and written.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_conv_chunk(
        &self,
        x: Ptr,
        w: Ptr,
        state: Ptr,
        y: Ptr,
        t: usize,
        channels: usize,
        x_stride: usize,
    ) -> Result<()> {
        ensure!(
            t > 0 && channels > 0 && x_stride >= channels,
            "conv chunk: tokens {t}, channels {channels}, stride {x_stride}"
        );
        ensure!(t.div_ceil(CONV_TT) <= 65535, "conv chunk: tokens {t} need more than 65535 blocks of {CONV_TT}");
        i32of("conv chunk channels * 4", channels * 4)?;
        let p = OrnithConvParams {
            x: x as _,
            w: w as _,
            state: state as _,
            y: y as _,
            tokens: t as i32,
            channels: channels as i32,
            x_stride: i32of("x_stride", x_stride)?,
            slot: std::ptr::null(),
            state_stride: 0,
        };
        // Two channels per thread (4-byte loads and stores: a warp reads whole 128-byte lines)
        // where channels and stride are even and x, y, state 4-byte aligned; else one. The kernel
        // reads the choice back from the grid's width.
        let pairs = channels.is_multiple_of(2)
            && x_stride.is_multiple_of(2)
            && [x, y, state].iter().all(|a| a.is_multiple_of(4));
        let per_block = if pairs { 512 } else { 256 };
        let grid = (channels.div_ceil(per_block) as u32, t.div_ceil(CONV_TT) as u32, 1);
        self.launch(Launch::new("conv1d_silu_chunk", grid, 256, (channels * (8 + 12) + t * channels * 4) as u64), p)
    }

    /// The two-phase chunked form's checks: one sequence (no per-row slots), a workspace.
    fn gdn_chunk_checks(p: &OrnithGdnParams) -> Result<()> {
        Self::gdn_checks(p)?;
        ensure!(p.slot.is_null(), "gdn two-phase: the chunked form runs one sequence (no per-row slots)");
        ensure!(!p.work.is_null(), "gdn two-phase: a workspace of gdn_work_len(tokens, v_heads) floats is required");
        Ok(())
    }

    /// Phase 1 of the chunked gated delta rule (`gdn_chunk_prep`: all 64-token chunks and heads
    /// in parallel: A' = (I + M)^{-1} diag(beta), decayed Q K^T, gate exponentials into
    /// `p.work`). Bytes: q, k, b, a read, the workspace written.
    pub(crate) fn k_gdn_chunk_prep(&self, p: OrnithGdnParams) -> Result<()> {
        Self::gdn_chunk_checks(&p)?;
        let (t, hv, hk) = (p.tokens as usize, p.v_heads as usize, p.k_heads as usize);
        let work = gdn_work_len(t, hv) * 4;
        let bytes = t * (2 * hk * 128 * 2 + 4 * hv) + work;
        let grid = (t.div_ceil(64) as u32, hv as u32, 1);
        self.launch(Launch::new("gdn_chunk_prep", grid, 256, bytes as u64).smem(GDN_PREP_SMEM), p)
    }

    /// Phase 2 (`gdn_chunk_scan`: sequential over the chunks per head and 16 value columns).
    /// Bytes: q, k, v per column block (L2) and the workspace, the state once, o written.
    pub(crate) fn k_gdn_chunk_scan(&self, p: OrnithGdnParams) -> Result<()> {
        Self::gdn_chunk_checks(&p)?;
        let (t, hv, hk) = (p.tokens as usize, p.v_heads as usize, p.k_heads as usize);
        let work = gdn_work_len(t, hv) * 4;
        let bytes = hv * 128 * 128 * 4 * 2 + t * ((2 * hk * 128 + hv * 128) * 2 + 4 * hv + hv * 128 * 2) + work;
        let grid = (hv as u32, (128 / GDN_SCAN_COLS) as u32, 1);
        self.launch(Launch::new("gdn_chunk_scan", grid, 256, bytes as u64).smem(GDN_SCAN_SMEM), p)
    }

    /// Chunked gated delta rule (chunk 64, dk = dv = 128) for prefill: [`Self::k_gdn_chunk_prep`]
    /// then [`Self::k_gdn_chunk_scan`]; the same parameters, state and output as
    /// [`CudaContext::k_gdn`] (`p.work` holds [`gdn_work_len`] floats).
    pub(crate) fn k_gdn_chunked(&self, p: OrnithGdnParams) -> Result<()> {
        self.k_gdn_chunk_prep(p)?;
        self.k_gdn_chunk_scan(p)
    }
}

// The slice-based wrappers (the kernel tests' entry points).
impl CudaContext {
    /// Per-row state slots (host copy of `slots`, `tokens` distinct values inside a pool of
    /// `pool` slots).
    fn check_slots(&self, what: &str, slots: &CudaSlice<i32>, tokens: usize, pool: usize) -> Result<()> {
        need(what, slots, tokens)?;
        let host = self.download(slots)?;
        let mut seen = std::collections::HashSet::new();
        for &s in &host[..tokens] {
            ensure!(
                s >= 0 && (s as usize) < pool && seen.insert(s),
                "{what}: slot {s} repeated or outside the pool of {pool}"
            );
        }
        Ok(())
    }

    /// [`Self::k_conv`] on buffers: `tokens` in order, updating `state` [3, channels]; or, with
    /// `slots`, token t the next one of its own sequence, whose state is slot `slots[t]` of
    /// `state` [pool, 3, channels].
    #[allow(clippy::too_many_arguments)]
    pub fn conv1d_silu(
        &self,
        x: &Bf,
        w: &Bf,
        state: &mut Bf,
        y: &mut Bf,
        tokens: usize,
        channels: usize,
        x_stride: usize,
        slots: Option<&CudaSlice<i32>>,
    ) -> Result<()> {
        ensure!(tokens > 0 && channels > 0, "conv: tokens {tokens}, channels {channels}");
        need("conv x", x, (tokens - 1) * x_stride + channels)?;
        need("conv w", w, channels * 4)?;
        need("conv state", state, 3 * channels)?;
        need("conv y", y, tokens * channels)?;
        if let Some(s) = slots {
            self.check_slots("conv slots", s, tokens, state.len() / (3 * channels))?;
        }
        let slots = slots.map(|s| (self.addr(s), 3 * channels));
        let (a, b, c, d) = (self.addr(x), self.addr(w), self.addr(state), self.addr(y));
        self.k_conv(a, b, c, d, tokens, channels, x_stride, slots)
    }

    /// The parameters of both gated delta rule forms from buffers: lengths checked, `work` null.
    /// With `a.slots` (recurrent form only), token t's state is slot `slots[t]` of `state`.
    pub(crate) fn gdn_params(&self, a: &GdnArgs, state: &mut CudaSlice<f32>, o: &mut Bf) -> Result<OrnithGdnParams> {
        ensure!(a.tokens > 0 && a.k_heads > 0, "gdn: {} tokens, {} k heads", a.tokens, a.k_heads);
        let width = (2 * a.k_heads + a.v_heads) * 128;
        need("gdn qkv", a.qkv, (a.tokens - 1) * a.qkv_stride + width)?;
        need("gdn ba", a.ba, (a.tokens - 1) * a.ba_stride + a.a_offset + a.v_heads)?;
        need("gdn a_log", a.a_log, a.v_heads)?;
        need("gdn dt_bias", a.dt_bias, a.v_heads)?;
        let per = a.v_heads * 128 * 128;
        need("gdn state", state, per)?;
        need("gdn o", o, a.tokens * a.v_heads * 128)?;
        if let Some(s) = a.slots {
            self.check_slots("gdn slots", s, a.tokens, state.len() / per)?;
        }
        Ok(OrnithGdnParams {
            qkv: self.addr(a.qkv) as _,
            ba: self.addr(a.ba) as _,
            a_log: self.addr(a.a_log) as _,
            dt_bias: self.addr(a.dt_bias) as _,
            state: self.addr(state) as _,
            o: self.addr(o) as _,
            tokens: i32of("tokens", a.tokens)?,
            k_heads: i32of("k_heads", a.k_heads)?,
            v_heads: i32of("v_heads", a.v_heads)?,
            qkv_stride: i32of("qkv_stride", a.qkv_stride)?,
            ba_stride: i32of("ba_stride", a.ba_stride)?,
            a_offset: i32of("a_offset", a.a_offset)?,
            work: std::ptr::null_mut(),
            slot: a.slots.map_or(std::ptr::null(), |s| self.addr(s) as _),
            state_stride: if a.slots.is_some() { i32of("gdn state stride", per)? } else { 0 },
        })
    }

    /// [`Self::k_gdn`] on buffers: `a.tokens` tokens of one sequence (state
    /// `[v_heads, 128, 128]`), or with `a.slots` one token of each of `a.tokens` sequences,
    /// token t's state slot `slots[t]` of `state [pool, v_heads, 128, 128]`.
    pub fn gdn_recurrent(&self, a: &GdnArgs, state: &mut CudaSlice<f32>, o: &mut Bf) -> Result<()> {
        let p = self.gdn_params(a, state, o)?;
        self.k_gdn(p)
    }

    /// [`Self::k_gated_norm`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_rmsnorm(
        &self,
        o: &Bf,
        z: &Bf,
        w: &Bf,
        y: &mut Bf,
        tokens: usize,
        heads: usize,
        dim: usize,
        z_stride: usize,
        eps: f32,
    ) -> Result<()> {
        ensure!(tokens > 0, "gated_rmsnorm: no tokens");
        need("gated o", o, tokens * heads * dim)?;
        need("gated z", z, (tokens - 1) * z_stride + heads * dim)?;
        need("gated w", w, dim)?;
        need("gated y", y, tokens * heads * dim)?;
        let (a, b, c, d) = (self.addr(o), self.addr(z), self.addr(w), self.addr(y));
        self.k_gated_norm(a, b, c, d, tokens, heads, dim, z_stride, eps)
    }

    /// [`Self::k_conv_chunk`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn conv1d_silu_chunk(
        &self,
        x: &Bf,
        w: &Bf,
        state: &mut Bf,
        y: &mut Bf,
        tokens: usize,
        channels: usize,
        x_stride: usize,
    ) -> Result<()> {
        ensure!(tokens > 0, "conv chunk: no tokens");
        need("conv chunk x", x, (tokens - 1) * x_stride + channels)?;
        need("conv chunk w", w, channels * 4)?;
        need("conv chunk state", state, 3 * channels)?;
        need("conv chunk y", y, tokens * channels)?;
        let (a, b, c, d) = (self.addr(x), self.addr(w), self.addr(state), self.addr(y));
        self.k_conv_chunk(a, b, c, d, tokens, channels, x_stride)
    }

    /// [`Self::k_gdn_chunked`] on buffers: the same inputs, state and output as
    /// [`CudaContext::gdn_recurrent`]; `work` holds [`gdn_work_len`] floats.
    pub fn gdn_chunked(
        &self,
        a: &GdnArgs,
        state: &mut CudaSlice<f32>,
        o: &mut Bf,
        work: &mut CudaSlice<f32>,
    ) -> Result<()> {
        ensure!(a.slots.is_none(), "gdn chunked: runs one sequence (no per-row slots)");
        let mut p = self.gdn_params(a, state, o)?;
        need("gdn work", work, gdn_work_len(a.tokens, a.v_heads))?;
        p.work = self.addr(work) as _;
        self.k_gdn_chunked(p)
    }
}
