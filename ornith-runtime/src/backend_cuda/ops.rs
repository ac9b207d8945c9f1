//! The backend's views of device memory as addresses (a layer reads and writes at column
//! offsets inside wide scratch rows, e.g. the Gated DeltaNet's `[qkv | z | b | a]` projection
//! row) and the Linear op, which picks the kernel for a row count and calls its launcher. Every
//! kernel has one launcher, in [`crate::cuda`] (the kernel tests call the same ones through
//! slice wrappers); the shapes come from the compiled [`Dims`](crate::graph::Dims) and
//! the scratch sizes fixed in [`super::plan`], both checked once when the backend is built.
use super::CudaBackend;
use crate::cuda::gemm::gemm_aligned;
use crate::cuda::nvfp4::{Fp4W, TAB_BYTES};
pub use crate::cuda::Ptr;
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use ornith_kernels::bindings::*;

/// The address of element `off` of `s`.
pub fn at<T>(b: &CudaBackend, s: &CudaSlice<T>, off: usize) -> Ptr {
    b.cx.addr(s) + (off * std::mem::size_of::<T>()) as u64
}

/// A prefill chunk of at most this many rows takes the decode products, a longer one the
/// prefill kernels (`ORNITH_GEMV_MAX_TOKENS`).
pub const GEMV_ROWS: usize = ORNITH_GEMV_MAX_TOKENS as usize;

/// Rows from which a chunk of one sequence runs the prefill kernels (tensor-core GEMMs, chunked
/// gated delta rule, flash attention, MoE grouped by expert) instead of the decode ones.
pub fn use_prefill(rows: usize) -> bool {
    rows > GEMV_ROWS
}

/// An activation in both forms a Linear may want: bf16 rows and per-token FP8 rows with their
/// scales (`None` until quantised). `stride` is the row stride of both, in elements. Or, with
/// `norm`, not yet computed: one decode row that is the RMSNorm of a residual row, which the
/// decode product computes in its prologue (`OrnithNormIn`; `bf` and `q8` are then unset,
/// see `CudaBackend::norm_rows_for`).
#[derive(Clone, Copy)]
pub struct XIn {
    pub bf: Ptr,
    pub q8: Option<(Ptr, Ptr)>,
    pub stride: usize,
    pub norm: Option<OrnithNormIn>,
}

/// Rows `r0 .. r0 + out_features` of a device Linear: weight address (BF16 or E4M3 rows of
/// `in_features`) and, for FP8, the address of the f32 scales of those rows; for NVFP4A16 the
/// codes, scale bytes and scale tables of those rows (`fp4`; `w` is then the codes too).
#[derive(Clone, Copy)]
pub struct WRows {
    pub w: Ptr,
    pub scale: Option<Ptr>,
    pub fp4: Option<Fp4W>,
    pub in_features: usize,
    pub out_features: usize,
    /// Rows of the whole stored matrix: the decode products choose their K split for it, so a
    /// part's rows get the bits the one launch over all rows gives them (batch invariance when a
    /// group of one runs the fused launch and a larger group the parts).
    pub split_rows: usize,
}

impl super::DevLinear {
    /// All rows.
    pub fn all(&self, b: &CudaBackend) -> WRows {
        self.rows(b, 0, self.out_features)
    }
    /// Rows `r0 .. r0 + n` (a part of a fused matrix; for NVFP4 starting at one of its tables).
    pub fn rows(&self, b: &CudaBackend, r0: usize, n: usize) -> WRows {
        debug_assert!(r0 + n <= self.out_features);
        let k = self.in_features;
        if let Some(f) = &self.fp4 {
            debug_assert!(r0.is_multiple_of(f.tab_rows));
            let w = at(b, &self.w, r0 * k / 2);
            let fw = Fp4W {
                w,
                ws: at(b, &f.ws, r0 * k / 16),
                tab: at(b, &f.tab, 0) + ((r0 / f.tab_rows) * TAB_BYTES) as u64,
                tab_rows: f.tab_rows,
            };
            return WRows {
                w,
                scale: None,
                fp4: Some(fw),
                in_features: k,
                out_features: n,
                split_rows: self.out_features,
            };
        }
        let elem = if self.scale.is_some() { 1 } else { 2 };
        WRows {
            w: at(b, &self.w, r0 * k * elem),
            scale: self.scale.as_ref().map(|s| at(b, s, r0)),
            fp4: None,
            in_features: k,
            out_features: n,
            split_rows: self.out_features,
        }
    }
}

