//! Launchers of the NVFP4A16 kernels: the decode products (gemv.cu: `gemv_nvfp4`,
//! `gemv_nvfp4_wide`, `moe_gemv_nvfp4`, `moe_gemv_nvfp4_grouped`), the prefill GEMMs (gemm.cu:
//! `gemm_nvfp4`, `gemm_nvfp4_grouped`) and the dequantiser (nvfp4.cu, which tests the register
//! dequantisation all of them share bit for bit). A weight is compressed-tensors' `weight_packed`
//! U8 `[out, in/2]` (uploaded in the kernels' order, [`fp4_device_codes`]), `weight_scale` E4M3
//! `[out, in/16]` and, per global scale, the dequantisation table [`fp4_table`]
//! (`ornith_kernels.h` states the math).
//!
//! One launcher per kernel (see [`super`]), then the slice-based wrappers the kernel tests call.
use super::gemm::{gemm_rows, gemm_smem, gemm_threads, GEMM_GROUPED_ROWS, GEMM_TILE, GROUPED_TILE_HEIGHTS};
use super::moe::MoeGroups;
use super::{aligned, i32of, need, CudaContext, Launch, Ptr};
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use ornith_kernels::bindings::*;

type Bf = CudaSlice<u16>;

/// Bytes of one dequantisation table: 256 entries (`OrnithFp4Entry`) of 16 bytes.
pub const TAB_BYTES: usize = 256 * 16;

/// The dequantisation table of one global scale (`OrnithFp4Entry[256]`, little-endian words):
/// entry `b` holds the 8 magnitudes `v_m = model_spec::nvfp4::dequant(m, s_b)`, `m = 0..7`, of
/// the group scale `s_b = model_spec::nvfp4::scale_table(global_scale)[b]`, as the words
/// `lo(v0..v3), lo(v4..v7), hi(v0..v3), hi(v4..v7)` (byte `j` of a word the low or high byte of
/// its `j`-th value), so the kernels look a magnitude up with one byte permute
/// (`kernels/cuda/fp4.cuh`) and never multiply or round.
pub fn fp4_table(global_scale: f32) -> Vec<u8> {
    let mut t = Vec::with_capacity(TAB_BYTES);
    for s in model_spec::nvfp4::scale_table(global_scale) {
        let v: [u16; 8] = std::array::from_fn(|m| model_spec::nvfp4::dequant(m as u8, s).to_bits());
        for (vals, shift) in [(&v[..4], 0), (&v[4..], 0), (&v[..4], 8), (&v[4..], 8)] {
            t.extend(vals.iter().map(|&x| (x >> shift) as u8));
        }
    }
    t
}

/// One u32 word of codes (little endian: nibble `n` the code of the word's column `n`, bit
/// `4n + 3` its sign) in the order `fp4_word` (`kernels/cuda/fp4.cuh`) reads: nibble `n` keeps
/// the magnitude (bits `4n .. 4n + 2`) and the signs move to the bits the kernel XORs into the
/// high bytes it looks up: column `j < 4`'s to bit `8j + 7`, column `4 + j`'s to bit `8j + 3`.
pub fn fp4_device_word(w: u32) -> u32 {
    // spread(x): bit i of a 16-bit x to bit 2i. The signs of columns 0..3 (bits 4j + 3) go to
    // 8j + 7 = 2(4j + 3) + 1, those of columns 4..7 (bits 16 + 4j + 3) to 8j + 3 = 2(4j + 3) - 3.
    fn spread(x: u32) -> u32 {
        let x = (x | (x << 8)) & 0x00ff_00ff;
        let x = (x | (x << 4)) & 0x0f0f_0f0f;
        let x = (x | (x << 2)) & 0x3333_3333;
        (x | (x << 1)) & 0x5555_5555
    }
    let s = w & 0x8888_8888;
    (w & 0x7777_7777) | (spread(s & 0xffff) << 1) | (spread(s >> 16) >> 3)
}

