//! CUDA backend: device context, PTX module loading and typed kernel launchers.
//!
//! The PTX is precompiled (`ornith-kernels`); the driver is loaded at run time, so building needs
//! neither the CUDA toolkit nor a GPU. The device's compute capability picks the PTX: 9.0 → sm_90,
//! 12.x → sm_121; anything else is refused with the device's name.
//!
//! **One launcher per kernel**, in one file per op family (the kernels' `.cu` files): [`norm`],
//! [`gemv`], [`moe`], [`gdn`], [`attention`], [`gemm`], [`sample`], [`nvfp4`]. Each kernel has
//! exactly one function that builds its parameter struct, checks what the kernel assumes
//! (alignment, divisibility, limits; an error, never a launch on a bad shape), computes its grid,
//! block and shared memory and the bytes it must move, and launches it through
//! [`CudaContext::launch`]. They take device addresses ([`Ptr`]) and shapes, or, where the kernel
//! has many inputs, its bindgen parameter struct, so the CUDA backend (`backend_cuda`) calls them
//! at column offsets inside its wide scratch rows. The kernel tests call them through thin
//! slice-based wrappers in the same files, which only check the buffers' lengths against the
//! shapes (and, for tables and slots held on the device, read them back) and convert the slices
//! to addresses. The kernels' math is stated in `kernels/include/ornith_kernels.h`.
use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{
    CudaContext as DriverContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
};
use ornith_kernels::bindings::{ORNITH_WIDE_SMEM, ORNITH_WIDE_SPLIT_ROWS, ORNITH_WIDE_TICKETS, ORNITH_WIDE_TOKENS};
use ornith_kernels::{Arch, Module};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// A device address in bytes.
pub type Ptr = u64;

/// Checks that buffer `s` holds at least the `n` elements a launch reads or writes (the
/// slice-based wrappers' check).
pub(crate) fn need<T>(what: &str, s: &CudaSlice<T>, n: usize) -> Result<()> {
    anyhow::ensure!(s.len() >= n, "{what}: buffer has {} elements, the launch needs {n}", s.len());
    Ok(())
}

/// Whether address `a` is a multiple of `n` bytes (a kernel's vector loads).
pub(crate) fn aligned(a: Ptr, n: u64) -> bool {
    a.is_multiple_of(n)
}

/// `v` as the kernel's int32 parameter, or an error naming it.
pub(crate) fn i32of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| anyhow!("{what} = {v} does not fit the kernel's int32"))
}

/// One kernel launch as a launcher computes it: the kernel, its grid, block (threads, 1-D) and
/// dynamic shared memory, and the bytes it must move at least (weights and activations read and
/// written; the profile's GB/s).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Launch {
    pub name: &'static str,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub smem: u32,
    pub bytes: u64,
    /// The kernel issues its first weight loads before `pdl_wait` (the decode products, gemv.cu):
    /// [`Pdl::Weights`] launches exactly these with programmatic dependent launch.
    pub weights_first: bool,
}

impl Launch {
    /// A launch of `name` without dynamic shared memory.
    pub fn new(name: &'static str, grid: (u32, u32, u32), block: u32, bytes: u64) -> Self {
        Launch { name, grid, block, smem: 0, bytes, weights_first: false }
    }
    /// The same launch with `smem` bytes of dynamic shared memory.
    pub fn smem(self, smem: u32) -> Self {
        Launch { smem, ..self }
    }
    /// The same launch of a weights-first kernel (see [`Launch::weights_first`]).
    pub fn weights_first(self) -> Self {
        Launch { weights_first: true, ..self }
    }
}

/// Which launches carry the programmatic-stream-serialization attribute (programmatic dependent
/// launch: the kernel's blocks may be scheduled while the previous kernel in the stream still
/// runs; each kernel waits with `griddepcontrol.wait` before it reads an input or writes
/// anything, so every mode gives the same bits; `kernels/cuda/common.cuh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pdl {
    /// Plain stream order.
    Off,
    /// The weights-first decode products only: their blocks become resident while the small
    /// kernel before them runs and issue their first weight loads before they wait. The small
    /// kernels keep plain order (with the attribute a one-block kernel's cost nearly doubles on
    /// the H200: 2.05 -> 3.98 us).
    Weights,
    /// Every launch.
    All,
}

/// The mode a context starts in (measured on the H200 by `ornith-bench`'s PDL columns, from
/// docs/PERF-2026-11.md's seventh session on).
pub const DEFAULT_PDL: Pdl = Pdl::Weights;

impl Pdl {
    pub const ALL: [Pdl; 3] = [Pdl::Off, Pdl::Weights, Pdl::All];
    /// Whether launch `l` carries the attribute in this mode.
    pub(crate) fn applies(self, l: &Launch) -> bool {
        match self {
            Pdl::Off => false,
            Pdl::Weights => l.weights_first,
            Pdl::All => true,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Pdl::Off => "off",
            Pdl::Weights => "weights",
            Pdl::All => "all",
        }
    }
    fn code(self) -> u8 {
        self as u8
    }
    fn from_code(c: u8) -> Pdl {
        Pdl::ALL[c as usize]
    }
}

impl std::str::FromStr for Pdl {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Pdl::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| anyhow!("unknown PDL mode `{s}` (expected off, weights or all)"))
    }
}

pub mod attention;
pub mod gdn;
pub mod gemm;
pub mod gemv;
pub mod graph_edit;
pub mod moe;
pub mod norm;
pub mod nvfp4;
#[cfg(test)]
mod nvfp4_tests;
#[cfg(test)]
mod prefill_tests;
pub mod profile;
pub mod sample;
pub mod spark;
#[cfg(test)]
mod test_util;
#[cfg(test)]
mod tests;

