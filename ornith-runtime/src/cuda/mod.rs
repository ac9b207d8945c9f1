//! CUDA backend: device context, PTX module loading and typed kernel launchers.
//!
//! The PTX is precompiled (`ornith-kernels`); the driver is loaded at run time, so building needs
//! neither the CUDA toolkit nor a GPU. The device's compute capability picks the PTX: 9.0 → sm_90,
//! 12.x → sm_121; anything else is refused with the device's name.
use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{CudaContext as DriverContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use ornith_kernels::{Arch, Module};
use std::collections::HashMap;
use std::sync::Arc;

pub mod launch;
pub mod prefill;
#[cfg(test)]
mod prefill_tests;
#[cfg(test)]
mod test_util;
#[cfg(test)]
mod tests;

/// Kernels per PTX module (names of the `extern "C"` entry points).
const KERNELS: [(Module, &[&str]); 10] = [
    (Module::Norm, &["embed_gather", "rmsnorm_residual", "quantize_fp8_rows"]),
    (Module::Gemv, &["gemv_bf16", "gemv_fp8", "moe_gemv_fp8", "gemv_bf16_v2", "gemv_fp8_v2", "moe_gemv_fp8_v2"]),
    (Module::Moe, &["moe_router_topk", "swiglu_quant", "moe_combine"]),
    (Module::Gdn, &["conv1d_silu", "conv1d_silu_chunk", "gdn_recurrent", "gated_rmsnorm"]),
    (Module::Attention, &["qk_norm_rope", "attn_decode_split", "attn_decode_combine"]),
    (Module::Sample, &["argmax_bf16"]),
    (Module::Gemm, &["gemm_fp8", "gemm_bf16", "gemm_fp8_grouped", "quantize_fp8_ct"]),
    (Module::GdnChunk, &["gdn_chunk_prep", "gdn_chunk_scan"]),
    (Module::FlashAttn, &["flash_attn_prefill"]),
    (Module::MoePrefill, &["moe_sort", "swiglu_quant_ct", "moe_combine_prefill"]),
];

/// Persistent-warp kernels (gemv.cu "v2"): their grids are sized to the blocks that fit on the
/// device at once, measured at load time (256 threads per block, static shared memory only).
const PERSISTENT: [&str; 3] = ["gemv_bf16_v2", "gemv_fp8_v2", "moe_gemv_fp8_v2"];

/// Warps per block of the v2 GEMVs (`GEMV2_WARPS` in gemv.cu).
pub(crate) const GEMV2_WARPS: usize = 8;
/// Decoded-x capacity of the FP8 v2 GEMVs in floats (`GEMV2_X_FLOATS` in gemv.cu).
pub(crate) const GEMV2_X_FLOATS: usize = 8192;

/// Lanes per weight row in the v2 GEMVs (`gemv2_team` in gemv.cu): the largest power of two
/// `g <= 32` with `g * u <= n16` chunks of 16 bytes per row, 1 if none.
pub(crate) fn gemv2_team(n16: usize, u: usize) -> usize {
    let mut g = 32;
    while g > 1 && g * u > n16 {
        g >>= 1;
    }
    g
}
/// 16-byte loads in flight per lane of the BF16 v2 GEMV (`U` in `gemv_bf16_v2_impl`).
pub(crate) fn gemv2_bf16_u(tokens: usize) -> usize {
    if tokens <= 2 { 8 } else { 4 }
}
/// 16-byte loads in flight per lane of the FP8 v2 GEMVs (`gemv2_fp8_u` in gemv.cu).
pub(crate) fn gemv2_fp8_u(tokens: usize) -> usize {
    if tokens <= 2 { 8 } else if tokens <= 4 { 4 } else { 2 }
}

/// The PTX arch shipped for a compute capability.
pub fn arch_for(major: i32, minor: i32, device: &str) -> Result<Arch> {
    match (major, minor) {
        (9, 0) => Ok(Arch::Sm90),
        (12, _) => Ok(Arch::Sm121),
        _ => bail!(
            "GPU '{device}' has compute capability {major}.{minor}; Ornith ships PTX only for sm_90 (H100/H200) and sm_121 (DGX Spark, also used for 12.x)"
        ),
    }
}

/// One device, one stream, all kernels loaded.
pub struct CudaContext {
    ctx: Arc<DriverContext>,
    stream: Arc<CudaStream>,
    arch: Arch,
    name: String,
    _modules: Vec<Arc<CudaModule>>,
    funcs: HashMap<&'static str, CudaFunction>,
    /// Streaming multiprocessors of the device.
    sms: u32,
    /// Blocks of 256 threads resident at once on the whole device, per [`PERSISTENT`] kernel.
    resident: HashMap<&'static str, u32>,
}

/// A kernel parameter struct passed by value (`#[repr(C)]` from bindgen, plain data).
#[repr(transparent)]
pub(crate) struct Param<T>(pub T);
unsafe impl<T: Copy> DeviceRepr for Param<T> {}

impl CudaContext {
    /// Opens GPU `ordinal` and loads every PTX module for its arch.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx = std::panic::catch_unwind(|| DriverContext::new(ordinal))
            .map_err(|_| anyhow!("cannot load the CUDA driver library (libcuda.so): is an NVIDIA driver installed?"))?
            .with_context(|| format!("cannot open CUDA device {ordinal}"))?;
        // All work goes through one stream, so cudarc's per-buffer event tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        let (major, minor) = ctx.compute_capability()?;
        let arch = arch_for(major, minor, &name)?;
        // A stream of our own, not the legacy default stream, which cannot be captured into a
        // CUDA graph (the decode step is captured once and replayed).
        let stream = ctx.new_stream().with_context(|| format!("creating a stream on '{name}'"))?;
        let mut modules = Vec::new();
        let mut funcs = HashMap::new();
        for (m, names) in KERNELS {
            let ptx = ornith_kernels::ptx(arch, m);
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                .with_context(|| format!("loading {} PTX module {} on '{name}'", arch.name(), m.stem()))?;
            for n in names.iter().copied() {
                let f = module.load_function(n).with_context(|| format!("kernel {n} missing from {}", m.stem()))?;
                funcs.insert(n, f);
            }
            modules.push(module);
        }
        let sms = ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let mut resident = HashMap::new();
        for n in PERSISTENT {
            let per_sm = funcs[n].occupancy_max_active_blocks_per_multiprocessor((GEMV2_WARPS * 32) as u32, 0, None)?;
            resident.insert(n, (per_sm * sms).max(1));
        }
        Ok(Self { ctx, stream, arch, name, _modules: modules, funcs, sms, resident })
    }

    pub fn arch(&self) -> Arch {
        self.arch
    }
    pub fn device_name(&self) -> &str {
        &self.name
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    pub fn driver(&self) -> &Arc<DriverContext> {
        &self.ctx
    }
    pub(crate) fn func(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }
    /// Grid of a persistent v2 GEMV with `warp_items` warp-sized work items: one block per 8 items
    /// but at least one per SM (small matrices spread over the whole device: items go to blocks
    /// first, warps second) and at most the resident blocks (one wave, no tail wave).
    fn gemv2_grid(&self, name: &str, warp_items: usize) -> u32 {
        let want = warp_items.div_ceil(GEMV2_WARPS).max(self.sms as usize);
        want.min(self.resident[name] as usize) as u32
    }
    /// 1-D grid of `gemv_bf16_v2` (a warp item = one team of rows).
    pub(crate) fn gemv_bf16_v2_grid(&self, tokens: usize, in_: usize, out: usize) -> u32 {
        let rows_per_warp = 32 / gemv2_team(in_ / 8, gemv2_bf16_u(tokens));
        self.gemv2_grid("gemv_bf16_v2", out.div_ceil(rows_per_warp))
    }
    /// 1-D grid of `gemv_fp8_v2`, or `None` where its staged x (tokens * in floats) does not fit.
    pub(crate) fn gemv_fp8_v2_grid(&self, tokens: usize, in_: usize, out: usize) -> Option<u32> {
        let rows_per_warp = 32 / gemv2_team(in_ / 16, gemv2_fp8_u(tokens));
        (tokens * in_ <= GEMV2_X_FLOATS).then(|| self.gemv2_grid("gemv_fp8_v2", out.div_ceil(rows_per_warp)))
    }
    /// 1-D grid of `moe_gemv_fp8_v2` over tokens x (top_k + 1) slots x row teams, or `None` where
    /// its staged x rows (tokens, times the slots when each slot has its own input) do not fit.
    pub(crate) fn moe_gemv_v2_grid(&self, tokens: usize, top_k: usize, in_: usize, out: usize, x_per_slot: bool) -> Option<u32> {
        let slots = top_k + 1;
        let x_rows = tokens * if x_per_slot { slots } else { 1 };
        let rows_per_warp = 32 / gemv2_team(in_ / 16, gemv2_fp8_u(1));
        (x_rows * in_ <= GEMV2_X_FLOATS).then(|| self.gemv2_grid("moe_gemv_fp8_v2", tokens * slots * out.div_ceil(rows_per_warp)))
    }
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
    pub fn upload<T: DeviceRepr + Clone>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(host)?)
    }
    pub fn download<T: DeviceRepr + Clone + Default>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        Ok(self.stream.clone_dtoh(dev)?)
    }
    /// Device buffer of `n` elements (contents unspecified until a kernel writes them).
    pub fn alloc<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        Ok(unsafe { self.stream.alloc::<T>(n) }?)
    }
    /// Raw device address of a buffer (event tracking is off, so no guard is needed).
    pub(crate) fn addr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }
}

#[cfg(test)]
mod arch_tests {
    use super::*;
    #[test]
    fn arch_selection() {
        assert_eq!(arch_for(9, 0, "H200").unwrap(), Arch::Sm90);
        assert_eq!(arch_for(12, 1, "GB10").unwrap(), Arch::Sm121);
        let e = arch_for(8, 0, "A100").unwrap_err().to_string();
        assert!(e.contains("A100") && e.contains("sm_90") && e.contains("sm_121"), "{e}");
    }
}
