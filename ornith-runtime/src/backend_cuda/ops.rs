//! Kernel launches on raw device addresses, so that a layer can read and write at column
//! offsets inside wide scratch rows (e.g. the Gated DeltaNet's `[qkv | z | b | a]` projection row)
//! and so that every launch can be timed with CUDA events (`ornith-bench`).
//!
//! The math of each kernel is documented in `kernels/include/ornith_kernels.h`; the checked,
//! slice-based launchers in [`crate::cuda::launch`] are their unit-tested entry points. Here the
//! shapes come from the compiled [`ModelDims`](crate::graph::ModelDims) and the scratch sizes
//! fixed in [`super::plan`], both checked once when the backend is built, so the launches below
//! only check what varies per call (row counts against scratch capacity).
use super::CudaBackend;
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use ornith_kernels::bindings::*;

/// A device address in bytes.
pub type Ptr = u64;

/// The address of element `off` of `s`.
pub fn at<T>(b: &CudaBackend, s: &CudaSlice<T>, off: usize) -> Ptr {
    b.cx.addr(s) + (off * std::mem::size_of::<T>()) as u64
}

/// A prefill chunk of at most this many rows takes the decode products, a longer one the
/// prefill GEMM (`ORNITH_GEMV_MAX_TOKENS`).
pub const GEMV_ROWS: usize = ORNITH_GEMV_MAX_TOKENS as usize;

/// An activation in both forms a Linear may want: bf16 rows and per-token FP8 rows with their
/// scales (`None` until quantised). `stride` is the row stride of both, in elements.
#[derive(Clone, Copy)]
pub struct XIn {
    pub bf: Ptr,
    pub q8: Option<(Ptr, Ptr)>,
    pub stride: usize,
}

/// Rows `r0 .. r0 + out_features` of a device Linear: weight address (BF16 or E4M3 rows of
/// `in_features`) and, for FP8, the address of the f32 scales of those rows.
#[derive(Clone, Copy)]
pub struct WRows {
    pub w: Ptr,
    pub scale: Option<Ptr>,
    pub in_features: usize,
    pub out_features: usize,
}

impl super::DevLinear {
    /// All rows.
    pub fn all(&self, b: &CudaBackend) -> WRows {
        self.rows(b, 0, self.out_features)
    }
    /// Rows `r0 .. r0 + n` (a part of a fused matrix).
    pub fn rows(&self, b: &CudaBackend, r0: usize, n: usize) -> WRows {
        debug_assert!(r0 + n <= self.out_features);
        let elem = if self.scale.is_some() { 1 } else { 2 };
        WRows {
            w: at(b, &self.w, r0 * self.in_features * elem),
            scale: self.scale.as_ref().map(|s| at(b, s, r0)),
            in_features: self.in_features,
            out_features: n,
        }
    }
}

impl CudaBackend {
    /// Launches `name` (timed when profiling). `bytes` is what the launch must move at least
    /// (weights + activations read and written), for the GB/s report.
    pub(super) fn go<P: crate::cuda::KernelParams>(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        bytes: u64,
        p: P,
    ) -> Result<()> {
        self.go_smem(name, grid, block, 0, bytes, p)
    }

