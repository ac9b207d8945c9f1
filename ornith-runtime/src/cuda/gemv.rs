//! Launchers of gemv.cu: the tensor-core decode products (BF16 and FP8 W8A8, any number of rows)
//! and the MoE expert products (per (token, slot) pair or grouped by expert).
//!
//! One launcher per kernel (see [`super`]): device addresses and shapes (or the kernel's parameter
//! struct) in, the kernel's assumptions checked, grid, block, shared memory and bytes computed,
//! launched through [`CudaContext::launch`]; the CUDA backend calls these. After them, the
//! slice-based wrappers the kernel tests call, which check buffer lengths (and device-held
//! tables and slots) and convert slices to addresses. The math is in
//! `kernels/include/ornith_kernels.h`; bf16 tensors are `CudaSlice<u16>` (bit patterns), FP8
//! E4M3 codes `CudaSlice<u8>`.
use super::moe::MoeGroups;
use super::{aligned, i32of, need, CudaContext, Launch, Ptr};
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use ornith_kernels::bindings::*;

type Bf = CudaSlice<u16>;

/// The largest hidden size the norm prologue takes (the header's).
pub(crate) const NORM_MAX_HIDDEN: usize = ORNITH_NORM_MAX_HIDDEN as usize;

/// Bytes a norm prologue reads: the residual row, the pending delta, the weight.
pub(super) fn norm_bytes(n: &OrnithNormIn, hidden: usize) -> usize {
    hidden * 2 * (2 + usize::from(!n.add.is_null()))
}

/// Bytes a residual fold moves: the residual read and written, the old delta read.
pub(super) fn fold_bytes(fold: Option<Ptr>, t: usize, out: usize) -> u64 {
    fold.map_or(0, |_| (t * out * 6) as u64)
}

/// Inputs of [`CudaContext::moe_gemv`].
pub struct MoeGemvArgs<'a> {
    pub xq: &'a CudaSlice<u8>,
    pub xs: &'a CudaSlice<f32>,
    pub idx: &'a CudaSlice<i32>,
    pub w: &'a CudaSlice<u8>,
    pub ws: &'a CudaSlice<f32>,
    pub shared_w: &'a CudaSlice<u8>,
    pub shared_ws: &'a CudaSlice<f32>,
    pub tokens: usize,
    pub top_k: usize,
    pub experts: usize,
    pub in_: usize,
    pub out: usize,
    pub x_tok_stride: usize,
    pub x_slot_stride: usize,
    pub xs_tok_stride: usize,
    pub xs_slot_stride: usize,
}

/// The parameters of an FP8 product of one row that a prologue computes (the norm, the
/// quantisation): everything but the prologue's input; refuses a K split chosen for fewer rows
/// than the launch's.
#[allow(clippy::too_many_arguments)]
fn fp8_row_params(
    w: Ptr,
    ws: Ptr,
    y: Ptr,
    in_: usize,
    out: usize,
    ys: usize,
    split: usize,
    fold: Option<Ptr>,
) -> Result<OrnithGemvFp8Params> {
    ensure!(split >= out, "gemv_fp8: split rows {split} < out {out}");
    Ok(OrnithGemvFp8Params {
        w: w as _,
        ws: ws as _,
        y: y as _,
        tokens: 1,
        in_: in_ as i32,
        out: out as i32,
        x_stride: in_ as i32,
        y_stride: ys as i32,
        split_out: i32of("gemv_fp8 split rows", split)?,
        fold: fold.map_or(std::ptr::null_mut(), |f| f as _),
        ..Default::default()
    })
}

