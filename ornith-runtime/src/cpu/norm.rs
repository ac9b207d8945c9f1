//! RMSNorm variants (docs/ARCHITECTURE.md §3.2 RMSNorm variants).
//!
//! * Zero-centred RMSNorm (`Qwen3_5MoeRMSNorm`: input / post-attention / final norm, q_norm,
//!   k_norm), per row of `n`, all in fp32 with one rounding:
//!   `y = bf16( (x · rsqrt(mean(x²) + eps)) · (1 + w) )`.
//! * Gated RMSNorm (`Qwen3_5MoeRMSNormGated`, GDN output, per (token, v-head) row of `dv`):
//!   `n = x · rsqrt(mean(x²) + eps)` (fp32), `n = bf16(w · bf16(n))` (the product in the weight's
//!   dtype, bf16), `y = bf16( n · silu(z) )` with `silu(z)` in fp32. The weight is plain `w`
//!   (≈ 1), not `1 + w`.
//! * [`add_rms_norm`]: the decoder's residual step `h = bf16(r + x)` followed by the zero-centred
//!   norm of `h`.
//!
//! `mean(x²)` is accumulated in fp32.

use super::{bf16_to_f32, check_len, silu};
use half::bf16;
use rayon::prelude::*;

/// Rows per rayon task (norm rows are cheap).
const ROWS_PER_TASK: usize = 8;

#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss = super::linear::dot(x, x);
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// Zero-centred RMSNorm over rows of `n`: `x [rows, n]`, `w [n]`, `y [rows, n]`.
pub fn rms_norm(x: &[bf16], w: &[bf16], n: usize, eps: f32, y: &mut [bf16]) {
    check_len("rms_norm w", w.len(), n);
    check_len("rms_norm y", y.len(), x.len());
    assert!(n > 0 && x.len().is_multiple_of(n), "rms_norm: x length {} is not a multiple of n = {n}", x.len());
    let w1: Vec<f32> = w.iter().map(|&v| 1.0 + bf16_to_f32(v)).collect();
    y.par_chunks_mut(n * ROWS_PER_TASK).zip(x.par_chunks(n * ROWS_PER_TASK)).for_each(|(yb, xb)| {
        let mut xf = vec![0f32; n];
        for (yr, xr) in yb.chunks_mut(n).zip(xb.chunks(n)) {
            for (d, &s) in xf.iter_mut().zip(xr) {
                *d = bf16_to_f32(s);
            }
            let r = inv_rms(&xf, eps);
            for ((d, &v), &g) in yr.iter_mut().zip(&xf).zip(&w1) {
                *d = bf16::from_f32((v * r) * g);
            }
        }
    });
}

/// Residual add then zero-centred RMSNorm: `r ← bf16(r + x)` (in place), `y = rms_norm(r)`.
/// Shapes: `r, x, y [rows, n]`, `w [n]`.
pub fn add_rms_norm(r: &mut [bf16], x: &[bf16], w: &[bf16], n: usize, eps: f32, y: &mut [bf16]) {
    check_len("add_rms_norm x", x.len(), r.len());
    add_into(r, x);
    rms_norm(r, w, n, eps, y);
}

/// `r ← bf16(r + x)` elementwise (the bf16 residual add).
pub fn add_into(r: &mut [bf16], x: &[bf16]) {
    check_len("add_into x", x.len(), r.len());
    r.par_chunks_mut(4096).zip(x.par_chunks(4096)).for_each(|(a, b)| {
        for (d, &s) in a.iter_mut().zip(b) {
            *d = bf16::from_f32(bf16_to_f32(*d) + bf16_to_f32(s));
        }
    });
}

