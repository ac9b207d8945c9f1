//! Launchers of gemm.cu: the prefill tensor-core GEMMs (FP8 W8A8 and BF16, plain or grouped by
//! MoE expert) and compressed-tensors activation quantisation.
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

/// GEMM tile (rows x outputs) of the plain GEMMs, and outputs per tile of every GEMM
/// (`ORNITH_GEMM_N`).
pub const GEMM_TILE: usize = ORNITH_GEMM_N as usize;

/// Threads per block of GEMM kernel `name` (gemm.cu): 128 for `gemm_bf16`, `gemm_fp8_grouped`
/// and `_96`, `gemm_nvfp4_grouped_96` and `_128`, four warps of 64 x 64 or 48 x 64 (`GBB_THREADS`,
/// `GBF_THREADS`) or 64 / 96 x 32 (`GBG_THREADS`); `GB_THREADS` = 256 for the others, eight warps
/// of BM/2 x 32.
pub(crate) fn gemm_threads(name: &str) -> u32 {
    match name {
        "gemm_bf16"
        | "gemm_fp8_grouped"
        | "gemm_fp8_grouped_96"
        | "gemm_nvfp4_grouped_96"
        | "gemm_nvfp4_grouped_128" => 128,
        _ => 256,
    }
}

/// The entry points of gemm.cu's module: the persistent GEMMs first, then the quantiser.
pub(crate) const MODULE_KERNELS: [&str; 9] = [
    "gemm_fp8",
    "gemm_bf16",
    "gemm_fp8_grouped",
    "gemm_fp8_grouped_96",
    "gemm_nvfp4",
    "gemm_nvfp4_grouped",
    "gemm_nvfp4_grouped_96",
    "gemm_nvfp4_grouped_128",
    "quantize_fp8_ct",
];

/// The persistent GEMM kernels of gemm.cu (their grid: [`CudaContext::gemm_grid`]).
pub(crate) const GEMM_KERNELS: &[&str] = MODULE_KERNELS.split_at(8).0;

/// Rows per tile of GEMM kernel `name` (gemm.cu): 64 for the 64-row grouped GEMMs
/// (`ORNITH_GROUPED_ROWS`), 96 for `gemm_fp8_grouped_96` and `gemm_nvfp4_grouped_96`, 128 for
/// `gemm_nvfp4_grouped_128` and the plain ones (`gemm_bf16`'s `GB_BF16_M` included).
pub(crate) fn gemm_rows(name: &str) -> usize {
    match name {
        "gemm_fp8_grouped_96" | "gemm_nvfp4_grouped_96" => GEMM_GROUPED_MID_ROWS,
        "gemm_nvfp4_grouped_128" => GEMM_GROUPED_WIDE_ROWS,
        n if n.ends_with("_grouped") => GEMM_GROUPED_ROWS,
        _ => GEMM_TILE,
    }
}

/// Dynamic shared memory of GEMM kernel `name` (ornith_kernels.h's GEMM geometry): the stages of
/// (rows + 128) x 128 bytes; `gemm_nvfp4_grouped_96` / `_128` (`GBF_SMEM(BM)`) the stages of rows
/// x 128 bytes of A, 2 dequantised weight tiles of 128 x 128 bytes and the raw weight stages of
/// 128 x (32 + 12) bytes (codes, scale words, table words).
pub(crate) fn gemm_smem(name: &str) -> u32 {
    let (rows, k, stages) = (gemm_rows(name), ORNITH_GEMM_K as usize, ORNITH_GEMM_STAGES as usize);
    let bytes = if matches!(name, "gemm_nvfp4_grouped_96" | "gemm_nvfp4_grouped_128") {
        stages * rows * k + 2 * GEMM_TILE * k + stages * GEMM_TILE * ORNITH_GEMM_FP4_RAW_ROW as usize
    } else {
        stages * (rows + GEMM_TILE) * k
    };
    bytes as u32
}