/// Kernels per PTX module (names of the `extern "C"` entry points).
const KERNELS: [(Module, &[&str]); 11] = [
    (Module::Norm, &["embed_gather", "rmsnorm_residual", "rmsnorm_residual_2k", "quantize_fp8_rows"]),
    (
        Module::Gemv,
        &[
            "gemv_bf16",
            "gemv_bf16_wide",
            "gemv_fp8",
            "gemv_fp8_wide",
            "gemv_bf16_staged",
            "gemv_fp8_staged",
            "gemv_bf16_norm",
            "gemv_fp8_norm",
            "gemv_fp8_quant",
            "gdn_out_proj",
            "gdn_out_reduce",
            "moe_gemv_fp8",
            "moe_gemv_fp8_norm",
            "moe_gemv_fp8_swiglu",
            "moe_gemv_grouped",
            "gemv_nvfp4",
            "gemv_nvfp4_wide",
            "gemv_nvfp4_norm",
            "moe_gemv_nvfp4",
            "moe_gemv_nvfp4_norm",
            "moe_gemv_nvfp4_swiglu",
            "moe_gemv_nvfp4_grouped",
        ],
    ),
    (Module::Moe, &["moe_router_topk", "swiglu_quant", "swiglu_bf16", "moe_combine"]),
    (Module::Gdn, &["conv1d_silu", "conv1d_silu_chunk", "gdn_recurrent", "gated_rmsnorm"]),
    (Module::Attention, &["qk_norm_rope", "attn_decode_split", "attn_decode_combine"]),
    (
        Module::Sample,
        &[
            "argmax_bf16",
            "apply_penalties",
            "sample_prep",
            "sample_hist",
            "sample_select",
            "sample_topk_block",
            "sample_select_topk",
            "sample_draw",
        ],
    ),
    (Module::Gemm, &gemm::MODULE_KERNELS),
    (Module::GdnChunk, &["gdn_chunk_prep", "gdn_chunk_scan"]),
    (Module::FlashAttn, &["flash_attn_prefill"]),
    (Module::MoePrefill, &["moe_sort", "moe_route_sort", "swiglu_quant_ct", "moe_combine_prefill"]),
    (Module::Nvfp4, &["nvfp4_dequant"]),
];

/// Warps per block of the decode products (`TC_WARPS` in gemv.cu).
pub(crate) const GEMV_WARPS: usize = 8;
/// Threads per block of the decode products.
pub(crate) const GEMV_BLOCK: u32 = (GEMV_WARPS * 32) as u32;

/// Warps the K split of a dense decode product aims at (`TC_TARGET_WARPS` in gemv.cu).
pub(crate) const GEMV_TARGET_WARPS: usize = 2048;
/// The same for one expert (or slot) of the MoE decode products (`MOE_TARGET_WARPS`).
pub(crate) const MOE_TARGET_WARPS: usize = 256;

/// K slices per 16-row group of the tensor-core decode products (`gemv_tc_ksplit` in gemv.cu):
/// the most (at most 8) that keep `target` warps short of, each slice at least 256 bytes and a
/// whole number of 64-byte steps. A function of the weight's shape only, so a row's summation
/// order never depends on the token count.
pub(crate) fn gemv_tc_ksplit(row_bytes: usize, out: usize, target: usize) -> usize {
    let groups = out.div_ceil(16);
    let mut ks = 1;
    while ks < GEMV_WARPS
        && groups * ks < target
        && row_bytes.is_multiple_of(ks * 2 * 64)
        && row_bytes / (ks * 2) >= 256
    {
        ks *= 2;
    }
    ks
}

/// The decode-product kernel for `tokens` rows: the wide build (`gemv_*_wide`: up to 64 tokens per
/// pass over the weights, 2 blocks per SM) for more than 8 tokens, else the narrow one (8 per pass,
/// 4 blocks per SM). The two give the same bits (gemv.cu).
pub(crate) fn gemv_tc_kernel(fp8: bool, tokens: usize) -> &'static str {
    match (fp8, gemv_tc_wide(tokens)) {
        (false, false) => "gemv_bf16",
        (false, true) => "gemv_bf16_wide",
        (true, false) => "gemv_fp8",
        (true, true) => "gemv_fp8_wide",
    }
}

/// The kernel and grid of a dense decode product of `tokens` rows over `out` rows of `row_bytes`
/// bytes whose K split is chosen for `split` rows (not the staged build, which [`gemv_staged`]
/// decides first): [`gemv_tc_kernel`] over [`gemv_tc_blocks`] row tiles, and for the wide build
/// the group's tokens split into the most token groups (grid.y, a power of two, at least 8 tokens
/// each) that keep the grid within `wave` blocks (one wave of the wide build on the device). The
/// products with few row tiles — out_proj and o_proj (128), the router (17), attention's k and v
/// parts (16) — otherwise left most SMs idle at 32–64 tokens (one block of 8 warps on 128 of the
/// H200's 132 SMs for out_proj); the GDN input projection and attention's q fill the wave alone.
/// A column's arithmetic does not depend on its group (gemv.cu), so the bits do not change.
pub(crate) fn gemv_tc_launch(
    fp8: bool,
    row_bytes: usize,
    out: usize,
    split: usize,
    tokens: usize,
    wave: u32,
) -> (&'static str, (u32, u32, u32)) {
    (gemv_tc_kernel(fp8, tokens), gemv_tc_grid(row_bytes, out, split, tokens, wave))
}