impl CudaContext {
    /// What both tensor-core decode products assume: `in % 16 == 0`, strides covering the rows and
    /// keeping them 16-byte aligned (`align` elements), offsets inside int32.
    #[allow(clippy::too_many_arguments)]
    fn gemv_checks(
        x: Ptr,
        w: Ptr,
        tokens: usize,
        in_: usize,
        out: usize,
        xs: usize,
        ys: usize,
        align: usize,
    ) -> Result<()> {
        // The kernel forms activation offsets as i32 (token * x_stride * element bytes).
        ensure!(tokens >= 1 && tokens * xs * (16 / align) <= i32::MAX as usize, "gemv: {tokens} tokens of stride {xs}");
        ensure!(in_ > 0 && in_.is_multiple_of(16), "gemv: in {in_} must be a positive multiple of 16");
        ensure!(out > 0 && xs >= in_ && ys >= out, "gemv: strides x {xs} >= in {in_}, y {ys} >= out {out}");
        ensure!(xs.is_multiple_of(align), "gemv: x stride {xs} must keep rows 16-byte aligned");
        ensure!(aligned(x, 16) && aligned(w, 16), "gemv: x and w must be 16-byte aligned");
        i32of("gemv out", out)?;
        i32of("gemv y_stride", ys)?;
        Ok(())
    }

