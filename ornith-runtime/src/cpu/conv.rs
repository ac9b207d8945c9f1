//! Causal depthwise conv1d + SiLU of the GDN block (docs/ARCHITECTURE.md §3.4 Gated DeltaNet, §6 item 5).
//!
//! Per channel c with weight `w[c, 0..K]` (`conv1d.weight[:, 0, :]`, K = 4) over the time axis of
//! `x [T, C]` (the pre-conv `in_proj_qkv` output), extended on the left by the state
//! `s [K-1, C]` (the last K-1 pre-conv rows, oldest first; zeros at sequence start):
//!
//! ```text
//! ext     = [s ; x]                                    [K-1+T, C]
//! conv    = bf16( Σ_{j<K} w[c,j] · ext[t+j, c] )        fp32 accumulation, one rounding (F.conv1d in bf16)
//! y[t,c]  = bf16( silu(conv) )                          SiLU on the bf16 conv output (HF torch path)
//! s'      = last K-1 rows of ext                        the updated state
//! ```
//!
//! `w[c, K-1]` multiplies the current token (cross-correlation, no flip). Prefill from zero state,
//! prefill continuing a state and single-token decode are the same function.

use super::{bf16_to_f32, check_len, silu};
use half::bf16;
use rayon::prelude::*;

/// Causal depthwise conv + SiLU (module doc). `x [t, c]`, `w [c, k]`, `state [k-1, c]` (updated in
/// place), `y [t, c]`.
pub fn conv_silu(x: &[bf16], t: usize, c: usize, w: &[bf16], k: usize, state: &mut [bf16], y: &mut [bf16]) {
    assert!(k >= 1, "conv_silu: kernel size must be ≥ 1");
    check_len("conv_silu x", x.len(), t * c);
    check_len("conv_silu w", w.len(), c * k);
    check_len("conv_silu state", state.len(), (k - 1) * c);
    check_len("conv_silu y", y.len(), t * c);
    let ext: Vec<bf16> = state.iter().chain(x.iter()).copied().collect();
    let wf: Vec<f32> = w.iter().map(|&v| bf16_to_f32(v)).collect();
    y.par_chunks_mut(c).enumerate().for_each(|(tt, yr)| {
        for (ch, d) in yr.iter_mut().enumerate() {
            let mut acc = 0f32;
            for j in 0..k {
                acc += wf[ch * k + j] * bf16_to_f32(ext[(tt + j) * c + ch]);
            }
            let conv = bf16::from_f32(acc).to_f32();
            *d = bf16::from_f32(silu(conv));
        }
    });
    let n = ext.len();
    state.copy_from_slice(&ext[n - (k - 1) * c..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::*;

    #[test]
    fn prefill_then_decode_equals_longer_prefill() {
        let mut r = rng(20);
        let (c, k, t0, n) = (24, 4, 5, 4);
        let x = uniform_bf16(&mut r, (t0 + n) * c, 2.0);
        let w = uniform_bf16(&mut r, c * k, 1.0);
        let mut s_full = vec![bf16::ZERO; (k - 1) * c];
        let mut y_full = vec![bf16::ZERO; (t0 + n) * c];
        conv_silu(&x, t0 + n, c, &w, k, &mut s_full, &mut y_full);
        let mut s = vec![bf16::ZERO; (k - 1) * c];
        let mut y = vec![bf16::ZERO; t0 * c];
        conv_silu(&x[..t0 * c], t0, c, &w, k, &mut s, &mut y);
        for i in 0..n {
            let mut y1 = vec![bf16::ZERO; c];
            conv_silu(&x[(t0 + i) * c..(t0 + i + 1) * c], 1, c, &w, k, &mut s, &mut y1);
            y.extend_from_slice(&y1);
        }
        // Bit-identical: the same sums in the same order.
        assert_eq!(y, y_full);
        assert_eq!(s, s_full);
        // The state is the last K-1 pre-conv rows.
        assert_eq!(&s[..], &x[(t0 + n - (k - 1)) * c..]);
    }

    /// f64 reference, returns (conv, y); `flip` reverses the taps (negative control).
    fn reference(x: &[bf16], t: usize, c: usize, w: &[bf16], k: usize, flip: bool) -> (Vec<f64>, Vec<f64>) {
        let mut y = vec![0f64; t * c];
        let mut cv = vec![0f64; t * c];
        for tt in 0..t {
            for ch in 0..c {
                let mut acc = 0f64;
                for j in 0..k {
                    let src = tt as isize + j as isize - (k as isize - 1);
                    if src >= 0 {
                        let tap = if flip { k - 1 - j } else { j };
                        acc += w[ch * k + tap].to_f64() * x[src as usize * c + ch].to_f64();
                    }
                }
                cv[tt * c + ch] = acc;
                y[tt * c + ch] = acc / (1.0 + (-acc).exp());
            }
        }
        (cv, y)
    }

    // Tolerance: two bf16 roundings with unit roundoff u = 2^-8: the conv output (error ≤ u·|conv|,
    // carried through SiLU whose slope is within [-0.1, 1.1]) and the SiLU output (≤ u·|y|), plus
    // fp32 arithmetic: 1.1·u·|conv| + u·|y| + 1e-6.
    #[test]
    fn matches_f64_and_rejects_flipped_taps() {
        let mut r = rng(21);
        let (t, c, k) = (9, 16, 4);
        let x = uniform_bf16(&mut r, t * c, 2.0);
        let w = uniform_bf16(&mut r, c * k, 1.0);
        let mut s = vec![bf16::ZERO; (k - 1) * c];
        let mut y = vec![bf16::ZERO; t * c];
        conv_silu(&x, t, c, &w, k, &mut s, &mut y);
        let (cv, want) = reference(&x, t, c, &w, k, false);
        let (cv_bad, wrong) = reference(&x, t, c, &w, k, true);
        let u = 1.0 / 256.0;
        let tol = |conv: f64, y: f64| 1.1 * u * conv.abs() + u * y.abs() + 1e-6;
        let mut excess = 0f64;
        for (i, g) in y.iter().enumerate() {
            let g = g.to_f64();
            assert!((g - want[i]).abs() <= tol(cv[i], want[i]), "{g} vs {}", want[i]);
            excess = excess.max((g - wrong[i]).abs() - tol(cv_bad[i], wrong[i]));
        }
        assert!(excess > 0.1, "flipped taps not rejected");
    }
}
