//! Linear layers `y = x @ W^T` with the checkpoint's `[out, in]` weight.
//!
//! * BF16: `y[t,o] = bf16( Σ_i x[t,i] · w[o,i] )`, fp32 accumulation, one rounding
//!   (what `nn.Linear` / cuBLAS do for bf16).
//! * FP8 W8A8 (docs/DESIGN.md "FP8 W8A8 arithmetic"): each x row is quantised per token
//!   ([`quantize_act_row`]: codes `qx[t,·]`, scale `sx[t]`), then
//!   `y[t,o] = bf16( (Σ_i e4m3(qx[t,i]) · e4m3(w8[o,i])) · sx[t] · sw[o] )`: E4M3 values decoded
//!   exactly to f32 (every product of two E4M3 values is exact in f32), fp32 accumulation,
//!   then `(acc · sx) · sw` in f32 and one bf16 rounding.
//! * NVFP4A16: each weight row is dequantised as compressed-tensors does
//!   ([`model_spec::nvfp4`]: `bf16(e2m1 · f32(e4m3 scale / global))`), then the BF16 product:
//!   `y[t,o] = bf16( Σ_i x[t,i] · w[o,i] )` — bit for bit [`linear_bf16`] on the dequantised weight.
//!
//! Shapes: `x [t, n_in]`, `w [n_out, n_in]`, `w_scale [n_out]`, `y [t, n_out]`.
//! Work is split over blocks of output rows (rayon); inside, one decoded weight row is dotted with
//! up to four x rows at a time (16 f32 lanes each, so the loops vectorise).

use super::fp8::quantize_act_row;
use super::{bf16_to_f32, check_len};
use half::bf16;
use model_spec::fp8::E4M3_TABLE;
use rayon::prelude::*;

/// A Linear's weight in one of the two stored formats.
#[derive(Clone, Copy, Debug)]
pub enum LinearWeight<'a> {
    /// `[n_out, n_in]` bf16.
    Bf16(&'a [bf16]),
    /// `[n_out, n_in]` E4M3 codes and the per-output-channel scale `[n_out]` (the stored
    /// `weight_scale`, widened to f32).
    Fp8 { w: &'a [u8], scale: &'a [f32] },
    /// The same stored FP8 weight computed the way the transformers oracle simulates it
    /// ([`linear_fp8_fake_quant`]); for tests that explain the oracle, never for serving.
    Fp8FakeQuant { w: &'a [u8], scale: &'a [f32] },
    /// NVFP4: packed E2M1 codes `[n_out, n_in/2]`, E4M3 group scales `[n_out, n_in/16]` (bytes as
    /// stored) and the global scale.
    Nvfp4 { packed: &'a [u8], scale: &'a [u8], global: f32 },
}

impl LinearWeight<'_> {
    /// `y = x @ W^T` with this weight's arithmetic (see the module doc).
    pub fn apply(&self, x: &[bf16], t: usize, n_in: usize, n_out: usize, y: &mut [bf16]) {
        match *self {
            LinearWeight::Bf16(w) => linear_bf16(x, w, t, n_in, n_out, y),
            LinearWeight::Fp8 { w, scale } => linear_fp8(x, w, scale, t, n_in, n_out, y),
            LinearWeight::Fp8FakeQuant { w, scale } => linear_fp8_fake_quant(x, w, scale, t, n_in, n_out, y),
            LinearWeight::Nvfp4 { packed, scale, global } => linear_nvfp4(x, packed, scale, global, t, n_in, n_out, y),
        }
    }
}

