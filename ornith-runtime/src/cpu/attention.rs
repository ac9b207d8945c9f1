//! Gated full attention pieces (docs/ARCHITECTURE.md §3.5 Gated attention, §6 items 8–9).
//!
//! Layer order (the lead wires it): `qg = x @ q_proj` → [`split_q_gate`] → q/k RMSNorm per head
//! (`norm::rms_norm` with `n = head_dim`, zero-centred) → [`apply_rope`] on q and k → write k
//! (after norm + RoPE) and v (raw) into the cache at positions `p0..p0+T` → [`attention`] →
//! [`output_gate`] → `o_proj`.
//!
//! * q_proj output per token is head-major `[H, 2·hd]`: per head the first `hd` values are the
//!   query, the next `hd` the output gate.
//! * RoPE (HF `Qwen3_5MoeTextRotaryEmbedding` + `apply_rotary_pos_emb`, text-only so mRoPE reduces
//!   to 1-D): `inv_freq[i] = 1 / θ^(2i/r)` (f32, i < r/2, r = rotary_dim), `f = pos · inv_freq[i]`
//!   (f32), `cos = bf16(cos f)`, `sin = bf16(sin f)` over `cat(f, f)`; on the first r dims of each
//!   head, NeoX pairs (i, i + r/2): `x' = bf16( bf16(x · cos) + bf16(rotate_half(x) · sin) )`
//!   with `rotate_half(x) = cat(−x[r/2..r], x[0..r/2])` (bf16 arithmetic, as HF); dims ≥ r pass.
//! * Attention, causal GQA: q head `h` uses kv head `h / (H/Hkv)`; for the query at position p,
//!   `s_j = (q·k_j) · hd^-0.5` over cached positions j ≤ p, `p = softmax(s)`, `o = Σ p_j v_j`, all
//!   in fp32, one bf16 rounding (SDPA-style fp32 internals).
//! * Output gate: `o = bf16( o · bf16(sigmoid(gate)) )` elementwise over `H·hd`.

use super::{bf16_to_f32, check_len, sigmoid};
use half::bf16;
use rayon::prelude::*;

/// Splits `qg [t, h, 2·hd]` into `q [t, h, hd]` and `gate [t, h·hd]`.
pub fn split_q_gate(qg: &[bf16], t: usize, h: usize, hd: usize, q: &mut [bf16], gate: &mut [bf16]) {
    check_len("split_q_gate qg", qg.len(), t * h * 2 * hd);
    check_len("split_q_gate q", q.len(), t * h * hd);
    check_len("split_q_gate gate", gate.len(), t * h * hd);
    for (i, blk) in qg.chunks_exact(2 * hd).enumerate() {
        q[i * hd..(i + 1) * hd].copy_from_slice(&blk[..hd]);
        gate[i * hd..(i + 1) * hd].copy_from_slice(&blk[hd..]);
    }
}

/// bf16 `cos` and `sin` tables for one position, each `[rotary_dim]` = `cat(f, f)` (module doc).
pub fn rope_cos_sin(pos: usize, rotary_dim: usize, theta: f32, cos: &mut [bf16], sin: &mut [bf16]) {
    assert!(rotary_dim.is_multiple_of(2), "rope: rotary_dim {rotary_dim} must be even");
    check_len("rope cos", cos.len(), rotary_dim);
    check_len("rope sin", sin.len(), rotary_dim);
    let half = rotary_dim / 2;
    for i in 0..half {
        let inv_freq = 1.0 / theta.powf((2 * i) as f32 / rotary_dim as f32);
        let f = pos as f32 * inv_freq;
        let (c, s) = (bf16::from_f32(f.cos()), bf16::from_f32(f.sin()));
        cos[i] = c;
        cos[i + half] = c;
        sin[i] = s;
        sin[i + half] = s;
    }
}

/// Partial NeoX RoPE in place on `x [t, heads, hd]` for positions `pos0..pos0+t` (module doc).
pub fn apply_rope(x: &mut [bf16], t: usize, heads: usize, hd: usize, rotary_dim: usize, pos0: usize, theta: f32) {
    check_len("apply_rope x", x.len(), t * heads * hd);
    assert!(rotary_dim <= hd, "apply_rope: rotary_dim {rotary_dim} > head_dim {hd}");
    let half = rotary_dim / 2;
    x.par_chunks_mut(heads * hd).enumerate().for_each(|(tt, row)| {
        let (mut cos, mut sin) = (vec![bf16::ZERO; rotary_dim], vec![bf16::ZERO; rotary_dim]);
        rope_cos_sin(pos0 + tt, rotary_dim, theta, &mut cos, &mut sin);
        let mul = |a: f32, b: bf16| bf16::from_f32(a * bf16_to_f32(b)).to_f32();
        for head in row.chunks_exact_mut(hd) {
            let xr: Vec<f32> = head[..rotary_dim].iter().map(|&v| bf16_to_f32(v)).collect();
            for i in 0..rotary_dim {
                let rot = if i < half { -xr[i + half] } else { xr[i - half] };
                head[i] = bf16::from_f32(mul(xr[i], cos[i]) + mul(rot, sin[i]));
            }
        }
    });
}

