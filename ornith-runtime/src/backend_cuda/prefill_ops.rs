//! Launches of the prefill kernels (`kernels/cuda/{gemm,gdn_chunk,flash_attn,moe_prefill}.cu` and
//! `conv1d_silu_chunk` in `gdn.cu`) on raw device addresses, as [`super::ops`] does for the decode
//! kernels. Their math and shape
//! assumptions are in `kernels/include/ornith_kernels.h`; the checked, slice-based launchers in
//! [`crate::cuda::prefill`] are their unit-tested entry points (against the CPU reference ops).
//! A prefill chunk (of one sequence) uses them when it has more than [`GEMV_ROWS`] rows; decode
//! rows keep the GEMVs.
use super::ops::{Ptr, GEMV_ROWS};
use super::plan::CHUNK;
use super::CudaBackend;
use crate::cuda::prefill::{
    CONV_TT, FA_SMEM, GDN_PREP_SMEM, GDN_SCAN_COLS, GDN_SCAN_SMEM, GEMM_GROUPED_ROWS, GEMM_GROUPED_SMEM, GEMM_SMEM,
    GEMM_TILE,
};
use anyhow::{ensure, Result};
use ornith_kernels::bindings::*;

/// Rows from which a chunk runs the prefill kernels instead of the decode ones.
pub fn use_prefill(rows: usize) -> bool {
    rows > GEMV_ROWS
}

/// Whether the GEMM's cp.async loads (16 bytes from `a + r · pitch`) are aligned, and `in` covers
/// whole 16-byte chunks (`in_bytes % 16 == 0`): otherwise the caller keeps the GEMV.
pub fn gemm_aligned(a: Ptr, pitch_bytes: usize, in_bytes: usize) -> bool {
    a.is_multiple_of(16) && pitch_bytes.is_multiple_of(16) && in_bytes.is_multiple_of(16)
}

