//! Decode kernels against the CPU reference ops (`crate::cpu`, the numerical oracle the CPU
//! backend runs, itself tested against f64 formulations in CI), `#[ignore]`d (CI has no GPU):
//! `cargo test -p ornith-runtime -- --ignored`. Where a kernel has no CPU op with the same
//! contract (the FP8 GEMVs and the MoE expert GEMVs take pre-quantised E4M3 activations, while
//! `cpu::linear::linear_fp8` quantises bf16 activations itself; the SwiGLU and the MoE combine
//! are inline steps of `cpu::moe`), the reference stays an f64 loop with the same bf16 cast
//! points, and the test says so. Tolerance rationale at `close`.
use super::attention::*;
use super::gdn::*;
use super::gemv::*;
use super::test_util::{
    bfv, check_combine_epilogue, check_fold, ctx, digest, page, reversed_table, rng, time_cold, time_it, unpage, KVB,
    POISON, R,
};
use crate::cpu::attention::{apply_rope, attention, split_q_gate};
use crate::cpu::conv::conv_silu;
use crate::cpu::gdn::{gates, recurrent, split_qkv, GdnDims};
use crate::cpu::linear::{linear_bf16, linear_fp8};
use crate::cpu::norm::{add_into, gated_rms_norm, rms_norm};
use half::bf16;
use model_spec::fp8::e4m3_to_f32;
use ornith_kernels::bindings::ORNITH_GDN_OUT_DIM;
use rand::Rng;
/// `n` random finite E4M3 codes of either sign (magnitude codes 0..=0x7E; 0x7F is NaN).
fn e4m3_codes(r: &mut R, n: usize) -> Vec<u8> {
    (0..n).map(|_| r.random_range(0..=0x7Eu8) | (r.random_range(0..2u8) << 7)).collect()
}
/// `n` per-output-channel FP8 weight scales.
fn fp8_scales(r: &mut R, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(1e-3f32..1e-2)).collect()
}
fn f(b: u16) -> f64 {
    bf16::from_bits(b).to_f64()
}
fn rb(x: f64) -> f64 {
    bf16::from_f64(x).to_f64()
}
fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}
/// The SwiGLU activations `swiglu_quant` quantises, as bf16 bits: bf16(bf16(silu(g)) · u) for each
/// of `rows` gate|up rows (`2 * inter` values: gate, then up).
fn swiglu_act(gu: &[u16], rows: usize, inter: usize) -> Vec<u16> {
    (0..rows * inter)
        .map(|k| {
            let (row, i) = (k / inter, k % inter);
            let g = f(gu[row * 2 * inter + i]);
            let u = f(gu[row * 2 * inter + inter + i]);
            bf16::from_f64(rb(silu(g)) * u).to_bits()
        })
        .collect()
}
fn sigm(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}
/// bf16 bit patterns as `bf16` values (the CPU ops' element type).
fn bv(b: &[u16]) -> Vec<bf16> {
    b.iter().map(|&x| bf16::from_bits(x)).collect()
}
fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}
/// A CPU op's bf16 output as the f64 values `close` compares with.
fn wf(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// Compares a bf16 GPU output with a reference: the bf16 output of the CPU reference op (most
/// tests) or an f64 loop (where no CPU op has the kernel's contract). Checked: no NaN/unwritten
/// element; max |d| <= 2^-7 * (|ref| + rms(ref)); and ||d|| / ||ref|| <= 4e-3. (These bounds were
/// first written for f64 references and are unchanged.)
/// * Against the CPU op: both compute in fp32 and round to bf16 at the same points, differing
///   only in fp32 summation order (~1e-6 relative), so an element differs only where that noise
///   moves a value across a bf16 rounding boundary: by one ulp, and one bf16 ulp of w is at most
///   2^-7 |w|; the rms term covers the order noise of a sum that cancels. Most elements are
///   bit-equal, so the L2 figure is far below 4e-3 (tighter than against f64, where every element
///   carries its own rounding error, up to 2^-9 relative).
/// * Against f64: each element differs by about one bf16 rounding (relative 2^-8) of its own
///   magnitude or of the typical magnitude (cancellation in a sum), plus fp32-vs-f64 noise; one
///   half-ulp rounding is 2^-9 ~ 2e-3 at most in L2.
pub(super) fn close(name: &str, got: &[u16], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let rms = (want.iter().map(|w| w * w).sum::<f64>() / want.len() as f64).sqrt();
    let (mut num, mut den) = (0.0, 0.0);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = f(g);
        assert!(g.is_finite(), "{name}[{i}]: got {g} (unwritten or NaN), want {w}");
        let d = (g - w).abs();
        assert!(d <= (w.abs() + rms) / 128.0 + 1e-30, "{name}[{i}]: got {g}, want {w} (rms {rms})");
        num += d * d;
        den += w * w;
    }
    let rel = (num / den.max(1e-300)).sqrt();
    assert!(rel <= 4e-3, "{name}: relative error {rel}");
}