/// Causal GQA attention of `t` new queries at positions `p0..p0+t` over a cache (module doc).
/// `q [t, h, hd]`; `k_cache, v_cache [ctx, hkv, hd]` holding at least positions `0..p0+t`;
/// `out [t, h·hd]`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[bf16],
    t: usize,
    p0: usize,
    k_cache: &[bf16],
    v_cache: &[bf16],
    h: usize,
    hkv: usize,
    hd: usize,
    out: &mut [bf16],
) {
    assert!(hkv > 0 && h.is_multiple_of(hkv), "attention: heads {h} must be a multiple of kv heads {hkv}");
    check_len("attention q", q.len(), t * h * hd);
    check_len("attention out", out.len(), t * h * hd);
    check_len("attention v_cache", v_cache.len(), k_cache.len());
    let row = hkv * hd;
    assert!(
        k_cache.len().is_multiple_of(row) && k_cache.len() / row >= p0 + t,
        "attention: cache of {} values holds fewer than p0 + t = {} positions of {row}",
        k_cache.len(),
        p0 + t
    );
    let group = h / hkv;
    let scale = (hd as f32).powf(-0.5);
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (tt, head) = (idx / h, idx % h);
        let kvh = head / group;
        let qf: Vec<f32> = q[idx * hd..(idx + 1) * hd].iter().map(|&v| bf16_to_f32(v)).collect();
        let n = p0 + tt + 1;
        let mut kf = vec![0f32; hd];
        let mut s = vec![0f32; n];
        for (j, sj) in s.iter_mut().enumerate() {
            for (d, &v) in kf.iter_mut().zip(&k_cache[j * row + kvh * hd..][..hd]) {
                *d = bf16_to_f32(v);
            }
            *sj = super::linear::dot(&qf, &kf) * scale;
        }
        let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f32;
        for sj in s.iter_mut() {
            *sj = (*sj - m).exp();
            z += *sj;
        }
        let mut acc = vec![0f32; hd];
        for (j, &pj) in s.iter().enumerate() {
            for (a, &v) in acc.iter_mut().zip(&v_cache[j * row + kvh * hd..][..hd]) {
                *a += pj * bf16_to_f32(v);
            }
        }
        for (d, a) in o.iter_mut().zip(&acc) {
            *d = bf16::from_f32(a / z);
        }
    });
}

