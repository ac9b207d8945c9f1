//! Prefill kernels against the CPU reference ops (`crate::cpu`), `#[ignore]`d (CI has no GPU):
//! `cargo test -p ornith-runtime prefill -- --ignored --test-threads=1`. Each test also prints a
//! `PERF` line at the real 2K-token shapes (median of 20 event-timed launches after 3 warm-ups).
use super::attention::*;
use super::gdn::*;
use super::moe::*;
use super::test_util::{ctx, digest, page, reversed_table, rng, same_bits_with_few_blocks, time_it, KVB, POISON, R};
use crate::cpu::attention::{attention, output_gate};
use crate::cpu::conv::conv_silu;
use crate::cpu::fp8::quantize_act_row;
use crate::cpu::gdn::{gated_delta_rule, GdnDims};
use crate::cpu::linear::{linear_bf16, linear_fp8, LinearWeight};
use crate::cpu::moe::{moe, route, Mlp, MoeWeights};
use half::bf16;
use rand::Rng;

/// The H200's dense bf16 tensor-core rate (TFLOP/s); FP8 through mma.sync runs at the same rate.
const H200_MMA_TFLOPS: f64 = 790.0;

fn bfv(r: &mut R, n: usize, scale: f32) -> Vec<bf16> {
    (0..n).map(|_| bf16::from_f32(r.random_range(-1.0f32..1.0) * scale)).collect()
}
fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|b| b.to_bits()).collect()
}
fn fp8v(r: &mut R, n: usize) -> Vec<u8> {
    // random finite E4M3 codes (0x7f / 0xff are NaN)
    (0..n)
        .map(|_| loop {
            let b: u8 = r.random();
            if b & 0x7f != 0x7f {
                break b;
            }
        })
        .collect()
}
/// Cheap deterministic finite E4M3 codes for the large timing-only weights.
fn fp8_pattern(n: usize, seed: u64) -> Vec<u8> {
    (0..n as u64).map(|i| ((i.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(seed) >> 40) as u8) & 0x7E).collect()
}
/// Spacing of bf16 numbers at |v| (one ulp).
fn ulp(v: f64) -> f64 {
    2f64.powi(v.abs().max(1e-30).log2().floor() as i32 - 7)
}

/// Elementwise check of a bf16 output against a reference that went through the same cast points:
/// |got - want| <= ulps * ulp(want) + abs_rms * rms(want) for every element, no NaN/unwritten
/// element, and ||got - want|| / ||want|| <= rel_l2. Returns (max |d| / rms, rel_l2).
fn check(name: &str, got: &[u16], want: &[f64], ulps: f64, abs_rms: f64, rel_l2: f64) -> (f64, f64) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let rms = (want.iter().map(|w| w * w).sum::<f64>() / want.len() as f64).sqrt();
    let (mut num, mut den, mut worst) = (0.0, 0.0, 0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = bf16::from_bits(g).to_f64();
        assert!(g.is_finite(), "{name}[{i}]: got {g} (unwritten or NaN), want {w}");
        let d = (g - w).abs();
        assert!(d <= ulps * ulp(w) + abs_rms * rms, "{name}[{i}]: got {g}, want {w} (rms {rms})");
        worst = worst.max(d / rms.max(1e-300));
        num += d * d;
        den += w * w;
    }
    let rel = (num / den.max(1e-300)).sqrt();
    assert!(rel <= rel_l2, "{name}: relative L2 error {rel} > {rel_l2}");
    (worst, rel)
}

// ---------------------------------------------------------------------------------------------
// GEMMs

