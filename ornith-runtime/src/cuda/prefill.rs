//! The prefill kernels' launchers (many tokens; gemm.cu, gdn_chunk.cu, flash_attn.cu,
//! moe_prefill.cu and `conv1d_silu_chunk` of gdn.cu; their math in
//! `kernels/include/ornith_kernels.h`), one per kernel as in [`super::launch`]: tensor-core GEMMs
//! (FP8 W8A8 and BF16, plain or grouped by MoE expert), compressed-tensors activation
//! quantisation, the token-parallel causal conv + SiLU, the chunked gated delta rule, causal
//! flash attention, SwiGLU + requantisation and the MoE combine. After them the slice-based
//! wrappers the kernel tests call, and the whole MoE block on buffers ([`CudaContext::moe_prefill`]).
use super::launch::GdnArgs;
use super::{i32of, need, CudaContext, Launch, Ptr};
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use ornith_kernels::bindings::*;

type Bf = CudaSlice<u16>;

/// GEMM tile (rows x outputs) of the plain GEMMs (`gemm.cu`: BM = GB_N = 128).
pub const GEMM_TILE: usize = 128;
/// Rows per tile of the grouped MoE GEMM `gemm_fp8_grouped` (`GB_GROUPED_M`, `MS_TILE`).
pub const GEMM_GROUPED_ROWS: usize = 64;
/// Dynamic shared memory of the kernels (bytes); all within the 99 KiB per block of sm_121.
/// GEMMs: 3 stages of (BM + 128) rows x 128 bytes.
pub(crate) const GEMM_SMEM: u32 = 3 * 2 * 128 * 128;
pub(crate) const GEMM_GROUPED_SMEM: u32 = 3 * (64 + 128) * 128;
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
/// `flash_attn_prefill`: Q, K and V tiles of 64 rows x 512 bytes (`FA_BQ`, `FA_BK`).
pub(crate) const FA_SMEM: u32 = 3 * 64 * 512;
/// Tokens per block of `conv1d_silu_chunk` (`CONV_TT` in `gdn.cu`).
pub const CONV_TT: usize = 32;

/// Element type of a prefill GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GemmKind {
    Fp8,
    Bf16,
}

/// Whether the GEMM's cp.async loads (16 bytes from `a + r · pitch`) are aligned and `in` covers
/// whole 16-byte chunks (`in_bytes % 16 == 0`): what [`CudaContext::k_gemm_fp8`] and
/// [`CudaContext::k_gemm_bf16`] require (the CUDA backend keeps the GEMV otherwise).
pub fn gemm_aligned(a: Ptr, pitch_bytes: usize, in_bytes: usize) -> bool {
    a.is_multiple_of(16) && pitch_bytes.is_multiple_of(16) && in_bytes.is_multiple_of(16)
}

impl CudaContext {
    /// What the plain GEMMs assume: a non-empty shape, `in` a multiple of 16 bytes, A rows
    /// covering `in` and 16-byte aligned (address and stride), the weight 16-byte aligned,
    /// offsets inside int32.
    #[allow(clippy::too_many_arguments)]
    fn gemm_checks(
        kind: GemmKind,
        a: Ptr,
        w: Ptr,
        rows: usize,
        in_: usize,
        out: usize,
        a_stride: usize,
        y_stride: usize,
    ) -> Result<()> {
        let (align, es) = match kind {
            GemmKind::Fp8 => (16, 1),
            GemmKind::Bf16 => (8, 2),
        };
        ensure!(rows > 0 && out > 0 && in_ > 0, "gemm: empty shape (rows {rows}, in {in_}, out {out})");
        ensure!(in_.is_multiple_of(align), "gemm: in {in_} must be a multiple of {align}");
        ensure!(
            a_stride >= in_ && gemm_aligned(a, a_stride * es, in_ * es),
            "gemm: A row stride {a_stride} must be >= in {in_} and keep rows 16-byte aligned"
        );
        ensure!(w.is_multiple_of(16), "gemm: the weight must be 16-byte aligned");
        ensure!(y_stride >= out, "gemm: y stride {y_stride} < out {out}");
        i32of("rows", rows)?;
        i32of("out * in", out * in_)?;
        i32of("a_stride", a_stride)?;
        i32of("y_stride", y_stride)?;
        Ok(())
    }