/// `y = bf16(x @ W^T)` with fp32 accumulation (module doc).
pub fn linear_bf16(x: &[bf16], w: &[bf16], t: usize, n_in: usize, n_out: usize, y: &mut [bf16]) {
    check_len("linear_bf16 x", x.len(), t * n_in);
    check_len("linear_bf16 w", w.len(), n_out * n_in);
    check_len("linear_bf16 y", y.len(), t * n_out);
    let xf: Vec<f32> = x.iter().map(|&v| bf16_to_f32(v)).collect();
    gemm(
        &xf,
        t,
        n_in,
        n_out,
        |o, row| {
            for (d, &s) in row.iter_mut().zip(&w[o * n_in..(o + 1) * n_in]) {
                *d = bf16_to_f32(s);
            }
        },
        |_, _, acc| acc,
        y,
    );
}

/// NVFP4A16 linear (module doc): the weight row is dequantised to bf16 exactly as
/// compressed-tensors' decompressor does, then dotted like [`linear_bf16`].
#[allow(clippy::too_many_arguments)]
pub fn linear_nvfp4(
    x: &[bf16],
    packed: &[u8],
    scale: &[u8],
    global: f32,
    t: usize,
    n_in: usize,
    n_out: usize,
    y: &mut [bf16],
) {
    use model_spec::nvfp4::{code, dequant, group_scale, GROUP};
    assert!(n_in.is_multiple_of(GROUP), "linear_nvfp4: n_in {n_in} is not a multiple of {GROUP}");
    check_len("linear_nvfp4 x", x.len(), t * n_in);
    check_len("linear_nvfp4 packed", packed.len(), n_out * n_in / 2);
    check_len("linear_nvfp4 scale", scale.len(), n_out * n_in / GROUP);
    check_len("linear_nvfp4 y", y.len(), t * n_out);
    let xf: Vec<f32> = x.iter().map(|&v| bf16_to_f32(v)).collect();
    gemm(
        &xf,
        t,
        n_in,
        n_out,
        |o, row| {
            let (p, s) = (&packed[o * n_in / 2..][..n_in / 2], &scale[o * n_in / GROUP..][..n_in / GROUP]);
            for (g, chunk) in row.chunks_exact_mut(GROUP).enumerate() {
                let gs = group_scale(s[g], global);
                for (k, d) in chunk.iter_mut().enumerate() {
                    *d = bf16_to_f32(dequant(code(p, g * GROUP + k), gs));
                }
            }
        },
        |_, _, acc| acc,
        y,
    );
}

/// FP8 W8A8 linear (module doc). `w8 [n_out, n_in]` E4M3 codes, `w_scale [n_out]`.
pub fn linear_fp8(x: &[bf16], w8: &[u8], w_scale: &[f32], t: usize, n_in: usize, n_out: usize, y: &mut [bf16]) {
    check_len("linear_fp8 x", x.len(), t * n_in);
    check_len("linear_fp8 w8", w8.len(), n_out * n_in);
    check_len("linear_fp8 w_scale", w_scale.len(), n_out);
    check_len("linear_fp8 y", y.len(), t * n_out);
    let (xf, sx) = quantize_rows(x, t, n_in);
    gemm(
        &xf,
        t,
        n_in,
        n_out,
        |o, row| {
            for (d, &c) in row.iter_mut().zip(&w8[o * n_in..(o + 1) * n_in]) {
                *d = E4M3_TABLE[c as usize];
            }
        },
        |tt, o, acc| acc * sx[tt] * w_scale[o],
        y,
    );
}

/// Per-token quantisation of `x [t, n_in]`: the E4M3 values decoded exactly to f32 (unscaled)
/// and the per-token scales `sx [t]`.
fn quantize_rows(x: &[bf16], t: usize, n_in: usize) -> (Vec<f32>, Vec<f32>) {
    let mut xf = vec![0f32; t * n_in];
    let mut sx = vec![0f32; t];
    xf.par_chunks_mut(n_in.max(1)).zip(x.par_chunks(n_in.max(1))).zip(sx.par_iter_mut()).for_each(|((xr, src), s)| {
        let mut q = vec![0u8; n_in];
        *s = quantize_act_row(src, &mut q);
        for (d, &c) in xr.iter_mut().zip(&q) {
            *d = E4M3_TABLE[c as usize];
        }
    });
    (xf, sx)
}

