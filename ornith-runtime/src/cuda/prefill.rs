//! Launchers of the prefill kernels (many tokens): tensor-core GEMMs (FP8 W8A8 and BF16, plain or
//! grouped by MoE expert), compressed-tensors activation quantisation, the token-parallel causal
//! conv + SiLU, the chunked gated delta rule, causal flash attention and the grouped MoE block. Each checks its kernel's shape assumptions and
//! buffer sizes and returns an error rather than launching on bad input.
use super::launch::GdnArgs;
use super::CudaContext;
use anyhow::{ensure, Result};
use cudarc::driver::sys::CUfunction_attribute_enum;
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

fn need<T>(what: &str, s: &CudaSlice<T>, n: usize) -> Result<()> {
    ensure!(s.len() >= n, "{what}: buffer has {} elements, the launch needs {n}", s.len());
    Ok(())
}
fn i32of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| anyhow::anyhow!("{what} = {v} does not fit the kernel's int32"))
}

/// Element type of a prefill GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GemmKind {
    Fp8,
    Bf16,
}

impl CudaContext {
    pub(crate) fn launch_smem<P: crate::cuda::KernelParams>(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        p: P,
    ) -> Result<()> {
        let f = self.func(name);
        if smem > 48 * 1024 {
            f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)?;
        }
        self.launch_with(name, grid, block, smem, p)
    }

    fn gemm_checks(
        kind: GemmKind,
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
            a_stride >= in_ && (a_stride * es).is_multiple_of(16),
            "gemm: A row stride {a_stride} must be >= in {in_} and keep rows 16-byte aligned"
        );
        ensure!(y_stride >= out, "gemm: y stride {y_stride} < out {out}");
        i32of("rows", rows)?;
        i32of("out * in", out * in_)?;
        Ok(())
    }

    /// Prefill FP8 W8A8 GEMM: `y[r, o] = bf16((Σ_i e4m3(a[r,i])·e4m3(w[o,i])) · a_scale[r] · w_scale[o])`
    /// for `rows` activation rows (E4M3 codes, row stride `a_stride`, per-row scales) and weight
    /// `w [out, in]` with per-channel scales; `y` row stride `y_stride`.
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
        Self::gemm_checks(GemmKind::Fp8, rows, in_, out, a_stride, y_stride)?;
        need("gemm_fp8 a", a, (rows - 1) * a_stride + in_)?;
        need("gemm_fp8 a_scale", a_scale, rows)?;
        need("gemm_fp8 w", w, out * in_)?;
        need("gemm_fp8 w_scale", w_scale, out)?;
        need("gemm_fp8 y", y, (rows - 1) * y_stride + out)?;
        let p = OrnithGemmParams {
            a: self.addr(a) as _,
            a_scale: self.addr(a_scale) as _,
            w: self.addr(w) as _,
            w_scale: self.addr(w_scale) as _,
            y: self.addr(y) as _,
            rows: rows as i32,
            in_: in_ as i32,
            out: out as i32,
            a_stride: i32of("a_stride", a_stride)?,
            y_stride: i32of("y_stride", y_stride)?,
            groups: 1,
            ..Default::default()
        };
        self.launch_smem(
            "gemm_fp8",
            (out.div_ceil(GEMM_TILE) as u32, rows.div_ceil(GEMM_TILE) as u32, 1),
            256,
            GEMM_SMEM,
            p,
        )
    }

    /// Prefill BF16 GEMM: `y[r, o] = bf16(Σ_i a[r,i]·w[o,i])`, fp32 accumulation.
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
        Self::gemm_checks(GemmKind::Bf16, rows, in_, out, a_stride, y_stride)?;
        need("gemm_bf16 a", a, (rows - 1) * a_stride + in_)?;
        need("gemm_bf16 w", w, out * in_)?;
        need("gemm_bf16 y", y, (rows - 1) * y_stride + out)?;
        let p = OrnithGemmParams {
            a: self.addr(a) as _,
            w: self.addr(w) as _,
            y: self.addr(y) as _,
            rows: rows as i32,
            in_: in_ as i32,
            out: out as i32,
            a_stride: i32of("a_stride", a_stride)?,
            y_stride: i32of("y_stride", y_stride)?,
            groups: 1,
            ..Default::default()
        };
        self.launch_smem(
            "gemm_bf16",
            (out.div_ceil(GEMM_TILE) as u32, rows.div_ceil(GEMM_TILE) as u32, 1),
            256,
            GEMM_SMEM,
            p,
        )
    }

    /// Per-row FP8 quantisation with compressed-tensors semantics (`cpu::fp8::quantize_act_row`):
    /// scale = bf16(amax/448) (2^-7 if 0), q8 = e4m3(bf16(x / scale)).
    pub fn quantize_fp8_ct(
        &self,
        x: &Bf,
        q8: &mut CudaSlice<u8>,
        scale: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        ensure!(rows > 0 && cols > 0, "quantize_fp8_ct: empty");
        need("quantize_fp8_ct x", x, rows * cols)?;
        need("quantize_fp8_ct q8", q8, rows * cols)?;
        need("quantize_fp8_ct scale", scale, rows)?;
        let p = OrnithQuantParams {
            x: self.addr(x) as _,
            q8: self.addr(q8) as _,
            scale: self.addr(scale) as _,
            tokens: i32of("rows", rows)?,
            cols: i32of("cols", cols)?,
        };
        self.launch_smem("quantize_fp8_ct", (rows as u32, 1, 1), 256, 0, p)
    }

    /// Causal depthwise conv (kernel 4) + SiLU of a prefill chunk, token-parallel: the same inputs,
    /// outputs and state update as [`CudaContext::conv1d_silu`], bit for bit (see `gdn.cu`).
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
        ensure!(
            tokens > 0 && channels > 0 && x_stride >= channels,
            "conv chunk: tokens {tokens}, channels {channels}, stride {x_stride}"
        );
        ensure!(
            tokens.div_ceil(CONV_TT) <= 65535,
            "conv chunk: tokens {tokens} need more than 65535 blocks of {CONV_TT}"
        );
        need("conv chunk x", x, (tokens - 1) * x_stride + channels)?;
        need("conv chunk w", w, channels * 4)?;
        need("conv chunk state", state, 3 * channels)?;
        need("conv chunk y", y, tokens * channels)?;
        i32of("channels * 4", channels * 4)?;
        let p = OrnithConvParams {
            x: self.addr(x) as _,
            w: self.addr(w) as _,
            state: self.addr(state) as _,
            y: self.addr(y) as _,
            tokens: tokens as i32,
            channels: channels as i32,
            x_stride: i32of("x_stride", x_stride)?,
            slot: std::ptr::null(),
            state_stride: 0,
        };
        self.launch_smem(
            "conv1d_silu_chunk",
            (channels.div_ceil(256) as u32, tokens.div_ceil(CONV_TT) as u32, 1),
            256,
            0,
            p,
        )
    }

    /// Checked parameters of the chunked kernels (shapes, strides, buffer sizes); `work` null.
    pub(crate) fn gdn_params(&self, a: &GdnArgs, state: &mut CudaSlice<f32>, o: &mut Bf) -> Result<OrnithGdnParams> {
        ensure!(
            a.tokens > 0 && a.k_heads > 0 && a.v_heads.is_multiple_of(a.k_heads),
            "gdn: v_heads {} must be a multiple of k_heads {}",
            a.v_heads,
            a.k_heads
        );
        ensure!(a.slots.is_none(), "gdn chunked: runs one sequence (no per-row slots)");
        let kdim = a.k_heads * 128;
        let width = 2 * kdim + a.v_heads * 128;
        ensure!(a.qkv_stride >= width, "gdn: qkv stride {} < {width}", a.qkv_stride);
        ensure!(
            a.ba_stride >= a.a_offset + a.v_heads && a.a_offset >= a.v_heads,
            "gdn: b/a layout (a_offset {}, stride {})",
            a.a_offset,
            a.ba_stride
        );
        need("gdn qkv", a.qkv, (a.tokens - 1) * a.qkv_stride + width)?;
        need("gdn ba", a.ba, (a.tokens - 1) * a.ba_stride + a.a_offset + a.v_heads)?;
        need("gdn a_log", a.a_log, a.v_heads)?;
        need("gdn dt_bias", a.dt_bias, a.v_heads)?;
        need("gdn state", state, a.v_heads * 128 * 128)?;
        need("gdn o", o, a.tokens * a.v_heads * 128)?;
        let p = OrnithGdnParams {
            qkv: self.addr(a.qkv) as _,
            ba: self.addr(a.ba) as _,
            a_log: self.addr(a.a_log) as _,
            dt_bias: self.addr(a.dt_bias) as _,
            state: self.addr(state) as _,
            o: self.addr(o) as _,
            tokens: i32of("tokens", a.tokens)?,
            k_heads: a.k_heads as i32,
            v_heads: a.v_heads as i32,
            qkv_stride: a.qkv_stride as i32,
            ba_stride: a.ba_stride as i32,
            a_offset: a.a_offset as i32,
            work: std::ptr::null_mut(),
            slot: std::ptr::null(),
            state_stride: 0,
        };
        Ok(p)
    }

    /// Chunked gated delta rule (chunk 64, dk = dv = 128) for prefill, in two phases
    /// (`gdn_chunk.cu`): `gdn_chunk_prep` (all chunks and heads in parallel: A' = (I + M)^{-1}
    /// diag(beta), decayed Q K^T, gate exponentials into `work`), then `gdn_chunk_scan` (sequential
    /// over chunks per head and 16 value columns). Same inputs, state and output as
    /// [`CudaContext::gdn_recurrent`]; `work` holds [`gdn_work_len`] floats.
    pub fn gdn_chunked(
        &self,
        a: &GdnArgs,
        state: &mut CudaSlice<f32>,
        o: &mut Bf,
        work: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let mut p = self.gdn_params(a, state, o)?;
        need("gdn work", work, gdn_work_len(a.tokens, a.v_heads))?;
        p.work = self.addr(work) as _;
        self.gdn_chunked_raw(p)
    }

    /// Launches both phases on checked parameters (`p.work` sized by [`gdn_work_len`]).
    pub(crate) fn gdn_chunked_raw(&self, p: OrnithGdnParams) -> Result<()> {
        ensure!(p.tokens > 0 && !p.work.is_null(), "gdn two-phase: tokens {} and a workspace are required", p.tokens);
        ensure!(
            p.k_heads > 0 && p.v_heads > 0 && p.v_heads % p.k_heads == 0 && p.v_heads <= 65535,
            "gdn two-phase: v_heads {} / k_heads {}",
            p.v_heads,
            p.k_heads
        );
        self.gdn_chunk_prep_raw(p)?;
        self.launch_smem("gdn_chunk_scan", (p.v_heads as u32, (128 / GDN_SCAN_COLS) as u32, 1), 256, GDN_SCAN_SMEM, p)
    }

    /// Phase 1 alone (timed separately by the test).
    pub(crate) fn gdn_chunk_prep_raw(&self, p: OrnithGdnParams) -> Result<()> {
        let chunks = (p.tokens as usize).div_ceil(64);
        self.launch_smem("gdn_chunk_prep", (chunks as u32, p.v_heads as u32, 1), 256, GDN_PREP_SMEM, p)
    }

    /// Causal flash attention (head_dim 256) of `tokens` queries at positions `pos0..` over the KV
    /// cache, optionally with the sigmoid output gate (see `OrnithFlashAttnParams`).
    pub fn flash_attention(&self, a: &FlashAttnArgs, out: &mut Bf) -> Result<()> {
        ensure!(
            a.tokens > 0 && a.kv_heads > 0 && a.q_heads.is_multiple_of(a.kv_heads),
            "flash_attention: q_heads {} must be a multiple of kv_heads {}",
            a.q_heads,
            a.kv_heads
        );
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
        let p = OrnithFlashAttnParams {
            q: self.addr(a.q) as _,
            k_cache: self.addr(a.k_cache) as _,
            v_cache: self.addr(a.v_cache) as _,
            qg: a.qg.map_or(std::ptr::null(), |g| self.addr(g) as _),
            out: self.addr(out) as _,
            tokens: a.tokens as i32,
            pos0: a.pos0 as i32,
            q_heads: a.q_heads as i32,
            kv_heads: a.kv_heads as i32,
            scale: 1.0 / 16.0,
            table: self.addr(a.table) as _,
        };
        self.launch_smem("flash_attn_prefill", (a.tokens.div_ceil(64) as u32, a.q_heads as u32, 1), 128, FA_SMEM, p)
    }

    /// The MoE block for `tokens` rows of `x` (see `cpu::moe::moe`): router (BF16 GEMM over the
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
        ensure!(e <= 256 && k >= 1 && k <= e, "moe_prefill: experts {e} <= 256, 1 <= top_k {k} <= experts");
        ensure!(
            i <= 2048 && si <= 2048 && i % 16 == 0 && si % 16 == 0 && d % 16 == 0,
            "moe_prefill: inter {i}, shared {si} (<= 2048) and hidden {d} must be multiples of 16"
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
        // Router logits (router | shared gate) and top-k.
        self.gemm_bf16(a.x, a.router, &mut s.logits, t, d, e + 1, d, e + 1)?;
        self.moe_router(&s.logits, &mut s.idx, &mut s.weight, t, e, k, e + 1)?;
        self.quantize_fp8_ct(a.x, &mut s.xq, &mut s.xs, t, d)?;
        let sp = OrnithMoeSortParams {
            idx: self.addr(&s.idx) as _,
            group_offsets: self.addr(&s.group_offsets) as _,
            tile_offsets: self.addr(&s.tile_offsets) as _,
            row_token: self.addr(&s.row_token) as _,
            row_of: self.addr(&s.row_of) as _,
            row_assign: std::ptr::null_mut(),
            active_list: std::ptr::null_mut(),
            active_count: std::ptr::null_mut(),
            tokens: t as i32,
            top_k: k as i32,
            experts: e as i32,
        };
        self.launch_smem("moe_sort", (1, 1, 1), 1024, 0, sp)?;
        // Grouped gate_up: row r (expert-sorted) reads token row_token[r] of xq.
        let tiles = n.div_ceil(GEMM_GROUPED_ROWS) + e.min(n);
        let gu = OrnithGemmParams {
            a: self.addr(&s.xq) as _,
            a_scale: self.addr(&s.xs) as _,
            a_rows: self.addr(&s.row_token) as _,
            w: self.addr(a.w_gate_up) as _,
            w_scale: self.addr(a.ws_gate_up) as _,
            y: self.addr(&s.gate_up) as _,
            group_offsets: self.addr(&s.group_offsets) as _,
            tile_offsets: self.addr(&s.tile_offsets) as _,
            rows: n as i32,
            in_: d as i32,
            out: (2 * i) as i32,
            a_stride: d as i32,
            y_stride: (2 * i) as i32,
            groups: e as i32,
        };
        self.launch_smem(
            "gemm_fp8_grouped",
            ((2 * i).div_ceil(GEMM_TILE) as u32, tiles as u32, 1),
            256,
            GEMM_GROUPED_SMEM,
            gu,
        )?;
        let sq = OrnithSwigluQuantParams {
            gate_up: self.addr(&s.gate_up) as _,
            q8: self.addr(&s.aq) as _,
            scale: self.addr(&s.as_) as _,
            rows: n as i32,
            inter: i as i32,
        };
        self.launch_smem("swiglu_quant_ct", (n as u32, 1, 1), 256, 0, sq)?;
        let dn = OrnithGemmParams {
            a: self.addr(&s.aq) as _,
            a_scale: self.addr(&s.as_) as _,
            w: self.addr(a.w_down) as _,
            w_scale: self.addr(a.ws_down) as _,
            y: self.addr(&s.down) as _,
            group_offsets: self.addr(&s.group_offsets) as _,
            tile_offsets: self.addr(&s.tile_offsets) as _,
            rows: n as i32,
            in_: i as i32,
            out: d as i32,
            a_stride: i as i32,
            y_stride: d as i32,
            groups: e as i32,
            ..Default::default()
        };
        self.launch_smem(
            "gemm_fp8_grouped",
            (d.div_ceil(GEMM_TILE) as u32, tiles as u32, 1),
            256,
            GEMM_GROUPED_SMEM,
            dn,
        )?;
        // Shared expert on every token.
        self.gemm_fp8(
            &s.xq,
            &s.xs,
            a.shared_gate_up,
            a.shared_gate_up_scale,
            &mut s.shared_gu,
            t,
            d,
            2 * si,
            d,
            2 * si,
        )?;
        let sq = OrnithSwigluQuantParams {
            gate_up: self.addr(&s.shared_gu) as _,
            q8: self.addr(&s.saq) as _,
            scale: self.addr(&s.sas) as _,
            rows: t as i32,
            inter: si as i32,
        };
        self.launch_smem("swiglu_quant_ct", (t as u32, 1, 1), 256, 0, sq)?;
        self.gemm_fp8(&s.saq, &s.sas, a.shared_down, a.shared_down_scale, &mut s.shared_y, t, si, d, si, d)?;
        let cp = OrnithMoeCombinePrefillParams {
            ys: self.addr(&s.down) as _,
            row_of: self.addr(&s.row_of) as _,
            weight: self.addr(&s.weight) as _,
            shared_y: self.addr(&s.shared_y) as _,
            gate_logit: (self.addr(&s.logits) + 2 * e as u64) as _,
            out: self.addr(out) as _,
            tokens: t as i32,
            top_k: k as i32,
            hidden: d as i32,
            gate_stride: (e + 1) as i32,
        };
        self.launch_smem("moe_combine_prefill", (d.div_ceil(256) as u32, t as u32, 1), 256, 0, cp)
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