    /// `y[t, o] = bf16(Σ_i x[t, i] w[o, i])` for any number of rows (`w` BF16 `[out, in]`; rows of
    /// `x` and `y` at strides `xs`, `ys` elements): the tensor-core decode product, whose K
    /// split depends on the stored weight's shape only (`gemv_tc_ksplit` of `in` and `split`, the
    /// rows of the whole matrix when these `out` rows are a part of it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gemv_bf16(
        &self,
        x: Ptr,
        w: Ptr,
        y: Ptr,
        t: usize,
        in_: usize,
        out: usize,
        xs: usize,
        ys: usize,
        split: usize,
        fold: Option<Ptr>,
    ) -> Result<()> {
        Self::gemv_checks(x, w, t, in_, out, xs, ys, 8)?;
        ensure!(split >= out, "gemv: split rows {split} < out {out}");
        let p = OrnithGemvBf16Params {
            fold: fold.map_or(std::ptr::null_mut(), |f| f as _),
            x: x as _,
            w: w as _,
            y: y as _,
            tokens: t as i32,
            in_: in_ as i32,
            out: out as i32,
            x_stride: xs as i32,
            y_stride: ys as i32,
            split_out: i32of("gemv split rows", split)?,
            ..Default::default()
        };
        if super::gemv_staged(in_ * 2, split, t) {
            return self.wide_passes(t, in_ * 2, out, split, |t0, n| {
                let bytes = (out * in_ * 2 + n * (in_ + out) * 2) as u64 + fold_bytes(fold, n, out);
                let p = OrnithGemvBf16Params {
                    x: (x + (t0 * xs * 2) as u64) as _,
                    y: (y + (t0 * ys * 2) as u64) as _,
                    fold: fold.map_or(std::ptr::null_mut(), |f| (f + (t0 * ys * 2) as u64) as _),
                    tokens: n as i32,
                    wide_part: self.addr(&self.wide_part) as _,
                    wide_ticket: self.addr(&self.wide_ticket) as _,
                    ..p
                };
                ("gemv_bf16_staged", bytes, p)
            });
        }
        let bytes = (out * in_ * 2 + t * (in_ + out) * 2) as u64 + fold_bytes(fold, t, out);
        let (name, grid) = super::gemv_tc_launch(false, in_ * 2, out, split, t, self.wide_wave);
        self.launch(Launch::new(name, grid, super::GEMV_BLOCK, bytes).weights_first(), p)
    }

    /// The staged build's launches for a group of `t` tokens: one per
    /// [`super::WIDE_TOKENS`] tokens, in order, each with its grid ([`super::gemv_wide_grid`]);
    /// `make(t0, n)` gives the kernel, bytes and parameters of
    /// tokens `t0 .. t0 + n`. The launches share the context's partials and counters, which one
    /// launch leaves as it found them (the counters zero).
    fn wide_passes<P: super::KernelParams>(
        &self,
        t: usize,
        row_bytes: usize,
        out: usize,
        split: usize,
        make: impl Fn(usize, usize) -> (&'static str, u64, P),
    ) -> Result<()> {
        for t0 in (0..t).step_by(super::WIDE_TOKENS) {
            let n = (t - t0).min(super::WIDE_TOKENS);
            let grid = super::gemv_wide_grid(row_bytes, out, split);
            if grid.1 > 1 {
                ensure!(
                    grid.1 as usize * out <= super::WIDE_SPLIT_ROWS && grid.0 <= super::WIDE_TICKETS,
                    "gemv staged: {} K slices x {out} rows exceed the partials' {} rows or {} tiles",
                    grid.1,
                    super::WIDE_SPLIT_ROWS,
                    super::WIDE_TICKETS
                );
            }
            let (name, bytes, p) = make(t0, n);
            self.launch(Launch::new(name, grid, super::GEMV_BLOCK, bytes).smem(super::WIDE_SMEM).weights_first(), p)?;
        }
        Ok(())
    }

    /// The GDN output projection of `t` decode rows with its gated RMSNorm (gemv.cu:
    /// `gdn_out_proj`): `y[t, r] = bf16(Σ_h Σ_i g[t, h, i] w[r, h·dim + i])`, `g` the gated norm of
    /// `o` (rows of stride `os`) with `z` (stride `zs`) and `norm_w` as `gated_rmsnorm` computes
    /// it, the heads' fp32 partials added in head order; `fold` as [`Self::k_gemv_bf16`]. One launch
    /// per [`super::WIDE_TOKENS`] rows; a launch of more than `ORNITH_GDN_OUT_TICKET_TOKENS` rows
    /// adds its heads in `gdn_out_reduce` (the same adds).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gdn_out(
        &self,
        (o, os): (Ptr, usize),
        (z, zs): (Ptr, usize),
        norm_w: Ptr,
        w: Ptr,
        (y, ys): (Ptr, usize),
        fold: Option<Ptr>,
        t: usize,
        heads: usize,
        out: usize,
        eps: f32,
    ) -> Result<()> {
        let dim = ORNITH_GDN_OUT_DIM as usize;
        let in_ = heads * dim;
        ensure!(t >= 1 && heads >= 1 && out >= 1, "gdn_out_proj: {t} tokens, {heads} heads, {out} rows");
        ensure!(os >= in_ && zs >= in_ && ys >= out, "gdn_out_proj: strides o {os}, z {zs} >= {in_}; y {ys} >= {out}");
        ensure!(aligned(w, 16), "gdn_out_proj: w must be 16-byte aligned");
        ensure!(
            heads * out <= super::WIDE_SPLIT_ROWS && out.div_ceil(128) <= super::WIDE_TICKETS as usize,
            "gdn_out_proj: {heads} heads x {out} rows exceed the partials' {} rows",
            super::WIDE_SPLIT_ROWS
        );
        i32of("gdn_out_proj rows", (t.min(super::WIDE_TOKENS) - 1) * os.max(zs) + in_)?;
        for t0 in (0..t).step_by(super::WIDE_TOKENS) {
            let n = (t - t0).min(super::WIDE_TOKENS);
            let ticket = n <= ORNITH_GDN_OUT_TICKET_TOKENS as usize;
            let p = OrnithGdnOutParams {
                o: (o + (t0 * os * 2) as u64) as _,
                z: (z + (t0 * zs * 2) as u64) as _,
                norm_w: norm_w as _,
                w: w as _,
                y: (y + (t0 * ys * 2) as u64) as _,
                fold: fold.map_or(std::ptr::null_mut(), |f| (f + (t0 * ys * 2) as u64) as _),
                part: self.addr(&self.wide_part) as _,
                ticket: if ticket { self.addr(&self.wide_ticket) as _ } else { std::ptr::null_mut() },
                tokens: n as i32,
                heads: heads as i32,
                out: out as i32,
                o_stride: i32of("gdn_out_proj o stride", os)?,
                z_stride: i32of("gdn_out_proj z stride", zs)?,
                y_stride: i32of("gdn_out_proj y stride", ys)?,
                eps,
            };
            // The weights, o and z read, the partials written; with a ticket also the partials read
            // and y written (and the fold), which gdn_out_reduce counts otherwise.
            let parts = (heads * n * out * 4) as u64;
            let sums = parts + (n * out * 2) as u64 + fold_bytes(fold, n, out);
            let bytes = (out * in_ * 2 + n * in_ * 4 + dim * 2) as u64 + parts + if ticket { sums } else { 0 };
            let grid = (out.div_ceil(128) as u32, heads as u32, 1);
            self.launch(Launch::new("gdn_out_proj", grid, super::GEMV_BLOCK, bytes).weights_first(), p)?;
            if !ticket {
                self.k_gdn_out_reduce(p)?;
            }
        }
        Ok(())
    }

    /// `gdn_out_reduce`: the heads' sums of one [`Self::k_gdn_out`] launch without a ticket.
    fn k_gdn_out_reduce(&self, p: OrnithGdnOutParams) -> Result<()> {
        let (n, out, heads) = (p.tokens as usize, p.out as usize, p.heads as usize);
        ensure!(p.ticket.is_null() && n * out <= i32::MAX as usize, "gdn_out_reduce: {n} tokens x {out} rows");
        let bytes = (heads * n * out * 4 + n * out * 2) as u64 + fold_bytes((!p.fold.is_null()).then_some(0), n, out);
        self.launch(Launch::new("gdn_out_reduce", ((n * out).div_ceil(256) as u32, 1, 1), 256, bytes), p)
    }

    /// FP8 W8A8 decode product for any number of rows:
    /// `y[t, o] = bf16((Σ_i xq[t, i] w[o, i]) · xsc[t] · ws[o])`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gemv_fp8(
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
        split: usize,
        fold: Option<Ptr>,
    ) -> Result<()> {
        Self::gemv_checks(xq, w, t, in_, out, xs, ys, 16)?;
        ensure!(split >= out, "gemv_fp8: split rows {split} < out {out}");
        let p = OrnithGemvFp8Params {
            fold: fold.map_or(std::ptr::null_mut(), |f| f as _),
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
            split_out: i32of("gemv_fp8 split rows", split)?,
            ..Default::default()
        };
        if super::gemv_staged(in_, split, t) {
            return self.wide_passes(t, in_, out, split, |t0, n| {
                let bytes = (out * in_ + out * 4 + n * (in_ + 4 + out * 2)) as u64 + fold_bytes(fold, n, out);
                let p = OrnithGemvFp8Params {
                    xq: (xq + (t0 * xs) as u64) as _,
                    xs: (xsc + (t0 * 4) as u64) as _,
                    y: (y + (t0 * ys * 2) as u64) as _,
                    fold: fold.map_or(std::ptr::null_mut(), |f| (f + (t0 * ys * 2) as u64) as _),
                    tokens: n as i32,
                    wide_part: self.addr(&self.wide_part) as _,
                    wide_ticket: self.addr(&self.wide_ticket) as _,
                    ..p
                };
                ("gemv_fp8_staged", bytes, p)
            });
        }
        let bytes = (out * in_ + out * 4 + t * (in_ + 4 + out * 2)) as u64 + fold_bytes(fold, t, out);
        let (name, grid) = super::gemv_tc_launch(true, in_, out, split, t, self.wide_wave);
        self.launch(Launch::new(name, grid, super::GEMV_BLOCK, bytes).weights_first(), p)
    }

    /// What the norm-prologue products assume (`OrnithNormIn`): one row (`ORNITH_NORM_ROWS`),
    /// the norm over the product's whole input (`in` = hidden <= `ORNITH_NORM_MAX_HIDDEN`), a
    /// weight, 16-byte aligned rows; returns the dynamic shared memory (the row).
    pub(super) fn norm_checks(n: &OrnithNormIn, in_: usize, elem: usize) -> Result<u32> {
        ensure!(!n.weight.is_null() && !n.res.is_null(), "norm prologue: no weight or residual");
        ensure!(
            in_ > 0 && in_ <= NORM_MAX_HIDDEN && in_.is_multiple_of(16),
            "norm prologue: hidden {in_} (<= {NORM_MAX_HIDDEN})"
        );
        ensure!(n.eps.is_finite() && n.eps >= 0.0, "norm prologue: eps {}", n.eps);
        Ok((in_ * elem) as u32)
    }

    /// `gemv_bf16` of one row whose input is the norm of a residual row, computed by every block
    /// after its first weight loads (`OrnithNormIn`): the bits of `rmsnorm_residual` then
    /// [`Self::k_gemv_bf16`], without the norm's launch or its stores; `fold` as there.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gemv_bf16_norm(
        &self,
        norm: OrnithNormIn,
        w: Ptr,
        y: Ptr,
        in_: usize,
        out: usize,
        ys: usize,
        split: usize,
        fold: Option<Ptr>,
    ) -> Result<()> {
        let smem = Self::norm_checks(&norm, in_, 2)?;
        Self::gemv_checks(norm.res as Ptr, w, 1, in_, out, in_, ys, 8)?;
        ensure!(split >= out, "gemv_bf16_norm: split rows {split} < out {out}");
        let p = OrnithGemvBf16Params {
            w: w as _,
            y: y as _,
            tokens: 1,
            in_: in_ as i32,
            out: out as i32,
            x_stride: in_ as i32,
            y_stride: ys as i32,
            split_out: i32of("gemv split rows", split)?,
            norm,
            fold: fold.map_or(std::ptr::null_mut(), |f| f as _),
            ..Default::default()
        };
        let bytes = (out * in_ * 2 + norm_bytes(&norm, in_) + out * 2) as u64 + fold_bytes(fold, 1, out);
        let grid = (super::gemv_tc_blocks(in_ * 2, out, split), 1, 1);
        self.launch(Launch::new("gemv_bf16_norm", grid, super::GEMV_BLOCK, bytes).smem(smem).weights_first(), p)
    }

    /// `gemv_fp8` of one row whose input is the quantised norm of a residual row, computed in the
    /// prologue as [`Self::k_gemv_bf16_norm`]: the bits of `rmsnorm_residual` (FP8 out) then
    /// [`Self::k_gemv_fp8`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gemv_fp8_norm(
        &self,
        norm: OrnithNormIn,
        w: Ptr,
        ws: Ptr,
        y: Ptr,
        in_: usize,
        out: usize,
        ys: usize,
        split: usize,
        fold: Option<Ptr>,
    ) -> Result<()> {
        let smem = Self::norm_checks(&norm, in_, 1)?;
        Self::gemv_checks(norm.res as Ptr, w, 1, in_, out, in_, ys, 16)?;
        let p = OrnithGemvFp8Params { norm, ..fp8_row_params(w, ws, y, in_, out, ys, split, fold)? };
        let bytes = (out * in_ + out * 4 + norm_bytes(&norm, in_) + out * 2) as u64 + fold_bytes(fold, 1, out);
        let grid = (super::gemv_tc_blocks(in_, out, split), 1, 1);
        self.launch(Launch::new("gemv_fp8_norm", grid, super::GEMV_BLOCK, bytes).smem(smem).weights_first(), p)
    }

    /// `gemv_fp8` of one bf16 row `xb` (`in_` elements) that every block quantises itself after
    /// its first weight loads (`gemv_fp8_quant`): the bits of `quantize_fp8_rows` then
    /// [`Self::k_gemv_fp8`], without the quantisation's launch; `fold` as there.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gemv_fp8_quant(
        &self,
        xb: Ptr,
        w: Ptr,
        ws: Ptr,
        y: Ptr,
        in_: usize,
        out: usize,
        ys: usize,
        split: usize,
        fold: Option<Ptr>,
    ) -> Result<()> {
        Self::gemv_checks(xb, w, 1, in_, out, in_, ys, 16)?;
        ensure!(in_ <= 48 * 1024, "gemv_fp8_quant: a row of {in_} codes exceeds the 48 KiB of shared memory");
        let p = OrnithGemvFp8Params { xb: xb as _, ..fp8_row_params(w, ws, y, in_, out, ys, split, fold)? };
        let bytes = (out * in_ + out * 4 + in_ * 2 + out * 2) as u64 + fold_bytes(fold, 1, out);
        let grid = (super::gemv_tc_blocks(in_, out, split), 1, 1);
        self.launch(Launch::new("gemv_fp8_quant", grid, super::GEMV_BLOCK, bytes).smem(in_ as u32).weights_first(), p)
    }

    /// The expert GEMVs of a decode group (see `OrnithMoeGemvParams`): per (token, slot)
    /// (`moe_gemv_fp8`: grid (tiles, top_k + 1, tokens)), or `grouped` by expert over
    /// `moe_sort`'s groups (`moe_gemv_grouped`, the same bits; one block row per possible active
    /// expert, `min(experts, tokens · top_k)`, plus one per 8 tokens for the shared expert). Bytes count each
    /// (token, slot)'s weight rows once per pair, or each touched expert's once when grouped.
    pub(crate) fn k_moe_gemv(&self, p: OrnithMoeGemvParams, grouped: bool) -> Result<()> {
        ensure!(p.tokens > 0 && p.top_k >= 1 && p.experts >= 1, "moe_gemv: {} tokens, top_k {}", p.tokens, p.top_k);
        let (t, in_, out, k) = (p.tokens as usize, p.in_ as usize, p.out as usize, p.top_k as usize);
        let slots = k + 1;
        ensure!(in_ > 0 && in_.is_multiple_of(16) && out > 0, "moe_gemv: in {in_} % 16, out {out}");
        let (xt, xsl) = (p.x_tok_stride as usize, p.x_slot_stride as usize);
        ensure!(
            p.x_tok_stride >= 0 && p.x_slot_stride >= 0 && xt.is_multiple_of(16) && xsl.is_multiple_of(16),
            "moe_gemv: activation strides must keep 16-byte alignment"
        );
        // The kernel forms activation offsets as i32 (token * x_tok_stride + slot * x_slot_stride).
        ensure!(t * xt + k * xsl <= i32::MAX as usize, "moe_gemv: {t} tokens of stride {xt}");
        let tiles = super::moe_tc_blocks(in_, out);
        ensure!(
            p.combine.out.is_null() || (!grouped && !p.gate_up.is_null()),
            "moe_gemv: the combine epilogue is the per-slot down product's (moe_gemv_fp8_swiglu)"
        );
        if grouped {
            ensure!(p.norm.weight.is_null() && p.gate_up.is_null(), "moe_gemv_grouped has no prologue");
            ensure!(
                !p.row_info.is_null() && (p.row_info as Ptr).is_multiple_of(16) && !p.row_assign.is_null(),
                "moe_gemv_grouped needs moe_sort's groups (row_info 16-byte aligned)"
            );
            let active = (p.experts as usize).min(t * k);
            let bytes = (active + 1) * (out * in_ + out * 4) + t * slots * (in_ + 4 + out * 2);
            // The shared expert's block rows: 8 tokens each (moe_shared_row in gemv.cu).
            let rows = active + t.div_ceil(8);
            ensure!(rows <= 65535, "moe_gemv_grouped: {rows} block rows exceed grid.y");
            return self.launch(
                Launch::new("moe_gemv_grouped", (tiles, rows as u32, 1), super::GEMV_BLOCK, bytes as u64)
                    .weights_first(),
                p,
            );
        }
        ensure!(
            p.norm.weight.is_null() || p.gate_up.is_null(),
            "moe_gemv: a norm prologue or a SwiGLU prologue, not both"
        );
        if !p.gate_up.is_null() {
            // The per-(token, slot) down product with the SwiGLU prologue: each block quantises
            // its (token, slot) row of SwiGLU(gate|up) itself (in = inter; gate|up rows of 2 in).
            // It reads its routed index before its PDL wait: launch it only right after the
            // per-slot gate|up product of the same idx (gemv.cu, moe_routed_index_early).
            ensure!(
                in_ <= super::moe::SWIGLU_MAX_INTER && p.x_slot_stride as usize == in_ && xt == slots * in_,
                "moe_gemv_fp8_swiglu: inter {in_} (<= {}), x strides {xt} / {xsl} (the swiglu rows')",
                super::moe::SWIGLU_MAX_INTER
            );
            // With the combine epilogue (the decode MoE of 1 to 3 tokens): the counters and its bytes.
            let (ticket, cb) = self.combine_epilogue(&p.combine, p.y as Ptr, p.tokens, p.top_k, p.out, tiles)?;
            let p = OrnithMoeGemvParams { ticket, ..p };
            let bytes = t * slots * (out * in_ + out * 4 + 2 * in_ * 2 + out * 2) + cb;
            return self.launch(
                Launch::new("moe_gemv_fp8_swiglu", (tiles, slots as u32, t as u32), super::GEMV_BLOCK, bytes as u64)
                    .smem(in_ as u32)
                    .weights_first(),
                p,
            );
        }
        if !p.norm.weight.is_null() {
            // The per-(token, slot) form with the norm prologue: each block quantises its token's
            // normalised row itself (in = hidden, rows of the residual at stride in).
            let smem = Self::norm_checks(&p.norm, in_, 1)?;
            let bytes = t * slots * (out * in_ + out * 4 + out * 2) + t * norm_bytes(&p.norm, in_);
            return self.launch(
                Launch::new("moe_gemv_fp8_norm", (tiles, slots as u32, t as u32), super::GEMV_BLOCK, bytes as u64)
                    .smem(smem)
                    .weights_first(),
                p,
            );
        }
        let bytes = t * slots * (out * in_ + out * 4 + in_ + 4 + out * 2);
        self.launch(
            Launch::new("moe_gemv_fp8", (tiles, slots as u32, t as u32), super::GEMV_BLOCK, bytes as u64)
                .weights_first(),
            p,
        )
    }
}