/// The transformers oracle's simulation of W8A8 (compressed-tensors decompression + fake
/// quantisation), used only to explain the oracle in tests — the engine computes [`linear_fp8`].
/// Weights are dequantised to bf16, `wd[o,i] = bf16(e4m3(w8[o,i]) · sw[o])`; each activation row
/// is quantised per token and dequantised to bf16, `xd[t,i] = bf16(e4m3(qx[t,i]) · sx[t])`; then a
/// bf16 Linear: `y = bf16(Σ_i xd[t,i] · wd[o,i])` with fp32 accumulation. It differs from
/// [`linear_fp8`] only by the two bf16 roundings of dequantised values (≤ 2^-9 relative each).
pub fn linear_fp8_fake_quant(
    x: &[bf16],
    w8: &[u8],
    w_scale: &[f32],
    t: usize,
    n_in: usize,
    n_out: usize,
    y: &mut [bf16],
) {
    check_len("linear_fp8_fake_quant x", x.len(), t * n_in);
    check_len("linear_fp8_fake_quant w8", w8.len(), n_out * n_in);
    check_len("linear_fp8_fake_quant w_scale", w_scale.len(), n_out);
    check_len("linear_fp8_fake_quant y", y.len(), t * n_out);
    let round = |v: f32| bf16::from_f32(v).to_f32();
    // Dequantised activations, rounded to bf16 as compressed-tensors' fake quantisation does.
    let (mut xf, sx) = quantize_rows(x, t, n_in);
    xf.par_chunks_mut(n_in.max(1)).zip(&sx).for_each(|(xr, &s)| xr.iter_mut().for_each(|v| *v = round(*v * s)));
    gemm(
        &xf,
        t,
        n_in,
        n_out,
        |o, row| {
            for (d, &c) in row.iter_mut().zip(&w8[o * n_in..(o + 1) * n_in]) {
                *d = round(E4M3_TABLE[c as usize] * w_scale[o]);
            }
        },
        |_, _, acc| acc,
        y,
    );
}

/// Output rows per rayon task.
const OUT_BLOCK: usize = 16;

/// Shared driver: `y[t,o] = bf16(epilogue(t, o, Σ_i xf[t,i] · wrow_o[i]))` where `decode(o, buf)`
/// writes weight row `o` as f32 into `buf`.
fn gemm<D, E>(xf: &[f32], t: usize, n_in: usize, n_out: usize, decode: D, epilogue: E, y: &mut [bf16])
where
    D: Fn(usize, &mut [f32]) + Sync,
    E: Fn(usize, usize, f32) -> f32 + Sync,
{
    if t == 0 || n_out == 0 {
        return;
    }
    // Transposed result [n_out, t], then one pass into y [t, n_out].
    let mut yt = vec![0f32; n_out * t];
    yt.par_chunks_mut(OUT_BLOCK * t).enumerate().for_each(|(blk, out)| {
        let mut wrow = vec![0f32; n_in];
        for (j, col) in out.chunks_mut(t).enumerate() {
            let o = blk * OUT_BLOCK + j;
            decode(o, &mut wrow);
            let mut tt = 0;
            while tt + 4 <= t {
                let r = dot4(&wrow, &xf[tt * n_in..(tt + 4) * n_in], n_in);
                for k in 0..4 {
                    col[tt + k] = epilogue(tt + k, o, r[k]);
                }
                tt += 4;
            }
            while tt < t {
                col[tt] = epilogue(tt, o, dot(&wrow, &xf[tt * n_in..(tt + 1) * n_in]));
                tt += 1;
            }
        }
    });
    y.par_chunks_mut(n_out).enumerate().for_each(|(tt, row)| {
        for (o, d) in row.iter_mut().enumerate() {
            *d = bf16::from_f32(yt[o * t + tt]);
        }
    });
}

const LANES: usize = 16;