/// A matrix's code bytes (`weight_packed`, rows of a multiple of 4 bytes) in the kernels' order
/// ([`fp4_device_word`] on every u32).
pub fn fp4_device_codes(codes: &[u8]) -> Vec<u8> {
    assert!(codes.len().is_multiple_of(4), "NVFP4 codes of {} bytes are not whole u32 words", codes.len());
    codes
        .chunks_exact(4)
        .flat_map(|c| fp4_device_word(u32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes())
        .collect()
}

/// Device addresses of an NVFP4 matrix `[out, in]` (or of `groups` of them one after the other):
/// codes, scale bytes, and its scale tables, table `k` serving rows `k · tab_rows ..`.
#[derive(Clone, Copy, Debug)]
pub struct Fp4W {
    pub w: Ptr,
    pub ws: Ptr,
    pub tab: Ptr,
    pub tab_rows: usize,
}

/// The weight checks every NVFP4 kernel shares: `in` a positive multiple of 32 (a lane's 16
/// code bytes; every real shape is), a row group of 16 never straddling two tables, the code
/// rows 16-byte and the scale rows 2-byte aligned, offsets inside int32.
fn fp4_checks(w: &Fp4W, in_: usize, out: usize) -> Result<()> {
    ensure!(
        in_ > 0 && in_.is_multiple_of(32) && out > 0,
        "nvfp4: in {in_} must be a positive multiple of 32, out {out} > 0"
    );
    ensure!(
        w.tab_rows > 0
            && out.is_multiple_of(w.tab_rows.min(out))
            && (w.tab_rows >= out || w.tab_rows.is_multiple_of(16)),
        "nvfp4: {} rows per scale table for {out} rows (a multiple of 16 dividing out, or all rows)",
        w.tab_rows
    );
    ensure!(aligned(w.w, 16) && aligned(w.ws, 2) && aligned(w.tab, 16), "nvfp4: codes, scales and tables misaligned");
    i32of("nvfp4 out", out)?;
    i32of("nvfp4 in", in_)?;
    Ok(())
}

/// Scale tables of a matrix of `out` rows.
fn tables(w: &Fp4W, out: usize) -> usize {
    out.div_ceil(w.tab_rows)
}

/// Bytes of an NVFP4 matrix as the kernels read it: codes, scale bytes, tables.
pub fn fp4_bytes(in_: usize, out: usize, tabs: usize) -> usize {
    out * in_ / 2 + out * in_ / 16 + tabs * TAB_BYTES
}

/// The parameters of an NVFP4 decode product (`gemv_nvfp4`, `gemv_nvfp4_norm`) of `t` rows;
/// refuses a K split chosen for fewer rows than the launch's.
#[allow(clippy::too_many_arguments)]
fn fp4_params(
    x: Ptr,
    w: &Fp4W,
    y: Ptr,
    t: usize,
    in_: usize,
    out: usize,
    xs: usize,
    ys: usize,
    split: usize,
    fold: Option<Ptr>,
) -> Result<OrnithGemvNvfp4Params> {
    ensure!(split >= out, "gemv_nvfp4: split rows {split} < out {out}");
    Ok(OrnithGemvNvfp4Params {
        x: x as _,
        w: w.w as _,
        ws: w.ws as _,
        tab: w.tab as _,
        y: y as _,
        tokens: t as i32,
        in_: in_ as i32,
        out: out as i32,
        x_stride: xs as i32,
        y_stride: i32of("gemv_nvfp4 y_stride", ys)?,
        tab_rows: i32of("tab_rows", w.tab_rows.min(out))?,
        split_out: i32of("gemv_nvfp4 split rows", split)?,
        fold: fold.map_or(std::ptr::null_mut(), |f| f as _),
        ..Default::default()
    })
}

impl CudaContext {
    /// `y[t, o] = bf16(Σ_i x[t, i] · wd[o, i])` for any number of rows (bf16 rows of `x` and `y`
    /// at strides `xs`, `ys` elements): the tensor-core decode product with the dense K split on
    /// the weights per row (`gemv_tc_ksplit(in, ..)`, the FP8 rule), so a row's bits never depend
    /// on the row count. With `fold` (the residual rows, `y` being the pending delta) the product
    /// first adds the delta `y` holds into them (`OrnithGemvNvfp4Params.fold`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gemv_nvfp4(
        &self,
        x: Ptr,
        w: Fp4W,
        y: Ptr,
        t: usize,
        in_: usize,
        out: usize,
        xs: usize,
        ys: usize,
        split: usize,
        fold: Option<Ptr>,
    ) -> Result<()> {
        fp4_checks(&w, in_, out)?;
        ensure!(t >= 1 && t * xs * 2 <= i32::MAX as usize, "gemv_nvfp4: {t} tokens of stride {xs}");
        ensure!(
            xs >= in_ && ys >= out && xs.is_multiple_of(8),
            "gemv_nvfp4: strides x {xs} (>= in {in_}, 16-byte rows), y {ys}"
        );
        ensure!(aligned(x, 16), "gemv_nvfp4: x must be 16-byte aligned");
        let p = fp4_params(x, &w, y, t, in_, out, xs, ys, split, fold)?;
        let bytes =
            (fp4_bytes(in_, out, tables(&w, out)) + t * (in_ + out) * 2) as u64 + super::gemv::fold_bytes(fold, t, out);
        let name = if super::gemv_tc_wide(t) { "gemv_nvfp4_wide" } else { "gemv_nvfp4" };
        ensure!(fold.is_none() || name == "gemv_nvfp4", "gemv_nvfp4: a fold takes at most 8 rows (the narrow build)");
        // Token groups over grid.y as the other wide products: same bits.
        let grid = super::gemv_tc_grid(in_, out, split, t, self.nvfp4_wide_wave);
        self.launch(Launch::new(name, grid, super::GEMV_BLOCK, bytes).weights_first(), p)
    }

    /// [`Self::k_gemv_nvfp4`] of one row whose input is the norm of a residual row, computed by
    /// every block after its first weight loads (`OrnithNormIn`, `gemv_nvfp4_norm`): the bits of
    /// `rmsnorm_residual` then `gemv_nvfp4`, without the norm's launch or its stores; `fold` as there.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gemv_nvfp4_norm(
        &self,
        norm: OrnithNormIn,
        w: Fp4W,
        y: Ptr,
        in_: usize,
        out: usize,
        ys: usize,
        split: usize,
        fold: Option<Ptr>,
    ) -> Result<()> {
        fp4_checks(&w, in_, out)?;
        let smem = Self::norm_checks(&norm, in_, 2)?;
        ensure!(ys >= out, "gemv_nvfp4_norm: y stride {ys} < out {out}");
        // x unused: the prologue computes the row.
        let p = OrnithGemvNvfp4Params { norm, ..fp4_params(0, &w, y, 1, in_, out, in_, ys, split, fold)? };
        let bytes = (fp4_bytes(in_, out, tables(&w, out)) + super::gemv::norm_bytes(&norm, in_) + out * 2) as u64
            + super::gemv::fold_bytes(fold, 1, out);
        let grid = (super::gemv_tc_blocks(in_, out, split), 1, 1);
        self.launch(Launch::new("gemv_nvfp4_norm", grid, super::GEMV_BLOCK, bytes).smem(smem).weights_first(), p)
    }

    /// The NVFP4 expert products of a decode group (see `OrnithMoeGemvNvfp4Params`): per
    /// (token, slot) (`moe_gemv_nvfp4`: grid (tiles, top_k + 1, tokens)), or `grouped` by expert
    /// over `moe_sort`'s groups (`moe_gemv_nvfp4_grouped`, the same bits). Bytes as `k_moe_gemv`.
    pub(crate) fn k_moe_gemv_nvfp4(&self, p: OrnithMoeGemvNvfp4Params, grouped: bool) -> Result<()> {
        ensure!(
            p.tokens > 0 && p.top_k >= 1 && p.experts >= 1,
            "moe_gemv_nvfp4: {} tokens, top_k {}",
            p.tokens,
            p.top_k
        );
        let (t, in_, out, k) = (p.tokens as usize, p.in_ as usize, p.out as usize, p.top_k as usize);
        let slots = k + 1;
        ensure!(
            p.norm.weight.is_null() || p.gate_up.is_null(),
            "moe_gemv_nvfp4: a norm prologue or a SwiGLU prologue, not both"
        );
        ensure!(!grouped || (p.norm.weight.is_null() && p.gate_up.is_null()), "moe_gemv_nvfp4_grouped has no prologue");
        ensure!(
            p.combine.out.is_null() || (!grouped && !p.gate_up.is_null()),
            "moe_gemv_nvfp4: the combine epilogue is the per-slot down product's (moe_gemv_nvfp4_swiglu)"
        );
        let w = Fp4W { w: p.w as Ptr, ws: p.ws as Ptr, tab: p.tab as Ptr, tab_rows: p.tab_rows.max(0) as usize };
        fp4_checks(&w, in_, out)?;
        let sw = Fp4W { w: p.shared_w as Ptr, ws: p.shared_ws as Ptr, tab: p.shared_tab as Ptr, ..w };
        fp4_checks(&sw, in_, out)?;
        ensure!(out.is_multiple_of(w.tab_rows), "moe_gemv_nvfp4: {} rows per table for {out} rows", w.tab_rows);
        let (xt, xsl) = (p.x_tok_stride as usize, p.x_slot_stride as usize);
        ensure!(
            p.x_tok_stride >= 0 && p.x_slot_stride >= 0 && xt.is_multiple_of(8) && xsl.is_multiple_of(8),
            "moe_gemv_nvfp4: activation strides must keep 16-byte alignment"
        );
        ensure!(aligned(p.x as Ptr, 16), "moe_gemv_nvfp4: x must be 16-byte aligned");
        // The kernel forms activation byte offsets as 32-bit (2 · (token · x_tok_stride + slot · x_slot_stride)).
        ensure!(2 * (t * xt + k * xsl) <= i32::MAX as usize, "moe_gemv_nvfp4: {t} tokens of stride {xt}");
        // The split is by weights (`in`, as FP8 rows of a byte each; gemv.cu tc_place).
        let tiles = super::moe_tc_blocks(in_, out);
        let per = fp4_bytes(in_, out, out / w.tab_rows);
        if grouped {
            ensure!(
                !p.row_info.is_null() && (p.row_info as Ptr).is_multiple_of(16) && !p.row_assign.is_null(),
                "moe_gemv_nvfp4_grouped needs moe_sort's groups (row_info 16-byte aligned)"
            );
            let active = (p.experts as usize).min(t * k);
            let bytes = (active + 1) * per + t * slots * (in_ + out) * 2;
            // The shared expert's block rows: 8 tokens each (moe_shared_row in gemv.cu).
            let rows = active + t.div_ceil(8);
            ensure!(rows <= 65535, "moe_gemv_nvfp4_grouped: {rows} block rows exceed grid.y");
            return self.launch(
                Launch::new("moe_gemv_nvfp4_grouped", (tiles, rows as u32, 1), super::GEMV_BLOCK, bytes as u64)
                    .weights_first(),
                p,
            );
        }
        let grid = (tiles, slots as u32, t as u32);
        if !p.norm.weight.is_null() {
            // The per-(token, slot) gate|up with the norm prologue: each block normalises its
            // token's residual row itself (in = hidden; bf16 in shared memory).
            let smem = Self::norm_checks(&p.norm, in_, 2)?;
            let bytes = t * slots * (per + out * 2) + t * super::gemv::norm_bytes(&p.norm, in_);
            let l = Launch::new("moe_gemv_nvfp4_norm", grid, super::GEMV_BLOCK, bytes as u64);
            return self.launch(l.smem(smem).weights_first(), p);
        }
        if !p.gate_up.is_null() {
            // The per-(token, slot) down product with the SwiGLU prologue: each block computes its
            // (token, slot) row of SwiGLU(gate|up) itself (in = inter; bf16 in shared memory).
            // The routed index before the PDL wait, as moe_gemv_fp8_swiglu: only right after the
            // per-slot gate|up product of the same idx.
            // With the combine epilogue (the decode MoE of 1 to 3 tokens): the counters and its bytes.
            let (ticket, cb) = self.combine_epilogue(&p.combine, p.y as Ptr, p.tokens, p.top_k, p.out, tiles)?;
            let p = OrnithMoeGemvNvfp4Params { ticket, ..p };
            let bytes = t * slots * (per + (2 * in_ + out) * 2) + cb;
            let l = Launch::new("moe_gemv_nvfp4_swiglu", grid, super::GEMV_BLOCK, bytes as u64);
            return self.launch(l.smem((in_ * 2) as u32).weights_first(), p);
        }
        let bytes = t * slots * (per + (in_ + out) * 2);
        self.launch(Launch::new("moe_gemv_nvfp4", grid, super::GEMV_BLOCK, bytes as u64).weights_first(), p)
    }

    /// The GEMM checks shared by both NVFP4 GEMMs (A bf16 rows 16-byte aligned).
    fn gemm_nvfp4_checks(p: &OrnithGemmParams) -> Result<Fp4W> {
        ensure!(p.rows > 0 && p.groups > 0, "gemm_nvfp4: rows {}, groups {}", p.rows, p.groups);
        let w = Fp4W {
            w: p.w as Ptr,
            ws: p.w_group_scale as Ptr,
            tab: p.w_tab as Ptr,
            tab_rows: p.tab_rows.max(0) as usize,
        };
        fp4_checks(&w, p.in_.max(0) as usize, p.out.max(0) as usize)?;
        ensure!(
            p.a_stride >= p.in_ && p.a_stride % 8 == 0 && aligned(p.a as Ptr, 16) && p.y_stride >= p.out,
            "gemm_nvfp4: A rows of stride {} (>= in {}, 16-byte aligned), y stride {}",
            p.a_stride,
            p.in_,
            p.y_stride
        );
        i32of("gemm_nvfp4 out * in", p.out as usize * p.in_ as usize)?;
        Ok(w)
    }

    /// Plain NVFP4A16 GEMM: `y[r, o] = bf16(Σ_i a[r, i] · wd[o, i])` for `rows` bf16 rows (row
    /// stride `a_stride`); the weight tile is dequantised into shared memory (gemm.cu).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gemm_nvfp4(
        &self,
        a: Ptr,
        w: Fp4W,
        y: Ptr,
        rows: usize,
        in_: usize,
        out: usize,
        a_stride: usize,
        y_stride: usize,
    ) -> Result<()> {
        let p = OrnithGemmParams {
            a: a as _,
            w: w.w as _,
            y: y as _,
            rows: i32of("rows", rows)?,
            in_: i32of("in", in_)?,
            out: i32of("out", out)?,
            a_stride: i32of("a_stride", a_stride)?,
            y_stride: i32of("y_stride", y_stride)?,
            groups: 1,
            w_group_scale: w.ws as _,
            w_tab: w.tab as _,
            tab_rows: i32of("tab_rows", w.tab_rows.min(out))?,
            ..Default::default()
        };
        Self::gemm_nvfp4_checks(&p)?;
        let bytes = fp4_bytes(in_, out, tables(&w, out)) + rows * (in_ + out) * 2;
        let grid = self.gemm_grid("gemm_nvfp4", Some(out.div_ceil(GEMM_TILE) * rows.div_ceil(gemm_rows("gemm_nvfp4"))));
        self.launch(
            Launch::new("gemm_nvfp4", grid, gemm_threads("gemm_nvfp4"), bytes as u64).smem(gemm_smem("gemm_nvfp4")),
            p,
        )
    }

    /// Grouped NVFP4A16 GEMM over the expert-sorted rows of `p` (`moe_sort`'s groups and its three
    /// tile-offset prefixes): `gemm_nvfp4_grouped` in 64-row tiles as `k_gemm_grouped`, or
    /// `gemm_nvfp4_grouped_96` / `_128` in 96- / 128-row tiles (`tile_rows`, chosen by
    /// [`super::gemm::grouped_tile_rows`]; the same bits). Bytes count every expert's weights once.
    pub(crate) fn k_gemm_nvfp4_grouped(&self, p: OrnithGemmParams, tile_rows: usize) -> Result<()> {
        let w = Self::gemm_nvfp4_checks(&p)?;
        ensure!(!p.group_offsets.is_null() && !p.tile_offsets.is_null(), "gemm_nvfp4_grouped needs moe_sort's groups");
        let (rows, in_, out, g) = (p.rows as usize, p.in_ as usize, p.out as usize, p.groups as usize);
        ensure!(out.is_multiple_of(w.tab_rows), "gemm_nvfp4_grouped: {} rows per table for {out} rows", w.tab_rows);
        i32of("gemm_nvfp4_grouped tiles", (rows.div_ceil(GEMM_GROUPED_ROWS) + g.min(rows)) * out.div_ceil(GEMM_TILE))?;
        let bytes = g * fp4_bytes(in_, out, out / w.tab_rows) + rows * (in_ + out) * 2;
        const KERNELS: [&str; GROUPED_TILE_HEIGHTS.len()] =
            ["gemm_nvfp4_grouped", "gemm_nvfp4_grouped_96", "gemm_nvfp4_grouped_128"];
        self.launch_grouped(&KERNELS, tile_rows, p, bytes as u64)
    }

    /// `y` (bf16 `[out, in]`) = the dequantised weight (nvfp4.cu).
    pub(crate) fn k_nvfp4_dequant(&self, w: Fp4W, y: Ptr, in_: usize, out: usize) -> Result<()> {
        fp4_checks(&w, in_, out)?;
        ensure!(aligned(y, 16), "nvfp4_dequant: y must be 16-byte aligned");
        let p = OrnithGemvNvfp4Params {
            w: w.w as _,
            ws: w.ws as _,
            tab: w.tab as _,
            y: y as _,
            in_: in_ as i32,
            out: out as i32,
            tab_rows: i32of("tab_rows", w.tab_rows.min(out))?,
            ..Default::default()
        };
        let blocks = (out * in_ / 8).div_ceil(256);
        ensure!(blocks <= u32::MAX as usize, "nvfp4_dequant: {blocks} blocks");
        let bytes = fp4_bytes(in_, out, tables(&w, out)) + out * in_ * 2;
        self.launch(Launch::new("nvfp4_dequant", (blocks as u32, 1, 1), 256, bytes as u64), p)
    }
}