    /// Plain FP8 W8A8 GEMM: `y[r, o] = bf16((Σ_i e4m3(a[r,i])·e4m3(w[o,i])) · a_scale[r] · w_scale[o])`
    /// for `rows` activation rows (E4M3 codes, row stride `a_stride`, per-row scales) and weight
    /// `w [out, in]` with per-channel scales; `y` row stride `y_stride`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gemm_fp8(
        &self,
        a: Ptr,
        a_scale: Ptr,
        w: Ptr,
        ws: Ptr,
        y: Ptr,
        rows: usize,
        in_: usize,
        out: usize,
        a_stride: usize,
        y_stride: usize,
    ) -> Result<()> {
        Self::gemm_checks(GemmKind::Fp8, a, w, rows, in_, out, a_stride, y_stride)?;
        let p = OrnithGemmParams {
            a: a as _,
            a_scale: a_scale as _,
            w: w as _,
            w_scale: ws as _,
            y: y as _,
            rows: rows as i32,
            in_: in_ as i32,
            out: out as i32,
            a_stride: a_stride as i32,
            y_stride: y_stride as i32,
            groups: 1,
            ..Default::default()
        };
        let bytes = out * in_ + out * 4 + rows * (in_ + 4 + out * 2);
        let grid = (out.div_ceil(GEMM_TILE) as u32, rows.div_ceil(GEMM_TILE) as u32, 1);
        self.launch(Launch::new("gemm_fp8", grid, 256, bytes as u64).smem(GEMM_SMEM), p)
    }

    /// Plain BF16 GEMM: `y[r, o] = bf16(Σ_i a[r,i]·w[o,i])`, fp32 accumulation.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gemm_bf16(
        &self,
        a: Ptr,
        w: Ptr,
        y: Ptr,
        rows: usize,
        in_: usize,
        out: usize,
        a_stride: usize,
        y_stride: usize,
    ) -> Result<()> {
        Self::gemm_checks(GemmKind::Bf16, a, w, rows, in_, out, a_stride, y_stride)?;
        let p = OrnithGemmParams {
            a: a as _,
            w: w as _,
            y: y as _,
            rows: rows as i32,
            in_: in_ as i32,
            out: out as i32,
            a_stride: a_stride as i32,
            y_stride: y_stride as i32,
            groups: 1,
            ..Default::default()
        };
        let bytes = out * in_ * 2 + rows * (in_ + out) * 2;
        let grid = (out.div_ceil(GEMM_TILE) as u32, rows.div_ceil(GEMM_TILE) as u32, 1);
        self.launch(Launch::new("gemm_bf16", grid, 256, bytes as u64).smem(GEMM_SMEM), p)
    }

    /// Grouped FP8 GEMM over the expert-sorted rows of `p` (`p.groups` experts, `moe_sort`'s
    /// `group_offsets` / `tile_offsets`): at most `ceil(rows / 64) + min(groups, rows)` row tiles
    /// of 64 rows (each expert's last tile is partial). Bytes count every expert's weights once
    /// (all are read when the chunk is long).
    pub(crate) fn k_gemm_grouped(&self, p: OrnithGemmParams) -> Result<()> {
        ensure!(
            p.rows > 0 && p.out > 0 && p.in_ > 0 && p.in_ % 16 == 0 && p.groups > 0,
            "gemm_grouped: rows {}, in {} (a multiple of 16), out {}, groups {}",
            p.rows,
            p.in_,
            p.out,
            p.groups
        );
        ensure!(
            p.a_stride >= p.in_ && p.a_stride % 16 == 0 && (p.a as Ptr).is_multiple_of(16),
            "gemm_grouped: A rows must be 16-byte aligned"
        );
        ensure!(!p.group_offsets.is_null() && !p.tile_offsets.is_null(), "gemm_grouped needs moe_sort's groups");
        let (rows, in_, out, g) = (p.rows as usize, p.in_ as usize, p.out as usize, p.groups as usize);
        let tiles = rows.div_ceil(GEMM_GROUPED_ROWS) + g.min(rows);
        let bytes = g * (out * in_ + out * 4) + rows * (in_ + 4 + out * 2);
        let grid = (out.div_ceil(GEMM_TILE) as u32, tiles as u32, 1);
        self.launch(Launch::new("gemm_fp8_grouped", grid, 256, bytes as u64).smem(GEMM_GROUPED_SMEM), p)
    }

    /// Per-row FP8 quantisation with compressed-tensors semantics (`cpu::fp8::quantize_act_row`)
    /// of `rows` contiguous rows of `cols`: scale = bf16(amax/448) (2^-7 if 0), q8 = e4m3(bf16(x / scale)).
    pub(crate) fn k_quant_ct(&self, x: Ptr, q8: Ptr, scale: Ptr, rows: usize, cols: usize) -> Result<()> {
        ensure!(rows > 0 && cols > 0, "quantize_fp8_ct: empty");
        let p = OrnithQuantParams {
            x: x as _,
            q8: q8 as _,
            scale: scale as _,
            tokens: i32of("rows", rows)?,
            cols: i32of("cols", cols)?,
        };
        self.launch(Launch::new("quantize_fp8_ct", (rows as u32, 1, 1), 256, (rows * cols * 3 + rows * 4) as u64), p)
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
        let grid = (channels.div_ceil(256) as u32, t.div_ceil(CONV_TT) as u32, 1);
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

    /// Causal flash attention (head_dim 256) of `p.tokens` queries at positions `pos0..` over the
    /// paged K/V cache (through the sequence's block table `p.table`), with the sigmoid output
    /// gate from `p.qg` when given (see `OrnithFlashAttnParams`). Bytes: every K/V row once, q,
    /// the gate and the output.
    pub(crate) fn k_flash_attn(&self, p: OrnithFlashAttnParams) -> Result<()> {
        ensure!(
            p.tokens > 0 && p.pos0 >= 0 && p.kv_heads > 0 && p.q_heads % p.kv_heads == 0,
            "flash_attention: q_heads {} must be a multiple of kv_heads {}",
            p.q_heads,
            p.kv_heads
        );
        let (t, qh, kvh) = (p.tokens as usize, p.q_heads as usize, p.kv_heads as usize);
        let bytes = (p.pos0 as usize + t) * kvh * 256 * 2 * 2 + t * qh * 256 * 2 * 3;
        let grid = (t.div_ceil(64) as u32, qh as u32, 1);
        self.launch(Launch::new("flash_attn_prefill", grid, 128, bytes as u64).smem(FA_SMEM), p)
    }

    /// SwiGLU + compressed-tensors FP8 requantisation of `rows` gate|up rows (`inter <= 2048`).
    pub(crate) fn k_swiglu_ct(&self, gu: Ptr, q8: Ptr, scale: Ptr, rows: usize, inter: usize) -> Result<()> {
        ensure!(rows > 0 && inter > 0 && inter <= 2048, "swiglu_quant_ct: 0 < inter {inter} <= 2048");
        let p = OrnithSwigluQuantParams {
            gate_up: gu as _,
            q8: q8 as _,
            scale: scale as _,
            rows: i32of("rows", rows)?,
            inter: inter as i32,
        };
        self.launch(Launch::new("swiglu_quant_ct", (rows as u32, 1, 1), 256, (rows * (inter * 5 + 4)) as u64), p)
    }

    /// The MoE combine of a prefill chunk over the expert-sorted rows (see
    /// `OrnithMoeCombinePrefillParams`).
    pub(crate) fn k_combine_prefill(&self, p: OrnithMoeCombinePrefillParams) -> Result<()> {
        ensure!(p.tokens > 0 && p.top_k > 0 && p.hidden > 0, "moe_combine_prefill: empty");
        let (t, k, h) = (p.tokens as usize, p.top_k as usize, p.hidden as usize);
        let bytes = t * ((k + 2) * h * 2 + k * 8 + 2);
        self.launch(Launch::new("moe_combine_prefill", (h.div_ceil(256) as u32, t as u32, 1), 256, bytes as u64), p)
    }
}