/// FP8 prefill GEMM = `cpu::linear::linear_fp8` (which quantises x itself with `quantize_act_row`;
/// the GPU quantises with `quantize_fp8_ct`, whose codes and scales must be bit-identical).
/// Tolerance: both sum the same exact E4M3 products in fp32, in different orders (the GPU in
/// 128-code partial sums). For these random data the order changes the fp32 sum by about
/// sqrt(K) * 2^-24 * sum|terms| ~ 1e-4 * rms, so a result can land on the other side of a bf16
/// rounding boundary: 1 ulp, plus 2^-10 * rms for the order noise (8x its typical size); L2 2^-9.
/// A wrong scale, row, code or missing K slice gives errors of order rms.
#[test]
#[ignore]
fn gemm_fp8_matches_reference() {
    let mut c = ctx();
    let mut r = rng(21);
    // (rows, in, out, a_stride, y_stride): decode-size, odd rows/outputs, MoE (2048 -> 1024 gate_up,
    // 512 -> 2048 down), an `in` that is 16 mod 128, strided A and y.
    for (t, inp, out, xs, ys) in [
        (1, 2048, 512, 2048, 512),
        (7, 2048, 1000, 2048, 1000),
        (133, 2048, 8192, 2048, 8192),
        (300, 2048, 1024, 2048, 1024),
        (257, 512, 2048, 512, 2048),
        (129, 528, 257, 528, 257),
        (65, 256, 136, 272, 140),
    ] {
        let x = bfv(&mut r, t * inp, 3.0);
        let w = fp8v(&mut r, out * inp);
        let ws: Vec<f32> = (0..out).map(|_| bf16::from_f32(r.random_range(1e-4f32..1e-2)).to_f32()).collect();
        let mut dsc = c.upload(&vec![-1f32; t]).unwrap();
        // GPU quantisation, checked bit for bit against the CPU codec
        let dxc = c.upload(&bits(&x)).unwrap();
        let mut dqc = c.upload(&vec![0xAAu8; t * inp]).unwrap();
        c.quantize_fp8_ct(&dxc, &mut dqc, &mut dsc, t, inp).unwrap();
        let (gq, gs) = (c.download(&dqc).unwrap(), c.download(&dsc).unwrap());
        for tt in 0..t {
            let mut q = vec![0u8; inp];
            let s = quantize_act_row(&x[tt * inp..(tt + 1) * inp], &mut q);
            assert_eq!(gs[tt], s, "quantize_fp8_ct scale of row {tt}");
            assert_eq!(&gq[tt * inp..(tt + 1) * inp], &q[..], "quantize_fp8_ct codes of row {tt}");
        }
        // strided codes for the GEMM
        let mut qpad = vec![0x7Fu8; (t - 1) * xs + inp]; // NaN codes in the padding
        for tt in 0..t {
            qpad[tt * xs..tt * xs + inp].copy_from_slice(&gq[tt * inp..(tt + 1) * inp]);
        }
        let dq = c.upload(&qpad).unwrap();
        let (dw, dws) = (c.upload(&w).unwrap(), c.upload(&ws).unwrap());
        let mut y = c.upload(&vec![POISON; (t - 1) * ys + out]).unwrap();
        c.gemm_fp8(&dq, &dsc, &dw, &dws, &mut y, t, inp, out, xs, ys).unwrap();
        let gy = c.download(&y).unwrap();
        same_bits_with_few_blocks(&mut c, &format!("gemm_fp8 t{t} {inp}->{out}"), &gy, |c| {
            c.gemm_fp8(&dq, &dsc, &dw, &dws, &mut y, t, inp, out, xs, ys).unwrap();
            c.download(&y).unwrap()
        });
        let mut want = vec![bf16::ZERO; t * out];
        linear_fp8(&x, &w, &ws, t, inp, out, &mut want);
        let got: Vec<u16> = (0..t).flat_map(|tt| gy[tt * ys..tt * ys + out].to_vec()).collect();
        let want: Vec<f64> = want.iter().map(|v| v.to_f64()).collect();
        let (worst, rel) =
            check(&format!("gemm_fp8 t{t} {inp}->{out}"), &got, &want, 1.0, 2f64.powi(-10), 2f64.powi(-9));
        eprintln!("gemm_fp8 t{t} {inp}->{out}: max |d|/rms {worst:.2e}, rel L2 {rel:.2e}, bits {:016x}", digest(&got));
        for tt in 0..t.saturating_sub(1) {
            assert!(
                gy[tt * ys + out..(tt + 1) * ys].iter().all(|&v| v == POISON),
                "gemm_fp8 wrote past `out` in row {tt}"
            );
        }
    }
    // Timing at the real prefill shapes: 2048 tokens, hidden 2048 -> 512 .. 8192, MoE-size down 512 -> 2048.
    for (t, inp, out) in
        [(2048, 2048, 8192), (2048, 2048, 4096), (2048, 2048, 512), (2048, 512, 2048), (8192, 2048, 8192)]
    {
        let (dq, dsc) = (c.upload(&fp8_pattern(t * inp, 1)).unwrap(), c.upload(&vec![1e-3f32; t]).unwrap());
        let (dw, dws) = (c.upload(&fp8_pattern(out * inp, 2)).unwrap(), c.upload(&vec![1e-3f32; out]).unwrap());
        let mut y = c.alloc::<u16>(t * out).unwrap();
        let s = time_it(&c, || c.gemm_fp8(&dq, &dsc, &dw, &dws, &mut y, t, inp, out, inp, out).unwrap());
        let tf = 2.0 * (t * inp * out) as f64 / s / 1e12;
        eprintln!(
            "PERF gemm_fp8 {t}x{inp} -> {out}: {:.1} us, {tf:.0} TFLOP/s ({:.0}% of {H200_MMA_TFLOPS})",
            s * 1e6,
            100.0 * tf / H200_MMA_TFLOPS
        );
    }
}