/// The grid of [`gemv_tc_launch`], for every format's dense decode product (`gemv_nvfp4*` as well,
/// with its own `wave`): [`gemv_tc_blocks`] row tiles by [`token_groups`] token groups.
pub(crate) fn gemv_tc_grid(row_bytes: usize, out: usize, split: usize, tokens: usize, wave: u32) -> (u32, u32, u32) {
    let blocks = gemv_tc_blocks(row_bytes, out, split);
    (blocks, token_groups(blocks, tokens, wave), 1)
}

/// grid.y of a decode product over `blocks` row tiles (see [`gemv_tc_launch`]): 1 up to 8
/// tokens (the narrow builds), else the most power-of-two groups of at least 8 tokens within
/// `wave` blocks, counted as the kernels split them (whole N tiles per group, none empty).
fn token_groups(blocks: u32, tokens: usize, wave: u32) -> u32 {
    let mut groups = 1u32;
    if gemv_tc_wide(tokens) {
        let tiles = tokens.div_ceil(8) as u32;
        while groups * 2 <= tiles && blocks * groups * 2 <= wave {
            groups *= 2;
        }
    }
    let per = tokens.div_ceil(groups as usize).div_ceil(8) * 8;
    tokens.div_ceil(per) as u32
}

/// Whether a decode product of `tokens` rows takes the wide build (every format: `gemv_*_wide`).
pub(crate) fn gemv_tc_wide(tokens: usize) -> bool {
    tokens > 8
}

/// Whether a dense decode product of `tokens` rows takes the staged build (`gemv_*_staged`,
/// gemv.cu: the same bits as the narrow and wide builds, activations staged in shared memory per
/// block): above 8 tokens for an unsplit row (`ks` 1: the lm_head). Split rows keep the wide
/// build: in the decode graph at 64 sequences (L2 warm) the staged split products were slower
/// (H200, s10a: the dense BF16 products 3.83 -> 4.50 ms per step) although faster with L2 flushed
/// (tests/peer/gemv_wide run 3), and above 64 rows 2.5x (BF16) to 4.5x (FP8) slower (H100, s66b:
/// 128 and 255 sequences).
pub(crate) fn gemv_staged(row_bytes: usize, split: usize, tokens: usize) -> bool {
    #[cfg(test)]
    if tokens > 8 && STAGED_ALWAYS.with(|f| f.get()) {
        return true;
    }
    tokens > 8 && gemv_tc_ksplit(row_bytes, split, GEMV_TARGET_WARPS) == 1
}