    /// [`Self::go`] with `smem` bytes of dynamic shared memory (the prefill kernels).
    pub(super) fn go_smem<P: crate::cuda::KernelParams>(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        bytes: u64,
        p: P,
    ) -> Result<()> {
        if *self.skip.lock().unwrap_or_else(|e| e.into_inner()) == Some(name) {
            return Ok(()); // measurement only: see `set_skip_kernel`
        }
        let mut prof = self.prof.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pr) = prof.as_mut() {
            let a = self.cx.driver().new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            let z = self.cx.driver().new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            a.record(self.cx.stream())?;
            self.cx.launch_smem(name, grid, block, smem, p)?;
            z.record(self.cx.stream())?;
            pr.push(super::profile::Launch { name, bytes, start: a, end: z });
            Ok(())
        } else {
            self.cx.launch_smem(name, grid, block, smem, p)
        }
    }

    pub(super) fn k_embed(&self, ids: Ptr, table: Ptr, out: Ptr, t: usize, hidden: usize, vocab: usize) -> Result<()> {
        let p = OrnithEmbedParams {
            ids: ids as _,
            table: table as _,
            out: out as _,
            tokens: t as i32,
            hidden: hidden as i32,
            vocab: vocab as i32,
        };
        self.go("embed_gather", (t as u32, 1, 1), 256, (t * hidden * 4 + t * 4) as u64, p)
    }

    /// `residual += add` (if any), then zero-centred RMSNorm into bf16 `out` and FP8 `q8`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn k_rmsnorm(
        &self,
        residual: Ptr,
        add: Option<Ptr>,
        w: Ptr,
        out: Ptr,
        q8: Option<(Ptr, Ptr)>,
        t: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        let mut p = OrnithRmsNormParams {
            residual: residual as _,
            weight: w as _,
            out: out as _,
            tokens: t as i32,
            hidden: hidden as i32,
            eps,
            ..Default::default()
        };
        let mut bytes = t * hidden * 4 + hidden * 2;
        if let Some(a) = add {
            p.add = a as _;
            bytes += t * hidden * 4;
        }
        if let Some((q, s)) = q8 {
            p.q8 = q as _;
            p.scale = s as _;
            bytes += t * (hidden + 4);
        }
        self.go("rmsnorm_residual", (t as u32, 1, 1), 256, bytes as u64, p)
    }

    pub(super) fn k_quant(&self, x: Ptr, q8: Ptr, scale: Ptr, rows: usize, cols: usize) -> Result<()> {
        let p = OrnithQuantParams { x: x as _, q8: q8 as _, scale: scale as _, tokens: rows as i32, cols: cols as i32 };
        self.go("quantize_fp8_rows", (rows as u32, 1, 1), 256, (rows * cols * 3 + rows * 4) as u64, p)
    }

    /// `y[t, o] = x[t] · w[o]` for any number of rows (`w` BF16 `[out, in]`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn k_gemv_bf16(
        &self,
        x: Ptr,
        w: Ptr,
        y: Ptr,
        t: usize,
        in_: usize,
        out: usize,
        xs: usize,
        ys: usize,
    ) -> Result<()> {
        let p = OrnithGemvBf16Params {
            x: x as _,
            w: w as _,
            y: y as _,
            tokens: t as i32,
            in_: in_ as i32,
            out: out as i32,
            x_stride: xs as i32,
            y_stride: ys as i32,
        };
        let bytes = (out * in_ * 2 + t * (in_ + out) * 2) as u64;
        let name = crate::cuda::gemv_tc_kernel(false, t);
        self.go(name, (crate::cuda::gemv_tc_blocks(in_ * 2, out), 1, 1), 256, bytes, p)
    }

    /// FP8 W8A8 decode product for any number of rows.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn k_gemv_fp8(
        &self,
        xq: Ptr,
        xsc: Ptr,
        w: Ptr,
        ws: Ptr,
        y: Ptr,
        t: usize,
        in_: usize,
        out: usize,
        xs: usize,
        ys: usize,
    ) -> Result<()> {
        let p = OrnithGemvFp8Params {
            xq: xq as _,
            xs: xsc as _,
            w: w as _,
            ws: ws as _,
            y: y as _,
            tokens: t as i32,
            in_: in_ as i32,
            out: out as i32,
            x_stride: xs as i32,
            y_stride: ys as i32,
        };
        let bytes = (out * in_ + out * 4 + t * (in_ + 4 + out * 2)) as u64;
        let name = crate::cuda::gemv_tc_kernel(true, t);
        self.go(name, (crate::cuda::gemv_tc_blocks(in_, out), 1, 1), 256, bytes, p)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn k_router(
        &self,
        logits: Ptr,
        idx: Ptr,
        weight: Ptr,
        t: usize,
        experts: usize,
        top_k: usize,
        stride: usize,
    ) -> Result<()> {
        let p = OrnithRouterParams {
            logits: logits as _,
            idx: idx as _,
            weight: weight as _,
            tokens: t as i32,
            experts: experts as i32,
            top_k: top_k as i32,
            logit_stride: stride as i32,
        };
        self.go("moe_router_topk", (t as u32, 1, 1), 32, (t * (experts * 2 + top_k * 8)) as u64, p)
    }

    /// Routed + shared expert GEMV; bytes count each (token, slot)'s weight rows once (an upper
    /// bound when tokens share experts).
    /// The expert GEMVs of a decode group: per (token, slot) (`moe_gemv_fp8`), or `grouped` by
    /// expert over `moe_sort`'s groups (`moe_gemv_grouped`, the same bits; its grid has one block
    /// row per possible active expert, `min(experts, tokens · top_k)`, plus the shared expert).
    pub(super) fn k_moe_gemv(&self, p: OrnithMoeGemvParams, grouped: bool) -> Result<()> {
        let slots = (p.top_k + 1) as usize;
        let (t, in_, out, k) = (p.tokens as usize, p.in_ as usize, p.out as usize, p.top_k as usize);
        let tiles = crate::cuda::moe_tc_blocks(in_, out);
        if grouped {
            anyhow::ensure!(
                !p.active_list.is_null() && !p.row_assign.is_null(),
                "moe_gemv_grouped needs moe_sort's groups"
            );
            let active = (p.experts as usize).min(t * k);
            // Each touched expert's weights once (at most `active`), activations per assignment.
            let bytes = (active + 1) * (out * in_ + out * 4) + t * slots * (in_ + 4 + out * 2);
            return self.go("moe_gemv_grouped", (tiles, active as u32 + 1, 1), 256, bytes as u64, p);
        }
        let bytes = t * slots * (out * in_ + out * 4 + in_ + 4 + out * 2);
        self.go("moe_gemv_fp8", (tiles, slots as u32, t as u32), 256, bytes as u64, p)
    }

    pub(super) fn k_swiglu(&self, gu: Ptr, q8: Ptr, scale: Ptr, rows: usize, inter: usize) -> Result<()> {
        let p = OrnithSwigluQuantParams {
            gate_up: gu as _,
            q8: q8 as _,
            scale: scale as _,
            rows: rows as i32,
            inter: inter as i32,
        };
        self.go("swiglu_quant", (rows as u32, 1, 1), 256, (rows * (inter * 5 + 4)) as u64, p)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn k_combine(
        &self,
        ys: Ptr,
        weight: Ptr,
        gate: Ptr,
        out: Ptr,
        t: usize,
        top_k: usize,
        hidden: usize,
        gate_stride: usize,
    ) -> Result<()> {
        let p = OrnithMoeCombineParams {
            ys: ys as _,
            weight: weight as _,
            gate_logit: gate as _,
            out: out as _,
            tokens: t as i32,
            top_k: top_k as i32,
            hidden: hidden as i32,
            gate_stride: gate_stride as i32,
        };
        self.go(
            "moe_combine",
            (hidden.div_ceil(256) as u32, t as u32, 1),
            256,
            (t * ((top_k + 2) * hidden * 2 + top_k * 4 + 2)) as u64,
            p,
        )
    }

    /// Causal conv + SiLU of `t` tokens of one sequence (state at `state`), or with
    /// `slots = Some((slot, stride))` of `t` sequences, token i continuing the state at
    /// `state + slot[i] · stride` (one grid row per token).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn k_conv(
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
        let p = OrnithConvParams {
            x: x as _,
            w: w as _,
            state: state as _,
            y: y as _,
            tokens: t as i32,
            channels: channels as i32,
            x_stride: x_stride as i32,
            slot: slots.map_or(std::ptr::null(), |s| s.0 as _),
            state_stride: slots.map_or(0, |s| s.1 as i32),
        };
        let rows = if slots.is_some() { t as u32 } else { 1 };
        self.go(
            "conv1d_silu",
            (channels.div_ceil(256) as u32, rows, 1),
            256,
            (channels * (8 + 12) + t * channels * 4) as u64,
            p,
        )
    }

    /// Recurrent delta rule: `p.tokens` tokens of one sequence, or with `p.slot` one token of
    /// each of `p.tokens` sequences (grid z = tokens; every state is read and written once).
    pub(super) fn k_gdn(&self, p: OrnithGdnParams) -> Result<()> {
        let (t, hv, hk) = (p.tokens as usize, p.v_heads as usize, p.k_heads as usize);
        let states = if p.slot.is_null() { 1 } else { t };
        let bytes = states * hv * 128 * 128 * 4 * 2 + t * ((2 * hk * 128 + hv * 128) * 2 + 4 * hv + hv * 128 * 2);
        self.go("gdn_recurrent", (hv as u32, 4, states as u32), 128, bytes as u64, p)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn k_gated_norm(
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
        let p = OrnithGatedNormParams {
            o: o as _,
            z: z as _,
            weight: w as _,
            y: y as _,
            tokens: t as i32,
            heads: heads as i32,
            dim: dim as i32,
            z_stride: z_stride as i32,
            eps,
        };
        self.go("gated_rmsnorm", ((t * heads) as u32, 1, 1), 128, (t * heads * dim * 6 + dim * 2) as u64, p)
    }

    pub(super) fn k_qk_rope(&self, p: OrnithQkRopeParams) -> Result<()> {
        let (t, qh, kvh, d) = (p.tokens as usize, p.q_heads as usize, p.kv_heads as usize, p.head_dim as usize);
        let bytes = t * (qh * d * 2 * 2 + kvh * d * 2 * 4);
        self.go("qk_norm_rope", ((qh + kvh) as u32, t as u32, 1), d as u32, bytes as u64, p)
    }

    /// Split-sequence attention + combine through their one launcher
    /// (`CudaContext::launch_attention`); `keys`: the K/V positions the rows read in all (the
    /// bytes of the profile).
    pub(super) fn k_attention(&self, p: OrnithAttnParams, keys: usize) -> Result<()> {
        self.cx.launch_attention(p, keys, &mut |name, grid, block, smem, bytes, p| {
            self.go_smem(name, grid, block, smem, bytes, p)
        })
    }

    /// Argmax of the first `n` columns of `rows` logits rows (row stride `stride`): row i of
    /// `logit_row` (device int32) when given, else row i.
    pub(super) fn k_argmax(
        &self,
        logits: Ptr,
        idx: Ptr,
        rows: usize,
        n: usize,
        stride: usize,
        logit_row: Option<Ptr>,
    ) -> Result<()> {
        let p = OrnithArgmaxParams {
            logits: logits as _,
            idx: idx as _,
            tokens: rows as i32,
            n: n as i32,
            stride: stride as i32,
            logit_row: logit_row.map_or(std::ptr::null(), |r| r as _),
        };
        self.go("argmax_bf16", (rows as u32, 1, 1), 1024, (rows * n * 2) as u64, p)
    }

    /// `y = x @ W^T` for `t` rows: the prefill GEMM when `prefill` (a chunk of one sequence of
    /// more than 8 rows, and the operands are 16-byte aligned), else the decode product over all
    /// `t` rows in one launch (each row's bits independent of the other rows: a decode group).
    /// FP8 Linears quantise `x` first (per
    /// token, compressed-tensors semantics) unless `x.q8` is given. Both kernels compute the same
    /// cast points (fp32 sums, one bf16 rounding of the scaled sum); they differ in summation order.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear_rows(
        &self,
        w: WRows,
        x: XIn,
        q8_scratch: (Ptr, Ptr),
        y: Ptr,
        y_stride: usize,
        t: usize,
        prefill: bool,
    ) -> Result<()> {
        use super::prefill_ops::{gemm_aligned, use_prefill};
        ensure!(t >= 1, "linear on zero rows");
        let prefill = prefill && use_prefill(t);
        let (in_, out) = (w.in_features, w.out_features);
        match w.scale {
            None => {
                if prefill && gemm_aligned(x.bf, x.stride * 2, in_ * 2) {
                    return self.k_gemm_bf16(x.bf, w.w, y, t, in_, out, x.stride, y_stride);
                }
                self.k_gemv_bf16(x.bf, w.w, y, t, in_, out, x.stride, y_stride)?;
            }
            Some(ws) => {
                let (xq, xsc, xstride) = match x.q8 {
                    Some((q, s)) => (q, s, x.stride),
                    None => {
                        self.k_quant_rows(x, q8_scratch, t, in_)?;
                        (q8_scratch.0, q8_scratch.1, in_)
                    }
                };
                if prefill && gemm_aligned(xq, xstride, in_) {
                    return self.k_gemm_fp8(xq, xsc, w.w, ws, y, t, in_, out, xstride, y_stride);
                }
                self.k_gemv_fp8(xq, xsc, w.w, ws, y, t, in_, out, xstride, y_stride)?;
            }
        }
        Ok(())
    }

    /// Per-token FP8 of `t` rows of `cols` (row stride `x.stride`) into contiguous scratch.
    fn k_quant_rows(&self, x: XIn, q8: (Ptr, Ptr), t: usize, cols: usize) -> Result<()> {
        if x.stride == cols {
            return self.k_quant(x.bf, q8.0, q8.1, t, cols);
        }
        for r in 0..t {
            self.k_quant(x.bf + (r * x.stride * 2) as u64, q8.0 + (r * cols) as u64, q8.1 + (r * 4) as u64, 1, cols)?;
        }
        Ok(())
    }
}