// The slice-based wrappers (the kernel tests' entry points).
impl CudaContext {
    /// [`Self::k_gemv_bf16`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_bf16(
        &self,
        x: &Bf,
        w: &Bf,
        y: &mut Bf,
        tokens: usize,
        in_: usize,
        out: usize,
        x_stride: usize,
        y_stride: usize,
    ) -> Result<()> {
        ensure!(tokens >= 1, "gemv: no tokens");
        need("gemv x", x, (tokens - 1) * x_stride + in_)?;
        need("gemv w", w, out * in_)?;
        need("gemv y", y, (tokens - 1) * y_stride + out)?;
        self.k_gemv_bf16(self.addr(x), self.addr(w), self.addr(y), tokens, in_, out, x_stride, y_stride, out, None)
    }

    /// [`Self::k_gdn_out`] on buffers: `o [tokens, heads * 128]`, `z` rows of stride `z_stride`,
    /// `w [out, heads * 128]`, `y [tokens, out]` (and the residual `fold`, when given).
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_out_proj(
        &self,
        o: &Bf,
        z: &Bf,
        norm_w: &Bf,
        w: &Bf,
        y: &mut Bf,
        fold: Option<&mut Bf>,
        tokens: usize,
        heads: usize,
        out: usize,
        z_stride: usize,
        eps: f32,
    ) -> Result<()> {
        let in_ = heads * ORNITH_GDN_OUT_DIM as usize;
        ensure!(tokens >= 1, "gdn_out_proj: no tokens");
        need("gdn_out o", o, tokens * in_)?;
        need("gdn_out z", z, (tokens - 1) * z_stride + in_)?;
        need("gdn_out norm", norm_w, ORNITH_GDN_OUT_DIM as usize)?;
        need("gdn_out w", w, out * in_)?;
        need("gdn_out y", y, tokens * out)?;
        let fold = match fold {
            Some(f) => {
                need("gdn_out fold", f, tokens * out)?;
                Some(self.addr(f))
            }
            None => None,
        };
        let (o, z, n, w, y) = (self.addr(o), self.addr(z), self.addr(norm_w), self.addr(w), self.addr(y));
        self.k_gdn_out((o, in_), (z, z_stride), n, w, (y, out), fold, tokens, heads, out, eps)
    }

    /// [`Self::k_gemv_fp8`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_fp8(
        &self,
        xq: &CudaSlice<u8>,
        xs: &CudaSlice<f32>,
        w: &CudaSlice<u8>,
        ws: &CudaSlice<f32>,
        y: &mut Bf,
        tokens: usize,
        in_: usize,
        out: usize,
        x_stride: usize,
        y_stride: usize,
    ) -> Result<()> {
        ensure!(tokens >= 1, "gemv_fp8: no tokens");
        need("gemv_fp8 x", xq, (tokens - 1) * x_stride + in_)?;
        need("gemv_fp8 xs", xs, tokens)?;
        need("gemv_fp8 w", w, out * in_)?;
        need("gemv_fp8 ws", ws, out)?;
        need("gemv_fp8 y", y, (tokens - 1) * y_stride + out)?;
        let (a, b, c, d, e) = (self.addr(xq), self.addr(xs), self.addr(w), self.addr(ws), self.addr(y));
        self.k_gemv_fp8(a, b, c, d, e, tokens, in_, out, x_stride, y_stride, out, None)
    }

    /// Expert GEMV for top_k routed slots + the shared slot ([`Self::k_moe_gemv`] per pair).
    pub fn moe_gemv(&self, a: &MoeGemvArgs, y: &mut Bf) -> Result<()> {
        let p = self.moe_gemv_params(a, y)?;
        self.k_moe_gemv(p, false)
    }

    fn moe_gemv_params(&self, a: &MoeGemvArgs, y: &Bf) -> Result<OrnithMoeGemvParams> {
        let slots = a.top_k + 1;
        ensure!(a.tokens > 0, "moe_gemv: no tokens");
        need("moe_gemv idx", a.idx, a.tokens * a.top_k)?;
        need("moe_gemv w", a.w, a.experts * a.out * a.in_)?;
        need("moe_gemv ws", a.ws, a.experts * a.out)?;
        need("moe_gemv shared w", a.shared_w, a.out * a.in_)?;
        need("moe_gemv shared ws", a.shared_ws, a.out)?;
        need("moe_gemv x", a.xq, (a.tokens - 1) * a.x_tok_stride + a.top_k * a.x_slot_stride + a.in_)?;
        need("moe_gemv xs", a.xs, (a.tokens - 1) * a.xs_tok_stride + a.top_k * a.xs_slot_stride + 1)?;
        need("moe_gemv y", y, a.tokens * slots * a.out)?;
        Ok(OrnithMoeGemvParams {
            xq: self.addr(a.xq) as _,
            xs: self.addr(a.xs) as _,
            idx: self.addr(a.idx) as _,
            w: self.addr(a.w) as _,
            ws: self.addr(a.ws) as _,
            shared_w: self.addr(a.shared_w) as _,
            shared_ws: self.addr(a.shared_ws) as _,
            y: self.addr(y) as _,
            tokens: i32of("tokens", a.tokens)?,
            top_k: a.top_k as i32,
            experts: i32of("experts", a.experts)?,
            in_: i32of("in", a.in_)?,
            out: i32of("out", a.out)?,
            x_tok_stride: i32of("x_tok_stride", a.x_tok_stride)?,
            x_slot_stride: i32of("x_slot_stride", a.x_slot_stride)?,
            xs_tok_stride: i32of("xs_tok_stride", a.xs_tok_stride)?,
            xs_slot_stride: i32of("xs_slot_stride", a.xs_slot_stride)?,
            row_info: std::ptr::null(),
            row_assign: std::ptr::null(),
            norm: OrnithNormIn::default(),
            gate_up: std::ptr::null(),
            combine: OrnithMoeCombineParams::default(),
            ticket: std::ptr::null_mut(),
        })
    }

    /// [`CudaContext::moe_gemv`] grouped by expert over `g` (see `moe_gemv_grouped`): the same
    /// outputs, bit for bit.
    pub fn moe_gemv_grouped(&self, a: &MoeGemvArgs, g: &MoeGroups, y: &mut Bf) -> Result<()> {
        let mut p = self.moe_gemv_params(a, y)?;
        let [ri, ra] = g.lists(self, "moe_gemv_grouped", a.experts, a.tokens * a.top_k)?;
        (p.row_info, p.row_assign) = (ri as _, ra as _);
        self.k_moe_gemv(p, true)
    }
}