#[cfg(test)]
thread_local! {
    /// Kernel tests only: every dense product of more than 8 tokens through the staged build, so
    /// its split-K path (partials, counters) is checked against the other builds' bits although
    /// [`gemv_staged`] gives it no split product today.
    pub(crate) static STAGED_ALWAYS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Tokens per launch of the staged products (`ORNITH_WIDE_TOKENS`; a larger group takes several
/// launches, each its own rows of x and y).
pub(crate) const WIDE_TOKENS: usize = ORNITH_WIDE_TOKENS as usize;
/// `ks * out` bound of a split staged product (`ORNITH_WIDE_SPLIT_ROWS`: the partials' rows).
pub(crate) const WIDE_SPLIT_ROWS: usize = ORNITH_WIDE_SPLIT_ROWS as usize;
/// Row tiles of a split staged product with a counter (`ORNITH_WIDE_TICKETS`).
pub(crate) const WIDE_TICKETS: u32 = ORNITH_WIDE_TICKETS;
/// Dynamic shared memory of the staged products (`ORNITH_WIDE_SMEM`: two activation chunks).
pub(crate) const WIDE_SMEM: u32 = ORNITH_WIDE_SMEM;
/// Grid of a staged product (any number of tokens up to [`WIDE_TOKENS`] per launch): blocks
/// `(ceil(groups / 8), ks)`, one warp per row group over all the launch's tokens. Builds with 2
/// or 4 warps per row group (a share of the token tiles each) were faster for small products
/// (H200, 64 tokens: the GDN input projection and q|k|v at 2, out_proj, o_proj and the router at
/// 4), which never take this build; the lm_head, the one that does, was fastest at 1.
pub(crate) fn gemv_wide_grid(row_bytes: usize, out: usize, split: usize) -> (u32, u32, u32) {
    let ks = gemv_tc_ksplit(row_bytes, split, GEMV_TARGET_WARPS);
    (out.div_ceil(16).div_ceil(GEMV_WARPS) as u32, ks as u32, 1)
}

/// Blocks of a dense decode product over `out` rows of `row_bytes` whose K split is chosen for
/// `split` rows (the stored matrix's, of which the launch covers `out`): `GEMV_WARPS / ks` row
/// groups of 16 per block.
pub(crate) fn gemv_tc_blocks(row_bytes: usize, out: usize, split: usize) -> u32 {
    out.div_ceil(16).div_ceil(GEMV_WARPS / gemv_tc_ksplit(row_bytes, split, GEMV_TARGET_WARPS)) as u32
}

/// Blocks per expert (or slot) of the MoE decode products over one expert's `[out, in]` (FP8).
pub(crate) fn moe_tc_blocks(in_: usize, out: usize) -> u32 {
    tc_blocks(in_, out, MOE_TARGET_WARPS)
}

/// `GEMV_WARPS / ks` row groups of 16 per block, `ks` the K split aiming at `target` warps.
fn tc_blocks(row_bytes: usize, out: usize, target: usize) -> u32 {
    out.div_ceil(16).div_ceil(GEMV_WARPS / gemv_tc_ksplit(row_bytes, out, target)) as u32
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
    /// Each kernel's static shared memory in bytes, read from the driver at load (the launch's
    /// opt-in rule, [`needs_smem_opt_in`], adds it to the dynamic part).
    static_smem: HashMap<&'static str, u32>,
    /// Which launches use programmatic dependent launch ([`Pdl`] as its code; see [`CudaContext::set_pdl`]).
    pdl: AtomicU8,
    /// Blocks of the decode attention's split kernel ([`attention::ATT_BLOCKS_PER_SM`] per SM, or
    /// as many as its shared memory lets reside).
    pub(crate) attn_blocks: u32,
    /// One wave of the wide decode products (`gemv_bf16_wide`, `gemv_fp8_wide`: SMs x the blocks
    /// of either one SM holds), the most blocks [`gemv_tc_launch`] gives a split group.
    pub(crate) wide_wave: u32,
    /// The same for `gemv_nvfp4_wide` (more blocks per SM).
    pub(crate) nvfp4_wide_wave: u32,
    /// Blocks of each persistent prefill GEMM (gemm.cu): SMs x the blocks of that kernel one SM
    /// holds at its shared memory (see [`gemm::gemm_smem`]).
    pub(crate) gemm_blocks: HashMap<&'static str, u32>,
    /// The staged decode products' K-slice partials and row-tile counters (`wide_part`,
    /// `wide_ticket` of `OrnithGemvBf16Params`; gemv.cu): one launch's at a time, the counters
    /// zero between launches. Allocated here, before the memory plan reads free memory.
    pub(crate) wide_part: CudaSlice<f32>,
    pub(crate) wide_ticket: CudaSlice<u32>,
    /// Whether [`Self::profile`] holds a recording (see [`Self::profile_begin`]).
    observing: AtomicBool,
    /// The launches recorded since [`Self::profile_begin`], each bracketed by two events.
    profile: Mutex<Vec<profile::Launch>>,
}

/// A kernel's by-value parameter struct: a bindgen `#[repr(C)]` struct of the shared header
/// (`kernels/include/ornith_kernels.h`), plain data (integers, floats, raw device pointers) with
/// the header's layout, which bindgen's size/offset assertions pin.
///
/// # Safety
/// Implement only for such structs: the launch copies the value's bytes as the kernel argument.
pub(crate) unsafe trait KernelParams: Copy {}
macro_rules! kernel_params {
    ($($t:ident),* $(,)?) => { $(
        // SAFETY: a bindgen struct of the shared header (see `KernelParams`).
        unsafe impl KernelParams for ornith_kernels::bindings::$t {}
    )* };
}
kernel_params!(
    OrnithEmbedParams,
    OrnithRmsNormParams,
    OrnithQuantParams,
    OrnithGemvBf16Params,
    OrnithGemvFp8Params,
    OrnithGemvNvfp4Params,
    OrnithMoeGemvNvfp4Params,
    OrnithSwigluParams,
    OrnithRouterParams,
    OrnithMoeGemvParams,
    OrnithSwigluQuantParams,
    OrnithMoeCombineParams,
    OrnithConvParams,
    OrnithGdnParams,
    OrnithGatedNormParams,
    OrnithGdnOutParams,
    OrnithQkRopeParams,
    OrnithAttnParams,
    OrnithArgmaxParams,
    OrnithPenaltyParams,
    OrnithSampleParams,
    OrnithGemmParams,
    OrnithMoeSortParams,
    OrnithMoeRouteParams,
    OrnithMoeCombinePrefillParams,
    OrnithFlashAttnParams
);

/// Where [`SlowNote`] says its lines (stderr in the binaries).
type Note = Arc<dyn Fn(&str) + Send + Sync>;

/// A note for work that may take long: `first` once the work has outlasted `after`, and then,
/// when [`Self::done`] is called, the line `ready` makes of its seconds; nothing when the work was
/// quicker than `after`, or failed (dropped without `done`: the error says what happened).
struct SlowNote {
    tx: Option<std::sync::mpsc::Sender<()>>,
    watch: Option<std::thread::JoinHandle<bool>>,
    t0: std::time::Instant,
    note: Note,
}

impl SlowNote {
    fn start(after: std::time::Duration, first: String, note: Note) -> Self {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let n = note.clone();
        let watch = std::thread::spawn(move || {
            // Only a timeout: a failed load drops the sender (Disconnected) and stays silent.
            let late = matches!(rx.recv_timeout(after), Err(std::sync::mpsc::RecvTimeoutError::Timeout));
            if late {
                n(&first);
            }
            late
        });
        Self { tx: Some(tx), watch: Some(watch), t0: std::time::Instant::now(), note }
    }

    fn done(mut self, ready: impl FnOnce(f64) -> String) {
        let secs = self.t0.elapsed().as_secs_f64();
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(());
        }
        let late = self.watch.take().is_some_and(|w| w.join().unwrap_or(false));
        if late {
            (self.note)(&ready(secs));
        }
    }
}

impl Drop for SlowNote {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(w) = self.watch.take() {
            let _ = w.join();
        }
    }
}

/// Environment variable naming a directory of cubins assembled by `cargo xtask cubin` from this
/// binary's PTX (test machines: a first start otherwise JIT-compiles every module). A module whose
/// cubin is absent, unreadable or refused by the driver is compiled from its PTX as usual.
pub const CUBIN_DIR_ENV: &str = "ORNITH_CUBIN_DIR";