/// An NVFP4 matrix (or `groups` of them, stacked) in device buffers, as the kernel tests hold it.
pub struct Fp4Buf {
    pub w: CudaSlice<u8>,
    pub ws: CudaSlice<u8>,
    pub tab: CudaSlice<u8>,
    pub tab_rows: usize,
}

/// Inputs of [`CudaContext::moe_gemv_nvfp4`]: `experts` stacked NVFP4 experts `[out, in]` and the
/// shared expert (the same `tab_rows`); the bf16 activation of (token t, slot j) at
/// `x + t · x_tok_stride + j · x_slot_stride`.
pub struct MoeNvfp4Args<'a> {
    pub x: &'a Bf,
    pub idx: &'a CudaSlice<i32>,
    pub w: &'a Fp4Buf,
    pub shared: &'a Fp4Buf,
    pub tokens: usize,
    pub top_k: usize,
    pub experts: usize,
    pub in_: usize,
    pub out: usize,
    pub x_tok_stride: usize,
    pub x_slot_stride: usize,
}

// The slice-based wrappers (the kernel tests' entry points).
impl CudaContext {
    /// `b`'s addresses after checking it holds `groups` matrices `[out, in]`.
    fn fp4_buf(&self, what: &str, b: &Fp4Buf, groups: usize, in_: usize, out: usize) -> Result<Fp4W> {
        need(&format!("{what} codes"), &b.w, groups * out * in_ / 2)?;
        need(&format!("{what} scales"), &b.ws, groups * out * in_ / 16)?;
        need(&format!("{what} tables"), &b.tab, groups * out.div_ceil(b.tab_rows.max(1)) * TAB_BYTES)?;
        Ok(Fp4W { w: self.addr(&b.w), ws: self.addr(&b.ws), tab: self.addr(&b.tab), tab_rows: b.tab_rows })
    }