// The slice-based wrappers (the kernel tests' entry points).
impl CudaContext {
    /// [`Self::k_gemm_fp8`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_fp8(
        &self,
        a: &CudaSlice<u8>,
        a_scale: &CudaSlice<f32>,
        w: &CudaSlice<u8>,
        w_scale: &CudaSlice<f32>,
        y: &mut Bf,
        rows: usize,
        in_: usize,
        out: usize,
        a_stride: usize,
        y_stride: usize,
    ) -> Result<()> {
        ensure!(rows > 0, "gemm_fp8: no rows");
        need("gemm_fp8 a", a, (rows - 1) * a_stride + in_)?;
        need("gemm_fp8 a_scale", a_scale, rows)?;
        need("gemm_fp8 w", w, out * in_)?;
        need("gemm_fp8 w_scale", w_scale, out)?;
        need("gemm_fp8 y", y, (rows - 1) * y_stride + out)?;
        let (pa, ps, pw, pws, py) = (self.addr(a), self.addr(a_scale), self.addr(w), self.addr(w_scale), self.addr(y));
        self.k_gemm_fp8(pa, ps, pw, pws, py, rows, in_, out, a_stride, y_stride)
    }

    /// [`Self::k_gemm_bf16`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_bf16(
        &self,
        a: &Bf,
        w: &Bf,
        y: &mut Bf,
        rows: usize,
        in_: usize,
        out: usize,
        a_stride: usize,
        y_stride: usize,
    ) -> Result<()> {
        ensure!(rows > 0, "gemm_bf16: no rows");
        need("gemm_bf16 a", a, (rows - 1) * a_stride + in_)?;
        need("gemm_bf16 w", w, out * in_)?;
        need("gemm_bf16 y", y, (rows - 1) * y_stride + out)?;
        self.k_gemm_bf16(self.addr(a), self.addr(w), self.addr(y), rows, in_, out, a_stride, y_stride)
    }

    /// [`Self::k_quant_ct`] on buffers.
    pub fn quantize_fp8_ct(
        &self,
        x: &Bf,
        q8: &mut CudaSlice<u8>,
        scale: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        need("quantize_fp8_ct x", x, rows * cols)?;
        need("quantize_fp8_ct q8", q8, rows * cols)?;
        need("quantize_fp8_ct scale", scale, rows)?;
        self.k_quant_ct(self.addr(x), self.addr(q8), self.addr(scale), rows, cols)
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

    /// [`Self::k_flash_attn`] on buffers: `tokens` queries at positions `pos0..` over the K/V
    /// cache, optionally with the sigmoid output gate.
    pub fn flash_attention(&self, a: &FlashAttnArgs, out: &mut Bf) -> Result<()> {
        ensure!(a.tokens > 0, "flash_attention: no tokens");
        let total = a.pos0 + a.tokens;
        need("flash q", a.q, a.tokens * a.q_heads * 256)?;
        self.check_paged(
            "flash attention",
            a.k_cache.len().min(a.v_cache.len()),
            a.kv_heads * 256,
            a.table,
            0,
            &[total - 1],
        )?;
        if let Some(g) = a.qg {
            need("flash qg", g, a.tokens * a.q_heads * 512)?;
        }
        need("flash out", out, a.tokens * a.q_heads * 256)?;
        self.k_flash_attn(OrnithFlashAttnParams {
            q: self.addr(a.q) as _,
            k_cache: self.addr(a.k_cache) as _,
            v_cache: self.addr(a.v_cache) as _,
            qg: a.qg.map_or(std::ptr::null(), |g| self.addr(g) as _),
            out: self.addr(out) as _,
            tokens: i32of("tokens", a.tokens)?,
            pos0: i32of("pos0", a.pos0)?,
            q_heads: i32of("q_heads", a.q_heads)?,
            kv_heads: i32of("kv_heads", a.kv_heads)?,
            scale: 1.0 / 16.0,
            table: self.addr(a.table) as _,
        })
    }

    /// The MoE block for `tokens` rows of `x` (see `cpu::moe::moe`) on buffers, through the
    /// launchers the CUDA backend's prefill MoE calls: router (BF16 GEMM over the
    /// `[experts + 1, hidden]` router | shared-gate weight) and top-k, per-token FP8 quantisation,
    /// counting sort by expert, grouped FP8 gate_up GEMM, SwiGLU + requantisation, grouped down
    /// GEMM, the shared expert, and the weighted combine into `out [tokens, hidden]`.
    pub fn moe_prefill(&self, a: &MoePrefillArgs, s: &mut MoePrefillScratch, out: &mut Bf) -> Result<()> {
        let (t, d, e, k, i, si) = (a.tokens, a.hidden, a.experts, a.top_k, a.inter, a.shared_inter);
        ensure!(t > 0 && t <= s.tokens, "moe_prefill: tokens {t} must be in 1..={} (scratch size)", s.tokens);
        ensure!(
            (d, e, k, i, si) == (s.hidden, s.experts, s.top_k, s.inter, s.shared_inter),
            "moe_prefill: scratch was made for other dims"
        );
        need("moe router", a.router, (e + 1) * d)?;
        need("moe w_gate_up", a.w_gate_up, e * 2 * i * d)?;
        need("moe ws_gate_up", a.ws_gate_up, e * 2 * i)?;
        need("moe w_down", a.w_down, e * d * i)?;
        need("moe ws_down", a.ws_down, e * d)?;
        need("moe shared gate_up", a.shared_gate_up, 2 * si * d)?;
        need("moe shared gate_up scale", a.shared_gate_up_scale, 2 * si)?;
        need("moe shared down", a.shared_down, d * si)?;
        need("moe shared down scale", a.shared_down_scale, d)?;
        need("moe x", a.x, t * d)?;
        need("moe out", out, t * d)?;
        let n = t * k;
        let at = |b: &CudaSlice<_>| -> Ptr { self.addr(b) };
        // Router logits (router | shared gate) and top-k.
        let logits = self.addr(&s.logits);
        self.k_gemm_bf16(self.addr(a.x), self.addr(a.router), logits, t, d, e + 1, d, e + 1)?;
        self.k_router(logits, self.addr(&s.idx), self.addr(&s.weight), t, e, k, e + 1)?;
        let (xq, xs) = (self.addr(&s.xq), self.addr(&s.xs));
        self.k_quant_ct(self.addr(a.x), xq, xs, t, d)?;
        let (go, to, rt, ro) = (at(&s.group_offsets), at(&s.tile_offsets), at(&s.row_token), at(&s.row_of));
        self.k_moe_sort(OrnithMoeSortParams {
            idx: self.addr(&s.idx) as _,
            group_offsets: go as _,
            tile_offsets: to as _,
            row_token: rt as _,
            row_of: ro as _,
            row_assign: std::ptr::null_mut(),
            active_list: std::ptr::null_mut(),
            active_count: std::ptr::null_mut(),
            tokens: i32of("tokens", t)?,
            top_k: k as i32,
            experts: e as i32,
        })?;
        // Grouped gate_up: row r (expert-sorted) reads token row_token[r] of xq.
        self.k_gemm_grouped(OrnithGemmParams {
            a: xq as _,
            a_scale: xs as _,
            a_rows: rt as _,
            w: self.addr(a.w_gate_up) as _,
            w_scale: self.addr(a.ws_gate_up) as _,
            y: self.addr(&s.gate_up) as _,
            group_offsets: go as _,
            tile_offsets: to as _,
            rows: i32of("rows", n)?,
            in_: d as i32,
            out: i32of("2 * inter", 2 * i)?,
            a_stride: d as i32,
            y_stride: (2 * i) as i32,
            groups: e as i32,
        })?;
        self.k_swiglu_ct(self.addr(&s.gate_up), self.addr(&s.aq), self.addr(&s.as_), n, i)?;
        self.k_gemm_grouped(OrnithGemmParams {
            a: self.addr(&s.aq) as _,
            a_scale: self.addr(&s.as_) as _,
            a_rows: std::ptr::null(),
            w: self.addr(a.w_down) as _,
            w_scale: self.addr(a.ws_down) as _,
            y: self.addr(&s.down) as _,
            group_offsets: go as _,
            tile_offsets: to as _,
            rows: n as i32,
            in_: i as i32,
            out: d as i32,
            a_stride: i as i32,
            y_stride: d as i32,
            groups: e as i32,
        })?;
        // Shared expert on every token.
        let (sgu, saq, sas, sy) =
            (self.addr(&s.shared_gu), self.addr(&s.saq), self.addr(&s.sas), self.addr(&s.shared_y));
        let (w1, s1) = (self.addr(a.shared_gate_up), self.addr(a.shared_gate_up_scale));
        self.k_gemm_fp8(xq, xs, w1, s1, sgu, t, d, 2 * si, d, 2 * si)?;
        self.k_swiglu_ct(sgu, saq, sas, t, si)?;
        let (w2, s2) = (self.addr(a.shared_down), self.addr(a.shared_down_scale));
        self.k_gemm_fp8(saq, sas, w2, s2, sy, t, si, d, si, d)?;
        self.k_combine_prefill(OrnithMoeCombinePrefillParams {
            ys: self.addr(&s.down) as _,
            row_of: ro as _,
            weight: self.addr(&s.weight) as _,
            shared_y: sy as _,
            gate_logit: (logits + 2 * e as u64) as _,
            out: self.addr(out) as _,
            tokens: t as i32,
            top_k: k as i32,
            hidden: d as i32,
            gate_stride: (e + 1) as i32,
        })
    }
}