/// Whether a launch with `dynamic` bytes of dynamic shared memory must first opt the kernel into
/// them (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`): the driver refuses, with
/// `CUDA_ERROR_INVALID_VALUE`, a launch whose static plus dynamic shared memory exceeds 48 KiB
/// otherwise (the dynamic part alone is not the rule: `moe_sort`'s 48 KiB window beside its static
/// counters was refused on an H100).
fn needs_smem_opt_in(static_bytes: u32, dynamic: u32) -> bool {
    static_bytes + dynamic > 48 * 1024
}

/// The cubin of module `m` for `arch` in `dir` (named by [`ornith_kernels::cubin_name`], so only a
/// cubin assembled from exactly the PTX this binary embeds), if the file exists.
fn cubin_path(dir: &std::path::Path, arch: Arch, m: Module) -> Option<std::path::PathBuf> {
    Some(dir.join(ornith_kernels::cubin_name(arch, m))).filter(|p| p.is_file())
}

/// The module in the cubin at `p`, or `None` after saying why not (the caller compiles the PTX).
fn load_cubin(ctx: &Arc<DriverContext>, p: &std::path::Path, note: &Note) -> Option<Arc<CudaModule>> {
    let loaded = std::fs::read(p)
        .map_err(anyhow::Error::from)
        .and_then(|bytes| Ok(ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bytes))?));
    loaded.map_err(|e| note(&format!("cannot load {} ({e:#}); compiling its PTX instead", p.display()))).ok()
}

/// A kernel parameter struct passed by value.
#[repr(transparent)]
pub(crate) struct Param<T>(pub T);
// SAFETY: `T: KernelParams` is plain `#[repr(C)]` data that the kernel reads as its argument.
unsafe impl<T: KernelParams> DeviceRepr for Param<T> {}

