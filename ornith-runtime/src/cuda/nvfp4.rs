//! Launchers of the NVFP4A16 kernels (`kernels/cuda/nvfp4.cu`): the dequantiser (prefill's first
//! step: bf16 weights for the BF16 GEMM) and the decode GEMV that dequantises in registers. The
//! weight is compressed-tensors' `weight_packed` U8 `[out, in/2]`, `weight_scale` E4M3
//! `[out, in/16]` and the global scale (`model_spec::nvfp4` states the math). Not yet used by the
//! CUDA backend, whose loader refuses NVFP4 checkpoints, so each kernel's one launcher takes
//! buffers (the kernel tests' form); wiring them in splits each into an address launcher and a
//! slice wrapper as in [`super::gemv`].
use super::moe::MoeGroups;
use super::{CudaContext, Launch};
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use ornith_kernels::bindings::*;

type Bf = CudaSlice<u16>;

/// Warps per block of `gemv_nvfp4` (`NVFP4_WARPS` in nvfp4.cu).
const NVFP4_WARPS: usize = 8;

/// Inputs of [`CudaContext::moe_gemv_nvfp4_grouped`]: `experts` NVFP4 experts `[out, in]` stored
/// one after the other (`w` codes, `ws` scales, `gs` one global scale each) and the shared expert;
/// the bf16 activation of (token t, slot j) at `x + t · x_tok_stride + j · x_slot_stride`.
pub struct MoeNvfp4Args<'a> {
    pub x: &'a Bf,
    pub w: &'a CudaSlice<u8>,
    pub ws: &'a CudaSlice<u8>,
    pub gs: &'a CudaSlice<f32>,
    pub shared_w: &'a CudaSlice<u8>,
    pub shared_ws: &'a CudaSlice<u8>,
    pub shared_gs: f32,
    pub tokens: usize,
    pub top_k: usize,
    pub experts: usize,
    pub in_: usize,
    pub out: usize,
    pub x_tok_stride: usize,
    pub x_slot_stride: usize,
}

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
        let bytes = out * in_ / 2 + out * in_ / 16 + out * in_ * 2;
        self.launch(Launch::new("nvfp4_dequant", (blocks as u32, 1, 1), 256, bytes as u64), p)
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
        let bytes = out * in_ / 2 + out * in_ / 16 + tokens * (in_ + out) * 2;
        let grid = (out.div_ceil(NVFP4_WARPS) as u32, 1, 1);
        self.launch(Launch::new("gemv_nvfp4", grid, (NVFP4_WARPS * 32) as u32, bytes as u64), p)
    }

    /// The MoE expert GEMV over NVFP4 experts grouped by expert (`g` from
    /// [`CudaContext::moe_groups`] of the router's `idx`): `y[(t · (top_k + 1) + j) · out + o]` for
    /// every token's top_k routed slots and the shared slot, each bit-identical to
    /// [`CudaContext::gemv_nvfp4`] of that expert on that activation row.
    pub fn moe_gemv_nvfp4_grouped(&self, a: &MoeNvfp4Args, g: &MoeGroups, y: &mut Bf) -> Result<()> {
        let (e, in_, out) = (a.experts, a.in_, a.out);
        ensure!(
            e > 0 && a.tokens > 0 && (1..=e).contains(&a.top_k),
            "moe_gemv_nvfp4: tokens {} top_k {} experts {e}",
            a.tokens,
            a.top_k
        );
        self.nvfp4_weight(a.w, a.ws, 1.0, in_, out * e)?;
        self.nvfp4_weight(a.shared_w, a.shared_ws, a.shared_gs, in_, out)?;
        ensure!(in_.is_multiple_of(32), "moe_gemv_nvfp4: in {in_} must be a multiple of 32");
        ensure!(a.gs.len() >= e, "moe_gemv_nvfp4 gs: {} global scales for {e} experts", a.gs.len());
        ensure!(
            a.x_tok_stride.is_multiple_of(8) && a.x_slot_stride.is_multiple_of(8),
            "moe_gemv_nvfp4: strides {} / {} must keep rows 16-byte aligned",
            a.x_tok_stride,
            a.x_slot_stride
        );
        let x_need = (a.tokens - 1) * a.x_tok_stride + a.top_k * a.x_slot_stride + in_;
        ensure!(a.x.len() >= x_need, "moe_gemv_nvfp4 x: {} elements, needs {x_need}", a.x.len());
        let slots = a.top_k + 1;
        ensure!(y.len() >= a.tokens * slots * out, "moe_gemv_nvfp4 y: {} elements", y.len());
        ensure!(
            g.group_offsets.len() > e && g.active_list.len() >= e,
            "moe_gemv_nvfp4: groups for fewer than {e} experts"
        );
        ensure!(g.row_assign.len() >= a.tokens * a.top_k, "moe_gemv_nvfp4: groups for fewer than {} tokens", a.tokens);
        let i32of = |what: &str, v: usize| {
            i32::try_from(v).map_err(|_| anyhow::anyhow!("moe_gemv_nvfp4: {what} {v} exceeds int32"))
        };
        let p = OrnithMoeGemvNvfp4Params {
            x: self.addr(a.x) as _,
            w: self.addr(a.w) as _,
            ws: self.addr(a.ws) as _,
            gs: self.addr(a.gs) as _,
            shared_w: self.addr(a.shared_w) as _,
            shared_ws: self.addr(a.shared_ws) as _,
            shared_gs: a.shared_gs,
            tokens: i32of("tokens", a.tokens)?,
            top_k: a.top_k as i32,
            experts: i32of("experts", e)?,
            in_: in_ as i32,
            out: out as i32,
            x_tok_stride: i32of("x_tok_stride", a.x_tok_stride)?,
            x_slot_stride: i32of("x_slot_stride", a.x_slot_stride)?,
            y: self.addr(y) as _,
            active_list: self.addr(&g.active_list) as _,
            active_count: self.addr(&g.active_count) as _,
            group_offsets: self.addr(&g.group_offsets) as _,
            row_assign: self.addr(&g.row_assign) as _,
        };
        let active = e.min(a.tokens * a.top_k) as u32;
        let grid = (out.div_ceil(NVFP4_WARPS) as u32, active + 1, 1);
        let bytes = (active as usize + 1) * (out * in_ / 2 + out * in_ / 16) + a.tokens * slots * (in_ + out) * 2;
        self.launch(Launch::new("moe_gemv_nvfp4_grouped", grid, (NVFP4_WARPS * 32) as u32, bytes as u64), p)
    }
}