/// Rows per tile of the 64-row grouped MoE GEMMs (`gemm_fp8_grouped`, `gemm_nvfp4_grouped`):
/// `moe_sort`'s first tile-offset prefix.
pub const GEMM_GROUPED_ROWS: usize = ORNITH_GROUPED_ROWS as usize;
/// Rows per tile of `gemm_fp8_grouped_96` and `gemm_nvfp4_grouped_96` (`moe_sort`'s second prefix).
pub const GEMM_GROUPED_MID_ROWS: usize = ORNITH_GROUPED_MID_ROWS as usize;
/// Rows per tile of `gemm_nvfp4_grouped_128` (`moe_sort`'s third prefix).
pub const GEMM_GROUPED_WIDE_ROWS: usize = ORNITH_GROUPED_WIDE_ROWS as usize;

/// The grouped GEMMs' tile heights in the order of `moe_sort`'s tile-offset prefixes: the prefix
/// of `GROUPED_TILE_HEIGHTS[i]`-row tiles is `tile_offsets[i (groups + 1) ..][..groups + 1]`.
pub const GROUPED_TILE_HEIGHTS: [usize; 3] = [GEMM_GROUPED_ROWS, GEMM_GROUPED_MID_ROWS, GEMM_GROUPED_WIDE_ROWS];

/// Length of `moe_sort`'s `tile_offsets` for `groups` experts: one prefix of `groups + 1` entries
/// per tile height.
pub const fn tile_offsets_len(groups: usize) -> usize {
    GROUPED_TILE_HEIGHTS.len() * (groups + 1)
}

/// The place of `tile_rows` in [`GROUPED_TILE_HEIGHTS`] (None for a height moe_sort does not
/// count): its prefix starts at `tile_offsets[place * (groups + 1)]`.
pub fn grouped_height_index(tile_rows: usize) -> Option<usize> {
    GROUPED_TILE_HEIGHTS.iter().position(|&h| h == tile_rows)
}

/// The row-tile height of the grouped NVFP4 MoE GEMM over `rows` expert-sorted rows of `groups`
/// experts. A weight tile is dequantised once per row tile, so taller tiles spend fewer
/// instructions per HMMA, while each expert's last tile runs partly empty; with the rows spread
/// over the experts (Poisson-like under uniform routing) the expected empty rows decide. H100
/// kernel tests (gate|up 2048 -> 1024, top-8 of 256; us in 64- / 96- / 128-row tiles):
///
/// | tokens (rows per expert) | 64 | 96 | 128 |
/// |---|---|---|---|
/// | 1,024 (32) | **391** | 496 | 612 |
/// | 2,048 (64) | 554 | **487** | 624 |
/// | 3,072 (96) | 787 | 724 | **627** |
/// | 4,096 (128) | 929 | 960 | **883** |
/// | 8,192 (256) | 1,734 | **1,469** | 1,529 |
///
/// Each height's times fit ~6.0 / 5.1 / 4.8 us per expected padded row per expert (a Poisson
/// model of the counts), whose minimum moves from 64 to 96 rows at an average of ~60 rows per
/// expert and to 128 at ~92; past ~132 the 96- and 128-row forms stay within ~2% of each other,
/// and in the model at 8,192-token steps (256 rows per expert) the 96-row tiles lost 0.7% of the
/// NVFP4A16 32K prefill (22,777 -> 22,625 tok/s, H100). So: 64-row tiles below 60 rows per expert,
/// 96 below 92, else 128 (NVFP4A16 2K prefill in 96-row tiles: 24,000 -> 25,258 tok/s). The
/// grouped FP8 GEMM takes the 96-row band only ([`grouped_fp8_tile_rows`]). Every height gives the
/// same bits, so this choice does not touch batch invariance.
pub fn grouped_tile_rows(rows: usize, groups: usize) -> usize {
    let g = groups.max(1);
    match rows {
        r if r < 60 * g => GEMM_GROUPED_ROWS,
        r if r < 92 * g => GEMM_GROUPED_MID_ROWS,
        _ => GEMM_GROUPED_WIDE_ROWS,
    }
}