/// Σ a_i b_i in f32 with 16 partial sums (summed pairwise at the end).
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    // The tail is added one product at a time onto the reduced sum, as `dot4` does, so a row's
    // result does not depend on how many rows are computed together (batch invariance).
    let mut r = reduce(&acc);
    for (x, y) in ra.iter().zip(rb) {
        r += x * y;
    }
    r
}

/// Four dot products of `w` with the four consecutive rows of `x4` (`[4, n]`).
#[inline]
fn dot4(w: &[f32], x4: &[f32], n: usize) -> [f32; 4] {
    let (x0, rest) = x4.split_at(n);
    let (x1, rest) = rest.split_at(n);
    let (x2, x3) = rest.split_at(n);
    let mut a = [[0f32; LANES]; 4];
    let full = n / LANES * LANES;
    let mut i = 0;
    while i < full {
        let wv = &w[i..i + LANES];
        let (v0, v1, v2, v3) = (&x0[i..i + LANES], &x1[i..i + LANES], &x2[i..i + LANES], &x3[i..i + LANES]);
        for l in 0..LANES {
            a[0][l] += wv[l] * v0[l];
            a[1][l] += wv[l] * v1[l];
            a[2][l] += wv[l] * v2[l];
            a[3][l] += wv[l] * v3[l];
        }
        i += LANES;
    }
    let mut r = [reduce(&a[0]), reduce(&a[1]), reduce(&a[2]), reduce(&a[3])];
    for j in full..n {
        r[0] += w[j] * x0[j];
        r[1] += w[j] * x1[j];
        r[2] += w[j] * x2[j];
        r[3] += w[j] * x3[j];
    }
    r
}