/// BF16 prefill GEMM = `cpu::linear::linear_bf16`. Tolerance: same fp32 products in another
/// order: 1 ulp across a rounding boundary + 2^-10 rms order noise; L2 2^-9.
#[test]
#[ignore]
fn gemm_bf16_matches_reference() {
    let mut c = ctx();
    let mut r = rng(22);
    for (t, inp, out) in [(1, 2048, 257), (5, 2048, 257), (300, 2048, 8192), (129, 4096, 2048), (77, 136, 33)] {
        let x = bfv(&mut r, t * inp, 2.0);
        let w = bfv(&mut r, out * inp, 0.1);
        let (dx, dw) = (c.upload(&bits(&x)).unwrap(), c.upload(&bits(&w)).unwrap());
        let mut y = c.upload(&vec![POISON; t * out]).unwrap();
        c.gemm_bf16(&dx, &dw, &mut y, t, inp, out, inp, out).unwrap();
        let gy = c.download(&y).unwrap();
        same_bits_with_few_blocks(&mut c, &format!("gemm_bf16 t{t} {inp}->{out}"), &gy, |c| {
            c.gemm_bf16(&dx, &dw, &mut y, t, inp, out, inp, out).unwrap();
            c.download(&y).unwrap()
        });
        let mut want = vec![bf16::ZERO; t * out];
        linear_bf16(&x, &w, t, inp, out, &mut want);
        let want: Vec<f64> = want.iter().map(|v| v.to_f64()).collect();
        let (worst, rel) =
            check(&format!("gemm_bf16 t{t} {inp}->{out}"), &gy, &want, 1.0, 2f64.powi(-10), 2f64.powi(-9));
        eprintln!("gemm_bf16 t{t} {inp}->{out}: max |d|/rms {worst:.2e}, rel L2 {rel:.2e}, bits {:016x}", digest(&gy));
    }
    for (t, inp, out) in [(2048, 2048, 8192), (2048, 2048, 257), (2048, 2048, 32768)] {
        let (dx, dw) = (c.upload(&vec![0x3c00u16; t * inp]).unwrap(), c.upload(&vec![0x3a00u16; out * inp]).unwrap());
        let mut y = c.alloc::<u16>(t * out).unwrap();
        let s = time_it(&c, || c.gemm_bf16(&dx, &dw, &mut y, t, inp, out, inp, out).unwrap());
        let tf = 2.0 * (t * inp * out) as f64 / s / 1e12;
        eprintln!(
            "PERF gemm_bf16 {t}x{inp} -> {out}: {:.1} us, {tf:.0} TFLOP/s ({:.0}% of {H200_MMA_TFLOPS})",
            s * 1e6,
            100.0 * tf / H200_MMA_TFLOPS
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Gated DeltaNet

/// Token-parallel conv + SiLU (`conv1d_silu_chunk`) against the sequential kernel `conv1d_silu`:
/// y and the final state must be identical bit for bit (same fp32 operations in the same order),
/// over token counts below, at and around the 32-token block (1, 2, 3 take the short-chunk state
/// path), odd channel counts and strides (one channel per thread, partial 256-channel blocks), even
/// ones (two channels per thread, partial 512-channel blocks), strided x with NaN padding, and a
/// random start state. Against the CPU reference `cpu::conv::conv_silu`: the state exactly (it is a copy
/// of inputs); y within the decode conv test's tolerance (tests.rs `close`: |d| <= (|want| +
/// rms) / 128, L2 4e-3; written here as 1 ulp(want) + rms/128, which is no looser since
/// ulp(want) <= |want| / 128). Why it holds: every bf16 x bf16 product is exact in fp32 and both
/// add them in the same order, so bf16(acc) agrees; only SiLU's exp (CUDA expf vs Rust's) can
/// differ by a few fp32 ulps and move y across one bf16 rounding boundary.
#[test]
#[ignore]
fn conv1d_chunk_matches_reference() {
    let c = ctx();
    let mut r = rng(26);
    // (tokens, channels, x_stride)
    for (t, ch, xs) in [
        (1, 257, 260),
        (1, 1000, 1002),
        (2, 8192, 12352),
        (5, 1000, 1002),
        (40, 514, 520),
        (3, 100, 100),
        (5, 1000, 1003),
        (17, 8192, 12352),
        (31, 33, 40),
        (32, 257, 257),
        (33, 8192, 12352),
        (65, 129, 131),
        (300, 1000, 1001),
        (777, 4097, 4100),
        (2048, 8192, 12352),
    ] {
        let x = bfv(&mut r, t * ch, 2.0);
        let w = bfv(&mut r, ch * 4, 1.0);
        let st = bfv(&mut r, 3 * ch, 2.0);
        let mut xpad = vec![POISON; (t - 1) * xs + ch]; // NaN between rows: a wrong stride shows up in y
        for tt in 0..t {
            xpad[tt * xs..tt * xs + ch].copy_from_slice(&bits(&x[tt * ch..(tt + 1) * ch]));
        }
        let (dx, dw) = (c.upload(&xpad).unwrap(), c.upload(&bits(&w)).unwrap());
        let (mut st_seq, mut st_par) = (c.upload(&bits(&st)).unwrap(), c.upload(&bits(&st)).unwrap());
        let (mut y_seq, mut y_par) =
            (c.upload(&vec![POISON; t * ch]).unwrap(), c.upload(&vec![POISON; t * ch]).unwrap());
        c.conv1d_silu(&dx, &dw, &mut st_seq, &mut y_seq, t, ch, xs, None).unwrap();
        c.conv1d_silu_chunk(&dx, &dw, &mut st_par, &mut y_par, t, ch, xs).unwrap();
        let (gy, gs) = (c.download(&y_par).unwrap(), c.download(&st_par).unwrap());
        let (sy, ss) = (c.download(&y_seq).unwrap(), c.download(&st_seq).unwrap());
        for (i, (a, b)) in gy.iter().zip(&sy).enumerate() {
            assert_eq!(a, b, "conv chunk t{t} c{ch}: y[{}, {}] = {a:#06x}, sequential kernel {b:#06x}", i / ch, i % ch);
        }
        assert_eq!(gs, ss, "conv chunk t{t} c{ch}: state differs from the sequential kernel's");
        // CPU reference
        let (mut s_cpu, mut y_cpu) = (st.clone(), vec![bf16::ZERO; t * ch]);
        conv_silu(&x, t, ch, &w, 4, &mut s_cpu, &mut y_cpu);
        assert_eq!(gs, bits(&s_cpu), "conv chunk t{t} c{ch}: state != last 3 rows of [state; x]");
        let want: Vec<f64> = y_cpu.iter().map(|v| v.to_f64()).collect();
        let (worst, rel) = check(&format!("conv chunk t{t} c{ch}"), &gy, &want, 1.0, 2f64.powi(-7), 4e-3);
        let differ = gy.iter().zip(&y_cpu).filter(|(a, b)| **a != b.to_bits()).count();
        eprintln!("conv1d_silu_chunk t{t} c{ch} stride {xs}: bit-identical to conv1d_silu; vs CPU {differ} of {} differ, max |d|/rms {worst:.2e}, rel L2 {rel:.2e}", t * ch);
    }
    // Timing at the real prefill shape: 2048-token chunk, conv_dim 8192 inside the 12352-wide
    // in_proj row. Bytes: x and y once (the minimum); the sequential kernel is the old prefill path.
    let (t, ch, xs) = (2048, 8192, 12352);
    let dx = c.upload(&bits(&bfv(&mut r, (t - 1) * xs + ch, 2.0))).unwrap();
    let dw = c.upload(&bits(&bfv(&mut r, ch * 4, 1.0))).unwrap();
    let mut st = c.upload(&vec![0u16; 3 * ch]).unwrap();
    let mut y = c.alloc::<u16>(t * ch).unwrap();
    let seq = time_it(&c, || c.conv1d_silu(&dx, &dw, &mut st, &mut y, t, ch, xs, None).unwrap());
    let par = time_it(&c, || c.conv1d_silu_chunk(&dx, &dw, &mut st, &mut y, t, ch, xs).unwrap());
    let gbs = (2 * t * ch * 2) as f64 / par / 1e9;
    eprintln!("PERF conv1d {t} tokens x {ch} channels (x stride {xs}): sequential conv1d_silu {:.1} us, conv1d_silu_chunk {:.1} us ({gbs:.0} GB/s), {:.1}x", seq * 1e6, par * 1e6, seq / par);
}

/// Chunked gated delta rule = `cpu::gdn::gated_delta_rule` (gates, l2norm, chunked form, one bf16
/// rounding), from a random non-zero state, at the real head counts (16 k, 32 v heads, d 128):
/// `gdn_chunked` (prep + scan, explicit A' = (I + M)^{-1} diag(beta) applied as a product: the same
/// fp32 noise level). T covers a single token (the reference then runs the recurrent form),
/// partial first/last chunks and 2048.
/// Tolerance: both are fp32 end to end with different summation orders (and Vn as
/// A(beta(V - e^G K S)) instead of A(beta V) - A(beta e^G K) S); fp32 noise is ~1e-6 relative,
/// so o may cross one bf16 rounding boundary (1 ulp) plus 2^-10 rms; the fp32 state must agree
/// to 2^-12 (|d| <= 2^-12 (|want| + rms)). A wrong decay, gate or missing term is O(1) relative.
#[test]
#[ignore]
fn gdn_chunked_matches_reference() {
    let c = ctx();
    let mut r = rng(23);
    let (hk, hv, dk) = (16, 32, 128);
    let dims = GdnDims { hk, hv, dk, dv: dk };
    let stride = dims.conv_dim();
    for t in [1, 2, 63, 64, 65, 129, 200, 777, 2048] {
        let qkv = bfv(&mut r, t * stride, 1.0);
        let (b, a) = (bfv(&mut r, t * hv, 3.0), bfv(&mut r, t * hv, 3.0));
        let ba: Vec<bf16> = (0..t)
            .flat_map(|tt| {
                b[tt * hv..(tt + 1) * hv].iter().chain(&a[tt * hv..(tt + 1) * hv]).copied().collect::<Vec<_>>()
            })
            .collect();
        let a_log: Vec<f32> = (0..hv).map(|_| r.random_range(0.01f32..16.0).ln()).collect();
        let dtb = bfv(&mut r, hv, 1.0);
        let st: Vec<f32> = (0..hv * dk * dk).map(|_| r.random_range(-0.5f32..0.5)).collect();
        let (dq, dba, dal, ddt) = (
            c.upload(&bits(&qkv)).unwrap(),
            c.upload(&bits(&ba)).unwrap(),
            c.upload(&a_log).unwrap(),
            c.upload(&bits(&dtb)).unwrap(),
        );
        let args = GdnArgs {
            qkv: &dq,
            ba: &dba,
            a_log: &dal,
            dt_bias: &ddt,
            tokens: t,
            k_heads: hk,
            v_heads: hv,
            qkv_stride: stride,
            ba_stride: 2 * hv,
            a_offset: hv,
            slots: None,
        };
        let mut s = st.clone();
        let mut want = vec![bf16::ZERO; t * hv * dk];
        gated_delta_rule(&qkv, &b, &a, &a_log, &dtb, t, dims, &mut s, &mut want);
        let want: Vec<f64> = want.iter().map(|v| v.to_f64()).collect();
        let rms = (s.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / s.len() as f64).sqrt();
        // Workspace poisoned with NaN: a read of an entry the prep did not write shows up.
        let mut dst = c.upload(&st).unwrap();
        let mut o = c.upload(&vec![POISON; t * hv * dk]).unwrap();
        let mut work = c.upload(&vec![f32::NAN; gdn_work_len(t, hv)]).unwrap();
        c.gdn_chunked(&args, &mut dst, &mut o, &mut work).unwrap();
        let go = c.download(&o).unwrap();
        let (worst, rel) = check(&format!("gdn_chunked o t{t}"), &go, &want, 1.0, 2f64.powi(-10), 2f64.powi(-9));
        let gs = c.download(&dst).unwrap();
        // the digest of o and the state's bits (16 bits at a time), to compare kernel forms
        let state_bits: Vec<u16> = gs.iter().flat_map(|v| [v.to_bits() as u16, (v.to_bits() >> 16) as u16]).collect();
        let bits = digest(&[go, state_bits].concat());
        let mut sworst = 0f64;
        for (i, (&g, &w)) in gs.iter().zip(&s).enumerate() {
            let d = (g as f64 - w as f64).abs();
            assert!(
                d <= 2f64.powi(-12) * (w.abs() as f64 + rms),
                "gdn_chunked state[{i}] t{t}: got {g}, want {w} (rms {rms})"
            );
            sworst = sworst.max(d / rms);
        }
        eprintln!(
            "gdn_chunked t{t}: o max |d|/rms {worst:.2e}, rel L2 {rel:.2e}; state max |d|/rms {sworst:.2e}, bits {bits:016x}"
        );
    }
    for t in [2048, 8192] {
        let qkv = bfv(&mut r, t * stride, 1.0);
        let ba = bfv(&mut r, t * 2 * hv, 3.0);
        let a_log: Vec<f32> = (0..hv).map(|_| r.random_range(0.01f32..16.0).ln()).collect();
        let (dq, dba, dal, ddt) = (
            c.upload(&bits(&qkv)).unwrap(),
            c.upload(&bits(&ba)).unwrap(),
            c.upload(&a_log).unwrap(),
            c.upload(&bits(&bfv(&mut r, hv, 1.0))).unwrap(),
        );
        let mut dst = c.upload(&vec![0f32; hv * dk * dk]).unwrap();
        let mut o = c.alloc::<u16>(t * hv * dk).unwrap();
        let args = GdnArgs {
            qkv: &dq,
            ba: &dba,
            a_log: &dal,
            dt_bias: &ddt,
            tokens: t,
            k_heads: hk,
            v_heads: hv,
            qkv_stride: stride,
            ba_stride: 2 * hv,
            a_offset: hv,
            slots: None,
        };
        let mut work = c.alloc::<f32>(gdn_work_len(t, hv)).unwrap();
        let s2 = time_it(&c, || c.gdn_chunked(&args, &mut dst, &mut o, &mut work).unwrap());
        let mut p = c.gdn_params(&args, &mut dst, &mut o).unwrap();
        p.work = c.addr(&work) as _;
        let prep = time_it(&c, || c.k_gdn_chunk_prep(p).unwrap());
        eprintln!(
            "PERF gdn_chunked {t} tokens, 32 v-heads x 128 x 128: {:.3} ms (prep {:.3} ms, scan ~{:.3} ms)",
            s2 * 1e3,
            prep * 1e3,
            (s2 - prep) * 1e3
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Attention

/// Flash attention prefill = `cpu::attention::attention` (+ `output_gate`), GQA 16:2, head_dim 256,
/// with cached positions before the new tokens (p0 > 0). Tolerance: the kernel rounds the
/// probabilities P to bf16 for the P V product (relative error <= 2^-9 each), so
/// |o - o_ref| <= 2^-9 * sum_j p_j |v_j| / l <= 2^-9 max|v| before the output rounding (1 ulp; the
/// gate adds one more rounding: 2 ulp); L2 2^-8. A wrong mask, scale or kv head is O(rms). The
/// cache is paged through a reversed block table (a kernel ignoring the table reads other rows).
/// The last two cases are long context: 5,000 and 9,003 cached positions (tiles wholly below every
/// query's diagonal, unmasked; a block's last tiles masked and partly skipped per warp).
#[test]
#[ignore]
fn flash_attention_matches_reference() {
    let c = ctx();
    let mut r = rng(24);
    let (h, hkv, hd) = (16, 2, 256);
    for (t, p0, gated) in [
        (1, 0, true),
        (37, 0, false),
        (64, 0, true),
        (130, 5, true),
        (200, 77, false),
        (65, 300, true),
        (96, 5000, true),
        (130, 9003, false),
    ] {
        let total = p0 + t;
        let q = bfv(&mut r, t * h * hd, 2.0);
        let kc = bfv(&mut r, total * hkv * hd, 2.0);
        let vc = bfv(&mut r, total * hkv * hd, 1.0);
        let qg = bfv(&mut r, t * h * 2 * hd, 3.0);
        let need = total.div_ceil(KVB);
        let table = reversed_table(need);
        let fill = vec![POISON; (need + 1) * KVB * hkv * hd]; // NaN outside the sequence: a stray read shows
        let (dq, dk, dv, dg, dt) = (
            c.upload(&bits(&q)).unwrap(),
            c.upload(&page(&bits(&kc), hkv * hd, &table, &fill)).unwrap(),
            c.upload(&page(&bits(&vc), hkv * hd, &table, &fill)).unwrap(),
            c.upload(&bits(&qg)).unwrap(),
            c.upload(&table).unwrap(),
        );
        let mut out = c.upload(&vec![POISON; t * h * hd]).unwrap();
        let args = FlashAttnArgs {
            q: &dq,
            k_cache: &dk,
            v_cache: &dv,
            qg: gated.then_some(&dg),
            tokens: t,
            pos0: p0,
            q_heads: h,
            kv_heads: hkv,
            table: &dt,
        };
        c.flash_attention(&args, &mut out).unwrap();
        let mut want = vec![bf16::ZERO; t * h * hd];
        attention(&q, t, p0, &kc, &vc, h, hkv, hd, &mut want);
        if gated {
            let gate: Vec<bf16> = qg.chunks(2 * hd).flat_map(|blk| blk[hd..].to_vec()).collect();
            output_gate(&mut want, &gate);
        }
        let vmax = vc.iter().map(|v| v.to_f64().abs()).fold(0.0, f64::max);
        let want: Vec<f64> = want.iter().map(|v| v.to_f64()).collect();
        let rms = (want.iter().map(|w| w * w).sum::<f64>() / want.len() as f64).sqrt();
        let ulps = if gated { 2.0 } else { 1.0 };
        let (worst, rel) = check(
            &format!("flash t{t} p0 {p0} gated {gated}"),
            &c.download(&out).unwrap(),
            &want,
            ulps,
            2f64.powi(-9) * vmax / rms,
            2f64.powi(-8),
        );
        eprintln!("flash_attention t{t} p0 {p0} gated {gated}: max |d|/rms {worst:.2e}, rel L2 {rel:.2e}");
    }
    for (t, p0) in [(2048usize, 0usize), (8192, 0), (2048, 6144), (2048, 129_024)] {
        let total = p0 + t;
        let need = total.div_ceil(KVB);
        let (dq, dk, dv, dt) = (
            c.upload(&bits(&bfv(&mut r, t * h * hd, 1.0))).unwrap(),
            c.upload(&bits(&bfv(&mut r, (need + 1) * KVB * hkv * hd, 1.0))).unwrap(),
            c.upload(&bits(&bfv(&mut r, (need + 1) * KVB * hkv * hd, 1.0))).unwrap(),
            c.upload(&reversed_table(need)).unwrap(),
        );
        let mut out = c.alloc::<u16>(t * h * hd).unwrap();
        let args = FlashAttnArgs {
            q: &dq,
            k_cache: &dk,
            v_cache: &dv,
            qg: None,
            tokens: t,
            pos0: p0,
            q_heads: h,
            kv_heads: hkv,
            table: &dt,
        };
        let s = time_it(&c, || c.flash_attention(&args, &mut out).unwrap());
        // causal FLOPs: 2 matmuls x 2 flops x hd per (query, visible key), summed over queries
        let pairs: f64 = (0..t).map(|i| (p0 + i + 1) as f64).sum();
        let tf = 4.0 * hd as f64 * h as f64 * pairs / s / 1e12;
        eprintln!(
            "PERF flash_attention {t} tokens after {p0} cached, 16 q / 2 kv heads x 256: {:.3} ms, {tf:.0} TFLOP/s",
            s * 1e3
        );
    }
}

// ---------------------------------------------------------------------------------------------
// MoE

/// The grouped MoE prefill block = `cpu::moe::moe` with FP8 experts (router, top-8, per-expert
/// SwiGLU MLPs, gated shared expert, fp32 slot-order combine). The router choice is checked
/// exactly first (GPU top-k vs `cpu::moe::route` on the CPU logits; with random data no logit is
/// within fp32 noise of a bf16 rounding boundary that also decides a top-k tie). Tolerance of the
/// output: the expert Linears agree to 1 ulp (see the GEMM test), but a gate_up output one ulp
/// away can move an activation across an E4M3 rounding boundary in the requantisation, changing
/// one code by one step (2^-4 relative) and so the down output by about 2^-4 |w a| ~ 2^-7 rms;
/// routed + shared + products add 3 roundings: 3 ulp + 2^-7 rms per element, L2 2^-7.
#[test]
#[ignore]
fn moe_prefill_matches_reference() {
    let mut c = ctx();
    let mut r = rng(25);
    let (d, inter, sinter, k) = (2048, 512, 512, 8);
    for (e, t) in [(64, 1), (64, 37), (256, 300), (32, 256)] {
        let x = bfv(&mut r, t * d, 2.0);
        let router = bfv(&mut r, (e + 1) * d, 0.05);
        let wgu = fp8v(&mut r, e * 2 * inter * d);
        let wgus: Vec<f32> =
            (0..e * 2 * inter).map(|_| bf16::from_f32(r.random_range(1e-4f32..4e-4)).to_f32()).collect();
        let wdn = fp8v(&mut r, e * d * inter);
        let wdns: Vec<f32> = (0..e * d).map(|_| bf16::from_f32(r.random_range(1e-4f32..4e-4)).to_f32()).collect();
        let sgu = fp8v(&mut r, 2 * sinter * d);
        let sgus: Vec<f32> = (0..2 * sinter).map(|_| bf16::from_f32(r.random_range(1e-4f32..4e-4)).to_f32()).collect();
        let sdn = fp8v(&mut r, d * sinter);
        let sdns: Vec<f32> = (0..d).map(|_| bf16::from_f32(r.random_range(1e-4f32..4e-4)).to_f32()).collect();
        let dx = c.upload(&bits(&x)).unwrap();
        let drouter = c.upload(&bits(&router)).unwrap();
        let (dwgu, dwgus, dwdn, dwdns) =
            (c.upload(&wgu).unwrap(), c.upload(&wgus).unwrap(), c.upload(&wdn).unwrap(), c.upload(&wdns).unwrap());
        let (dsgu, dsgus, dsdn, dsdns) =
            (c.upload(&sgu).unwrap(), c.upload(&sgus).unwrap(), c.upload(&sdn).unwrap(), c.upload(&sdns).unwrap());
        let args = MoePrefillArgs {
            x: &dx,
            router: &drouter,
            w_gate_up: &dwgu,
            ws_gate_up: &dwgus,
            w_down: &dwdn,
            ws_down: &dwdns,
            shared_gate_up: &dsgu,
            shared_gate_up_scale: &dsgus,
            shared_down: &dsdn,
            shared_down_scale: &dsdns,
            tokens: t,
            hidden: d,
            experts: e,
            top_k: k,
            inter,
            shared_inter: sinter,
        };
        let mut scratch = MoePrefillScratch::new(&c, t, d, e, k, inter, sinter).unwrap();
        let mut out = c.upload(&vec![POISON; t * d]).unwrap();
        c.moe_prefill(&args, &mut scratch, &mut out).unwrap();
        let got = c.download(&out).unwrap();
        same_bits_with_few_blocks(&mut c, &format!("moe_prefill e{e} t{t}"), &got, |c| {
            c.moe_prefill(&args, &mut scratch, &mut out).unwrap();
            c.download(&out).unwrap()
        });
        // Either tile height of the grouped GEMMs (moe_prefill picks one by rows per expert).
        for tiles in [64, 96] {
            let name = format!("moe_prefill e{e} t{t}, {tiles}-row tiles");
            let mut run = |c: &super::CudaContext| {
                c.stream().memcpy_htod(&vec![POISON; t * d], &mut out).unwrap();
                c.moe_prefill_tiles(&args, &mut scratch, &mut out, tiles).unwrap();
                c.download(&out).unwrap()
            };
            assert!(run(&c) == got, "{name}: other bits than moe_prefill's");
            same_bits_with_few_blocks(&mut c, &name, &got, run);
        }

        // Router: logits and top-k.
        let mut logits = vec![bf16::ZERO; t * e];
        linear_bf16(&x, &router[..e * d], t, d, e, &mut logits);
        let (mut idx, mut wr) = (vec![0u32; t * k], vec![bf16::ZERO; t * k]);
        route(&logits, t, e, k, &mut idx, &mut wr);
        let gidx = c.download(&scratch.idx).unwrap();
        let gw = c.download(&scratch.weight).unwrap();
        for a in 0..t * k {
            assert_eq!(gidx[a] as u32, idx[a], "moe router: token {} slot {}", a / k, a % k);
            assert_eq!(gw[a], wr[a].to_f32(), "moe router weight: token {} slot {}", a / k, a % k);
        }
        // Whole block.
        fn mlp<'a>(gu: &'a [u8], gus: &'a [f32], dn: &'a [u8], dns: &'a [f32], i: usize, d: usize) -> Mlp<'a> {
            Mlp {
                gate: LinearWeight::Fp8 { w: &gu[..i * d], scale: &gus[..i] },
                up: LinearWeight::Fp8 { w: &gu[i * d..], scale: &gus[i..] },
                down: LinearWeight::Fp8 { w: dn, scale: dns },
            }
        }
        let experts: Vec<Mlp> = (0..e)
            .map(|ex| {
                let (g0, s0) = (ex * 2 * inter, ex * d);
                mlp(
                    &wgu[g0 * d..(g0 + 2 * inter) * d],
                    &wgus[g0..g0 + 2 * inter],
                    &wdn[s0 * inter..(s0 + d) * inter],
                    &wdns[s0..s0 + d],
                    inter,
                    d,
                )
            })
            .collect();
        let shared = mlp(&sgu, &sgus, &sdn, &sdns, sinter, d);
        let wts = MoeWeights {
            router: &router[..e * d],
            experts: &experts,
            moe_inter: inter,
            shared,
            shared_inter: sinter,
            shared_gate: &router[e * d..],
            top_k: k,
        };
        let mut want = vec![bf16::ZERO; t * d];
        moe(&x, t, d, &wts, &mut want);
        let want: Vec<f64> = want.iter().map(|v| v.to_f64()).collect();
        let (worst, rel) = check(&format!("moe_prefill e{e} t{t}"), &got, &want, 3.0, 2f64.powi(-7), 2f64.powi(-7));
        eprintln!("moe_prefill e{e} t{t}: max |d|/rms {worst:.2e}, rel L2 {rel:.2e}, bits {:016x}", digest(&got));
    }
    // Timing at the real shape: 256 experts, top-8, 1,024 to 8,192 tokens (32 to 256 rows per
    // expert), the grouped GEMMs in 64- and 96-row tiles.
    let e = 256;
    let drouter = c.upload(&bits(&bfv(&mut r, (e + 1) * d, 0.05))).unwrap();
    let (dwgu, dwgus) =
        (c.upload(&fp8_pattern(e * 2 * inter * d, 3)).unwrap(), c.upload(&vec![2e-4f32; e * 2 * inter]).unwrap());
    let (dwdn, dwdns) = (c.upload(&fp8_pattern(e * d * inter, 4)).unwrap(), c.upload(&vec![2e-4f32; e * d]).unwrap());
    let (dsgu, dsgus) =
        (c.upload(&fp8_pattern(2 * sinter * d, 5)).unwrap(), c.upload(&vec![2e-4f32; 2 * sinter]).unwrap());
    let (dsdn, dsdns) = (c.upload(&fp8_pattern(d * sinter, 6)).unwrap(), c.upload(&vec![2e-4f32; d]).unwrap());
    for t in [1024, 2048, 3072, 8192] {
        let dx = c.upload(&bits(&bfv(&mut r, t * d, 2.0))).unwrap();
        let args = MoePrefillArgs {
            x: &dx,
            router: &drouter,
            w_gate_up: &dwgu,
            ws_gate_up: &dwgus,
            w_down: &dwdn,
            ws_down: &dwdns,
            shared_gate_up: &dsgu,
            shared_gate_up_scale: &dsgus,
            shared_down: &dsdn,
            shared_down_scale: &dsdns,
            tokens: t,
            hidden: d,
            experts: e,
            top_k: k,
            inter,
            shared_inter: sinter,
        };
        let mut scratch = MoePrefillScratch::new(&c, t, d, e, k, inter, sinter).unwrap();
        let mut out = c.alloc::<u16>(t * d).unwrap();
        for tiles in [64, 96] {
            let s = time_it(&c, || c.moe_prefill_tiles(&args, &mut scratch, &mut out, tiles).unwrap());
            let flops = 2.0 * t as f64 * d as f64 * ((k * 3 * inter + 3 * sinter) as f64 + (e + 1) as f64);
            eprintln!(
                "PERF moe_prefill {t} tokens, 256 experts top-8 + shared, {tiles}-row tiles: {:.3} ms, {:.0} TFLOP/s",
                s * 1e3,
                flops / s / 1e12
            );
        }
    }
}