/// `o ← bf16(o · bf16(sigmoid(gate)))` elementwise.
pub fn output_gate(o: &mut [bf16], gate: &[bf16]) {
    check_len("output_gate gate", gate.len(), o.len());
    for (x, &g) in o.iter_mut().zip(gate) {
        let sg = bf16::from_f32(sigmoid(bf16_to_f32(g))).to_f32();
        *x = bf16::from_f32(bf16_to_f32(*x) * sg);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::norm::rms_norm;
    use crate::cpu::testutil::*;

    const U: f64 = 1.0 / 256.0; // bf16 unit roundoff

    /// f64 RoPE on one head; `interleaved` pairs (2i, 2i+1) instead of (i, i+r/2) (negative control).
    fn ref_rope(x: &[f64], pos: usize, r: usize, theta: f64, interleaved: bool) -> Vec<f64> {
        let mut y = x.to_vec();
        for i in 0..r / 2 {
            let f = pos as f64 / theta.powf((2 * i) as f64 / r as f64);
            let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + r / 2) };
            y[a] = x[a] * f.cos() - x[b] * f.sin();
            y[b] = x[b] * f.cos() + x[a] * f.sin();
        }
        y
    }

    // Tolerance: cos/sin rounded to bf16 (u each), both products rounded (u), the sum rounded (u):
    // |err| ≤ 2u·(|x_a cos| + |x_b sin|) + u·|y| ≤ 2u·(|x_a| + |x_b|) + u·|y|, plus 2e-6·(|x_a|+|x_b|)
    // for the f32 angle at large positions (pos·inv_freq has relative error ~2^-24).
    #[test]
    fn rope_matches_f64_and_rejects_interleaved_pairs() {
        let mut r = rng(30);
        let (t, heads, hd, rd, theta) = (6, 3, 32, 8, 1e7f32);
        for &pos0 in &[0usize, 5, 100_000] {
            let x = uniform_bf16(&mut r, t * heads * hd, 3.0);
            let mut y = x.clone();
            apply_rope(&mut y, t, heads, hd, rd, pos0, theta);
            let mut excess_bad = 0f64;
            for tt in 0..t {
                for hh in 0..heads {
                    let s = (tt * heads + hh) * hd;
                    let xs = f64s(&x[s..s + hd]);
                    let want = ref_rope(&xs, pos0 + tt, rd, theta as f64, false);
                    let bad = ref_rope(&xs, pos0 + tt, rd, theta as f64, true);
                    for i in 0..hd {
                        let partner = if i < rd { xs[(i + rd / 2) % rd] } else { 0.0 };
                        let tol = (2.0 * U + 2e-6) * (xs[i].abs() + partner.abs()) + U * want[i].abs();
                        let g = y[s + i].to_f64();
                        assert!((g - want[i]).abs() <= tol, "pos {} dim {i}: {g} vs {}", pos0 + tt, want[i]);
                        if i >= rd {
                            assert_eq!(y[s + i], x[s + i], "pass-through dim changed");
                        }
                        excess_bad = excess_bad.max((g - bad[i]).abs() - tol);
                    }
                }
            }
            if pos0 > 0 {
                assert!(excess_bad > 0.1, "interleaved RoPE not rejected at pos0 {pos0}");
            }
        }
    }

    /// f64 causal GQA attention; `tile`: the wrong kv mapping `h % hkv` (negative control).
    #[allow(clippy::too_many_arguments)]
    fn ref_attn(
        q: &[bf16],
        t: usize,
        p0: usize,
        kc: &[bf16],
        vc: &[bf16],
        h: usize,
        hkv: usize,
        hd: usize,
        tile: bool,
    ) -> Vec<f64> {
        let mut o = vec![0f64; t * h * hd];
        for tt in 0..t {
            for hh in 0..h {
                let kvh = if tile { hh % hkv } else { hh / (h / hkv) };
                let qs = f64s(&q[(tt * h + hh) * hd..][..hd]);
                let n = p0 + tt + 1;
                let s: Vec<f64> = (0..n)
                    .map(|j| {
                        let ks = &kc[(j * hkv + kvh) * hd..][..hd];
                        qs.iter().zip(ks).map(|(a, b)| a * b.to_f64()).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                for j in 0..n {
                    let p = (s[j] - m).exp() / z;
                    for d in 0..hd {
                        o[(tt * h + hh) * hd + d] += p * vc[(j * hkv + kvh) * hd + d].to_f64();
                    }
                }
            }
        }
        o
    }

    // Tolerance: fp32 scores/softmax/sums (~1e-6 relative to max|v|) and one bf16 rounding of the
    // output (u·|ref|): u·|ref| + 1e-5·max|v|.
    #[test]
    fn attention_matches_f64_and_rejects_tiled_kv_heads() {
        let mut r = rng(31);
        let (h, hkv, hd) = (4, 2, 32);
        for &(t, p0) in &[(1usize, 0usize), (7, 0), (3, 9)] {
            let ctx = p0 + t;
            let q = uniform_bf16(&mut r, t * h * hd, 1.0);
            let kc = uniform_bf16(&mut r, ctx * hkv * hd, 1.0);
            let vc = uniform_bf16(&mut r, ctx * hkv * hd, 2.0);
            let mut o = vec![bf16::ZERO; t * h * hd];
            attention(&q, t, p0, &kc, &vc, h, hkv, hd, &mut o);
            let want = ref_attn(&q, t, p0, &kc, &vc, h, hkv, hd, false);
            let bad = ref_attn(&q, t, p0, &kc, &vc, h, hkv, hd, true);
            let mut excess = 0f64;
            for ((g, e), b) in o.iter().zip(&want).zip(&bad) {
                let tol = |v: f64| U * v.abs() + 1e-5 * 2.0;
                assert!((g.to_f64() - e).abs() <= tol(*e), "t{t} p0 {p0}: {g} vs {e}");
                excess = excess.max((g.to_f64() - b).abs() - tol(*b));
            }
            if ctx > 1 {
                assert!(excess > 0.05, "tiled kv heads not rejected (t {t}, p0 {p0})");
            }
        }
    }

    /// One attention step through norm, RoPE, cache write and attention, as the layer does it.
    #[allow(clippy::too_many_arguments)]
    fn step(
        q_raw: &[bf16],
        k_raw: &[bf16],
        v_raw: &[bf16],
        t: usize,
        p0: usize,
        kc: &mut [bf16],
        vc: &mut [bf16],
        nw: &[bf16],
    ) -> Vec<bf16> {
        let (h, hkv, hd, rd) = (4, 2, 32, 8);
        let mut q = vec![bf16::ZERO; q_raw.len()];
        rms_norm(q_raw, nw, hd, 1e-6, &mut q);
        let mut k = vec![bf16::ZERO; k_raw.len()];
        rms_norm(k_raw, nw, hd, 1e-6, &mut k);
        apply_rope(&mut q, t, h, hd, rd, p0, 1e7);
        apply_rope(&mut k, t, hkv, hd, rd, p0, 1e7);
        kc[p0 * hkv * hd..(p0 + t) * hkv * hd].copy_from_slice(&k);
        vc[p0 * hkv * hd..(p0 + t) * hkv * hd].copy_from_slice(v_raw);
        let mut o = vec![bf16::ZERO; t * h * hd];
        attention(&q, t, p0, &kc[..(p0 + t) * hkv * hd], &vc[..(p0 + t) * hkv * hd], h, hkv, hd, &mut o);
        o
    }

    #[test]
    fn prefill_then_decode_equals_longer_prefill() {
        let mut r = rng(32);
        let (h, hkv, hd, t0, n) = (4, 2, 32, 6, 3);
        let t = t0 + n;
        let q = uniform_bf16(&mut r, t * h * hd, 2.0);
        let k = uniform_bf16(&mut r, t * hkv * hd, 2.0);
        let v = uniform_bf16(&mut r, t * hkv * hd, 2.0);
        let nw = uniform_bf16(&mut r, hd, 0.3);
        let (mut kc, mut vc) = (vec![bf16::ZERO; 16 * hkv * hd], vec![bf16::ZERO; 16 * hkv * hd]);
        let full = step(&q, &k, &v, t, 0, &mut kc, &mut vc, &nw);
        let (mut kc2, mut vc2) = (vec![bf16::ZERO; 16 * hkv * hd], vec![bf16::ZERO; 16 * hkv * hd]);
        let (qs, ks) = (h * hd, hkv * hd);
        let mut inc = step(&q[..t0 * qs], &k[..t0 * ks], &v[..t0 * ks], t0, 0, &mut kc2, &mut vc2, &nw);
        for i in t0..t {
            let r1 = i..i + 1;
            inc.extend(step(
                &q[r1.start * qs..r1.end * qs],
                &k[i * ks..(i + 1) * ks],
                &v[i * ks..(i + 1) * ks],
                1,
                i,
                &mut kc2,
                &mut vc2,
                &nw,
            ));
        }
        // Bit-identical: each query's sums run over the same keys in the same order.
        assert_eq!(inc, full);
        assert_eq!(kc, kc2);
    }

    #[test]
    fn split_and_gate() {
        let (t, h, hd) = (2, 2, 3);
        let qg: Vec<bf16> = (0..t * h * 2 * hd).map(|i| bf16::from_f32(i as f32)).collect();
        let (mut q, mut g) = (vec![bf16::ZERO; t * h * hd], vec![bf16::ZERO; t * h * hd]);
        split_q_gate(&qg, t, h, hd, &mut q, &mut g);
        let f = |v: &[bf16]| v.iter().map(|x| x.to_f32() as u32).collect::<Vec<_>>();
        assert_eq!(f(&q), [0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19, 20]);
        assert_eq!(f(&g), [3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 23]);
        // Gate: sigmoid rounded to bf16 before the product.
        let mut o = [bf16::from_f32(3.0)];
        output_gate(&mut o, &[bf16::from_f32(0.7)]);
        let sg = bf16::from_f32(sigmoid(bf16::from_f32(0.7).to_f32())).to_f32();
        assert_eq!(o[0], bf16::from_f32(3.0 * sg));
    }

    /// Real widths (16 query / 2 kv heads of 256, 100 tokens) against the f64 reference with the
    /// tolerance of `attention_matches_f64_and_rejects_tiled_kv_heads`: u·|ref| + 1e-5·max|v|
    /// (max|v| = 1 here). It still holds at head_dim 256: a score's fp32 error is about
    /// sqrt(256)·2^-24·Σ|q k|·256^-0.5 ~ 1e-6, so each probability moves by ~1e-6 relative.
    /// (The timing this test printed before is for `ornith-bench`, not CI.)
    #[test]
    fn real_dims_match_f64() {
        let mut r = rng(33);
        let (t, h, hkv, hd) = (100, 16, 2, 256);
        let q = uniform_bf16(&mut r, t * h * hd, 1.0);
        let kc = uniform_bf16(&mut r, t * hkv * hd, 1.0);
        let vc = uniform_bf16(&mut r, t * hkv * hd, 1.0);
        let mut o = vec![bf16::ZERO; t * h * hd];
        attention(&q, t, 0, &kc, &vc, h, hkv, hd, &mut o);
        let want = ref_attn(&q, t, 0, &kc, &vc, h, hkv, hd, false);
        for (i, (g, e)) in o.iter().zip(&want).enumerate() {
            let tol = U * e.abs() + 1e-5;
            assert!((g.to_f64() - e).abs() <= tol, "[{}, {}]: {g} vs {e}", i / (h * hd), i % (h * hd));
        }
    }
}