/// Inputs of [`CudaContext::flash_attention`].
pub struct FlashAttnArgs<'a> {
    /// `[tokens, q_heads, 256]` (after q norm + RoPE).
    pub q: &'a Bf,
    /// Paged `[blocks, KV_BLOCK, kv_heads, 256]`, positions `0..pos0 + tokens` written through
    /// `table`.
    pub k_cache: &'a Bf,
    pub v_cache: &'a Bf,
    /// The sequence's block table (position p in cache row `table[p / KV_BLOCK] · KV_BLOCK + p % KV_BLOCK`).
    pub table: &'a CudaSlice<i32>,
    /// q_proj output `[tokens, q_heads, 512]` (query | gate per head): applies the output gate.
    pub qg: Option<&'a Bf>,
    pub tokens: usize,
    pub pos0: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
}

/// Weights and dims of [`CudaContext::moe_prefill`]. FP8 weights are `[.., out, in]` E4M3 codes with
/// per-output-channel f32 scales; an expert's gate_up is its gate rows then its up rows.
pub struct MoePrefillArgs<'a> {
    /// `[tokens, hidden]` bf16 (post-attention norm output).
    pub x: &'a Bf,
    /// `[experts + 1, hidden]` bf16: the router rows, then `shared_expert_gate`.
    pub router: &'a Bf,
    pub w_gate_up: &'a CudaSlice<u8>,
    pub ws_gate_up: &'a CudaSlice<f32>,
    pub w_down: &'a CudaSlice<u8>,
    pub ws_down: &'a CudaSlice<f32>,
    pub shared_gate_up: &'a CudaSlice<u8>,
    pub shared_gate_up_scale: &'a CudaSlice<f32>,
    pub shared_down: &'a CudaSlice<u8>,
    pub shared_down_scale: &'a CudaSlice<f32>,
    pub tokens: usize,
    pub hidden: usize,
    pub experts: usize,
    pub top_k: usize,
    pub inter: usize,
    pub shared_inter: usize,
}

