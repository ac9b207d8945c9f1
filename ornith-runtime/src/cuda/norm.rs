//! Launchers of norm.cu: the embedding gather, residual add + RMSNorm (optionally FP8 out) and
//! per-token FP8 quantisation.
//!
//! One launcher per kernel (see [`super`]): device addresses and shapes (or the kernel's parameter
//! struct) in, the kernel's assumptions checked, grid, block, shared memory and bytes computed,
//! launched through [`CudaContext::launch`]; the CUDA backend calls these. After them, the
//! slice-based wrappers the kernel tests call, which check buffer lengths (and device-held
//! tables and slots) and convert slices to addresses. The math is in
//! `kernels/include/ornith_kernels.h`; bf16 tensors are `CudaSlice<u16>` (bit patterns), FP8
//! E4M3 codes `CudaSlice<u8>`.
use super::{aligned, i32of, need, CudaContext, Launch, Ptr};
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use ornith_kernels::bindings::*;

type Bf = CudaSlice<u16>;

impl CudaContext {
    /// `out[t] = table[ids[t]]`: rows of `hidden` bf16 (`hidden % 8 == 0`, 16-byte copies).
    pub(crate) fn k_embed(&self, ids: Ptr, table: Ptr, out: Ptr, t: usize, hidden: usize, vocab: usize) -> Result<()> {
        ensure!(t > 0 && hidden > 0 && hidden.is_multiple_of(8), "embed: tokens {t} > 0 and hidden {hidden} % 8 == 0");
        ensure!(aligned(table, 16) && aligned(out, 16), "embed: table and out must be 16-byte aligned");
        let p = OrnithEmbedParams {
            ids: ids as _,
            table: table as _,
            out: out as _,
            tokens: i32of("tokens", t)?,
            hidden: i32of("hidden", hidden)?,
            vocab: i32of("vocab", vocab)?,
        };
        self.launch(Launch::new("embed_gather", (t as u32, 1, 1), 256, (t * hidden * 4 + t * 4) as u64), p)
    }

    /// `residual += add` (if any), then zero-centred RMSNorm of `t` rows of `hidden`
    /// (`0 < hidden <= 8192`) into bf16 `out` and/or FP8 `q8 = (codes, per-row scales)`:
    /// `rmsnorm_residual_2k` up to 2,048 (8 values per thread: more blocks per SM), else
    /// `rmsnorm_residual` (32); the same bits either way.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_rmsnorm(
        &self,
        residual: Ptr,
        add: Option<Ptr>,
        w: Ptr,
        out: Option<Ptr>,
        q8: Option<(Ptr, Ptr)>,
        t: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        let kernel = if hidden <= 2048 { "rmsnorm_residual_2k" } else { "rmsnorm_residual" };
        self.k_rmsnorm_on(kernel, residual, add, w, out, q8, t, hidden, eps)
    }

    /// [`Self::k_rmsnorm`] on instance `kernel` (`rmsnorm_residual_2k` takes `hidden <= 2048`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_rmsnorm_on(
        &self,
        kernel: &'static str,
        residual: Ptr,
        add: Option<Ptr>,
        w: Ptr,
        out: Option<Ptr>,
        q8: Option<(Ptr, Ptr)>,
        t: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        let max = if kernel == "rmsnorm_residual_2k" { 2048 } else { 8192 };
        ensure!(t > 0 && hidden > 0 && hidden <= max, "{kernel}: 0 < hidden {hidden} <= {max}");
        ensure!(out.is_some() || q8.is_some(), "rmsnorm: no output requested");
        let mut p = OrnithRmsNormParams {
            residual: residual as _,
            weight: w as _,
            tokens: i32of("tokens", t)?,
            hidden: hidden as i32,
            eps,
            ..Default::default()
        };
        let mut bytes = t * hidden * 4 + hidden * 2;
        if let Some(a) = add {
            p.add = a as _;
            bytes += t * hidden * 4;
        }
        if let Some(o) = out {
            p.out = o as _;
        }
        if let Some((q, s)) = q8 {
            p.q8 = q as _;
            p.scale = s as _;
            bytes += t * (hidden + 4);
        }
        self.launch(Launch::new(kernel, (t as u32, 1, 1), 256, bytes as u64), p)
    }

    /// Per-row FP8 quantisation of `rows` contiguous rows of `cols`, compressed-tensors' form
    /// (`act_scale` / `quant_e4m3` of common.cuh): scale = bf16(amax / 448) (2^-7 if 0),
    /// q8 = e4m3(bf16(x / scale)).
    pub(crate) fn k_quant(&self, x: Ptr, q8: Ptr, scale: Ptr, rows: usize, cols: usize) -> Result<()> {
        ensure!(rows > 0 && cols > 0, "quantize: empty");
        let p = OrnithQuantParams {
            x: x as _,
            q8: q8 as _,
            scale: scale as _,
            tokens: i32of("rows", rows)?,
            cols: i32of("cols", cols)?,
        };
        self.launch(Launch::new("quantize_fp8_rows", (rows as u32, 1, 1), 256, (rows * cols * 3 + rows * 4) as u64), p)
    }
}

// The slice-based wrappers (the kernel tests' entry points).
impl CudaContext {
    /// [`Self::k_embed`] on buffers.
    pub fn embed(
        &self,
        ids: &CudaSlice<i32>,
        table: &Bf,
        out: &mut Bf,
        tokens: usize,
        hidden: usize,
        vocab: usize,
    ) -> Result<()> {
        need("embed ids", ids, tokens)?;
        need("embed table", table, vocab * hidden)?;
        need("embed out", out, tokens * hidden)?;
        self.k_embed(self.addr(ids), self.addr(table), self.addr(out), tokens, hidden, vocab)
    }

    /// [`Self::k_rmsnorm`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_residual(
        &self,
        residual: &mut Bf,
        add: Option<&Bf>,
        weight: &Bf,
        out: Option<&mut Bf>,
        q8: Option<(&mut CudaSlice<u8>, &mut CudaSlice<f32>)>,
        tokens: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        let n = tokens * hidden;
        need("rmsnorm residual", residual, n)?;
        need("rmsnorm weight", weight, hidden)?;
        if let Some(a) = add {
            need("rmsnorm add", a, n)?;
        }
        if let Some(o) = &out {
            need("rmsnorm out", o, n)?;
        }
        if let Some((q, s)) = &q8 {
            need("rmsnorm q8", q, n)?;
            need("rmsnorm scale", s, tokens)?;
        }
        self.k_rmsnorm(
            self.addr(residual),
            add.map(|a| self.addr(a)),
            self.addr(weight),
            out.map(|o| self.addr(o)),
            q8.map(|(q, s)| (self.addr(q), self.addr(s))),
            tokens,
            hidden,
            eps,
        )
    }

    /// [`Self::k_quant`] on buffers.
    pub fn quantize_fp8(
        &self,
        x: &Bf,
        q8: &mut CudaSlice<u8>,
        scale: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        need("quantize x", x, rows * cols)?;
        need("quantize q8", q8, rows * cols)?;
        need("quantize scale", scale, rows)?;
        self.k_quant(self.addr(x), self.addr(q8), self.addr(scale), rows, cols)
    }
}