    /// [`Self::k_nvfp4_dequant`] on buffers.
    pub fn nvfp4_dequant(&self, w: &Fp4Buf, y: &mut Bf, in_: usize, out: usize) -> Result<()> {
        let fw = self.fp4_buf("nvfp4_dequant", w, 1, in_, out)?;
        need("nvfp4_dequant y", y, out * in_)?;
        self.k_nvfp4_dequant(fw, self.addr(y), in_, out)
    }

    /// [`Self::k_gemv_nvfp4`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_nvfp4(
        &self,
        x: &Bf,
        w: &Fp4Buf,
        y: &mut Bf,
        tokens: usize,
        in_: usize,
        out: usize,
        x_stride: usize,
        y_stride: usize,
    ) -> Result<()> {
        ensure!(tokens >= 1, "gemv_nvfp4: no tokens");
        let fw = self.fp4_buf("gemv_nvfp4", w, 1, in_, out)?;
        need("gemv_nvfp4 x", x, (tokens - 1) * x_stride + in_)?;
        need("gemv_nvfp4 y", y, (tokens - 1) * y_stride + out)?;
        self.k_gemv_nvfp4(self.addr(x), fw, self.addr(y), tokens, in_, out, x_stride, y_stride, out, None)
    }

    /// [`Self::k_gemm_nvfp4`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_nvfp4(
        &self,
        a: &Bf,
        w: &Fp4Buf,
        y: &mut Bf,
        rows: usize,
        in_: usize,
        out: usize,
        a_stride: usize,
        y_stride: usize,
    ) -> Result<()> {
        ensure!(rows >= 1, "gemm_nvfp4: no rows");
        let fw = self.fp4_buf("gemm_nvfp4", w, 1, in_, out)?;
        need("gemm_nvfp4 a", a, (rows - 1) * a_stride + in_)?;
        need("gemm_nvfp4 y", y, (rows - 1) * y_stride + out)?;
        self.k_gemm_nvfp4(self.addr(a), fw, self.addr(y), rows, in_, out, a_stride, y_stride)
    }

    pub(super) fn moe_nvfp4_params(&self, a: &MoeNvfp4Args, y: &Bf) -> Result<OrnithMoeGemvNvfp4Params> {
        ensure!(a.tokens > 0, "moe_gemv_nvfp4: no tokens");
        let w = self.fp4_buf("moe_gemv_nvfp4 experts", a.w, a.experts, a.in_, a.out)?;
        let s = self.fp4_buf("moe_gemv_nvfp4 shared", a.shared, 1, a.in_, a.out)?;
        ensure!(a.w.tab_rows == a.shared.tab_rows, "moe_gemv_nvfp4: experts and shared expert differ in tab_rows");
        need("moe_gemv_nvfp4 idx", a.idx, a.tokens * a.top_k)?;
        need("moe_gemv_nvfp4 x", a.x, (a.tokens - 1) * a.x_tok_stride + a.top_k * a.x_slot_stride + a.in_)?;
        need("moe_gemv_nvfp4 y", y, a.tokens * (a.top_k + 1) * a.out)?;
        Ok(OrnithMoeGemvNvfp4Params {
            x: self.addr(a.x) as _,
            idx: self.addr(a.idx) as _,
            w: w.w as _,
            ws: w.ws as _,
            tab: w.tab as _,
            shared_w: s.w as _,
            shared_ws: s.ws as _,
            shared_tab: s.tab as _,
            y: self.addr(y) as _,
            tokens: i32of("tokens", a.tokens)?,
            top_k: i32of("top_k", a.top_k)?,
            experts: i32of("experts", a.experts)?,
            in_: i32of("in", a.in_)?,
            out: i32of("out", a.out)?,
            x_tok_stride: i32of("x_tok_stride", a.x_tok_stride)?,
            x_slot_stride: i32of("x_slot_stride", a.x_slot_stride)?,
            tab_rows: i32of("tab_rows", a.w.tab_rows)?,
            ..Default::default()
        })
    }

    /// [`Self::k_moe_gemv_nvfp4`] per (token, slot) on buffers.
    pub fn moe_gemv_nvfp4(&self, a: &MoeNvfp4Args, y: &mut Bf) -> Result<()> {
        let p = self.moe_nvfp4_params(a, y)?;
        self.k_moe_gemv_nvfp4(p, false)
    }

    /// [`Self::k_moe_gemv_nvfp4`] grouped by expert over `g`: the same outputs, bit for bit.
    pub fn moe_gemv_nvfp4_grouped(&self, a: &MoeNvfp4Args, g: &MoeGroups, y: &mut Bf) -> Result<()> {
        let mut p = self.moe_nvfp4_params(a, y)?;
        let [ri, ra] = g.lists(self, "moe_gemv_nvfp4_grouped", a.experts, a.tokens * a.top_k)?;
        (p.row_info, p.row_assign) = (ri as _, ra as _);
        self.k_moe_gemv_nvfp4(p, true)
    }
}