/// Device scratch of [`CudaContext::moe_prefill`] for up to `tokens` rows.
pub struct MoePrefillScratch {
    tokens: usize,
    hidden: usize,
    experts: usize,
    top_k: usize,
    inter: usize,
    shared_inter: usize,
    pub logits: Bf,
    pub idx: CudaSlice<i32>,
    pub weight: CudaSlice<f32>,
    xq: CudaSlice<u8>,
    xs: CudaSlice<f32>,
    group_offsets: CudaSlice<i32>,
    tile_offsets: CudaSlice<i32>,
    row_token: CudaSlice<i32>,
    row_of: CudaSlice<i32>,
    gate_up: Bf,
    aq: CudaSlice<u8>,
    as_: CudaSlice<f32>,
    down: Bf,
    shared_gu: Bf,
    saq: CudaSlice<u8>,
    sas: CudaSlice<f32>,
    shared_y: Bf,
}

impl MoePrefillScratch {
    pub fn new(
        c: &CudaContext,
        tokens: usize,
        hidden: usize,
        experts: usize,
        top_k: usize,
        inter: usize,
        shared_inter: usize,
    ) -> Result<Self> {
        let n = tokens * top_k;
        Ok(Self {
            tokens,
            hidden,
            experts,
            top_k,
            inter,
            shared_inter,
            logits: c.alloc(tokens * (experts + 1))?,
            idx: c.alloc(n)?,
            weight: c.alloc(n)?,
            xq: c.alloc(tokens * hidden)?,
            xs: c.alloc(tokens)?,
            group_offsets: c.alloc(experts + 1)?,
            tile_offsets: c.alloc(experts + 1)?,
            row_token: c.alloc(n)?,
            row_of: c.alloc(n)?,
            gate_up: c.alloc(n * 2 * inter)?,
            aq: c.alloc(n * inter)?,
            as_: c.alloc(n)?,
            down: c.alloc(n * hidden)?,
            shared_gu: c.alloc(tokens * 2 * shared_inter)?,
            saq: c.alloc(tokens * shared_inter)?,
            sas: c.alloc(tokens)?,
            shared_y: c.alloc(tokens * hidden)?,
        })
    }
}