/// Gated RMSNorm of the GDN block (module doc). `x, z, y [rows, n]` (a row is one token's one
/// v-head), `w [n]` (bf16: HF runs with the F32-stored weight cast to bf16).
pub fn gated_rms_norm(x: &[bf16], z: &[bf16], w: &[bf16], n: usize, eps: f32, y: &mut [bf16]) {
    check_len("gated_rms_norm w", w.len(), n);
    check_len("gated_rms_norm z", z.len(), x.len());
    check_len("gated_rms_norm y", y.len(), x.len());
    assert!(n > 0 && x.len().is_multiple_of(n), "gated_rms_norm: x length {} is not a multiple of n = {n}", x.len());
    let chunk = n * ROWS_PER_TASK;
    y.par_chunks_mut(chunk).zip(x.par_chunks(chunk)).zip(z.par_chunks(chunk)).for_each(|((yb, xb), zb)| {
        let mut xf = vec![0f32; n];
        for ((yr, xr), zr) in yb.chunks_mut(n).zip(xb.chunks(n)).zip(zb.chunks(n)) {
            for (d, &s) in xf.iter_mut().zip(xr) {
                *d = bf16_to_f32(s);
            }
            let r = inv_rms(&xf, eps);
            for (((d, &v), &wi), &zi) in yr.iter_mut().zip(&xf).zip(w).zip(zr) {
                let nb = bf16::from_f32(v * r).to_f32();
                let wn = bf16::from_f32(bf16_to_f32(wi) * nb).to_f32();
                *d = bf16::from_f32(wn * silu(bf16_to_f32(zi)));
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::*;

    fn ref_rms(x: &[f64], w: &[f64], eps: f64, zero_centred: bool) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(v, g)| v * r * if zero_centred { 1.0 + g } else { *g }).collect()
    }

    // Tolerance: the reference is exact; the implementation rounds once to bf16 (unit roundoff
    // u = 2^-8 relative) after fp32 arithmetic (~1e-6 relative): (u + 1e-5) · |ref|.
    #[test]
    fn rms_norm_matches_f64() {
        let mut r = rng(10);
        for &(rows, n) in &[(1, 8), (5, 64), (3, 2048), (7, 256)] {
            let x = uniform_bf16(&mut r, rows * n, 4.0);
            let w = uniform_bf16(&mut r, n, 0.5);
            let mut y = vec![bf16::ZERO; rows * n];
            rms_norm(&x, &w, n, 1e-6, &mut y);
            for i in 0..rows {
                let want = ref_rms(&f64s(&x[i * n..(i + 1) * n]), &f64s(&w), 1e-6, true);
                for (g, e) in y[i * n..(i + 1) * n].iter().zip(&want) {
                    assert!((g.to_f64() - e).abs() <= e.abs() * (1.0 / 256.0 + 1e-5) + 1e-30, "{g} vs {e}");
                }
            }
        }
    }

    #[test]
    fn add_rms_norm_rounds_residual() {
        let mut r = rng(11);
        let n = 64;
        let mut res = uniform_bf16(&mut r, 2 * n, 100.0);
        let x = uniform_bf16(&mut r, 2 * n, 0.1);
        let w = uniform_bf16(&mut r, n, 0.5);
        let want_r: Vec<bf16> = res.iter().zip(&x).map(|(a, b)| bf16::from_f32(a.to_f32() + b.to_f32())).collect();
        let mut want_y = vec![bf16::ZERO; 2 * n];
        rms_norm(&want_r, &w, n, 1e-6, &mut want_y);
        let mut y = vec![bf16::ZERO; 2 * n];
        add_rms_norm(&mut res, &x, &w, n, 1e-6, &mut y);
        assert_eq!(res, want_r);
        assert_eq!(y, want_y);
    }

    /// f64 gated norm; `one_plus_w` is the wrong (zero-centred) variant used as a negative control.
    fn ref_gated(x: &[f64], z: &[f64], w: &[f64], one_plus_w: bool) -> Vec<f64> {
        let n = ref_rms(x, &vec![1.0; x.len()], 1e-6, false);
        n.iter()
            .zip(z)
            .zip(w)
            .map(|((v, zi), wi)| v * if one_plus_w { 1.0 + wi } else { *wi } * (zi / (1.0 + (-zi).exp())))
            .collect()
    }

    // Tolerance: three bf16 roundings (bf16(n), bf16(w·n), final), each ≤ u = 2^-8 relative, plus
    // fp32 arithmetic (~1e-6): (3u + 1e-5)·|ref|, and 1e-6 absolute for values near 0.
    #[test]
    fn gated_rms_norm_matches_f64_and_rejects_one_plus_w() {
        let mut r = rng(12);
        let (rows, n) = (12, 128);
        let x = uniform_bf16(&mut r, rows * n, 2.0);
        let z = uniform_bf16(&mut r, rows * n, 3.0);
        // Weight ≈ 1 as in the checkpoint (plain scale, init ones).
        let w: Vec<bf16> = uniform(&mut r, n, 0.2).iter().map(|v| bf16::from_f32(1.0 + v)).collect();
        let mut y = vec![bf16::ZERO; rows * n];
        gated_rms_norm(&x, &z, &w, n, 1e-6, &mut y);
        let mut wrong_max = 0f64;
        for i in 0..rows {
            let s = i * n..(i + 1) * n;
            let want = ref_gated(&f64s(&x[s.clone()]), &f64s(&z[s.clone()]), &f64s(&w), false);
            let wrong = ref_gated(&f64s(&x[s.clone()]), &f64s(&z[s.clone()]), &f64s(&w), true);
            for ((g, e), b) in y[s].iter().zip(&want).zip(&wrong) {
                let tol = |v: f64| v.abs() * (3.0 / 256.0 + 1e-5) + 1e-6;
                assert!((g.to_f64() - e).abs() <= tol(*e), "{g} vs {e}");
                wrong_max = wrong_max.max((g.to_f64() - b).abs() - tol(*b));
            }
        }
        assert!(wrong_max > 0.1, "the (1+w) variant is not rejected: excess {wrong_max}");
    }

    #[test]
    fn gated_rms_norm_rounds_n_before_weight() {
        // The HF cast order is observable: compare with the same math without the bf16(n) step.
        let mut r = rng(13);
        let (rows, n) = (64, 128);
        let x = uniform_bf16(&mut r, rows * n, 2.0);
        let z = uniform_bf16(&mut r, rows * n, 3.0);
        let w: Vec<bf16> = uniform(&mut r, n, 0.2).iter().map(|v| bf16::from_f32(1.0 + v)).collect();
        let mut y = vec![bf16::ZERO; rows * n];
        gated_rms_norm(&x, &z, &w, n, 1e-6, &mut y);
        let mut differ = 0;
        for i in 0..rows {
            let xf: Vec<f32> = x[i * n..(i + 1) * n].iter().map(|v| v.to_f32()).collect();
            let rr = inv_rms(&xf, 1e-6);
            for j in 0..n {
                let clean = bf16::from_f32(xf[j] * rr * w[j].to_f32() * silu(z[i * n + j].to_f32()));
                differ += (clean != y[i * n + j]) as usize;
            }
        }
        assert!(differ > 0, "bf16(n) rounding had no effect on {} values", rows * n);
    }
}
