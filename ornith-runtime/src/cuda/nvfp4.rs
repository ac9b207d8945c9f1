//! Launchers of the NVFP4A16 kernels (`kernels/cuda/nvfp4.cu`): the dequantiser (prefill's first
//! step: bf16 weights for the BF16 GEMM) and the decode GEMV that dequantises in registers. The
//! weight is compressed-tensors' `weight_packed` U8 `[out, in/2]`, `weight_scale` E4M3
//! `[out, in/16]` and the global scale (`model_spec::nvfp4` states the math). Not yet used by the
//! CUDA backend, whose loader refuses NVFP4 checkpoints.
use super::CudaContext;
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use ornith_kernels::bindings::*;

type Bf = CudaSlice<u16>;

/// Warps per block of `gemv_nvfp4` (`NVFP4_WARPS` in nvfp4.cu).
const NVFP4_WARPS: usize = 8;

impl CudaContext {
    /// Shape checks shared by both kernels: `w` `[out, in/2]`, `ws` `[out, in/16]`, a positive
    /// finite global scale.
    fn nvfp4_weight(&self, w: &CudaSlice<u8>, ws: &CudaSlice<u8>, gs: f32, in_: usize, out: usize) -> Result<()> {
        ensure!(
            out > 0 && in_ > 0 && in_.is_multiple_of(16),
            "nvfp4: in {in_} must be a positive multiple of 16, out {out} > 0"
        );
        ensure!(i32::try_from(in_).is_ok() && i32::try_from(out).is_ok(), "nvfp4: in {in_} / out {out} exceed int32");
        ensure!(w.len() >= out * in_ / 2, "nvfp4 w: {} bytes, the weight needs {}", w.len(), out * in_ / 2);
        ensure!(ws.len() >= out * in_ / 16, "nvfp4 ws: {} scales, the weight needs {}", ws.len(), out * in_ / 16);
        ensure!(gs.is_finite() && gs > 0.0, "nvfp4: global scale {gs} must be positive and finite");
        Ok(())
    }

    /// `y` (bf16 `[out, in]`) = the dequantised weight, bit-identical to `model_spec::nvfp4::dequantize`.
    pub fn nvfp4_dequant(
        &self,
        w: &CudaSlice<u8>,
        ws: &CudaSlice<u8>,
        gs: f32,
        y: &mut Bf,
        in_: usize,
        out: usize,
    ) -> Result<()> {
        self.nvfp4_weight(w, ws, gs, in_, out)?;
        ensure!(y.len() >= out * in_, "nvfp4_dequant y: {} elements, needs {}", y.len(), out * in_);
        let p = OrnithNvfp4Params {
            x: std::ptr::null(),
            w: self.addr(w) as _,
            ws: self.addr(ws) as _,
            y: self.addr(y) as _,
            gs,
            tokens: 0,
            in_: in_ as i32,
            out: out as i32,
            x_stride: 0,
            y_stride: 0,
        };
        let blocks = (out * in_ / 2).div_ceil(256);
        ensure!(blocks <= u32::MAX as usize, "nvfp4_dequant: {blocks} blocks");
        self.launch("nvfp4_dequant", (blocks as u32, 1, 1), 256, p)
    }

    /// `y[t, o] = bf16(Σ_i x[t, i] · wd[o, i])` for 1..=8 tokens (rows of `x` and `y` at the given
    /// strides, in elements); `in` must be a multiple of 32 (one lane's 16-byte chunk of codes).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_nvfp4(
        &self,
        x: &Bf,
        w: &CudaSlice<u8>,
        ws: &CudaSlice<u8>,
        gs: f32,
        y: &mut Bf,
        tokens: usize,
        in_: usize,
        out: usize,
        x_stride: usize,
        y_stride: usize,
    ) -> Result<()> {
        self.nvfp4_weight(w, ws, gs, in_, out)?;
        ensure!((1..=ORNITH_GEMV_MAX_TOKENS as usize).contains(&tokens), "gemv_nvfp4: tokens {tokens} must be 1..=8");
        ensure!(in_.is_multiple_of(32), "gemv_nvfp4: in {in_} must be a multiple of 32");
        ensure!(
            x_stride >= in_ && y_stride >= out,
            "gemv_nvfp4: strides x {x_stride} >= in {in_}, y {y_stride} >= out {out}"
        );
        ensure!(x_stride.is_multiple_of(8), "gemv_nvfp4: x stride {x_stride} must keep rows 16-byte aligned");
        ensure!(x.len() >= (tokens - 1) * x_stride + in_, "gemv_nvfp4 x: {} elements", x.len());
        ensure!(y.len() >= (tokens - 1) * y_stride + out, "gemv_nvfp4 y: {} elements", y.len());
        ensure!(i32::try_from(x_stride.max(y_stride)).is_ok(), "gemv_nvfp4: strides exceed int32");
        let p = OrnithNvfp4Params {
            x: self.addr(x) as _,
            w: self.addr(w) as _,
            ws: self.addr(ws) as _,
            y: self.addr(y) as _,
            gs,
            tokens: tokens as i32,
            in_: in_ as i32,
            out: out as i32,
            x_stride: x_stride as i32,
            y_stride: y_stride as i32,
        };
        self.launch("gemv_nvfp4", (out.div_ceil(NVFP4_WARPS) as u32, 1, 1), (NVFP4_WARPS * 32) as u32, p)
    }
}
