// Numerics model of flash_attn_prefill (old: 32-key tiles, e^x; new: 64-key tiles, 2^x with
// log2e folded) against the CPU reference (cpu::attention + output_gate), with
// flash_attention_matches_reference's tolerance: |d| <= ulps * ulp(want) + 2^-9 max|v|, rel L2
// <= 2^-8. Models the cast points (fp32 scores, tile-wise online softmax, P rounded to bf16, fp32
// accumulation, bf16 output and gate), not the mma's summation order. Its own inputs (an LCG, the
// test's distributions), not the test's. `cargo run --release --offline` here; output in
// ../fa_numerics.txt.
use half::bf16;
use rayon::prelude::*;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}
fn bfv(r: &mut Rng, n: usize, s: f32) -> Vec<f32> {
    (0..n).map(|_| bf16::from_f32(r.next() * s).to_f32()).collect()
}
fn rbf(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
fn ulp(v: f64) -> f64 {
    2f64.powi(v.abs().max(1e-30).log2().floor() as i32 - 7)
}

// mode 0: reference; 1: old kernel; 2: new kernel
fn run(mode: u32, q: &[f32], k: &[f32], v: &[f32], g: Option<&[f32]>, t: usize, p0: usize, h: usize, hkv: usize) -> Vec<f32> {
    let hd = 256;
    let row = hkv * hd;
    let scale = 1.0f32 / 16.0;
    let mut out = vec![0f32; t * h * hd];
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (tt, head) = (idx / h, idx % h);
        let kvh = head / (h / hkv);
        let qr = &q[idx * hd..(idx + 1) * hd];
        let n = p0 + tt + 1;
        let s: Vec<f32> = (0..n).map(|j| dot(qr, &k[j * row + kvh * hd..][..hd])).collect();
        let mut acc = vec![0f32; hd];
        let l;
        if mode == 0 {
            let sv: Vec<f32> = s.iter().map(|x| x * scale).collect();
            let m = sv.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let p: Vec<f32> = sv.iter().map(|x| (x - m).exp()).collect();
            l = p.iter().sum::<f32>();
            for j in 0..n {
                let vr = &v[j * row + kvh * hd..][..hd];
                for d in 0..hd {
                    acc[d] += p[j] * vr[d];
                }
            }
        } else {
            let bk = if mode == 1 { 32 } else { 64 };
            let c2 = scale * std::f32::consts::LOG2_E;
            let (mut m, mut ll) = (f32::NEG_INFINITY, 0f32);
            let mut j0 = 0;
            while j0 < n {
                let j1 = (j0 + bk).min(n);
                let (alpha, p): (f32, Vec<f32>) = if mode == 1 {
                    let vs: Vec<f32> = s[j0..j1].iter().map(|x| x * scale).collect();
                    let mx = vs.iter().copied().fold(m, f32::max);
                    let a = (m - mx).exp();
                    m = mx;
                    (a, vs.iter().map(|x| (x - mx).exp()).collect())
                } else {
                    let raw = s[j0..j1].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mx = m.max(raw * c2);
                    let a = (m - mx).exp2();
                    m = mx;
                    (a, s[j0..j1].iter().map(|x| x.mul_add(c2, -mx).exp2()).collect())
                };
                ll = ll * alpha + p.iter().sum::<f32>();
                for d in 0..hd {
                    acc[d] *= alpha;
                }
                for (jj, &pj) in p.iter().enumerate() {
                    let pb = rbf(pj);
                    let vr = &v[(j0 + jj) * row + kvh * hd..][..hd];
                    for d in 0..hd {
                        acc[d] += pb * vr[d];
                    }
                }
                j0 = j1;
            }
            l = ll;
        }
        for d in 0..hd {
            let mut x = rbf(acc[d] / l);
            if let Some(g) = g {
                let gv = g[idx * 2 * hd + hd + d];
                x = rbf(x * rbf(1.0 / (1.0 + (-gv).exp())));
            }
            o[d] = x;
        }
    });
    out
}

fn main() {
    let (h, hkv, hd) = (16, 2, 256);
    let mut r = Rng(24);
    let cases = [(1, 0, true), (37, 0, false), (64, 0, true), (130, 5, true), (200, 77, false), (65, 300, true), (96, 5000, true), (130, 9003, false), (64, 2000, false), (300, 1000, true)];
    for (t, p0, gated) in cases {
        let total = p0 + t;
        let q = bfv(&mut r, t * h * hd, 2.0);
        let k = bfv(&mut r, total * hkv * hd, 2.0);
        let v = bfv(&mut r, total * hkv * hd, 1.0);
        let g = bfv(&mut r, t * h * 2 * hd, 3.0);
        let gg = if gated { Some(&g[..]) } else { None };
        let want = run(0, &q, &k, &v, gg, t, p0, h, hkv);
        let vmax = v.iter().fold(0f32, |a, x| a.max(x.abs())) as f64;
        let rms = (want.iter().map(|w| (*w as f64).powi(2)).sum::<f64>() / want.len() as f64).sqrt();
        let ulps = if gated { 2.0 } else { 1.0 };
        let abs = 2f64.powi(-9) * vmax;
        let mut line = format!("t {t:>4} p0 {p0:>5} gated {gated:>5}:");
        for mode in [1, 2] {
            let got = run(mode, &q, &k, &v, gg, t, p0, h, hkv);
            let (mut worst, mut num, mut den) = (0f64, 0f64, 0f64);
            for (&gv, &wv) in got.iter().zip(&want) {
                let (gv, wv) = (gv as f64, wv as f64);
                let d = (gv - wv).abs();
                worst = worst.max(d / (ulps * ulp(wv) + abs));
                num += d * d;
                den += wv * wv;
            }
            line += &format!("  {}: max |d|/tol {:.3}, rel L2 {:.2e} (tol {:.2e})", if mode == 1 { "old" } else { "new" }, worst, (num / den).sqrt(), 2f64.powi(-8));
        }
        println!("{line}");
    }
}