/// FP8 codes and scales bit-exact against the CPU reference quantiser (compressed-tensors
/// semantics, `cpu/fp8.rs`): scale = bf16(amax / 448) (2^-7 for an all-zero row), returned as its
/// exact f32 widening; code = e4m3(bf16(y / scale)), RNE, saturating.
fn check_quant(name: &str, y: &[u16], q8: &[u8], scale: &[f32], cols: usize) {
    for (t, row) in y.chunks(cols).enumerate() {
        let xs: Vec<bf16> = row.iter().map(|&b| bf16::from_bits(b)).collect();
        let mut want = vec![0u8; cols];
        let s = crate::cpu::fp8::quantize_act_row(&xs, &mut want);
        assert!(scale[t] == s || (scale[t].is_nan() && s.is_nan()), "{name}: scale of row {t}: {} vs {s}", scale[t]);
        for (i, &b) in row.iter().enumerate() {
            assert_eq!(q8[t * cols + i], want[i], "{name}: code [{t},{i}] of {}", bf16::from_bits(b));
        }
    }
}

/// PERF line for one GEMV launch: L2-warm (operands resident from the previous run) and L2-cold
/// times; the cold one is what a decode step sees.
pub(super) fn perf(c: &super::CudaContext, what: &str, bytes: f64, mut f: impl FnMut()) {
    let warm = time_it(c, &mut f);
    let cold = time_cold(c, &mut f);
    eprintln!(
        "PERF {what}: cold {:.2} us = {:.0} GB/s; warm {:.2} us = {:.0} GB/s",
        cold * 1e6,
        bytes / cold / 1e9,
        warm * 1e6,
        bytes / warm / 1e9
    );
}

/// Whether a decode-product shape is one whose speed is reported: the real decode shapes, alone
/// and in groups of 8 and 64 (aggregate bytes: the weights once, each token's activations).
fn decode_shape(inp: usize, tokens: usize) -> bool {
    inp >= 2048 && matches!(tokens, 1 | 8 | 32 | 64)
}

/// Checks a decode-product output `y` (`tokens` rows of stride `yst`, `out` values each) against
/// the reference (`want`, `tokens * out` values): the padding between rows untouched, values within
/// `close`'s tolerance.
fn check_gemv_rows(
    name: &str,
    y: &[u16],
    (inp, out, tokens, yst): (usize, usize, usize, usize),
    want: &[f64],
) -> Vec<u16> {
    assert!(
        (0..tokens).all(|t| y[t * yst + out..(t + 1) * yst].iter().all(|&b| b == POISON)),
        "{name}: wrote outside the rows"
    );
    let got: Vec<u16> = (0..tokens * out).map(|k| y[(k / out) * yst + k % out]).collect();
    close(&format!("{name} {inp}x{out} t{tokens}"), &got, want);
    got
}

/// Batch invariance of a decode product: row `t` of a group's output (`group`, `out` per row) is
/// bit for bit what the same token gives alone (`alone`).
fn check_alone(name: &str, group: &[u16], alone: &[u16], t: usize, out: usize) {
    assert!(group[t * out..(t + 1) * out] == *alone, "{name}: token {t} of the group differs from the token alone");
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

mod attention;
mod gdn;
mod gemv;
mod moe;
mod norm;
mod sample;