impl CudaContext {
    /// Opens GPU `ordinal` and loads every PTX module for its arch, silently.
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_notes(ordinal, |_| {})
    }

    /// [`Self::new`], telling `note` when loading the modules takes long: the driver compiles the
    /// PTX for the GPU at the first start after an install or a driver update (about 25 s on the
    /// H200's host, nearly all of it `gemv`; docs/PERF-2026-12-early.md, twelfth session) and
    /// serves later starts from its compute cache (`~/.nv/ComputeCache`) in well under a second.
    pub fn with_notes(ordinal: usize, note: impl Fn(&str) + Send + Sync + 'static) -> Result<Self> {
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
        let note: Note = Arc::new(note);
        let compiling = SlowNote::start(
            std::time::Duration::from_secs(3),
            format!(
                "compiling the CUDA kernels ({} PTX) for '{name}': the driver does this once after an install or a \
                 driver update (under a minute) and caches the result",
                arch.name()
            ),
            note.clone(),
        );
        let cubins = std::env::var_os(CUBIN_DIR_ENV).map(std::path::PathBuf::from);
        let mut from_cubin = 0;
        let mut modules = Vec::new();
        let mut funcs = HashMap::new();
        let mut static_smem = HashMap::new();
        for (m, names) in KERNELS {
            let cubin = cubins.as_deref().and_then(|d| cubin_path(d, arch, m));
            let module = match cubin.and_then(|p| load_cubin(&ctx, &p, &note)) {
                Some(module) => {
                    from_cubin += 1;
                    module
                }
                None => ctx
                    .load_module(cudarc::nvrtc::Ptx::from_src(ornith_kernels::ptx(arch, m)))
                    .with_context(|| format!("loading {} PTX module {} on '{name}'", arch.name(), m.stem()))?,
            };
            for n in names.iter().copied() {
                let f = module.load_function(n).with_context(|| format!("kernel {n} missing from {}", m.stem()))?;
                static_smem.insert(n, f.shared_size_bytes()?.max(0) as u32);
                funcs.insert(n, f);
            }
            modules.push(module);
        }
        compiling.done(|s| format!("CUDA kernels ready after {s:.0} s"));
        if let Some(d) = &cubins {
            note(&format!(
                "{from_cubin} of {} kernel modules loaded from cubins in {} ({CUBIN_DIR_ENV}), the rest JIT-compiled \
                 from their PTX",
                KERNELS.len(),
                d.display()
            ));
        }
        let sms = ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let sms = sms.max(1) as u32;
        // Blocks of kernel `n` (`threads` each, `smem` bytes of dynamic shared memory, opted into
        // here) one SM holds at once; an error if not even one fits.
        let per_sm = |n: &'static str, threads: u32, smem: u32| -> Result<u32> {
            let f = &funcs[n];
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
            let b = f.occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)?;
            anyhow::ensure!(b > 0, "'{name}' cannot hold one {n} block ({smem} bytes of shared memory)");
            Ok(b)
        };
        let attn_blocks =
            sms * per_sm("attn_decode_split", 64, attention::ATT_SPLIT_SMEM)?.min(attention::ATT_BLOCKS_PER_SM);
        let wide_wave = sms * per_sm("gemv_bf16_wide", GEMV_BLOCK, 0)?.min(per_sm("gemv_fp8_wide", GEMV_BLOCK, 0)?);
        let nvfp4_wide_wave = sms * per_sm("gemv_nvfp4_wide", GEMV_BLOCK, 0)?;
        let mut gemm_blocks = HashMap::new();
        for &n in gemm::GEMM_KERNELS {
            gemm_blocks.insert(n, sms * per_sm(n, gemm::gemm_threads(n), gemm::gemm_smem(n))?);
        }
        let wide_part = unsafe { stream.alloc::<f32>(WIDE_SPLIT_ROWS * WIDE_TOKENS) }?;
        let wide_ticket = stream.alloc_zeros::<u32>(WIDE_TICKETS as usize)?;
        Ok(Self {
            wide_part,
            wide_ticket,
            ctx,
            stream,
            arch,
            name,
            _modules: modules,
            funcs,
            static_smem,
            pdl: AtomicU8::new(DEFAULT_PDL.code()),
            attn_blocks,
            wide_wave,
            nvfp4_wide_wave,
            gemm_blocks,
            observing: AtomicBool::new(false),
            profile: Mutex::new(Vec::new()),
        })
    }

    /// Which launches use programmatic dependent launch ([`Pdl`]; [`DEFAULT_PDL`] unless set).
    /// Every mode gives the same bits (tests compare them); `ornith-bench` times each. A
    /// captured decode graph keeps the mode it was captured with (it is part of its key).
    pub fn set_pdl(&self, mode: Pdl) {
        self.pdl.store(mode.code(), Relaxed);
    }
    pub fn pdl(&self) -> Pdl {
        Pdl::from_code(self.pdl.load(Relaxed))
    }

    /// Starts recording every launch with a pair of CUDA events around it (`ornith-bench`'s
    /// per-kernel table), until [`Self::profile_end`]. Events cannot bracket launches inside a
    /// captured graph, so the CUDA backend runs its decode steps eagerly while this is on.
    pub fn profile_begin(&self) {
        self.profile.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.observing.store(true, Relaxed);
    }

    /// Whether launches are being recorded ([`Self::profile_begin`]).
    pub fn profiling(&self) -> bool {
        self.observing.load(Relaxed)
    }

    /// Stops recording; waits for the stream and returns the recorded launches' event times.
    pub fn profile_end(&self) -> Result<Vec<profile::KernelTime>> {
        self.observing.store(false, Relaxed);
        let l = std::mem::take(&mut *self.profile.lock().unwrap_or_else(|e| e.into_inner()));
        self.synchronize()?;
        profile::collect(l)
    }

    /// Launches `l` with its parameter struct `p`: the one launch function every launcher ends
    /// in. The observer check costs one relaxed atomic load per launch while no profile is
    /// recorded; while one is ([`Self::profile_begin`]), each launch also creates and records
    /// two events (a few µs of host work, and the GPU idles between the brackets, so small
    /// kernels read slower than inside a graph: `ornith-bench`'s in-graph ablation measures that).
    pub(crate) fn launch<P: KernelParams>(&self, l: Launch, p: P) -> Result<()> {
        if !self.observing.load(Relaxed) {
            return self.launch_with(l, p);
        }
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let (start, end) = (self.ctx.new_event(Some(CU_EVENT_DEFAULT))?, self.ctx.new_event(Some(CU_EVENT_DEFAULT))?);
        start.record(&self.stream)?;
        self.launch_with(l, p)?;
        end.record(&self.stream)?;
        let rec = profile::Launch { name: l.name, bytes: l.bytes, start, end };
        self.profile.lock().unwrap_or_else(|e| e.into_inner()).push(rec);
        Ok(())
    }

    /// Launches kernel `l.name` with one by-value parameter struct `p` on the stream, with the
    /// programmatic-serialization attribute when [`Self::pdl`]'s mode applies to it (dynamic shared
    /// memory that with the kernel's static shared memory exceeds 48 KiB is opted into first).
    /// `cuLaunchKernelEx` directly: cudarc's builder has no attributes.
    fn launch_with<P: KernelParams>(&self, l: Launch, p: P) -> Result<()> {
        use cudarc::driver::sys;
        let pdl = self.pdl().applies(&l);
        let Launch { name, grid, block, smem, .. } = l;
        let f = self.func(name);
        if smem > 0 && needs_smem_opt_in(self.static_smem[name], smem) {
            f.set_attribute(
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let mut param = Param(p);
        let mut args = [&mut param as *mut Param<P> as *mut std::ffi::c_void];
        // SAFETY: a zeroed attribute is a valid plain-data value (id 0 = ignored, value union of
        // plain integers); only the serialization flag is set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(pdl),
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: `args` points at one parameter, the kernel's single by-value `const Params`
        // argument (`P` is the bindgen `#[repr(C)]` struct of the shared header); the config and
        // the attribute outlive the call, which copies them.
        unsafe { sys::cuLaunchKernelEx(&cfg, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .with_context(|| format!("launching kernel {name} (grid {grid:?}, block {block}, {smem} B shared)"))?;
        Ok(())
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
        self.funcs.get(name).unwrap_or_else(|| panic!("kernel {name} is not in cuda::KERNELS"))
    }
    /// The loaded kernel whose driver handle is `f`, if any (to name a captured graph's nodes).
    pub(crate) fn kernel_of(&self, f: cudarc::driver::sys::CUfunction) -> Option<&'static str> {
        self.funcs.iter().find(|(_, g)| g.cu_function() == f).map(|(n, _)| *n)
    }
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
    /// Runs `f` as the profiled range of an external profiler started with profiling off
    /// (`ncu --profile-from-start off`, tests/gpu/profile.sh): `cuProfilerStart` before, and after
    /// a synchronisation `cuProfilerStop`. Without a profiler both calls do nothing.
    pub fn profiler_range<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.synchronize()?;
        unsafe { cudarc::driver::sys::cuProfilerStart() }.result().context("cuProfilerStart")?;
        let out = f();
        let synced = self.synchronize();
        unsafe { cudarc::driver::sys::cuProfilerStop() }.result().context("cuProfilerStop")?;
        let out = out?;
        synced?;
        Ok(out)
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
    pub(crate) fn addr<T>(&self, s: &CudaSlice<T>) -> Ptr {
        s.device_ptr(&self.stream).0
    }
}

#[cfg(test)]
mod kernel_table_tests {
    use super::*;
    use std::collections::BTreeSet;
    /// `KERNELS` names exactly the entry points of each module's PTX, for both architectures (a
    /// kernel missing from the table cannot be loaded, one listed but absent fails at start-up).
    #[test]
    fn kernel_table_lists_every_entry_point() {
        for (m, names) in KERNELS {
            let listed: BTreeSet<&str> = names.iter().copied().collect();
            assert_eq!(listed.len(), names.len(), "{m:?}: a kernel listed twice");
            for a in ornith_kernels::Arch::ALL {
                let ptx = ornith_kernels::ptx(a, m);
                let entries: BTreeSet<&str> = ptx
                    .split(".entry ")
                    .skip(1)
                    .map(|b| &b[..b.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(b.len())])
                    .collect();
                assert_eq!(entries, listed, "{a:?} {m:?}: PTX entry points (left) against cuda::KERNELS (right)");
            }
        }
    }
}

#[cfg(test)]
mod pdl_tests {
    use super::*;
    /// Which launches carry the attribute in each mode, and the names `ornith-bench --pdl` takes.
    #[test]
    fn pdl_modes() {
        let plain = Launch::new("rmsnorm_residual", (1, 1, 1), 256, 0);
        let product = Launch::new("gemv_bf16", (386, 1, 1), 256, 0).weights_first();
        assert!(!Pdl::Off.applies(&plain) && !Pdl::Off.applies(&product));
        assert!(!Pdl::Weights.applies(&plain) && Pdl::Weights.applies(&product));
        assert!(Pdl::All.applies(&plain) && Pdl::All.applies(&product));
        for m in Pdl::ALL {
            assert_eq!(m.name().parse::<Pdl>().unwrap(), m);
            assert_eq!(Pdl::from_code(m.code()), m);
        }
        assert!("on".parse::<Pdl>().unwrap_err().to_string().contains("off, weights or all"));
        assert_eq!(DEFAULT_PDL, Pdl::Weights);
    }
}

#[cfg(test)]
mod slow_note_tests {
    use super::*;
    use std::time::Duration;

    fn notes() -> (Arc<Mutex<Vec<String>>>, Note) {
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = got.clone();
        (got, Arc::new(move |m: &str| g.lock().unwrap().push(m.to_string())))
    }

    /// The module-compilation note: said once the work outlasts its delay and followed by the
    /// ready line; nothing for quick work, nor for work that fails (dropped without `done`),
    /// however long it took.
    #[test]
    fn slow_note_speaks_only_for_slow_work_that_finishes() {
        let (got, note) = notes();
        let n = SlowNote::start(Duration::from_millis(20), "compiling".into(), note);
        std::thread::sleep(Duration::from_millis(120));
        n.done(|s| format!("ready after {}", s >= 0.1));
        assert_eq!(*got.lock().unwrap(), ["compiling", "ready after true"]);

        let (got, note) = notes();
        SlowNote::start(Duration::from_secs(30), "compiling".into(), note).done(|_| "ready".into());
        assert!(got.lock().unwrap().is_empty(), "quick work: {:?}", got.lock().unwrap());

        let (got, note) = notes();
        drop(SlowNote::start(Duration::from_millis(20), "compiling".into(), note));
        std::thread::sleep(Duration::from_millis(60));
        assert!(got.lock().unwrap().is_empty(), "a failed load: {:?}", got.lock().unwrap());
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

#[cfg(test)]
mod gemv_tc_tests {
    use super::*;
    /// Which dense decode products take the staged build, its grids at the real shapes, and the
    /// workspace bound every split product of those shapes keeps.
    #[test]
    fn gemv_staged_grids_of_the_decode_shapes() {
        // (bytes per row, rows, tokens, staged, grid)
        for (row_bytes, out, t, staged, grid) in [
            (4096, 248_320, 9, true, (1940, 1, 1)),  // lm_head from 9 tokens
            (4096, 248_320, 64, true, (1940, 1, 1)), // lm_head
            (4096, 12_352, 64, false, (0, 0, 0)),    // GDN in: split rows keep the wide build
            (8192, 2048, 64, false, (0, 0, 0)),      // GDN out_proj
            (2048, 9216, 64, false, (0, 0, 0)),      // attention q|k|v, FP8
        ] {
            assert_eq!(gemv_staged(row_bytes, out, t), staged, "{row_bytes} x {out}, {t} tokens");
            if staged {
                assert_eq!(gemv_wide_grid(row_bytes, out, out), grid, "{row_bytes} x {out}, {t} tokens");
            }
        }
        // The grid rule for split rows (the kernel serves them: the kernel tests call it so).
        for (row_bytes, out, grid) in
            [(4096, 12_352, (97, 4, 1)), (8192, 2048, (16, 8, 1)), (4096, 257, (3, 8, 1)), (2048, 9216, (72, 4, 1))]
        {
            let g = gemv_wide_grid(row_bytes, out, out);
            assert_eq!(g, grid, "{row_bytes} x {out}");
            assert!(g.1 as usize * out <= WIDE_SPLIT_ROWS && g.0 <= WIDE_TICKETS);
        }
        assert!(!gemv_staged(4096, 248_320, 8), "up to 8 tokens the narrow build");
    }

    /// The K split of the real decode shapes (bytes per row, rows) and their grids: it fixes each
    /// row's summation order, so a change here changes every decode product's bits.
    #[test]
    fn gemv_tc_split_of_the_decode_shapes() {
        for (row_bytes, out, ks, blocks) in [
            (4096, 248_320, 1, 1940), // lm_head, BF16
            (4096, 12_352, 4, 386),   // GDN fused input projection, BF16
            (8192, 2048, 8, 128),     // GDN out_proj, BF16
            (4096, 257, 8, 17),       // router + shared-expert gate, BF16
            (2048, 9216, 4, 288),     // attention q|k|v, FP8
            (4096, 2048, 8, 128),     // o_proj, FP8
            (32, 64, 1, 1),           // tiny preset: half a 64-byte step
        ] {
            assert_eq!(gemv_tc_ksplit(row_bytes, out, GEMV_TARGET_WARPS), ks, "{row_bytes} x {out}");
            assert_eq!(gemv_tc_blocks(row_bytes, out, out), blocks, "{row_bytes} x {out}");
        }
        // A part of a stored matrix takes the whole matrix's split: attention's k part (512 of
        // the fused 9,216 rows) splits K 4 ways as the whole does, not the 8 of a 512-row matrix.
        assert_eq!(gemv_tc_ksplit(2048, 512, GEMV_TARGET_WARPS), 8);
        assert_eq!(gemv_tc_blocks(2048, 512, 512), 32);
        assert_eq!(gemv_tc_blocks(2048, 512, 9216), 16);
        assert_eq!(gemv_tc_blocks(2048, 8192, 9216), 256);
        // Token groups of the wide build within one wave (the H200's: 132 SMs x 2 blocks).
        let wave = 264;
        assert_eq!(gemv_tc_launch(false, 4096, 12_352, 12_352, 64, wave), ("gemv_bf16_wide", (386, 1, 1)));
        assert_eq!(gemv_tc_launch(false, 8192, 2048, 2048, 64, wave), ("gemv_bf16_wide", (128, 2, 1)));
        assert_eq!(gemv_tc_launch(false, 8192, 2048, 2048, 8, wave), ("gemv_bf16", (128, 1, 1)));
        assert_eq!(gemv_tc_launch(false, 4096, 257, 257, 64, wave), ("gemv_bf16_wide", (17, 8, 1)));
        assert_eq!(gemv_tc_launch(false, 4096, 257, 257, 20, wave), ("gemv_bf16_wide", (17, 2, 1)));
        assert_eq!(gemv_tc_launch(false, 4096, 257, 257, 17, wave), ("gemv_bf16_wide", (17, 2, 1)));
        assert_eq!(gemv_tc_launch(true, 2048, 512, 9216, 33, wave), ("gemv_fp8_wide", (16, 3, 1)));
        assert_eq!(gemv_tc_launch(true, 2048, 8192, 9216, 64, wave), ("gemv_fp8_wide", (256, 1, 1)));
        // NVFP4A16 o_proj (K split by weights: 4096 per row), 2 blocks of gemv_nvfp4_wide per SM.
        assert_eq!(gemv_tc_grid(4096, 2048, 2048, 64, 264).1, 2);
        // One expert's [out, in] of the MoE products (FP8).
        for (in_, out, ks, blocks) in [
            (2048, 1024, 4, 32), // (shared) expert gate|up
            (512, 2048, 2, 32),  // (shared) expert down
            (32, 64, 1, 1),      // tiny preset
        ] {
            assert_eq!(gemv_tc_ksplit(in_, out, MOE_TARGET_WARPS), ks, "{in_} x {out}");
            assert_eq!(moe_tc_blocks(in_, out), blocks, "{in_} x {out}");
        }
    }
}

#[cfg(test)]
mod cubin_tests {
    use super::*;

    /// The opt-in rule counts static and dynamic shared memory together: 48 KiB in all needs
    /// none, one byte more does, whichever part it is in.
    #[test]
    fn smem_opt_in_counts_static_and_dynamic() {
        assert!(!needs_smem_opt_in(0, 48 * 1024));
        assert!(needs_smem_opt_in(0, 48 * 1024 + 1));
        assert!(!needs_smem_opt_in(4096, 44 * 1024));
        assert!(needs_smem_opt_in(4097, 44 * 1024));
        assert!(needs_smem_opt_in(8336, 48 * 1024), "moe_sort: a 48 KiB window beside its 8,336 static bytes");
    }

    /// `ORNITH_CUBIN_DIR` finds a module's cubin only under the name of this binary's own PTX:
    /// present for the module written, absent for another module, another arch, or a cubin of
    /// other PTX (a stale file of the same module).
    #[test]
    fn cubin_path_finds_only_this_ptx() {
        let dir = std::env::temp_dir().join(format!("ornith-cubin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(ornith_kernels::cubin_name(Arch::Sm90, Module::Gemm)), b"x").unwrap();
        std::fs::write(dir.join("sm_90-norm-0000000000000000.cubin"), b"x").unwrap();
        assert_eq!(
            cubin_path(&dir, Arch::Sm90, Module::Gemm),
            Some(dir.join(ornith_kernels::cubin_name(Arch::Sm90, Module::Gemm)))
        );
        assert_eq!(cubin_path(&dir, Arch::Sm121, Module::Gemm), None);
        assert_eq!(cubin_path(&dir, Arch::Sm90, Module::Gemv), None);
        assert_eq!(cubin_path(&dir, Arch::Sm90, Module::Norm), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