/// The row-tile height of the grouped FP8 MoE GEMM over `rows` expert-sorted rows of `groups`
/// experts: `gemm_fp8_grouped_96` from 60 to 92 rows per expert (a 2,048-token chunk's 64: one
/// 96-row tile per expert where 64-row tiles take ~1.5, the second mostly empty), else 64. The same
/// bits in either height. H100, the MoE block in 64 / 96-row tiles: 32 rows per expert 0.563 /
/// 0.667 ms, 64 rows 0.788 / 0.762, 96 rows 1.061 / 1.128; at 256 rows 96 was 1.6% faster (2.385 /
/// 2.347), not taken until the model shows it (at those sizes the NVFP4 96-row tiles lost in the
/// model where their kernel test gained).
pub fn grouped_fp8_tile_rows(rows: usize, groups: usize) -> usize {
    // The band is grouped_tile_rows' 96-row band (one place for its bounds); no 128-row FP8 form.
    match grouped_tile_rows(rows, groups) {
        GEMM_GROUPED_MID_ROWS => GEMM_GROUPED_MID_ROWS,
        _ => GEMM_GROUPED_ROWS,
    }
}

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
    /// The grid of persistent GEMM `name` (gemm.cu: each block takes every grid-th tile): as many
    /// blocks as the GPU holds at once, no more than `tiles` when the host knows the tile count
    /// (plain GEMMs; a grouped GEMM's tiles are counted on the device by moe_sort).
    pub(crate) fn gemm_grid(&self, name: &str, tiles: Option<usize>) -> (u32, u32, u32) {
        let resident = self.gemm_blocks.get(name).copied().unwrap_or(1);
        let blocks = tiles.map_or(resident, |t| resident.min(t.max(1) as u32));
        (blocks, 1, 1)
    }

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
        let grid = self.gemm_grid("gemm_fp8", Some(out.div_ceil(GEMM_TILE) * rows.div_ceil(gemm_rows("gemm_fp8"))));
        self.launch(
            Launch::new("gemm_fp8", grid, gemm_threads("gemm_fp8"), bytes as u64).smem(gemm_smem("gemm_fp8")),
            p,
        )
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
        let grid = self.gemm_grid("gemm_bf16", Some(out.div_ceil(GEMM_TILE) * rows.div_ceil(gemm_rows("gemm_bf16"))));
        let threads = gemm_threads("gemm_bf16");
        self.launch(Launch::new("gemm_bf16", grid, threads, bytes as u64).smem(gemm_smem("gemm_bf16")), p)
    }

    /// Grouped FP8 GEMM over the expert-sorted rows of `p` (`p.groups` experts, `moe_sort`'s
    /// `group_offsets` / `tile_offsets`): row tiles of `tile_rows` rows (64: `gemm_fp8_grouped`, or
    /// 96: `gemm_fp8_grouped_96`, [`grouped_fp8_tile_rows`]; each expert's last one partial),
    /// counted on the device, taken by the resident blocks. Bytes count every expert's weights
    /// once (all are read when the chunk is long).
    pub(crate) fn k_gemm_grouped(&self, p: OrnithGemmParams, tile_rows: usize) -> Result<()> {
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
        // Tile indices (row tiles x column tiles) inside int32.
        i32of("gemm_grouped tiles", (rows.div_ceil(GEMM_GROUPED_ROWS) + g.min(rows)) * out.div_ceil(GEMM_TILE))?;
        let bytes = g * (out * in_ + out * 4) + rows * (in_ + 4 + out * 2);
        self.launch_grouped(&["gemm_fp8_grouped", "gemm_fp8_grouped_96"], tile_rows, p, bytes as u64)
    }

    /// Launches the grouped GEMM for `tile_rows`-row tiles: `kernels` holds one kernel per tile
    /// height, in [`GROUPED_TILE_HEIGHTS`]' order (a prefix of it: the heights the precision has);
    /// the chosen kernel counts its tiles in moe_sort's prefix of that height (`p.tile_offsets`
    /// advanced to it, see [`tile_offsets_len`]).
    pub(crate) fn launch_grouped(
        &self,
        kernels: &[&'static str],
        tile_rows: usize,
        mut p: OrnithGemmParams,
        bytes: u64,
    ) -> Result<()> {
        let Some(h) = grouped_height_index(tile_rows).filter(|&h| h < kernels.len()) else {
            anyhow::bail!("{}: {tile_rows}-row tiles (one of {:?})", kernels[0], &GROUPED_TILE_HEIGHTS[..kernels.len()])
        };
        let name = kernels[h];
        p.tile_offsets = p.tile_offsets.wrapping_add(h * (p.groups as usize + 1));
        let grid = self.gemm_grid(name, None);
        self.launch(Launch::new(name, grid, gemm_threads(name), bytes).smem(gemm_smem(name)), p)
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each GEMM's dynamic shared memory as gemm.cu states it (its static_asserts check the NVFP4
    /// forms' layout), within the 99 KiB a block may take on sm_121.
    #[test]
    fn gemm_smem_is_the_kernels_layout() {
        let kib = |n: &str| gemm_smem(n) as f64 / 1024.0;
        assert_eq!(kib("gemm_fp8"), 96.0);
        assert_eq!(kib("gemm_bf16"), 96.0);
        assert_eq!(kib("gemm_fp8_grouped"), 72.0);
        assert_eq!(kib("gemm_fp8_grouped_96"), 84.0);
        assert_eq!(kib("gemm_nvfp4_grouped"), 72.0);
        assert_eq!(kib("gemm_nvfp4_grouped_96"), 84.5);
        assert_eq!(kib("gemm_nvfp4_grouped_128"), 96.5);
        for n in GEMM_KERNELS {
            assert!(gemm_smem(n) <= 99 * 1024, "{n}");
        }
    }

    /// The heights `grouped_tile_rows` and `grouped_fp8_tile_rows` pick at the measured averages
    /// (top-8 of 256 experts), at their boundaries, and for no experts.
    #[test]
    fn grouped_tile_rows_follows_the_measured_table() {
        let pick = |tokens: usize| grouped_tile_rows(tokens * 8, 256);
        assert_eq!([pick(1024), pick(2048), pick(3072), pick(4096), pick(8192)], [64, 96, 128, 128, 128]);
        assert_eq!([grouped_tile_rows(59, 1), grouped_tile_rows(60, 1)], [64, 96]);
        assert_eq!([grouped_tile_rows(91, 1), grouped_tile_rows(92, 1)], [96, 128]);
        assert_eq!(grouped_tile_rows(100, 0), 128);
        // moe_sort's layout: a prefix of experts + 1 entries per height, 64 / 96 / 128 in order.
        assert_eq!(tile_offsets_len(256), 3 * 257);
        assert_eq!([64, 96, 128, 80].map(grouped_height_index), [Some(0), Some(1), Some(2), None]);
        let fp8 = |tokens: usize| grouped_fp8_tile_rows(tokens * 8, 256);
        assert_eq!([fp8(1024), fp8(2048), fp8(3072), fp8(8192)], [64, 96, 64, 64]);
        assert_eq!(
            [grouped_fp8_tile_rows(59, 1), grouped_fp8_tile_rows(60, 1), grouped_fp8_tile_rows(92, 1)],
            [64, 96, 64]
        );
        for r in [0, 1, 1000, 1 << 20] {
            assert!(
                [GEMM_GROUPED_ROWS, GEMM_GROUPED_MID_ROWS, GEMM_GROUPED_WIDE_ROWS].contains(&grouped_tile_rows(r, 7))
            );
        }
    }
}