impl CudaBackend {
    /// Plain FP8 W8A8 GEMM: `y[r, o] = bf16((Σ_i e4m3(a[r,i])·e4m3(w[o,i])) · a_scale[r] · w_scale[o])`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn k_gemm_fp8(
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
        self.go_smem("gemm_fp8", grid, 256, GEMM_SMEM, bytes as u64, p)
    }

    /// Plain BF16 GEMM: `y[r, o] = bf16(Σ_i a[r,i]·w[o,i])`, fp32 accumulation.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn k_gemm_bf16(
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
        self.go_smem("gemm_bf16", grid, 256, GEMM_SMEM, bytes as u64, p)
    }

    /// Grouped FP8 GEMM over the expert-sorted rows of `p` (`p.groups` experts): at most
    /// `ceil(rows / 64) + min(groups, rows)` row tiles of 64 rows (each expert's last tile is
    /// partial). Bytes count every expert's weights once (all are read when the chunk is long).
    pub(super) fn k_gemm_grouped(&self, p: OrnithGemmParams) -> Result<()> {
        let (rows, in_, out, g) = (p.rows as usize, p.in_ as usize, p.out as usize, p.groups as usize);
        let tiles = rows.div_ceil(GEMM_GROUPED_ROWS) + g.min(rows);
        let bytes = g * (out * in_ + out * 4) + rows * (in_ + 4 + out * 2);
        self.go_smem(
            "gemm_fp8_grouped",
            (out.div_ceil(GEMM_TILE) as u32, tiles as u32, 1),
            256,
            GEMM_GROUPED_SMEM,
            bytes as u64,
            p,
        )
    }

    /// Token-parallel causal conv + SiLU of `t` tokens: the same parameters, output and state update
    /// as [`Self::k_conv`], bit for bit. Bytes: x and y once, w, and the state read and written.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn k_conv_chunk(
        &self,
        x: Ptr,
        w: Ptr,
        state: Ptr,
        y: Ptr,
        t: usize,
        channels: usize,
        x_stride: usize,
    ) -> Result<()> {
        let p = OrnithConvParams {
            x: x as _,
            w: w as _,
            state: state as _,
            y: y as _,
            tokens: t as i32,
            channels: channels as i32,
            x_stride: x_stride as i32,
            slot: std::ptr::null(),
            state_stride: 0,
        };
        let grid = (channels.div_ceil(256) as u32, t.div_ceil(CONV_TT) as u32, 1);
        self.go("conv1d_silu_chunk", grid, 256, (channels * (8 + 12) + t * channels * 4) as u64, p)
    }

    /// Chunked gated delta rule: the same parameters, state and output as `gdn_recurrent`, in two
    /// phases, `gdn_chunk_prep` + `gdn_chunk_scan` (p.work: `ScratchSizes::gdn_work`).
    pub(super) fn k_gdn_chunked(&self, p: OrnithGdnParams) -> Result<()> {
        let (t, hv, hk) = (p.tokens as usize, p.v_heads as usize, p.k_heads as usize);
        let bytes = hv * 128 * 128 * 4 * 2 + t * ((2 * hk * 128 + hv * 128) * 2 + 4 * hv + hv * 128 * 2);
        ensure!(t <= CHUNK && !p.work.is_null(), "gdn two-phase: {t} tokens > the workspace's {CHUNK}");
        ensure!(p.slot.is_null(), "gdn two-phase: the chunked form runs one sequence");
        // Bytes: the prep reads q, k, b, a and writes the workspace; the scan reads q, k, v
        // per column block (L2) and the workspace, the state once, and writes o.
        let work = hv * t.div_ceil(64) * ORNITH_GDN_WORK_PER_CHUNK as usize * 4;
        let chunks = t.div_ceil(64) as u32;
        self.go_smem(
            "gdn_chunk_prep",
            (chunks, hv as u32, 1),
            256,
            GDN_PREP_SMEM,
            (t * (2 * hk * 128 * 2 + 4 * hv) + work) as u64,
            p,
        )?;
        self.go_smem(
            "gdn_chunk_scan",
            (hv as u32, (128 / GDN_SCAN_COLS) as u32, 1),
            256,
            GDN_SCAN_SMEM,
            (bytes + work) as u64,
            p,
        )
    }

    /// Causal flash attention of `p.tokens` queries at positions `pos0..` over the paged K/V cache
    /// (through the sequence's block table `p.table`), with
    /// the sigmoid output gate from `p.qg`. Bytes: every K/V row once, q, the gate and the output.
    pub(super) fn k_flash_attn(&self, p: OrnithFlashAttnParams) -> Result<()> {
        let (t, qh, kvh) = (p.tokens as usize, p.q_heads as usize, p.kv_heads as usize);
        let bytes = (p.pos0 as usize + t) * kvh * 256 * 2 * 2 + t * qh * 256 * 2 * 3;
        self.go_smem("flash_attn_prefill", (t.div_ceil(64) as u32, qh as u32, 1), 128, FA_SMEM, bytes as u64, p)
    }

    pub(super) fn k_moe_sort(&self, p: OrnithMoeSortParams) -> Result<()> {
        let n = (p.tokens * p.top_k) as usize;
        self.go("moe_sort", (1, 1, 1), 1024, (n * 12 + (p.experts as usize + 1) * 8) as u64, p)
    }

    /// SwiGLU + compressed-tensors FP8 requantisation of `rows` gate|up rows.
    pub(super) fn k_swiglu_ct(&self, gu: Ptr, q8: Ptr, scale: Ptr, rows: usize, inter: usize) -> Result<()> {
        let p = OrnithSwigluQuantParams {
            gate_up: gu as _,
            q8: q8 as _,
            scale: scale as _,
            rows: rows as i32,
            inter: inter as i32,
        };
        self.go("swiglu_quant_ct", (rows as u32, 1, 1), 256, (rows * (inter * 5 + 4)) as u64, p)
    }

    pub(super) fn k_combine_prefill(&self, p: OrnithMoeCombinePrefillParams) -> Result<()> {
        let (t, k, h) = (p.tokens as usize, p.top_k as usize, p.hidden as usize);
        self.go(
            "moe_combine_prefill",
            (h.div_ceil(256) as u32, t as u32, 1),
            256,
            (t * ((k + 2) * h * 2 + k * 8 + 2)) as u64,
            p,
        )
    }
}