#[cfg(test)]
mod tests {
    use super::{fp4_device_codes, fp4_device_word, fp4_table, TAB_BYTES};
    use half::bf16;
    use model_spec::nvfp4::{dequant, scale_table};

    /// prmt.b32 (`__byte_perm`) for selector nibbles below 8: byte k of the result is byte
    /// `nibble k` of the 8 bytes {a, b}.
    fn byte_perm(a: u32, b: u32, sel: u32) -> u32 {
        let src = (u64::from(b) << 32) | u64::from(a);
        (0..4).fold(0, |r, k| r | ((((src >> (8 * ((sel >> (4 * k)) & 7))) & 0xff) as u32) << (8 * k)))
    }

    /// `fp4_word` (kernels/cuda/fp4.cuh) step by step on the CPU: the 8 bf16 values of a device
    /// word under one table entry.
    fn fp4_word(w: u32, e: [u32; 4]) -> [u16; 8] {
        let m = w & 0x7777_7777;
        let (lo_a, lo_b) = (byte_perm(e[0], e[1], m), byte_perm(e[0], e[1], m >> 16));
        let hi_a = byte_perm(e[2], e[3], m) ^ (w & 0x8080_8080);
        let hi_b = byte_perm(e[2], e[3], m >> 16) ^ ((w << 4) & 0x8080_8080);
        let r = [
            byte_perm(lo_a, hi_a, 0x5140),
            byte_perm(lo_a, hi_a, 0x7362),
            byte_perm(lo_b, hi_b, 0x5140),
            byte_perm(lo_b, hi_b, 0x7362),
        ];
        std::array::from_fn(|n| (r[n / 2] >> (16 * (n % 2))) as u16)
    }