impl CudaBackend {
    /// `y = x @ W^T` for `t` rows: the prefill GEMM when `prefill` (a chunk of one sequence of
    /// more than 8 rows, and the operands are 16-byte aligned), else the decode product over all
    /// `t` rows in one launch (each row's bits independent of the other rows: a decode group).
    /// FP8 Linears quantise `x` first (per
    /// token, compressed-tensors semantics) unless `x.q8` is given. Both kernels compute the same
    /// cast points (fp32 sums, one bf16 rounding of the scaled sum); they differ in summation order.
    /// With `x.norm` the row's norm is computed in the product's prologue (one decode row, BF16
    /// or FP8 weights); with `fold` (the residual rows, `y` being the pending delta) the product
    /// first adds the delta `y` holds into them (`OrnithGemvBf16Params.fold`; decode products).
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
        fold: Option<Ptr>,
    ) -> Result<()> {
        ensure!(t >= 1, "linear on zero rows");
        let prefill = prefill && use_prefill(t);
        let (in_, out) = (w.in_features, w.out_features);
        ensure!(fold.is_none() || !prefill, "a residual fold needs a decode product");
        if let Some(n) = x.norm {
            ensure!(t == 1 && !prefill, "the norm prologue takes one decode row");
            return match (w.fp4, w.scale) {
                (Some(f), _) => self.cx.k_gemv_nvfp4_norm(n, f, y, in_, out, y_stride, w.split_rows, fold),
                (None, None) => self.cx.k_gemv_bf16_norm(n, w.w, y, in_, out, y_stride, w.split_rows, fold),
                (None, Some(ws)) => self.cx.k_gemv_fp8_norm(n, w.w, ws, y, in_, out, y_stride, w.split_rows, fold),
            };
        }
        if let Some(f) = w.fp4 {
            // NVFP4A16: bf16 activations, dequantised in the GEMM's tile or the product's registers.
            if prefill && gemm_aligned(x.bf, x.stride * 2, in_ * 2) {
                return self.cx.k_gemm_nvfp4(x.bf, f, y, t, in_, out, x.stride, y_stride);
            }
            return self.cx.k_gemv_nvfp4(x.bf, f, y, t, in_, out, x.stride, y_stride, w.split_rows, fold);
        }
        match w.scale {
            None => {
                if prefill && gemm_aligned(x.bf, x.stride * 2, in_ * 2) {
                    return self.cx.k_gemm_bf16(x.bf, w.w, y, t, in_, out, x.stride, y_stride);
                }
                self.cx.k_gemv_bf16(x.bf, w.w, y, t, in_, out, x.stride, y_stride, w.split_rows, fold)?;
            }
            Some(ws) => {
                let (xq, xsc, xstride) = match x.q8 {
                    Some((q, s)) => (q, s, x.stride),
                    // one decode row: quantised in the product's prologue
                    None if t == 1 && !prefill => {
                        return self.cx.k_gemv_fp8_quant(x.bf, w.w, ws, y, in_, out, y_stride, w.split_rows, fold);
                    }
                    None => {
                        self.k_quant_rows(x, q8_scratch, t, in_)?;
                        (q8_scratch.0, q8_scratch.1, in_)
                    }
                };
                if prefill && gemm_aligned(xq, xstride, in_) {
                    return self.cx.k_gemm_fp8(xq, xsc, w.w, ws, y, t, in_, out, xstride, y_stride);
                }
                self.cx.k_gemv_fp8(xq, xsc, w.w, ws, y, t, in_, out, xstride, y_stride, w.split_rows, fold)?;
            }
        }
        Ok(())
    }

    /// Per-token FP8 of `t` rows of `cols` (row stride `x.stride`) into contiguous scratch.
    fn k_quant_rows(&self, x: XIn, q8: (Ptr, Ptr), t: usize, cols: usize) -> Result<()> {
        if x.stride == cols {
            return self.cx.k_quant(x.bf, q8.0, q8.1, t, cols);
        }
        for r in 0..t {
            self.cx.k_quant(
                x.bf + (r * x.stride * 2) as u64,
                q8.0 + (r * cols) as u64,
                q8.1 + (r * 4) as u64,
                1,
                cols,
            )?;
        }
        Ok(())
    }
}