#[inline]
fn reduce(acc: &[f32; LANES]) -> f32 {
    let mut s = [0f32; 8];
    for l in 0..8 {
        s[l] = acc[l] + acc[l + 8];
    }
    ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::fp8::dequantize_row;
    use crate::cpu::testutil::*;
    use model_spec::fp8::{e4m3_from_f32, e4m3_to_f32};
    use rand::Rng;

    /// One bf16 ulp at |v| (spacing of bf16 numbers around v).
    fn bf16_ulp(v: f64) -> f64 {
        let a = v.abs().max(1e-30);
        2f64.powi(a.log2().floor() as i32 - 7)
    }

    // Tolerance for both tests: the reference is the exact (f64) sum rounded to bf16; the fp32
    // accumulation error (≤ n·2^-24·Σ|x w| ≈ 1e-4 relative here) can move the result across a
    // bf16 rounding boundary, so one bf16 ulp is allowed, and nothing more.
    #[test]
    fn bf16_matches_f64() {
        let mut r = rng(2);
        for &(t, n_in, n_out) in &[(1, 7, 5), (3, 33, 17), (9, 256, 40), (5, 1000, 3)] {
            let x = uniform_bf16(&mut r, t * n_in, 2.0);
            let w = uniform_bf16(&mut r, n_out * n_in, 0.5);
            let mut y = vec![bf16::ZERO; t * n_out];
            linear_bf16(&x, &w, t, n_in, n_out, &mut y);
            for tt in 0..t {
                for o in 0..n_out {
                    let exact: f64 = (0..n_in).map(|i| x[tt * n_in + i].to_f64() * w[o * n_in + i].to_f64()).sum();
                    let got = y[tt * n_out + o].to_f64();
                    assert!((got - exact).abs() <= bf16_ulp(exact), "t{tt} o{o}: {got} vs {exact}");
                }
            }
        }
    }

    #[test]
    fn fp8_matches_f64_on_dequantised_values() {
        let mut r = rng(3);
        for &(t, n_in, n_out) in &[(1, 16, 8), (6, 300, 33), (4, 2048, 12)] {
            let x = uniform_bf16(&mut r, t * n_in, 3.0);
            let w8: Vec<u8> = (0..n_out * n_in).map(|_| e4m3_from_f32(r.random_range(-400.0..400.0))).collect();
            let ws: Vec<f32> = (0..n_out).map(|_| bf16::from_f32(r.random_range(1e-4..1e-2)).to_f32()).collect();
            let mut y = vec![bf16::ZERO; t * n_out];
            linear_fp8(&x, &w8, &ws, t, n_in, n_out, &mut y);
            for tt in 0..t {
                let mut q = vec![0u8; n_in];
                let sx = quantize_act_row(&x[tt * n_in..(tt + 1) * n_in], &mut q);
                let mut xd = vec![0f32; n_in];
                dequantize_row(&q, sx, &mut xd);
                for o in 0..n_out {
                    let exact: f64 =
                        (0..n_in).map(|i| xd[i] as f64 * e4m3_to_f32(w8[o * n_in + i]) as f64 * ws[o] as f64).sum();
                    let got = y[tt * n_out + o].to_f64();
                    assert!((got - exact).abs() <= bf16_ulp(exact), "t{tt} o{o}: {got} vs {exact}");
                }
            }
        }
    }

    /// NVFP4: the product is the BF16 Linear on the weight compressed-tensors would dequantise
    /// (model_spec::nvfp4, checked against its decompressor in tests/tests/golden_nvfp4.rs), bit
    /// for bit, and a row's result does not depend on how many rows run with it.
    #[test]
    fn nvfp4_matches_reference() {
        let mut r = rng(11);
        for &(t, n_in, n_out) in &[(1, 16, 8), (6, 64, 33), (5, 2048, 12)] {
            let x = uniform_bf16(&mut r, t * n_in, 3.0);
            let packed: Vec<u8> = (0..n_out * n_in / 2).map(|_| r.random::<u8>()).collect();
            // E4M3 scales of normal and subnormal magnitude (codes 0x01..0x7e, no NaN).
            let scale: Vec<u8> = (0..n_out * n_in / 16).map(|_| r.random_range(1u8..0x7f)).collect();
            let global = 2688.0 / r.random_range(0.5f32..8.0);
            let wd = model_spec::nvfp4::dequantize(&packed, &scale, global, n_out, n_in);
            let mut want = vec![bf16::ZERO; t * n_out];
            linear_bf16(&x, &wd, t, n_in, n_out, &mut want);
            let mut got = vec![bf16::ZERO; t * n_out];
            LinearWeight::Nvfp4 { packed: &packed, scale: &scale, global }.apply(&x, t, n_in, n_out, &mut got);
            assert_eq!(got, want, "t {t} n_in {n_in} n_out {n_out}");
            for tt in 0..t {
                let mut one = vec![bf16::ZERO; n_out];
                linear_nvfp4(&x[tt * n_in..(tt + 1) * n_in], &packed, &scale, global, 1, n_in, n_out, &mut one);
                assert_eq!(one, got[tt * n_out..(tt + 1) * n_out], "row {tt} alone");
            }
        }
    }

    #[test]
    fn fp8_quantises_activations() {
        // Negative control: a W8A8 linear must differ from the bf16 linear on the dequantised
        // weight (the activation quantisation error, ~2^-5 relative, is far above one bf16 ulp).
        let mut r = rng(4);
        let (t, n_in, n_out) = (4, 256, 16);
        let x = uniform_bf16(&mut r, t * n_in, 3.0);
        let w8: Vec<u8> = (0..n_out * n_in).map(|_| e4m3_from_f32(r.random_range(-400.0..400.0))).collect();
        let ws = vec![1.0 / 256.0; n_out];
        let wd: Vec<bf16> = w8.iter().map(|&c| bf16::from_f32(e4m3_to_f32(c) / 256.0)).collect();
        let (mut y8, mut yb) = (vec![bf16::ZERO; t * n_out], vec![bf16::ZERO; t * n_out]);
        linear_fp8(&x, &w8, &ws, t, n_in, n_out, &mut y8);
        linear_bf16(&x, &wd, t, n_in, n_out, &mut yb);
        let differing =
            y8.iter().zip(&yb).filter(|(a, b)| (a.to_f64() - b.to_f64()).abs() > bf16_ulp(b.to_f64())).count();
        assert!(differing > t * n_out / 2, "only {differing} outputs differ");
    }

    /// Real widths (in_proj_qkv of a ~100-token prompt: 2048 -> 8192; 102 rows, so both the
    /// four-row and the one-row dot paths run), both formats against exact f64 sums on every 7th
    /// output column of every row (and the last column). Tolerance, a worst-case bound for any
    /// fp32 summation order: the products are exact in f32 (bf16 x bf16, E4M3 x E4M3); an n-term
    /// fp32 sum is within γ = (n-1)u/(1-(n-1)u) ≤ 1.34·n·u (u = 2^-24, n = 2048) of Σ|terms| of
    /// the exact sum; the FP8 epilogue's two f32 products add ≤ 2u relative; the final bf16
    /// rounding of a value v adds ≤ 2^-8|v| ≤ ulp(exact) + 2^-8·(v's error). So
    /// |got - exact| ≤ ulp(exact) + 2·n·u·Σ|terms| (+ 2^-22·|exact| for FP8). Here that is about
    /// 2 ulps of a typical output; a wrong row, column, scale or missing block is off by the
    /// output's own size. (The timing this test printed before belongs in `ornith-bench`.)
    #[test]
    fn real_dims_match_f64() {
        let mut r = rng(5);
        let (t, n_in, n_out) = (102, 2048, 8192);
        let x = uniform_bf16(&mut r, t * n_in, 1.0);
        let w = uniform_bf16(&mut r, n_out * n_in, 0.05);
        let w8: Vec<u8> = (0..n_out * n_in).map(|i| (i * 37 % 251) as u8 & 0x77).collect();
        let ws: Vec<f32> = (0..n_out).map(|o| bf16::from_f32(1e-3 * (1 + o % 7) as f32).to_f32()).collect();
        let (mut yb, mut y8) = (vec![bf16::ZERO; t * n_out], vec![bf16::ZERO; t * n_out]);
        linear_bf16(&x, &w, t, n_in, n_out, &mut yb);
        linear_fp8(&x, &w8, &ws, t, n_in, n_out, &mut y8);
        let fp32 = 2.0 * n_in as f64 * 2f64.powi(-24);
        let cols: Vec<usize> = (0..n_out).step_by(7).chain([n_out - 1]).collect();
        for tt in 0..t {
            let xr = &x[tt * n_in..(tt + 1) * n_in];
            let mut q = vec![0u8; n_in];
            let sx = quantize_act_row(xr, &mut q) as f64;
            for &o in &cols {
                let (mut e, mut a) = (0f64, 0f64);
                for (xi, wi) in xr.iter().zip(&w[o * n_in..(o + 1) * n_in]) {
                    let p = xi.to_f64() * wi.to_f64();
                    e += p;
                    a += p.abs();
                }
                let got = yb[tt * n_out + o].to_f64();
                assert!((got - e).abs() <= bf16_ulp(e) + fp32 * a, "bf16 t{tt} o{o}: {got} vs {e}");
                let (mut e8, mut a8) = (0f64, 0f64);
                for (&qi, &wi) in q.iter().zip(&w8[o * n_in..(o + 1) * n_in]) {
                    let p = e4m3_to_f32(qi) as f64 * e4m3_to_f32(wi) as f64;
                    e8 += p;
                    a8 += p.abs();
                }
                let s = sx * ws[o] as f64;
                let (e8, a8) = (e8 * s, a8 * s);
                let got = y8[tt * n_out + o].to_f64();
                let tol = bf16_ulp(e8) + fp32 * a8 + 2f64.powi(-22) * e8.abs();
                assert!((got - e8).abs() <= tol, "fp8 t{tt} o{o}: {got} vs {e8}");
            }
        }
    }
}