    fn entry(t: &[u8], b: usize) -> [u32; 4] {
        std::array::from_fn(|k| u32::from_le_bytes(t[16 * b + 4 * k..16 * b + 4 * k + 4].try_into().unwrap()))
    }

    #[test]
    fn device_word_moves_only_the_signs() {
        for n in 0..8 {
            for c in 0..16u32 {
                let d = fp4_device_word(c << (4 * n));
                let sign_bit = if n < 4 { 8 * n + 7 } else { 8 * (n - 4) + 3 };
                let want = ((c & 7) << (4 * n)) | (((c >> 3) & 1) << sign_bit);
                assert_eq!(d, want, "column {n} code {c:#x}");
            }
        }
        assert_eq!(fp4_device_codes(&[0x98, 0xba, 0xdc, 0xfe]), fp4_device_word(0xfedc_ba98).to_le_bytes());
    }

    /// The table and the kernel's lookup give compressed-tensors' weight (`dequant`) for every
    /// code in every column under every scale byte, at several global scales: bit for bit, NaN
    /// scale bytes giving NaN.
    #[test]
    fn table_lookup_matches_dequant() {
        for gs in [1.0f32, 448.0 * 6.0 / 0.37, 3.7e-3, 2.5e7] {
            let t = fp4_table(gs);
            assert_eq!(t.len(), TAB_BYTES);
            let scales = scale_table(gs);
            for (b, &s) in scales.iter().enumerate() {
                for w in [0x7654_3210u32, 0xfedc_ba98, 0x1f2e_3d4c, 0x8a9b_f0e7] {
                    let got = fp4_word(fp4_device_word(w), entry(&t, b));
                    for (n, &g) in got.iter().enumerate() {
                        let want = dequant(((w >> (4 * n)) & 15) as u8, s);
                        let g = bf16::from_bits(g);
                        assert!(
                            g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                            "gs {gs} byte {b} column {n}"
                        );
                    }
                }
            }
        }
    }
}
