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
    bfv, check_combine_epilogue, check_fold, ctx, page, reversed_table, rng, time_cold, time_it, unpage, KVB, POISON, R,
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

#[test]
#[ignore]
fn embed_gather_matches_reference() {
    let c = ctx();
    let mut r = rng(1);
    for (vocab, hidden, tokens) in [(1000, 64, 5), (4099, 2048, 3)] {
        let table = bfv(&mut r, vocab * hidden, 1.0);
        let ids: Vec<i32> = (0..tokens).map(|_| r.random_range(0..vocab as i32)).collect();
        let mut out = c.upload(&vec![POISON; tokens * hidden]).unwrap();
        c.embed(&c.upload(&ids).unwrap(), &c.upload(&table).unwrap(), &mut out, tokens, hidden, vocab).unwrap();
        // CPU reference: `cpu::embed::embed`, a row copy, so bit-exact.
        let mut want = vec![bf16::ZERO; tokens * hidden];
        let ids_u: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        crate::cpu::embed::embed(&ids_u, &bv(&table), hidden, &mut want).unwrap();
        assert_eq!(c.download(&out).unwrap(), bits(&want), "embed vocab {vocab} hidden {hidden}");
    }
}

/// The expert down product with the SwiGLU prologue (`moe_gemv_fp8_swiglu`: each block quantises
/// its (token, slot) row of SwiGLU(gate|up) itself) gives the bits of `swiglu_quant` followed by
/// the plain per-slot product (`moe_gemv_fp8`), at the model's shapes (inter 512 -> hidden 2048,
/// 8 routed slots + the shared one; 1 and 3 tokens) and at a ragged row (inter 336: not a multiple
/// of the block's 256 threads nor of the 64-byte K step; 2 tokens); and with the combine epilogue
/// the bits of `moe_combine` after it (`check_combine_epilogue`).
#[test]
#[ignore]
fn swiglu_prologue_matches_swiglu_quant() {
    let c = ctx();
    let mut r = rng(43);
    let (e, k) = (16usize, 8usize);
    let slots = k + 1;
    for (inter, hidden, t) in [(512usize, 2048usize, 1usize), (512, 2048, 3), (336, 256, 2)] {
        let rows = t * slots;
        let gu = bfv(&mut r, rows * 2 * inter, 3.0);
        let dgu = c.upload(&gu).unwrap();
        let mut q8 = c.upload(&vec![0xAAu8; rows * inter]).unwrap();
        let mut qs = c.upload(&vec![-1f32; rows]).unwrap();
        c.swiglu_quant(&dgu, &mut q8, &mut qs, rows, inter).unwrap();
        let wq = e4m3_codes(&mut r, e * hidden * inter);
        let wqs = fp8_scales(&mut r, e * hidden);
        let sw = e4m3_codes(&mut r, hidden * inter);
        let sws = fp8_scales(&mut r, hidden);
        let idx: Vec<i32> = (0..(t * k) as i32).map(|j| (j * 7 + 3) % e as i32).collect();
        let (dwq, dwqs, dsw, dsws, didx) = (
            c.upload(&wq).unwrap(),
            c.upload(&wqs).unwrap(),
            c.upload(&sw).unwrap(),
            c.upload(&sws).unwrap(),
            c.upload(&idx).unwrap(),
        );
        let a = MoeGemvArgs {
            xq: &q8,
            xs: &qs,
            idx: &didx,
            w: &dwq,
            ws: &dwqs,
            shared_w: &dsw,
            shared_ws: &dsws,
            tokens: t,
            top_k: k,
            experts: e,
            in_: inter,
            out: hidden,
            x_tok_stride: slots * inter,
            x_slot_stride: inter,
            xs_tok_stride: slots,
            xs_slot_stride: 1,
        };
        let mut want = c.upload(&vec![POISON; rows * hidden]).unwrap();
        c.moe_gemv(&a, &mut want).unwrap();
        let got = c.upload(&vec![POISON; rows * hidden]).unwrap();
        let p = ornith_kernels::bindings::OrnithMoeGemvParams {
            idx: c.addr(&didx) as _,
            w: c.addr(&dwq) as _,
            ws: c.addr(&dwqs) as _,
            shared_w: c.addr(&dsw) as _,
            shared_ws: c.addr(&dsws) as _,
            y: c.addr(&got) as _,
            tokens: t as i32,
            top_k: k as i32,
            experts: e as i32,
            in_: inter as i32,
            out: hidden as i32,
            x_tok_stride: (slots * inter) as i32,
            x_slot_stride: inter as i32,
            xs_tok_stride: slots as i32,
            xs_slot_stride: 1,
            gate_up: c.addr(&dgu) as _,
            ..Default::default()
        };
        c.k_moe_gemv(p, false).unwrap();
        let (g, w) = (c.download(&got).unwrap(), c.download(&want).unwrap());
        assert!(
            w.iter().all(|&v| v != POISON),
            "moe_gemv_fp8 left outputs unwritten ({inter} -> {hidden}, {t} tokens)"
        );
        assert!(
            g == w,
            "moe_gemv_fp8_swiglu {inter} -> {hidden} ({t} tokens) differs from swiglu_quant + moe_gemv_fp8"
        );
        // With the combine epilogue: moe_combine's rows and fold, and the same products.
        let name = format!("moe_gemv_fp8_swiglu + combine {inter} -> {hidden} ({t} tokens)");
        check_combine_epilogue(&c, &mut r, &want, &got, (t, k, hidden), &name, |combine| {
            c.k_moe_gemv(ornith_kernels::bindings::OrnithMoeGemvParams { combine, ..p }, false).unwrap()
        });
    }
}

/// `rmsnorm_residual` = `cpu::norm::add_into` (the residual `bf16(r + x)`, bit-exact: one
/// rounding of an fp32 sum on both) then `cpu::norm::rms_norm` (zero-centred, `close`), and the
/// FP8 codes of its output bit-exact against `cpu::fp8::quantize_act_row`.
/// The norm prologue of the decode products (`gemv_bf16_norm`, `gemv_fp8_norm`,
/// `moe_gemv_fp8_norm`) against what it replaces, bit for bit: `rmsnorm_residual` (itself tested
/// against the CPU reference above) then the plain product on its output. And the residual fold
/// (the writer of the next delta adds the old one into the residual: `fold` of the dense products
/// and of `moe_combine`) against `rmsnorm_residual`'s residual output. Hidden 2048 (the model's)
/// and 528 (a row that is not a multiple of the block), with and without a pending delta; the
/// real decode shapes (GDN input projection, router, attention q|k|v, expert gate|up).
#[test]
#[ignore]
fn norm_prologue_and_fold_match_the_norm_kernel() {
    use ornith_kernels::bindings::OrnithNormIn;
    let c = ctx();
    let mut r = rng(41);
    let eps = 1e-6f32;
    for (hidden, with_add) in [(2048, true), (2048, false), (528, true)] {
        let res = bfv(&mut r, hidden, 4.0);
        let add = bfv(&mut r, hidden, 4.0);
        let wn = bfv(&mut r, hidden, 0.5);
        let (dres0, dadd, dwn) = (c.upload(&res).unwrap(), c.upload(&add).unwrap(), c.upload(&wn).unwrap());
        // The reference: rmsnorm_residual's outputs (on a copy of the residual).
        let mut dres = c.upload(&res).unwrap();
        let mut xb = c.upload(&vec![POISON; hidden]).unwrap();
        let mut xq = c.upload(&vec![0xAAu8; hidden]).unwrap();
        let mut xs = c.upload(&[-1f32; 1]).unwrap();
        c.rmsnorm_residual(
            &mut dres,
            with_add.then_some(&dadd),
            &dwn,
            Some(&mut xb),
            Some((&mut xq, &mut xs)),
            1,
            hidden,
            eps,
        )
        .unwrap();
        let res_after = c.download(&dres).unwrap();
        let norm = OrnithNormIn {
            res: c.addr(&dres0) as _,
            add: if with_add { c.addr(&dadd) as _ } else { std::ptr::null() },
            weight: c.addr(&dwn) as _,
            eps,
        };
        for out in [12_352, 257, 64] {
            let w = bfv(&mut r, out * hidden, 0.05);
            let dw = c.upload(&w).unwrap();
            let mut want = c.upload(&vec![POISON; out]).unwrap();
            c.gemv_bf16(&xb, &dw, &mut want, 1, hidden, out, hidden, out).unwrap();
            let got = c.upload(&vec![POISON; out]).unwrap();
            c.k_gemv_bf16_norm(norm, c.addr(&dw), c.addr(&got), hidden, out, out, out, None).unwrap();
            assert!(
                c.download(&got).unwrap() == c.download(&want).unwrap(),
                "gemv_bf16_norm {hidden} -> {out} (add {with_add}) differs from rmsnorm_residual + gemv_bf16"
            );
        }
        for out in [9216, 64] {
            let w8 = e4m3_codes(&mut r, out * hidden);
            let ws = fp8_scales(&mut r, out);
            let (dw, dws) = (c.upload(&w8).unwrap(), c.upload(&ws).unwrap());
            let mut want = c.upload(&vec![POISON; out]).unwrap();
            c.gemv_fp8(&xq, &xs, &dw, &dws, &mut want, 1, hidden, out, hidden, out).unwrap();
            let got = c.upload(&vec![POISON; out]).unwrap();
            c.k_gemv_fp8_norm(norm, c.addr(&dw), c.addr(&dws), c.addr(&got), hidden, out, out, out, None).unwrap();
            assert!(
                c.download(&got).unwrap() == c.download(&want).unwrap(),
                "gemv_fp8_norm {hidden} -> {out} (add {with_add}) differs from rmsnorm_residual + gemv_fp8"
            );
        }
        // Expert gate|up, per (token, slot), 8 routed slots of 16 experts + the shared one.
        let (e, k, o) = (16, 8, 256);
        let wq = e4m3_codes(&mut r, e * o * hidden);
        let wqs = fp8_scales(&mut r, e * o);
        let sw: Vec<u8> = (0..o * hidden).map(|_| r.random_range(0..=0x7Eu8)).collect();
        let sws = fp8_scales(&mut r, o);
        let idx: Vec<i32> = (0..k as i32).map(|j| (j * 5 + 3) % e as i32).collect();
        let (dwq, dwqs, dsw, dsws, didx) = (
            c.upload(&wq).unwrap(),
            c.upload(&wqs).unwrap(),
            c.upload(&sw).unwrap(),
            c.upload(&sws).unwrap(),
            c.upload(&idx).unwrap(),
        );
        let a = MoeGemvArgs {
            xq: &xq,
            xs: &xs,
            idx: &didx,
            w: &dwq,
            ws: &dwqs,
            shared_w: &dsw,
            shared_ws: &dsws,
            tokens: 1,
            top_k: k,
            experts: e,
            in_: hidden,
            out: o,
            x_tok_stride: hidden,
            x_slot_stride: 0,
            xs_tok_stride: 1,
            xs_slot_stride: 0,
        };
        let mut want = c.upload(&vec![POISON; (k + 1) * o]).unwrap();
        c.moe_gemv(&a, &mut want).unwrap();
        let got = c.upload(&vec![POISON; (k + 1) * o]).unwrap();
        let p = ornith_kernels::bindings::OrnithMoeGemvParams {
            idx: c.addr(&didx) as _,
            w: c.addr(&dwq) as _,
            ws: c.addr(&dwqs) as _,
            shared_w: c.addr(&dsw) as _,
            shared_ws: c.addr(&dsws) as _,
            y: c.addr(&got) as _,
            tokens: 1,
            top_k: k as i32,
            experts: e as i32,
            in_: hidden as i32,
            out: o as i32,
            x_tok_stride: hidden as i32,
            xs_tok_stride: 1,
            norm,
            ..Default::default()
        };
        c.k_moe_gemv(p, false).unwrap();
        assert!(
            c.download(&got).unwrap() == c.download(&want).unwrap(),
            "moe_gemv_fp8_norm {hidden} (add {with_add}) differs from rmsnorm_residual + moe_gemv_fp8"
        );
        if !with_add {
            continue;
        }
        // The folds: the writer of the next delta adds the old delta (in y / out) into the residual
        // first; the residual then equals rmsnorm_residual's, the new delta the plain product's.
        let inw = 512;
        let xin = bfv(&mut r, inw, 1.0);
        let wo = bfv(&mut r, hidden * inw, 0.05);
        let (dxin, dwo) = (c.upload(&xin).unwrap(), c.upload(&wo).unwrap());
        let mut want = c.upload(&vec![POISON; hidden]).unwrap();
        c.gemv_bf16(&dxin, &dwo, &mut want, 1, inw, hidden, inw, hidden).unwrap();
        check_fold(&c, "gemv_bf16", &res, &add, &res_after, &c.download(&want).unwrap(), |delta, fold| {
            c.k_gemv_bf16(c.addr(&dxin), c.addr(&dwo), delta, 1, inw, hidden, inw, hidden, hidden, Some(fold)).unwrap()
        });
        // moe_combine's fold (its own output checked against the reference in moe_decode_matches_reference).
        let ys = c.upload(&bfv(&mut r, (k + 1) * hidden, 1.0)).unwrap();
        let wt = c.upload(&(0..k).map(|j| 0.1 * (j + 1) as f32).collect::<Vec<f32>>()).unwrap();
        let gl = c.upload(&bfv(&mut r, 1, 1.0)).unwrap();
        let mut want = c.upload(&vec![POISON; hidden]).unwrap();
        c.moe_combine(&ys, &wt, &gl, &mut want, 1, k, hidden, 1).unwrap();
        check_fold(&c, "moe_combine", &res, &add, &res_after, &c.download(&want).unwrap(), |delta, fold| {
            let p =
                super::moe::combine_params(c.addr(&ys), c.addr(&wt), c.addr(&gl), delta, 1, k, hidden, 1, Some(fold));
            c.k_combine_with(p.unwrap()).unwrap()
        });
    }
    // PERF: the GDN input projection (2048 -> 12,352 BF16) as norm + product vs the fused product.
    let hidden = 2048;
    let (res, wn) = (bfv(&mut r, hidden, 4.0), bfv(&mut r, hidden, 0.5));
    let (dres, dwn) = (c.upload(&res).unwrap(), c.upload(&wn).unwrap());
    let dw = c.upload(&bfv(&mut r, 12_352 * hidden, 0.05)).unwrap();
    let mut y = c.upload(&vec![0u16; 12_352]).unwrap();
    let mut xb = c.upload(&vec![0u16; hidden]).unwrap();
    let mut scratch = c.upload(&res).unwrap();
    let sep = time_cold(&c, || {
        c.rmsnorm_residual(&mut scratch, None, &dwn, Some(&mut xb), None, 1, hidden, eps).unwrap();
        c.gemv_bf16(&xb, &dw, &mut y, 1, hidden, 12_352, hidden, 12_352).unwrap();
    });
    let norm = OrnithNormIn { res: c.addr(&dres) as _, add: std::ptr::null(), weight: c.addr(&dwn) as _, eps };
    let fused = time_cold(&c, || {
        c.k_gemv_bf16_norm(norm, c.addr(&dw), c.addr(&y), hidden, 12_352, 12_352, 12_352, None).unwrap()
    });
    eprintln!(
        "PERF norm + gemv_bf16 2048 -> 12352 (L2 cold): separate {:.2} us, fused prologue {:.2} us",
        sep * 1e6,
        fused * 1e6
    );
}

/// The quantisation prologue (`gemv_fp8_quant`: every block quantises the one bf16 row itself)
/// against what it replaces, bit for bit: `quantize_fp8_rows` (itself tested against
/// `model_spec::fp8` above) then `gemv_fp8`; with a residual fold, the residual and the delta
/// against `gemv_fp8`'s fold from the same buffers. The decode o_proj (4,096 -> 2,048), a row
/// that is not a multiple of the block, and one longer than the registers hold (two L2 passes).
#[test]
#[ignore]
fn gemv_fp8_quant_matches_quantize_and_gemv_fp8() {
    let c = ctx();
    let mut r = rng(43);
    for (in_, out) in [(4096, 2048), (528, 64), (4368, 136)] {
        let x = bfv(&mut r, in_, 3.0);
        let (w8, ws) = (e4m3_codes(&mut r, out * in_), fp8_scales(&mut r, out));
        let (dx, dw, dws) = (c.upload(&x).unwrap(), c.upload(&w8).unwrap(), c.upload(&ws).unwrap());
        let mut xq = c.upload(&vec![0xAAu8; in_]).unwrap();
        let mut xs = c.upload(&[-1f32; 1]).unwrap();
        c.quantize_fp8(&dx, &mut xq, &mut xs, 1, in_).unwrap();
        let mut want = c.upload(&vec![POISON; out]).unwrap();
        c.gemv_fp8(&xq, &xs, &dw, &dws, &mut want, 1, in_, out, in_, out).unwrap();
        let got = c.upload(&vec![POISON; out]).unwrap();
        c.k_gemv_fp8_quant(c.addr(&dx), c.addr(&dw), c.addr(&dws), c.addr(&got), in_, out, out, out, None).unwrap();
        let want = c.download(&want).unwrap();
        assert!(
            c.download(&got).unwrap() == want,
            "gemv_fp8_quant {in_} -> {out} differs from quantize_fp8_rows + gemv_fp8"
        );
        // The fold: the same residual and pending delta into both kernels.
        let (res, old) = (bfv(&mut r, out, 4.0), bfv(&mut r, out, 4.0));
        let (fr_want, dl_want) = (c.upload(&res).unwrap(), c.upload(&old).unwrap());
        let (fr_got, dl_got) = (c.upload(&res).unwrap(), c.upload(&old).unwrap());
        let (a, b) = (c.addr(&xq), c.addr(&xs));
        c.k_gemv_fp8(
            a,
            b,
            c.addr(&dw),
            c.addr(&dws),
            c.addr(&dl_want),
            1,
            in_,
            out,
            in_,
            out,
            out,
            Some(c.addr(&fr_want)),
        )
        .unwrap();
        c.k_gemv_fp8_quant(
            c.addr(&dx),
            c.addr(&dw),
            c.addr(&dws),
            c.addr(&dl_got),
            in_,
            out,
            out,
            out,
            Some(c.addr(&fr_got)),
        )
        .unwrap();
        assert!(c.download(&dl_got).unwrap() == want, "gemv_fp8_quant {in_} -> {out} with a fold changed its output");
        assert_eq!(
            c.download(&fr_got).unwrap(),
            c.download(&fr_want).unwrap(),
            "gemv_fp8_quant {in_} -> {out}: the folded residual is not gemv_fp8's"
        );
    }
}

#[test]
#[ignore]
fn rmsnorm_residual_matches_reference() {
    let c = ctx();
    let mut r = rng(2);
    for (hidden, tokens, with_add) in
        [(2048, 1, true), (2048, 3, false), (64, 2, true), (1000, 5, true), (8192, 1, true)]
    {
        let res = bfv(&mut r, tokens * hidden, 4.0);
        let add = bfv(&mut r, tokens * hidden, 4.0);
        let w = bfv(&mut r, hidden, 0.5);
        let mut dres = c.upload(&res).unwrap();
        let dadd = c.upload(&add).unwrap();
        let mut out = c.upload(&vec![POISON; tokens * hidden]).unwrap();
        let mut q8 = c.upload(&vec![0xAAu8; tokens * hidden]).unwrap();
        let mut sc = c.upload(&vec![-1f32; tokens]).unwrap();
        c.rmsnorm_residual(
            &mut dres,
            with_add.then_some(&dadd),
            &c.upload(&w).unwrap(),
            Some(&mut out),
            Some((&mut q8, &mut sc)),
            tokens,
            hidden,
            1e-6,
        )
        .unwrap();
        let (gres, gout, gq, gs) =
            (c.download(&dres).unwrap(), c.download(&out).unwrap(), c.download(&q8).unwrap(), c.download(&sc).unwrap());
        let mut h = bv(&res);
        if with_add {
            add_into(&mut h, &bv(&add));
        }
        assert_eq!(gres, bits(&h), "residual h{hidden} t{tokens}: the residual stream is bf16(r + x)");
        let mut want = vec![bf16::ZERO; tokens * hidden];
        rms_norm(&h, &bv(&w), hidden, 1e-6, &mut want);
        close(&format!("rmsnorm h{hidden} t{tokens}"), &gout, &wf(&want));
        check_quant("rmsnorm q8", &gout, &gq, &gs, hidden);
        // The 8-per-thread instance (hidden <= 2048, what k_rmsnorm launches there) and the
        // general one give the same bits (the same sums in the same order).
        if hidden <= 2048 {
            let dres2 = c.upload(&res).unwrap();
            let (out2, q82) =
                (c.upload(&vec![POISON; tokens * hidden]).unwrap(), c.alloc::<u8>(tokens * hidden).unwrap());
            let sc2 = c.alloc::<f32>(tokens).unwrap();
            let dw = c.upload(&w).unwrap();
            c.k_rmsnorm_on(
                "rmsnorm_residual",
                c.addr(&dres2),
                with_add.then(|| c.addr(&dadd)),
                c.addr(&dw),
                Some(c.addr(&out2)),
                Some((c.addr(&q82), c.addr(&sc2))),
                tokens,
                hidden,
                1e-6,
            )
            .unwrap();
            assert_eq!(c.download(&dres2).unwrap(), gres, "rmsnorm_residual vs _2k residual h{hidden}");
            assert_eq!(c.download(&out2).unwrap(), gout, "rmsnorm_residual vs _2k out h{hidden} t{tokens}");
            assert_eq!(c.download(&q82).unwrap(), gq, "rmsnorm_residual vs _2k codes h{hidden} t{tokens}");
            assert_eq!(c.download(&sc2).unwrap(), gs, "rmsnorm_residual vs _2k scales h{hidden} t{tokens}");
        }
    }
    // The prefill shape: 2,048 rows of 2,048 with the residual add and both outputs.
    let (t, h) = (2048, 2048);
    let (mut dres, dadd, dw) = (
        c.upload(&bfv(&mut r, t * h, 4.0)).unwrap(),
        c.upload(&bfv(&mut r, t * h, 4.0)).unwrap(),
        c.upload(&bfv(&mut r, h, 0.5)).unwrap(),
    );
    let (mut out, mut q8, mut sc) =
        (c.alloc::<u16>(t * h).unwrap(), c.alloc::<u8>(t * h).unwrap(), c.alloc::<f32>(t).unwrap());
    let bytes = (t * h * (2 + 2 + 2 + 2 + 1) + h * 2 + t * 4) as f64;
    perf(&c, "rmsnorm_residual_2k 2048 rows x 2048 (add, bf16 + FP8 out)", bytes, || {
        c.rmsnorm_residual(&mut dres, Some(&dadd), &dw, Some(&mut out), Some((&mut q8, &mut sc)), t, h, 1e-6).unwrap()
    });
}

#[test]
#[ignore]
fn quantize_fp8_matches_reference() {
    let c = ctx();
    let mut r = rng(3);
    for (rows, cols) in [(1, 4096), (9, 512), (3, 100), (2, 8200)] {
        let mut x = bfv(&mut r, rows * cols, 30.0);
        x[0] = bf16::from_f32(1e-3).to_bits(); // tiny values reach E4M3 subnormals
        if rows > 2 {
            for v in &mut x[2 * cols..3 * cols] {
                *v = 0;
            } // an all-zero row: scale 2^-7, codes 0
        }
        let mut q8 = c.upload(&vec![0xAAu8; rows * cols]).unwrap();
        let mut sc = c.upload(&vec![-1f32; rows]).unwrap();
        c.quantize_fp8(&c.upload(&x).unwrap(), &mut q8, &mut sc, rows, cols).unwrap();
        check_quant("quantize", &x, &c.download(&q8).unwrap(), &c.download(&sc).unwrap(), cols);
    }
}

/// NaN and inf in rows to quantise: every FP8 activation quantiser — the decode ones
/// (`quantize_fp8_rows`, `rmsnorm_residual`'s FP8 output, `swiglu_quant`; the norm and SwiGLU
/// prologues share their code) and the prefill ones (`quantize_fp8_ct`, `swiglu_quant_ct`) — gives
/// `cpu::fp8::quantize_act_row`'s scale and codes: a row holding a NaN the NaN scale and every
/// code 0x7F, an inf the inf scale (finite values 0, the inf itself inf / inf: 0x7F).
#[test]
#[ignore]
fn fp8_quantisers_keep_nan_and_inf() {
    let c = ctx();
    let mut r = rng(12);
    let (rows, cols) = (4, 512);
    let mut x = bfv(&mut r, rows * cols, 3.0);
    x[7] = bf16::NAN.to_bits();
    x[cols + 100] = bf16::INFINITY.to_bits();
    x[2 * cols + 5] = bf16::NEG_INFINITY.to_bits();
    x[2 * cols + 300] = bf16::NAN.to_bits(); // row 3: finite
    let dx = c.upload(&x).unwrap();
    for ct in [false, true] {
        let mut q8 = c.upload(&vec![0xAAu8; rows * cols]).unwrap();
        let mut sc = c.upload(&vec![-1f32; rows]).unwrap();
        if ct {
            c.quantize_fp8_ct(&dx, &mut q8, &mut sc, rows, cols).unwrap();
        } else {
            c.quantize_fp8(&dx, &mut q8, &mut sc, rows, cols).unwrap();
        }
        let name = if ct { "quantize_fp8_ct" } else { "quantize_fp8_rows" };
        check_quant(name, &x, &c.download(&q8).unwrap(), &c.download(&sc).unwrap(), cols);
    }
    // The norm's FP8 output (these rows as the residual, no add): quantised from its bf16 output.
    let w = bfv(&mut r, cols, 0.5);
    let mut dres = c.upload(&x).unwrap();
    let mut out = c.upload(&vec![POISON; rows * cols]).unwrap();
    let mut q8 = c.upload(&vec![0xAAu8; rows * cols]).unwrap();
    let mut sc = c.upload(&vec![-1f32; rows]).unwrap();
    c.rmsnorm_residual(
        &mut dres,
        None,
        &c.upload(&w).unwrap(),
        Some(&mut out),
        Some((&mut q8, &mut sc)),
        rows,
        cols,
        1e-6,
    )
    .unwrap();
    let gout = c.download(&out).unwrap();
    assert!(gout[..cols].iter().all(|&b| bf16::from_bits(b).is_nan()), "rmsnorm: a NaN row normalises to NaN");
    check_quant("rmsnorm q8", &gout, &c.download(&q8).unwrap(), &c.download(&sc).unwrap(), cols);
    // SwiGLU: gate|up rows with a NaN gate, an inf up, and finite values.
    let inter = 256;
    let mut gu = bfv(&mut r, 3 * 2 * inter, 3.0);
    gu[3] = bf16::NAN.to_bits();
    gu[2 * inter + inter + 9] = bf16::INFINITY.to_bits();
    let dgu = c.upload(&gu).unwrap();
    let act = swiglu_act(&gu, 3, inter);
    let mut q8 = c.upload(&vec![0xAAu8; 3 * inter]).unwrap();
    let mut sc = c.upload(&[-1f32; 3]).unwrap();
    c.swiglu_quant(&dgu, &mut q8, &mut sc, 3, inter).unwrap();
    check_quant("swiglu", &act, &c.download(&q8).unwrap(), &c.download(&sc).unwrap(), inter);
    // The prefill form (swiglu_quant_ct, one warp per row): the same codes and scales.
    let q8 = c.upload(&vec![0xAAu8; 3 * inter]).unwrap();
    let sc = c.upload(&[-1f32; 3]).unwrap();
    c.k_swiglu_ct(c.addr(&dgu), c.addr(&q8), c.addr(&sc), 3, inter).unwrap();
    check_quant("swiglu_quant_ct", &act, &c.download(&q8).unwrap(), &c.download(&sc).unwrap(), inter);
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

/// BF16 decode product = `cpu::linear::linear_bf16` (fp32 accumulation, one bf16 rounding) on the
/// same rows; tolerance at `close`. Each group's first and last tokens, run alone, give the same
/// bits as in the group (the summation order depends on the weight's shape only).
#[test]
#[ignore]
fn gemv_bf16_matches_reference() {
    let c = ctx();
    let mut r = rng(4);
    // (in, out, tokens, extra x / y stride): odd row counts (a row group's last rows empty), tiny
    // rows (in 16: 32 bytes, half a 64-byte step; in 272: a partial last step), strided rows, every
    // N-tile count (1..8 tiles, and 70 tokens: a second pass over the weights), and the real decode
    // shapes: GDN fused input projection 2048 -> 12352 (4 K slices), out_proj 4096 -> 2048 (8),
    // router (+ shared gate) 2048 -> 257, lm_head (1 slice).
    let shapes = [
        (64, 67, 3, 0),
        (16, 45, 4, 8),
        (272, 33, 9, 0),
        (2048, 8192, 1, 0),
        (2048, 257, 2, 0),
        (4096, 2048, 8, 0),
        (2048, 33, 5, 0),
        (1024, 100, 17, 24),
        (512, 70, 33, 0),
        (4096, 77, 41, 16),
        (2048, 12352, 64, 0),
        (1024, 300, 70, 0),
        (2048, 12352, 1, 0),
        (2048, 12352, 8, 0),
        (2048, 12352, 32, 0),
        (4096, 2048, 1, 0),
        (4096, 2048, 32, 0),
        (4096, 2048, 64, 0),
        (2048, 257, 1, 0),
        (2048, 248320, 1, 0),
        (2048, 248320, 8, 0),
        // The staged build (gemv_bf16_staged): unsplit rows from 9 tokens (33,000 rows: K in one
        // slice), with a partial last 64-byte step (in 272) and strided rows; every shape of more
        // than 8 tokens again through it (STAGED_ALWAYS, split rows included), the same bits.
        (1024, 33000, 12, 8),
        (272, 33000, 9, 0),
        (2048, 257, 64, 0),
        (2048, 257, 70, 8),
    ];
    for (inp, out, tokens, pad) in shapes {
        let (xst, yst) = (inp + pad, out + pad);
        let x = bfv(&mut r, tokens * xst, 1.0);
        let w = bfv(&mut r, out * inp, 0.05);
        let (dx, dw) = (c.upload(&x).unwrap(), c.upload(&w).unwrap());
        // CPU reference on the rows without their padding.
        let xr: Vec<bf16> = (0..tokens).flat_map(|t| bv(&x[t * xst..t * xst + inp])).collect();
        let mut yc = vec![bf16::ZERO; tokens * out];
        linear_bf16(&xr, &bv(&w), tokens, inp, out, &mut yc);
        let want = wf(&yc);
        let mut y = c.upload(&vec![POISON; tokens * yst]).unwrap();
        c.gemv_bf16(&dx, &dw, &mut y, tokens, inp, out, xst, yst).unwrap();
        let raw = c.download(&y).unwrap();
        let got = check_gemv_rows("gemv_bf16", &raw, (inp, out, tokens, yst), &want);
        if tokens > 8 {
            // The staged build on every shape (split rows included): the same bits.
            let mut y2 = c.upload(&vec![POISON; tokens * yst]).unwrap();
            super::STAGED_ALWAYS.with(|f| f.set(true));
            c.gemv_bf16(&dx, &dw, &mut y2, tokens, inp, out, xst, yst).unwrap();
            super::STAGED_ALWAYS.with(|f| f.set(false));
            assert!(
                c.download(&y2).unwrap() == raw,
                "gemv_bf16_staged {inp}x{out} t{tokens}: other bits than the wide build"
            );
        }
        for t in [0, tokens - 1] {
            let d1 = c.upload(&x[t * xst..t * xst + inp]).unwrap();
            let mut y1 = c.upload(&vec![POISON; out]).unwrap();
            c.gemv_bf16(&d1, &dw, &mut y1, 1, inp, out, inp, out).unwrap();
            check_alone(&format!("gemv_bf16 {inp}x{out} t{tokens}"), &got, &c.download(&y1).unwrap(), t, out);
        }
        if decode_shape(inp, tokens) {
            let bytes = (out * inp * 2 + tokens * (inp + out) * 2) as f64;
            perf(&c, &format!("gemv_bf16 in {inp} out {out} tokens {tokens}"), bytes, || {
                c.gemv_bf16(&dx, &dw, &mut y, tokens, inp, out, xst, yst).unwrap()
            });
        }
    }
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

/// FP8 decode product. The kernel takes pre-quantised E4M3 activations and an f32 scale per
/// token, a contract no CPU op has (`cpu::linear::linear_fp8` quantises bf16 activations itself),
/// so the main shapes, fed random codes and scales, keep an f64 reference:
/// `(sum of exact E4M3 products) * xs * ws`. Then, on a few shapes, the kernel is fed what
/// `cpu::fp8::quantize_act_row` makes of bf16 rows and must match `cpu::linear::linear_fp8` of
/// those rows (same exact products, fp32 sums in another order, the same f32 epilogue and one bf16
/// rounding: `close`). Each group's first and last tokens alone give the same bits as in the group.
#[test]
#[ignore]
fn gemv_fp8_matches_reference() {
    let c = ctx();
    let mut r = rng(5);
    // (in, out, tokens, extra x / y stride): as for BF16 (in 16 and 1040: partial 64-byte steps),
    // plus the decode shapes q|k|v 2048 -> 9216 (4 K slices), o_proj 4096 -> 2048 (8), the shared
    // expert 2048 -> 1024 and 512 -> 2048.
    let shapes = [
        (64, 67, 3, 0),
        (16, 40, 6, 16),
        (1040, 90, 12, 0),
        (2048, 8192, 1, 0),
        (2048, 1024, 2, 0),
        (512, 2048, 1, 0),
        (512, 2048, 23, 0),
        (4096, 2048, 8, 0),
        (1024, 300, 8, 32),
        (2048, 100, 4, 0),
        (4096, 77, 2, 16),
        (1024, 51, 65, 0),
        (1024, 90, 7, 0),
        (2048, 9216, 1, 0),
        (2048, 9216, 8, 0),
        (2048, 9216, 32, 0),
        (2048, 9216, 64, 0),
        (4096, 2048, 1, 0),
        (4096, 2048, 64, 0),
        (2048, 250000, 1, 0),
        // The staged build (gemv_fp8_staged): unsplit rows with a partial last step (1040 bytes),
        // strided, from 9 tokens; split rows at 33, 64 and 100 tokens (two launches) through
        // STAGED_ALWAYS as every shape of more than 8 tokens.
        (1040, 33000, 20, 16),
        (2048, 1024, 33, 0),
        (4096, 2048, 100, 0),
    ];
    for (inp, out, tokens, pad) in shapes {
        let (xst, yst) = (inp + pad, out + pad);
        let xq = fp8v(&mut r, tokens * xst);
        let xs: Vec<f32> = (0..tokens).map(|_| r.random_range(0.001f32..0.01)).collect();
        let w = fp8v(&mut r, out * inp);
        let ws: Vec<f32> = (0..out).map(|_| bf16::from_f32(r.random_range(0.0001f32..0.001)).to_f32()).collect();
        let (dxq, dxs, dw, dws) =
            (c.upload(&xq).unwrap(), c.upload(&xs).unwrap(), c.upload(&w).unwrap(), c.upload(&ws).unwrap());
        let want: Vec<f64> = (0..tokens * out)
            .map(|k| {
                let (t, o) = (k / out, k % out);
                let acc: f64 =
                    (0..inp).map(|i| e4m3_to_f32(xq[t * xst + i]) as f64 * e4m3_to_f32(w[o * inp + i]) as f64).sum();
                acc * xs[t] as f64 * ws[o] as f64
            })
            .collect();
        let mut y = c.upload(&vec![POISON; tokens * yst]).unwrap();
        c.gemv_fp8(&dxq, &dxs, &dw, &dws, &mut y, tokens, inp, out, xst, yst).unwrap();
        let raw = c.download(&y).unwrap();
        let got = check_gemv_rows("gemv_fp8", &raw, (inp, out, tokens, yst), &want);
        if tokens > 8 {
            let mut y2 = c.upload(&vec![POISON; tokens * yst]).unwrap();
            super::STAGED_ALWAYS.with(|f| f.set(true));
            c.gemv_fp8(&dxq, &dxs, &dw, &dws, &mut y2, tokens, inp, out, xst, yst).unwrap();
            super::STAGED_ALWAYS.with(|f| f.set(false));
            assert!(
                c.download(&y2).unwrap() == raw,
                "gemv_fp8_staged {inp}x{out} t{tokens}: other bits than the wide build"
            );
        }
        for t in [0, tokens - 1] {
            let (d1, s1) = (c.upload(&xq[t * xst..t * xst + inp]).unwrap(), c.upload(&xs[t..t + 1]).unwrap());
            let mut y1 = c.upload(&vec![POISON; out]).unwrap();
            c.gemv_fp8(&d1, &s1, &dw, &dws, &mut y1, 1, inp, out, inp, out).unwrap();
            check_alone(&format!("gemv_fp8 {inp}x{out} t{tokens}"), &got, &c.download(&y1).unwrap(), t, out);
        }
        if decode_shape(inp, tokens) {
            let bytes = (out * inp + out * 4 + tokens * (inp + out * 2)) as f64;
            perf(&c, &format!("gemv_fp8 in {inp} out {out} tokens {tokens}"), bytes, || {
                c.gemv_fp8(&dxq, &dxs, &dw, &dws, &mut y, tokens, inp, out, xst, yst).unwrap()
            });
        }
    }
    // Against the CPU W8A8 Linear: bf16 rows quantised by the CPU reference quantiser.
    for (inp, out, tokens) in [(2048, 9216, 1), (4096, 2048, 1), (2048, 257, 3), (1024, 51, 5), (2048, 1024, 40)] {
        let x = bfv(&mut r, tokens * inp, 4.0);
        let w = fp8v(&mut r, out * inp);
        let ws: Vec<f32> = (0..out).map(|_| bf16::from_f32(r.random_range(0.0001f32..0.001)).to_f32()).collect();
        let (mut xq, mut xs) = (vec![0u8; tokens * inp], vec![0f32; tokens]);
        for t in 0..tokens {
            xs[t] = crate::cpu::fp8::quantize_act_row(&bv(&x[t * inp..(t + 1) * inp]), &mut xq[t * inp..(t + 1) * inp]);
        }
        let mut yc = vec![bf16::ZERO; tokens * out];
        linear_fp8(&bv(&x), &w, &ws, tokens, inp, out, &mut yc);
        let want = wf(&yc);
        let (dxq, dxs, dw, dws) =
            (c.upload(&xq).unwrap(), c.upload(&xs).unwrap(), c.upload(&w).unwrap(), c.upload(&ws).unwrap());
        let mut y = c.upload(&vec![POISON; tokens * out]).unwrap();
        c.gemv_fp8(&dxq, &dxs, &dw, &dws, &mut y, tokens, inp, out, inp, out).unwrap();
        check_gemv_rows("gemv_fp8 vs cpu", &c.download(&y).unwrap(), (inp, out, tokens, out), &want);
    }
}

/// `moe_sort` against a counting sort on the host: each expert's group offset and 64-row tile
/// offset (prefix sums over the experts) and the grouped block rows' `row_info` (the experts with
/// assignments, ascending, each with its first sorted row and count; then zero rows up to
/// min(experts, assignments)) exactly; the scatter as sets (the order inside a group follows the atomics):
/// group e holds exactly the assignments routed to e, row_of inverts row_assign, row_token is
/// the assignment's token. Expert counts below, at and above a warp, including 1,024 (one
/// thread each) and groups larger than a tile; PERF line for a decode group of 8 tokens.
#[test]
#[ignore]
fn moe_sort_matches_reference() {
    let c = ctx();
    let mut r = rng(71);
    for (tokens, k, e) in
        [(1, 8, 256), (8, 8, 256), (64, 8, 256), (300, 8, 256), (5, 3, 7), (40, 2, 33), (100, 8, 1024), (2048, 8, 64)]
    {
        // Skewed routing: a few hot experts (groups of more than 64 rows), the rest uniform.
        let idx: Vec<i32> = (0..tokens * k)
            .map(|_| if r.random_range(0..4) == 0 { r.random_range(0..e.min(3)) } else { r.random_range(0..e) } as i32)
            .collect();
        let didx = c.upload(&idx).unwrap();
        let mut g = c.moe_groups(&didx, tokens, k, e).unwrap();
        // Again over a poisoned row_info: every row up to min(experts, assignments) is written.
        g.row_info = c.upload(&vec![-7i32; 4 * e.min(tokens * k)]).unwrap();
        c.k_moe_sort(g.sort_params(&c, &didx, tokens, k, e).unwrap()).unwrap();
        let dl = |b: &cudarc::driver::CudaSlice<i32>| c.download(b).unwrap();
        let (go, to, tok, of, asg, info) = (
            dl(&g.group_offsets),
            dl(&g.tile_offsets),
            dl(&g.row_token),
            dl(&g.row_of),
            dl(&g.row_assign),
            dl(&g.row_info),
        );
        let mut cnt = vec![0usize; e];
        for &x in &idx {
            cnt[x as usize] += 1;
        }
        let (mut off, mut toff, mut rows) = (0usize, 0usize, Vec::new());
        for ex in 0..e {
            assert_eq!(go[ex] as usize, off, "group offset of expert {ex} ({tokens} x {k}, {e} experts)");
            assert_eq!(to[ex] as usize, toff, "tile offset of expert {ex} ({tokens} x {k}, {e} experts)");
            let mut got: Vec<i32> = asg[off..off + cnt[ex]].to_vec();
            got.sort_unstable();
            let want: Vec<i32> = (0..idx.len() as i32).filter(|&a| idx[a as usize] == ex as i32).collect();
            assert_eq!(got, want, "assignments of expert {ex} ({tokens} x {k}, {e} experts)");
            if cnt[ex] > 0 {
                rows.extend([ex as i32, off as i32, cnt[ex] as i32, 0]);
            }
            off += cnt[ex];
            toff += cnt[ex].div_ceil(64);
        }
        assert_eq!((go[e] as usize, to[e] as usize), (off, toff), "totals ({tokens} x {k}, {e} experts)");
        rows.resize(4 * e.min(tokens * k), 0);
        assert_eq!(info, rows, "row_info ({tokens} x {k}, {e} experts)");
        for (pos, &a) in asg.iter().enumerate() {
            assert_eq!(of[a as usize] as usize, pos, "row_of of assignment {a}");
            assert_eq!(tok[pos], a / k as i32, "row_token of row {pos}");
        }
    }
    let idx: Vec<i32> = (0..64).map(|_| r.random_range(0..256)).collect();
    let didx = c.upload(&idx).unwrap();
    let g = c.moe_groups(&didx, 8, 8, 256).unwrap();
    let p = g.sort_params(&c, &didx, 8, 8, 256).unwrap();
    let us = time_it(&c, || c.k_moe_sort(p).unwrap());
    eprintln!("PERF moe_sort 8 tokens x top-8 of 256 experts: {:.2} us", us * 1e6);
}

/// The whole MoE decode chain on the device (router -> gate_up -> SwiGLU+FP8 -> down -> combine),
/// each stage fed the GPU's own output of the stage before. The router against
/// `cpu::moe::route` (indices exact, weights within 2^-7 relative); the SwiGLU's FP8 codes bit
/// for bit against `cpu::fp8::quantize_act_row`. No CPU op has the contract of the other stages,
/// so they keep f64 references with the same cast points: the expert GEMVs take pre-quantised
/// E4M3 activations (`cpu::moe::Mlp` quantises bf16 ones itself), and the SwiGLU product
/// `bf16(bf16(silu(g)) * u)` and the combine `bf16(bf16(sum_j bf16(y_j w_j)) + bf16(g y_s))` are
/// inline steps of `cpu::moe` (`Mlp::forward`, `moe`), written out here.
#[test]
#[ignore]
fn moe_decode_matches_reference() {
    let c = ctx();
    let mut r = rng(6);
    // (experts, top_k, hidden, inter, tokens)
    // K slices per row group follow the expert's shape (gemv_tc_ksplit, MoE target): gate|up
    // 2048 -> 1024: 4, down 512 -> 2048: 2, the small shapes 1 (in 48 / 32: a partial 64-byte step; odd row
    // count 96). Every case also checks the grouped form against the per-(token, slot) one, bit
    // for bit: several assignments per expert (13, 64 tokens), several N tiles of one expert
    // (16 experts x 40 tokens: ~10 per expert), more than one pass of 64 columns (4 experts x
    // 100 tokens, and the shared expert over 100 tokens).
    for (e, k, h, inter, tokens) in [
        (256, 8, 2048, 512, 1),
        (16, 4, 64, 32, 3),
        (256, 8, 2048, 512, 2),
        (8, 2, 1024, 48, 2),
        (256, 8, 2048, 512, 13),
        (16, 4, 64, 32, 9),
        (256, 8, 2048, 512, 64),
        (16, 4, 64, 32, 40),
        (4, 2, 64, 32, 100),
    ] {
        let slots = k + 1;
        let logits = bfv(&mut r, tokens * (e + 1), 3.0); // router logits + shared-gate logit per token
        let xq = fp8v(&mut r, tokens * h);
        let xs: Vec<f32> = (0..tokens).map(|_| r.random_range(0.001f32..0.01)).collect();
        let wgu = fp8v(&mut r, e * 2 * inter * h);
        let wgus: Vec<f32> = (0..e * 2 * inter).map(|_| r.random_range(0.0005f32..0.002)).collect();
        let sgu = fp8v(&mut r, 2 * inter * h);
        let sgus: Vec<f32> = (0..2 * inter).map(|_| r.random_range(0.0005f32..0.002)).collect();
        let wd = fp8v(&mut r, e * h * inter);
        let wds: Vec<f32> = (0..e * h).map(|_| r.random_range(0.0005f32..0.002)).collect();
        let sd = fp8v(&mut r, h * inter);
        let sds: Vec<f32> = (0..h).map(|_| r.random_range(0.0005f32..0.002)).collect();
        let dl = c.upload(&logits).unwrap();
        let mut idx = c.upload(&vec![-1i32; tokens * k]).unwrap();
        let mut wt = c.upload(&vec![f32::NAN; tokens * k]).unwrap();
        c.moe_router(&dl, &mut idx, &mut wt, tokens, e, k, e + 1).unwrap();
        let (gidx, gwt) = (c.download(&idx).unwrap(), c.download(&wt).unwrap());
        // Router reference: `cpu::moe::route` on the same logits (columns 0..e of each row; column
        // e is the shared-expert gate): softmax in fp32, top-k by probability (ties to the lower
        // index), renormalised, bf16 weights — the kernel's own fp32 formulation, so a near-tie
        // in the order is no more likely to split them than against the f64 loop this replaced.
        // The weight bound is the one written for the f64 reference
        // (2^-7 relative); the CPU weight is one bf16 rounding of an fp32 value, so the GPU's
        // fp32 or bf16 weight is within one bf16 ulp (<= 2^-7 relative) of it.
        let rl: Vec<bf16> = (0..tokens).flat_map(|t| bv(&logits[t * (e + 1)..t * (e + 1) + e])).collect();
        let (mut cidx, mut cw) = (vec![0u32; tokens * k], vec![bf16::ZERO; tokens * k]);
        crate::cpu::moe::route(&rl, tokens, e, k, &mut cidx, &mut cw);
        for t in 0..tokens {
            for j in 0..k {
                assert_eq!(gidx[t * k + j], cidx[t * k + j] as i32, "router idx [{t},{j}]");
                let want = cw[t * k + j].to_f64();
                assert!(
                    (gwt[t * k + j] as f64 - want).abs() <= want / 128.0,
                    "router weight [{t},{j}] {} vs {want}",
                    gwt[t * k + j]
                );
            }
        }
        let (dxq, dxs) = (c.upload(&xq).unwrap(), c.upload(&xs).unwrap());
        let (dwgu, dwgus, dsgu, dsgus) =
            (c.upload(&wgu).unwrap(), c.upload(&wgus).unwrap(), c.upload(&sgu).unwrap(), c.upload(&sgus).unwrap());
        let mut gu = c.upload(&vec![POISON; tokens * slots * 2 * inter]).unwrap();
        let a1 = MoeGemvArgs {
            xq: &dxq,
            xs: &dxs,
            idx: &idx,
            w: &dwgu,
            ws: &dwgus,
            shared_w: &dsgu,
            shared_ws: &dsgus,
            tokens,
            top_k: k,
            experts: e,
            in_: h,
            out: 2 * inter,
            x_tok_stride: h,
            x_slot_stride: 0,
            xs_tok_stride: 1,
            xs_slot_stride: 0,
        };
        c.moe_gemv(&a1, &mut gu).unwrap();
        let ggu = c.download(&gu).unwrap();
        let groups = c.moe_groups(&idx, tokens, k, e).unwrap();
        let mut gu2 = c.upload(&vec![POISON; tokens * slots * 2 * inter]).unwrap();
        c.moe_gemv_grouped(&a1, &groups, &mut gu2).unwrap();
        assert!(c.download(&gu2).unwrap() == ggu, "grouped gate_up differs from the per-slot GEMV ({tokens} tokens)");
        let dot = |w: &[u8], x: &[u8]| -> f64 {
            w.iter().zip(x).map(|(&a, &b)| e4m3_to_f32(a) as f64 * e4m3_to_f32(b) as f64).sum()
        };
        let mut want_gu = Vec::new();
        for t in 0..tokens {
            for j in 0..slots {
                for o in 0..2 * inter {
                    let (w, s) = if j < k {
                        let ex = gidx[t * k + j] as usize;
                        (&wgu[(ex * 2 * inter + o) * h..][..h], wgus[ex * 2 * inter + o])
                    } else {
                        (&sgu[o * h..][..h], sgus[o])
                    };
                    want_gu.push(dot(w, &xq[t * h..][..h]) * xs[t] as f64 * s as f64);
                }
            }
        }
        close("moe gate_up", &ggu, &want_gu);
        let rows = tokens * slots;
        let mut aq = c.upload(&vec![0xAAu8; rows * inter]).unwrap();
        let mut asc = c.upload(&vec![-1f32; rows]).unwrap();
        c.swiglu_quant(&gu, &mut aq, &mut asc, rows, inter).unwrap();
        let (gaq, gasc) = (c.download(&aq).unwrap(), c.download(&asc).unwrap());
        // SwiGLU from the GPU's bf16 gate_up, then the bit-exact quantisation check
        check_quant("swiglu", &swiglu_act(&ggu, rows, inter), &gaq, &gasc, inter);
        let (dwd, dwds, dsd, dsds) =
            (c.upload(&wd).unwrap(), c.upload(&wds).unwrap(), c.upload(&sd).unwrap(), c.upload(&sds).unwrap());
        let mut ys = c.upload(&vec![POISON; rows * h]).unwrap();
        let a2 = MoeGemvArgs {
            xq: &aq,
            xs: &asc,
            idx: &idx,
            w: &dwd,
            ws: &dwds,
            shared_w: &dsd,
            shared_ws: &dsds,
            tokens,
            top_k: k,
            experts: e,
            in_: inter,
            out: h,
            x_tok_stride: slots * inter,
            x_slot_stride: inter,
            xs_tok_stride: slots,
            xs_slot_stride: 1,
        };
        c.moe_gemv(&a2, &mut ys).unwrap();
        let gys = c.download(&ys).unwrap();
        let mut ys2 = c.upload(&vec![POISON; rows * h]).unwrap();
        c.moe_gemv_grouped(&a2, &groups, &mut ys2).unwrap();
        assert!(c.download(&ys2).unwrap() == gys, "grouped down differs from the per-slot GEMV ({tokens} tokens)");
        let mut want_ys = Vec::new();
        for t in 0..tokens {
            for j in 0..slots {
                let rr = t * slots + j;
                for o in 0..h {
                    let (w, s) = if j < k {
                        let ex = gidx[t * k + j] as usize;
                        (&wd[(ex * h + o) * inter..][..inter], wds[ex * h + o])
                    } else {
                        (&sd[o * inter..][..inter], sds[o])
                    };
                    want_ys.push(dot(w, &gaq[rr * inter..][..inter]) * gasc[rr] as f64 * s as f64);
                }
            }
        }
        close("moe down", &gys, &want_ys);
        if tokens == 1 && e == 256 {
            // decode: gate|up (in 2048, out 1024) and down (in 512, out 2048) over 9 slots
            for (a, what) in [(&a1, "gate_up"), (&a2, "down")] {
                let (in_, out) = (a.in_, a.out);
                let bytes = (slots * (out * in_ + out * 4 + out * 2)
                    + in_ * if a.x_slot_stride > 0 { slots } else { 1 }) as f64;
                let mut y = c.upload(&vec![POISON; slots * out]).unwrap();
                perf(&c, &format!("moe_gemv_fp8 {what} in {in_} out {out} slots {slots} experts {e}"), bytes, || {
                    c.moe_gemv(a, &mut y).unwrap()
                });
            }
        }
        let mut out = c.upload(&vec![POISON; tokens * h]).unwrap();
        let gate = c.upload(&logits[e..]).unwrap(); // shared-gate logit at column e of each row
        c.moe_combine(&ys, &wt, &gate, &mut out, tokens, k, h, e + 1).unwrap();
        let gout = c.download(&out).unwrap();
        let mut want = Vec::new();
        for t in 0..tokens {
            let g = rb(sigm(f(logits[t * (e + 1) + e])));
            for o in 0..h {
                let routed: f64 = (0..k).map(|j| rb(f(gys[(t * slots + j) * h + o]) * gwt[t * k + j] as f64)).sum();
                let shared = rb(g * f(gys[(t * slots + k) * h + o]));
                want.push(rb(routed) + shared);
            }
        }
        close("moe combine", &gout, &want);
    }
}

/// `conv1d_silu` = `cpu::conv::conv_silu` (causal depthwise conv over [state; x], one bf16
/// rounding, SiLU, one rounding; `close`), and the state it leaves exactly the CPU's (a copy of
/// the last 3 input rows). Per-row slots (a decode group): token t of its own sequence, state
/// slot `slots[t]` of a pool, bit-identical to one single-token launch per sequence, and the
/// slots not named untouched.
#[test]
#[ignore]
fn conv1d_silu_matches_reference() {
    let c = ctx();
    let mut r = rng(7);
    for (ch, tokens) in [(8192, 1), (8192, 5), (100, 7)] {
        let x = bfv(&mut r, tokens * ch, 2.0);
        let w = bfv(&mut r, ch * 4, 1.0);
        let st = bfv(&mut r, 3 * ch, 2.0);
        let mut dst = c.upload(&st).unwrap();
        let mut y = c.upload(&vec![POISON; tokens * ch]).unwrap();
        let (dx, dw) = (c.upload(&x).unwrap(), c.upload(&w).unwrap());
        c.conv1d_silu(&dx, &dw, &mut dst, &mut y, tokens, ch, ch, None).unwrap();
        let (mut s_cpu, mut want) = (bv(&st), vec![bf16::ZERO; tokens * ch]);
        conv_silu(&bv(&x), tokens, ch, &bv(&w), 4, &mut s_cpu, &mut want);
        close(&format!("conv c{ch} t{tokens}"), &c.download(&y).unwrap(), &wf(&want));
        assert_eq!(c.download(&dst).unwrap(), bits(&s_cpu), "conv state = last 3 inputs (the CPU's state)");

        // Per-row slots: `tokens` sequences in a pool of tokens + 2 slots, in reversed order.
        let pool_n = tokens + 2;
        let pool = bfv(&mut r, pool_n * 3 * ch, 2.0);
        let slots: Vec<i32> = (0..tokens).map(|t| (pool_n - 1 - t) as i32).collect();
        let mut dpool = c.upload(&pool).unwrap();
        let mut yg = c.upload(&vec![POISON; tokens * ch]).unwrap();
        c.conv1d_silu(&dx, &dw, &mut dpool, &mut yg, tokens, ch, ch, Some(&c.upload(&slots).unwrap())).unwrap();
        let (gy, gpool) = (c.download(&yg).unwrap(), c.download(&dpool).unwrap());
        let mut want_pool = pool.clone();
        for (t, &sl) in slots.iter().enumerate() {
            let sl = sl as usize;
            let mut one = c.upload(&pool[sl * 3 * ch..(sl + 1) * 3 * ch]).unwrap();
            let mut y1 = c.upload(&vec![POISON; ch]).unwrap();
            c.conv1d_silu(&c.upload(&x[t * ch..(t + 1) * ch]).unwrap(), &dw, &mut one, &mut y1, 1, ch, ch, None)
                .unwrap();
            assert_eq!(&gy[t * ch..(t + 1) * ch], &c.download(&y1).unwrap()[..], "conv per-row y, row {t}");
            want_pool[sl * 3 * ch..(sl + 1) * 3 * ch].copy_from_slice(&c.download(&one).unwrap());
        }
        assert_eq!(gpool, want_pool, "conv per-row states (named slots advanced, the others untouched)");
    }
}

/// `gdn_recurrent` = the CPU's recurrent gated delta rule: `cpu::gdn::gates` (beta, decay),
/// `split_qkv` (l2norm, q scale) and `recurrent` (the token-by-token form; `gated_delta_rule`
/// would take the chunked form for T > 1), output rounded to bf16 once, from a random non-zero
/// state. Output: `close`. State: fp32 end to end on both sides, differing only in summation
/// order; the bound written for the f64 reference (relative L2 1e-5) is kept: against f64 each
/// side carries ~1e-6 of fp32 rounding over these few steps of 128-term dot products, so the
/// two fp32 sides differ by about the same.
#[test]
#[ignore]
fn gdn_recurrent_matches_reference() {
    let c = ctx();
    let mut r = rng(8);
    for (hk, hv, tokens) in [(16, 32, 1), (16, 32, 3), (2, 4, 5)] {
        let d = 128;
        let stride = 2 * hk * d + hv * d;
        let qkv = bfv(&mut r, tokens * stride, 1.0);
        let ba = bfv(&mut r, tokens * 2 * hv, 3.0);
        let a_log: Vec<f32> = (0..hv).map(|_| r.random_range(0.01f32..16.0).ln()).collect();
        let dtb = bfv(&mut r, hv, 1.0);
        let st: Vec<f32> = (0..hv * d * d).map(|_| r.random_range(-0.5f32..0.5)).collect();
        let mut dst = c.upload(&st).unwrap();
        let mut o = c.upload(&vec![POISON; tokens * hv * d]).unwrap();
        let (dq, dba, dal, ddt) =
            (c.upload(&qkv).unwrap(), c.upload(&ba).unwrap(), c.upload(&a_log).unwrap(), c.upload(&dtb).unwrap());
        let args = GdnArgs {
            qkv: &dq,
            ba: &dba,
            a_log: &dal,
            dt_bias: &ddt,
            tokens,
            k_heads: hk,
            v_heads: hv,
            qkv_stride: stride,
            ba_stride: 2 * hv,
            a_offset: hv,
            slots: None,
        };
        c.gdn_recurrent(&args, &mut dst, &mut o).unwrap();
        // CPU reference: b and a are the two halves of each `ba` row.
        let dims = GdnDims { hk, hv, dk: d, dv: d };
        let b: Vec<bf16> = (0..tokens).flat_map(|t| bv(&ba[t * 2 * hv..t * 2 * hv + hv])).collect();
        let a: Vec<bf16> = (0..tokens).flat_map(|t| bv(&ba[t * 2 * hv + hv..(t + 1) * 2 * hv])).collect();
        let (mut beta, mut g) = (vec![0f32; tokens * hv], vec![0f32; tokens * hv]);
        gates(&b, &a, &a_log, &bv(&dtb), tokens, hv, &mut beta, &mut g);
        let (mut q, mut k) = (vec![0f32; tokens * hk * d], vec![0f32; tokens * hk * d]);
        let mut v = vec![0f32; tokens * hv * d];
        split_qkv(&bv(&qkv), tokens, dims, &mut q, &mut k, &mut v);
        let (mut s, mut oc) = (st.clone(), vec![0f32; tokens * hv * d]);
        recurrent(&q, &k, &v, &g, &beta, tokens, dims, &mut s, &mut oc);
        let want: Vec<f64> = oc.iter().map(|&x| bf16::from_f32(x).to_f64()).collect();
        close(&format!("gdn o hk{hk} hv{hv} t{tokens}"), &c.download(&o).unwrap(), &want);
        let gs = c.download(&dst).unwrap();
        let num: f64 = gs.iter().zip(&s).map(|(&g, &w)| (g as f64 - w as f64).powi(2)).sum();
        let den: f64 = s.iter().map(|&w| (w as f64).powi(2)).sum();
        assert!((num / den).sqrt() < 1e-5, "gdn state rel err {}", (num / den).sqrt());

        // Per-row slots (a decode group): token t is the next token of its own sequence, state
        // slot `slots[t]` of a pool of tokens + 2 (reversed order); bit-identical to one
        // single-token launch per sequence, the slots not named untouched.
        let per = hv * d * d;
        let pool_n = tokens + 2;
        let pool: Vec<f32> = (0..pool_n * per).map(|_| r.random_range(-0.5f32..0.5)).collect();
        let slots: Vec<i32> = (0..tokens).map(|t| (pool_n - 1 - t) as i32).collect();
        let dslots = c.upload(&slots).unwrap();
        let mut dpool = c.upload(&pool).unwrap();
        let mut og = c.upload(&vec![POISON; tokens * hv * d]).unwrap();
        c.gdn_recurrent(&GdnArgs { slots: Some(&dslots), ..args }, &mut dpool, &mut og).unwrap();
        let (go, gpool) = (c.download(&og).unwrap(), c.download(&dpool).unwrap());
        let mut want_pool = pool.clone();
        for (t, &sl) in slots.iter().enumerate() {
            let sl = sl as usize;
            let (q1, b1) = (
                c.upload(&qkv[t * stride..(t + 1) * stride]).unwrap(),
                c.upload(&ba[t * 2 * hv..(t + 1) * 2 * hv]).unwrap(),
            );
            let mut one = c.upload(&pool[sl * per..(sl + 1) * per]).unwrap();
            let mut o1 = c.upload(&vec![POISON; hv * d]).unwrap();
            c.gdn_recurrent(&GdnArgs { qkv: &q1, ba: &b1, tokens: 1, ..args }, &mut one, &mut o1).unwrap();
            assert_eq!(&go[t * hv * d..(t + 1) * hv * d], &c.download(&o1).unwrap()[..], "gdn per-row o, row {t}");
            want_pool[sl * per..(sl + 1) * per].copy_from_slice(&c.download(&one).unwrap());
        }
        assert!(gpool == want_pool, "gdn per-row states differ from single-sequence launches");
    }
}

/// `gated_rmsnorm` = `cpu::norm::gated_rms_norm` (plain weight, bf16(n), bf16(w n), silu(z) in
/// fp32, one rounding; `close`).
#[test]
#[ignore]
fn gated_rmsnorm_matches_reference() {
    let c = ctx();
    let mut r = rng(9);
    // (15 rows: a partial block of 8 warp-rows; dim 100: a partial last element group.)
    for (tokens, heads, dim) in [(1, 32, 128), (3, 4, 32), (5, 3, 100)] {
        let o = bfv(&mut r, tokens * heads * dim, 2.0);
        let z = bfv(&mut r, tokens * heads * dim, 3.0);
        let w = bfv(&mut r, dim, 1.5);
        let mut y = c.upload(&vec![POISON; tokens * heads * dim]).unwrap();
        c.gated_rmsnorm(
            &c.upload(&o).unwrap(),
            &c.upload(&z).unwrap(),
            &c.upload(&w).unwrap(),
            &mut y,
            tokens,
            heads,
            dim,
            heads * dim,
            1e-6,
        )
        .unwrap();
        let mut want = vec![bf16::ZERO; tokens * heads * dim];
        gated_rms_norm(&bv(&o), &bv(&z), &bv(&w), dim, 1e-6, &mut want);
        close("gated_rmsnorm", &c.download(&y).unwrap(), &wf(&want));
    }
    // The prefill shape: 2,048 tokens x 32 heads x 128.
    let (t, h, d) = (2048, 32, 128);
    let (o, z, w) = (
        c.upload(&bfv(&mut r, t * h * d, 2.0)).unwrap(),
        c.upload(&bfv(&mut r, t * h * d, 3.0)).unwrap(),
        c.upload(&bfv(&mut r, d, 1.5)).unwrap(),
    );
    let mut y = c.alloc::<u16>(t * h * d).unwrap();
    perf(&c, "gated_rmsnorm 2048 tokens x 32 heads x 128", (t * h * d * 6 + d * 2) as f64, || {
        c.gated_rmsnorm(&o, &z, &w, &mut y, t, h, d, h * d, 1e-6).unwrap()
    });
}

/// `gdn_out_proj` (the GDN output projection with its gated RMSNorm in the prologue) =
/// `cpu::norm::gated_rms_norm` and then `cpu::linear::linear_bf16` on the normalised bf16 rows
/// (tolerance at `close`), the residual fold bit for bit (`fold = bf16(fold + y_old)`). Each
/// group's first and last tokens run alone (the ticket path) give the same bits as in the group
/// (above `ORNITH_GDN_OUT_TICKET_TOKENS` (2) tokens the heads are added by `gdn_out_reduce`: the
/// same adds in the same order).
#[test]
#[ignore]
fn gdn_out_proj_matches_reference() {
    let c = ctx();
    let mut r = rng(10);
    let dim = ORNITH_GDN_OUT_DIM as usize;
    // (tokens, heads, out, z stride padding): one token and the ticket path's largest launch (2);
    // launches through gdn_out_reduce (3, 8, 9, 33, 64); two launches (70 = 64 + 6); the real
    // shape 32 heads x 128 -> 2048; row counts that leave a row tile's last rows or warps empty
    // (77, 130, 200); 40 heads, a second group of loads in the heads' sum (alone: the ticket path;
    // the group of 3: gdn_out_reduce).
    let shapes = [
        (1, 32, 2048, 0),
        (3, 40, 100, 0),
        (2, 32, 2048, 0),
        (8, 32, 2048, 0),
        (3, 4, 200, 64),
        (9, 2, 77, 0),
        (33, 32, 2048, 0),
        (64, 32, 2048, 0),
        (70, 3, 130, 8),
    ];
    for (tokens, heads, out, pad) in shapes {
        let (inp, zs) = (heads * dim, heads * dim + pad);
        let o = bfv(&mut r, tokens * inp, 2.0);
        let z = bfv(&mut r, tokens * zs, 3.0);
        let nw = bfv(&mut r, dim, 1.5);
        let w = bfv(&mut r, out * inp, 0.05);
        let res = bfv(&mut r, tokens * out, 1.0);
        let old = bfv(&mut r, tokens * out, 1.0);
        let zr: Vec<bf16> = (0..tokens).flat_map(|t| bv(&z[t * zs..t * zs + inp])).collect();
        let mut g = vec![bf16::ZERO; tokens * inp];
        gated_rms_norm(&bv(&o), &zr, &bv(&nw), dim, 1e-6, &mut g);
        let mut yc = vec![bf16::ZERO; tokens * out];
        linear_bf16(&g, &bv(&w), tokens, inp, out, &mut yc);
        let want_fold: Vec<u16> = res
            .iter()
            .zip(&old)
            .map(|(&a, &b)| bf16::from_f32(bf16::from_bits(a).to_f32() + bf16::from_bits(b).to_f32()).to_bits())
            .collect();
        let (d_o, d_z, d_n, d_w) =
            (c.upload(&o).unwrap(), c.upload(&z).unwrap(), c.upload(&nw).unwrap(), c.upload(&w).unwrap());
        let (mut y, mut fo) = (c.upload(&old).unwrap(), c.upload(&res).unwrap());
        c.gdn_out_proj(&d_o, &d_z, &d_n, &d_w, &mut y, Some(&mut fo), tokens, heads, out, zs, 1e-6).unwrap();
        let name = format!("gdn_out_proj {heads}x{dim} -> {out} t{tokens}");
        let got = c.download(&y).unwrap();
        close(&name, &got, &wf(&yc));
        assert!(c.download(&fo).unwrap() == want_fold, "{name}: residual fold");
        for t in [0, tokens - 1] {
            let (o1, z1) = (c.upload(&o[t * inp..(t + 1) * inp]).unwrap(), c.upload(&z[t * zs..t * zs + inp]).unwrap());
            let mut y1 = c.upload(&vec![POISON; out]).unwrap();
            c.gdn_out_proj(&o1, &z1, &d_n, &d_w, &mut y1, None, 1, heads, out, zs, 1e-6).unwrap();
            check_alone(&name, &got, &c.download(&y1).unwrap(), t, out);
        }
        if heads == 32 && decode_shape(inp, tokens) {
            let bytes = (out * inp * 2 + tokens * (2 * inp + out) * 2) as f64;
            perf(&c, &format!("gdn_out_proj 32x128 -> {out} tokens {tokens}"), bytes, || {
                c.gdn_out_proj(&d_o, &d_z, &d_n, &d_w, &mut y, None, tokens, heads, out, zs, 1e-6).unwrap()
            });
        }
    }
}

/// Decode attention over a paged cache. `qk_norm_rope` = `cpu::attention::split_q_gate`,
/// `cpu::norm::rms_norm` per head (zero-centred) and `cpu::attention::apply_rope` (bf16 cos/sin
/// and products) on q and k, k and v written through a reversed block table to the cache rows of
/// positions pos0..; then the split attention, from the GPU's q and cache, =
/// `cpu::attention::attention` (fp32 softmax and P·V, one bf16 rounding), times the output gate
/// `bf16(sigmoid(gate))` of `cpu::attention::output_gate` with the product left unrounded, as in
/// the f64 loop this replaced (`close`). Why not `output_gate` itself: the kernel's split-K
/// combine and the CPU's sum differ by fp32 noise (~1e-6; the tensor-core P·V carries P as two
/// bf16 halves, 16 significant bits), which rounds some `o` (~3e-4 of them) to neighbouring bf16
/// values; rounding the gated product on both sides as well would let such an element differ by
/// up to 2 ulps, where the f64-shaped reference (1 ulp of `o`·gate + half an ulp) keeps the risk
/// profile this tolerance was tested with. The per-row (device-position) forms must equal the
/// host forms bit for bit — also with every row reading its own copy of the sequence through its
/// own block table (a decode group of different sequences).
#[test]
#[ignore]
fn attention_decode_matches_reference() {
    let c = ctx();
    let mut r = rng(10);
    let (qh, kvh, d, rot, theta) = (16usize, 2usize, 256usize, 64usize, 1e7f32);
    let row = kvh * d;
    for (pos0, tokens, split) in
        [(0usize, 1usize, 64usize), (37, 1, 16), (1000, 1, 64), (300, 3, 128), (4095, 1, 64), (254, 3, 16)]
    {
        let max_seq = pos0 + tokens;
        let need = max_seq.div_ceil(KVB);
        let table = reversed_table(need);
        let cache_len = (need + 1) * KVB * row;
        // logical rows before pos0 hold earlier tokens (already normed/rotated k, raw v)
        let mut kc = bfv(&mut r, max_seq * row, 1.0);
        let mut vc = bfv(&mut r, max_seq * row, 1.0);
        let (kfill, vfill) = (bfv(&mut r, cache_len, 1.0), bfv(&mut r, cache_len, 1.0));
        let qg = bfv(&mut r, tokens * qh * 2 * d, 2.0);
        let k = bfv(&mut r, tokens * row, 2.0);
        let v = bfv(&mut r, tokens * row, 2.0);
        let qn = bfv(&mut r, d, 0.5);
        let kn = bfv(&mut r, d, 0.5);
        let (dqg, dk, dv, dqn, dkn) = (
            c.upload(&qg).unwrap(),
            c.upload(&k).unwrap(),
            c.upload(&v).unwrap(),
            c.upload(&qn).unwrap(),
            c.upload(&kn).unwrap(),
        );
        let dtable = c.upload(&table).unwrap();
        let mut dkc = c.upload(&page(&kc, row, &table, &kfill)).unwrap();
        let mut dvc = c.upload(&page(&vc, row, &table, &vfill)).unwrap();
        let mut q = c.upload(&vec![POISON; tokens * qh * d]).unwrap();
        let a = QkRopeArgs {
            qg: &dqg,
            k: &dk,
            v: &dv,
            q_norm: &dqn,
            k_norm: &dkn,
            tokens,
            pos0,
            q_heads: qh,
            kv_heads: kvh,
            head_dim: d,
            rot,
            theta,
            eps: 1e-6,
            pos_dev: None,
            table: &dtable,
            table_stride: 0,
        };
        c.qk_norm_rope(&a, &mut q, &mut dkc, &mut dvc).unwrap();
        // CPU reference q/k: per-head zero-centred RMSNorm, then rotate-half RoPE.
        let (mut q_raw, mut gate) = (vec![bf16::ZERO; tokens * qh * d], vec![bf16::ZERO; tokens * qh * d]);
        split_q_gate(&bv(&qg), tokens, qh, d, &mut q_raw, &mut gate);
        let mut want_q = vec![bf16::ZERO; tokens * qh * d];
        rms_norm(&q_raw, &bv(&qn), d, 1e-6, &mut want_q);
        apply_rope(&mut want_q, tokens, qh, d, rot, pos0, theta);
        let mut kr = vec![bf16::ZERO; tokens * row];
        rms_norm(&bv(&k), &bv(&kn), d, 1e-6, &mut kr);
        apply_rope(&mut kr, tokens, kvh, d, rot, pos0, theta);
        kc[pos0 * row..(pos0 + tokens) * row].copy_from_slice(&bits(&kr));
        vc[pos0 * row..(pos0 + tokens) * row].copy_from_slice(&v);
        let gq = c.download(&q).unwrap();
        close(&format!("q rope pos {pos0}"), &gq, &wf(&want_q));
        let (pk, pv) = (c.download(&dkc).unwrap(), c.download(&dvc).unwrap());
        let gkc = unpage(&pk, row, &table, max_seq);
        close(&format!("k cache pos {pos0}"), &gkc, &kc.iter().map(|&b| f(b)).collect::<Vec<_>>());
        // v through the table, and no row outside the sequence's positions written
        assert_eq!(pv, page(&vc, row, &table, &vfill), "v cache (paged)");
        assert_eq!(page(&gkc, row, &table, &kfill), pk, "k cache: rows outside the positions untouched");
        // Per-row form (what a captured decode graph runs): row t's position pos_dev[t] and its
        // own block table row (here all rows of one sequence: the same table, stride `need`).
        // It must write the same q and cache rows (rewriting the rows just written).
        let dpos = c.upload(&(pos0..max_seq).map(|p| p as i32).collect::<Vec<_>>()).unwrap();
        let rows_table: Vec<i32> = (0..tokens).flat_map(|_| table.iter().copied()).collect();
        let drows_table = c.upload(&rows_table).unwrap();
        let (grid, min_split) = (256usize, 32usize);
        let mut q2 = c.upload(&vec![POISON; tokens * qh * d]).unwrap();
        let a2 = QkRopeArgs { pos_dev: Some(&dpos), pos0: 0, table: &drows_table, table_stride: need, ..a };
        c.qk_norm_rope(&a2, &mut q2, &mut dkc, &mut dvc).unwrap();
        assert_eq!(c.download(&q2).unwrap(), gq, "device-position q, pos {pos0}");
        assert_eq!(c.download(&dkc).unwrap(), pk, "device-position k cache, pos {pos0}");
        // attention from the GPU's q and cache (checked above)
        let splits = max_seq.div_ceil(split);
        let mut po = c.alloc::<f32>(tokens * qh * splits * d).unwrap();
        let mut pml = c.alloc::<f32>(tokens * qh * splits * 2).unwrap();
        let mut out = c.upload(&vec![POISON; tokens * qh * d]).unwrap();
        let aa = AttnArgs {
            q: &q,
            qg: &dqg,
            k_cache: &dkc,
            v_cache: &dvc,
            tokens,
            pos0,
            q_heads: qh,
            kv_heads: kvh,
            head_dim: d,
            split_len: split,
            pos_dev: None,
            table: &dtable,
            table_stride: 0,
        };
        c.attention_decode(&aa, &mut po, &mut pml, &mut out).unwrap();
        // With the FP8 o_proj's input from the combine (the row's last block quantises it): the
        // same output, and the codes and scales of quantize_fp8_rows on it, bit for bit; twice,
        // so the second launch finds the row counters back at zero.
        let want_q8 = c.upload(&vec![0xAAu8; tokens * qh * d]).unwrap();
        let want_sc = c.upload(&vec![-1f32; tokens]).unwrap();
        c.k_quant(c.addr(&out), c.addr(&want_q8), c.addr(&want_sc), tokens, qh * d).unwrap();
        let (want_q8, want_sc) = (c.download(&want_q8).unwrap(), c.download(&want_sc).unwrap());
        for run in 0..2 {
            let mut out_q = c.upload(&vec![POISON; tokens * qh * d]).unwrap();
            let mut q8 = c.upload(&vec![0x55u8; tokens * qh * d]).unwrap();
            let mut sc = c.upload(&vec![-2f32; tokens]).unwrap();
            c.attention_decode_q8(&aa, &mut po, &mut pml, &mut out_q, &mut q8, &mut sc).unwrap();
            assert!(
                c.download(&out_q).unwrap() == c.download(&out).unwrap(),
                "attention with FP8 output: out (run {run})"
            );
            assert!(
                c.download(&q8).unwrap() == want_q8,
                "attention FP8 codes vs quantize_fp8_rows (pos {pos0} t{tokens} run {run})"
            );
            assert!(
                c.download(&sc).unwrap() == want_sc,
                "attention FP8 scales vs quantize_fp8_rows (pos {pos0} t{tokens} run {run})"
            );
        }
        let mut o_cpu = vec![bf16::ZERO; tokens * qh * d];
        attention(&bv(&gq), tokens, pos0, &bv(&gkc), &bv(&vc), qh, kvh, d, &mut o_cpu);
        let sg = |g: &bf16| bf16::from_f32(crate::cpu::sigmoid(g.to_f32())).to_f64();
        let want: Vec<f64> = o_cpu.iter().zip(&gate).map(|(o, g)| o.to_f64() * sg(g)).collect();
        close(&format!("attention pos {pos0} t{tokens}"), &c.download(&out).unwrap(), &want);
        // Device-position form: positions read from device memory, each row's split length
        // derived on the device from its own position over a fixed grid of 256 splits (minimum
        // 32 keys). In these cases every row's own length gives the host form's split length
        // (checked), so it must equal the host form bit for bit.
        let dsplit = max_seq.div_ceil(grid).max(min_split);
        assert!((pos0 + 1..=max_seq).all(|l| l.div_ceil(grid).max(min_split) == dsplit));
        let mut po2 = c.alloc::<f32>(tokens * qh * grid * d).unwrap();
        let mut pml2 = c.alloc::<f32>(tokens * qh * grid * 2).unwrap();
        let mut out_host = c.upload(&vec![POISON; tokens * qh * d]).unwrap();
        let mut out_dev = c.upload(&vec![POISON; tokens * qh * d]).unwrap();
        c.attention_decode(&AttnArgs { split_len: dsplit, ..aa }, &mut po2, &mut pml2, &mut out_host).unwrap();
        let host = c.download(&out_host).unwrap();
        let dev_form = AttnArgs {
            pos_dev: Some((&dpos, grid, min_split)),
            pos0: 0,
            table: &drows_table,
            table_stride: need,
            ..aa
        };
        c.attention_decode(&dev_form, &mut po2, &mut pml2, &mut out_dev).unwrap();
        assert_eq!(c.download(&out_dev).unwrap(), host, "device-position attention, pos {pos0} t{tokens}");
        // A decode group of different sequences: row t reads its own copy of the K/V through
        // its own block table (blocks t·need + 1 .., reversed); bit-identical to the host form.
        let copies = tokens * need + 1;
        let own: Vec<Vec<i32>> =
            (0..tokens).map(|t| reversed_table(need).iter().map(|&b| b + (t * need) as i32).collect()).collect();
        let fill = bfv(&mut r, copies * KVB * row, 1.0);
        let (mut pk2, mut pv2) = (fill.clone(), fill);
        for tb in &own {
            pk2 = page(&gkc, row, tb, &pk2);
            pv2 = page(&vc, row, tb, &pv2);
        }
        let (dk2, dv2) = (c.upload(&pk2).unwrap(), c.upload(&pv2).unwrap());
        let down = c.upload(&own.concat()).unwrap();
        let mut out_own = c.upload(&vec![POISON; tokens * qh * d]).unwrap();
        c.attention_decode(
            &AttnArgs { k_cache: &dk2, v_cache: &dv2, table: &down, ..dev_form },
            &mut po2,
            &mut pml2,
            &mut out_own,
        )
        .unwrap();
        assert_eq!(c.download(&out_own).unwrap(), host, "per-row block tables, pos {pos0} t{tokens}");
        if pos0 == 4095 {
            let s = time_it(&c, || c.attention_decode(&aa, &mut po, &mut pml, &mut out).unwrap());
            let bytes = (2 * max_seq * row * 2) as f64;
            eprintln!("PERF attention_decode len {max_seq}: {:.2} us, {:.0} GB/s of KV", s * 1e6, bytes / s / 1e9);
        }
    }
}

/// The decode attention (`attn_decode_split` + `attn_decode_combine`) over a decode group of
/// sequences of different lengths in one launch, in the captured decode graph's form: positions
/// read from the device, each row's split length derived from its own length over a grid of 256
/// splits (at least 32 keys), each row reading its own K/V through its own block table (the
/// sequences' blocks descending through one cache that is NaN everywhere else, block 0 unused) =
/// `cpu::attention::attention` of each sequence alone times `bf16(sigmoid(gate))`, compared with
/// `close` as in `attention_decode_matches_reference` (fp32 order noise only: the kernel keeps
/// the scores, softmax and P in fp32 — P·V as two bf16 halves of P). Lengths: 1 and 37 (partial
/// 16-key tiles), 256 (one K/V block), 300 (two), 1000 (splits of 32 keys), 8191 and
/// 100,003 (~100K: splits of 391 keys, a multiple of neither the tile nor the block), then 57
/// rows of 2..3,000 keys (64 rows: a full launch). A wrong
/// mask, scale, kv head, table or split is O(rms). Then each row alone in the host form (its
/// split length given, a grid of only its own work items) must give the group's bits: a row's
/// result depends neither on the other rows nor on the grid (batch invariance). PERF: the ~100K
/// row alone (K/V GB/s).
#[test]
#[ignore]
fn attention_decode_group_matches_reference() {
    let c = ctx();
    let mut r = rng(12);
    let (qh, kvh, d) = (16usize, 2usize, 256usize);
    let row = kvh * d;
    // Then 57 short rows of assorted lengths: 64 rows, a whole launch (ATT_MAX_ROWS), so the
    // per-row setup's scan over both warps and the item search cover every row index.
    let lens: Vec<usize> =
        [1usize, 37, 256, 300, 1000, 8191, 100_003].into_iter().chain((0..57).map(|i| 2 + (97 * i) % 3001)).collect();
    let n = lens.len();
    assert_eq!(n, crate::cuda::attention::ATT_MAX_ROWS);
    let (grid, min_split) = (256usize, 32usize);
    let need: Vec<usize> = lens.iter().map(|l| l.div_ceil(KVB)).collect();
    let blocks = need.iter().sum::<usize>() + 1;
    let width = *need.iter().max().unwrap();
    let mut next = blocks;
    let tables: Vec<Vec<i32>> = need
        .iter()
        .map(|&k| {
            (0..k)
                .map(|_| {
                    next -= 1;
                    next as i32
                })
                .collect()
        })
        .collect();
    let (mut kc, mut vc) = (vec![POISON; blocks * KVB * row], vec![POISON; blocks * KVB * row]);
    let (mut ks, mut vs) = (Vec::new(), Vec::new());
    for (i, &len) in lens.iter().enumerate() {
        let (k, v) = (bfv(&mut r, len * row, 2.0), bfv(&mut r, len * row, 1.0));
        for p in 0..len {
            let at = (tables[i][p / KVB] as usize * KVB + p % KVB) * row;
            kc[at..at + row].copy_from_slice(&k[p * row..(p + 1) * row]);
            vc[at..at + row].copy_from_slice(&v[p * row..(p + 1) * row]);
        }
        ks.push(k);
        vs.push(v);
    }
    let q = bfv(&mut r, n * qh * d, 2.0);
    let qg = bfv(&mut r, n * qh * 2 * d, 3.0);
    let pos: Vec<i32> = lens.iter().map(|&l| (l - 1) as i32).collect();
    let flat: Vec<i32> = tables
        .iter()
        .flat_map(|t| {
            let mut w = t.clone();
            w.resize(width, 0);
            w
        })
        .collect();
    let (dq, dqg, dk, dv) =
        (c.upload(&q).unwrap(), c.upload(&qg).unwrap(), c.upload(&kc).unwrap(), c.upload(&vc).unwrap());
    let (dpos, dtab) = (c.upload(&pos).unwrap(), c.upload(&flat).unwrap());
    let mut po = c.alloc::<f32>(n * qh * grid * d).unwrap();
    let mut pml = c.alloc::<f32>(n * qh * grid * 2).unwrap();
    let mut out = c.upload(&vec![POISON; n * qh * d]).unwrap();
    let group = AttnArgs {
        q: &dq,
        qg: &dqg,
        k_cache: &dk,
        v_cache: &dv,
        tokens: n,
        pos0: 0,
        q_heads: qh,
        kv_heads: kvh,
        head_dim: d,
        split_len: 0,
        pos_dev: Some((&dpos, grid, min_split)),
        table: &dtab,
        table_stride: width,
    };
    c.attention_decode(&group, &mut po, &mut pml, &mut out).unwrap();
    let got = c.download(&out).unwrap();
    for (i, &len) in lens.iter().enumerate() {
        let (qs, gs) = (&q[i * qh * d..(i + 1) * qh * d], &qg[i * qh * 2 * d..(i + 1) * qh * 2 * d]);
        let mut o_cpu = vec![bf16::ZERO; qh * d];
        attention(&bv(qs), 1, len - 1, &bv(&ks[i]), &bv(&vs[i]), qh, kvh, d, &mut o_cpu);
        let gate = gs.chunks(2 * d).flat_map(|b| b[d..].to_vec());
        let sg = |g: u16| bf16::from_f32(crate::cpu::sigmoid(bf16::from_bits(g).to_f32())).to_f64();
        let want: Vec<f64> = o_cpu.iter().zip(gate).map(|(o, g)| o.to_f64() * sg(g)).collect();
        let mine = &got[i * qh * d..(i + 1) * qh * d];
        let name = format!("attention group row {i}, length {len}");
        close(&name, mine, &want);
        let rms = (want.iter().map(|w| w * w).sum::<f64>() / want.len() as f64).sqrt();
        let worst = mine.iter().zip(&want).map(|(&g, w)| (f(g) - w).abs()).fold(0.0, f64::max);
        eprintln!("{name}: max |d| / rms {:.2e}", worst / rms);
        // The row alone, host form: its own split length, a grid of its own items only.
        let (dq1, dqg1, dtab1) = (c.upload(qs).unwrap(), c.upload(gs).unwrap(), c.upload(&tables[i]).unwrap());
        let alone = AttnArgs {
            q: &dq1,
            qg: &dqg1,
            tokens: 1,
            pos0: len - 1,
            split_len: len.div_ceil(grid).max(min_split),
            pos_dev: None,
            table: &dtab1,
            table_stride: 0,
            ..group
        };
        let mut o1 = c.upload(&vec![POISON; qh * d]).unwrap();
        c.attention_decode(&alone, &mut po, &mut pml, &mut o1).unwrap();
        assert_eq!(c.download(&o1).unwrap(), mine, "{name}: alone (host form) differs from the group");
        if len == 100_003 {
            let (p, keys) = c.attention_params(&alone, &mut po, &mut pml, &mut o1).unwrap();
            let s = time_it(&c, || c.k_attention(p, keys).unwrap());
            let bytes = (len * row * 2 * 2) as f64;
            eprintln!(
                "PERF attention_decode len {len} (split + combine): {:.1} us, {:.0} GB/s of K/V",
                s * 1e6,
                bytes / s / 1e9
            );
        }
    }
}

/// `argmax_bf16` = the CPU backend's greedy choice, `crate::sampling::argmax` (the largest finite
/// logit, the lowest index on ties; the data hold a NaN, +inf, -inf and a tie).
#[test]
#[ignore]
fn argmax_matches_reference() {
    let c = ctx();
    let mut r = rng(11);
    // Aligned rows (vector loads), an aligned row with a tail (1003), unaligned rows (7, 1003 x 2).
    for (tokens, n) in [(1, 248320), (3, 1000), (2, 7), (1, 1003), (2, 1003)] {
        let mut l = bfv(&mut r, tokens * n, 10.0);
        if n > 10 {
            l[5] = 0x7fc0; // NaN is never chosen
            l[6] = 0x7f80; // nor +inf
            l[8] = 0xff80; // nor -inf
            let m = l[..n].iter().map(|&b| f(b)).filter(|v| v.is_finite()).fold(f64::MIN, f64::max);
            let mb = bf16::from_f64(m).to_bits();
            l[n - 1] = mb; // a tie with a later index: the first one wins
        }
        let mut idx = c.upload(&vec![-7i32; tokens]).unwrap();
        c.argmax(&c.upload(&l).unwrap(), &mut idx, tokens, n, n).unwrap();
        let got = c.download(&idx).unwrap();
        for t in 0..tokens {
            let want = crate::sampling::argmax(&l[t * n..(t + 1) * n]).unwrap();
            assert_eq!(got[t], want as i32, "argmax row {t} of {n}");
        }
        if n == 248320 {
            let dl = c.upload(&l).unwrap();
            let s = time_it(&c, || c.argmax(&dl, &mut idx, 1, n, n).unwrap());
            eprintln!("PERF argmax over {n} bf16 logits: {:.2} us", s * 1e6);
        }
    }
}

/// The MoE decode chain end to end against the CPU reference block `cpu::moe::moe` (the stages
/// above are checked one by one, each fed the GPU's own previous output; here only the block's
/// input is shared). The CPU quantises the bf16 rows with `cpu::fp8::quantize_act_row` (as the
/// decode RMSNorm kernel does, bit-exact: `rmsnorm_residual_matches_reference`) and computes the
/// router and shared-gate logits with `cpu::linear::linear_bf16` (the router GEMV is
/// `gemv_bf16_matches_reference`); the GPU then runs router -> gate_up -> SwiGLU+FP8 -> down ->
/// combine. Tolerance: the one `prefill_tests::moe_prefill_matches_reference` derives for the same
/// block (3 ulp + 2^-7 rms per element, relative L2 2^-7): a gate_up output one ulp away can move
/// a SwiGLU activation across an E4M3 rounding boundary, changing one code by one step (2^-4) and
/// the down output by about 2^-7 rms; the routed sum, shared product and final add are 3
/// roundings. The router must choose the CPU's experts exactly. This bound is not yet measured on
/// the device (first run: check the printed figures).
#[test]
#[ignore]
fn moe_decode_chain_matches_cpu_moe() {
    use crate::cpu::linear::LinearWeight;
    use crate::cpu::moe::{moe, Mlp, MoeWeights};
    let c = ctx();
    let mut r = rng(12);
    // (experts, top_k, hidden, inter, tokens)
    for (e, k, h, inter, tokens) in [(256, 8, 2048, 512, 1), (16, 4, 64, 32, 3), (8, 2, 1024, 48, 2)] {
        let slots = k + 1;
        let x = bv(&bfv(&mut r, tokens * h, 2.0));
        let router = bv(&bfv(&mut r, (e + 1) * h, 0.05)); // e router rows, then the shared gate row
        let wgu = fp8v(&mut r, e * 2 * inter * h);
        let wgus: Vec<f32> = (0..e * 2 * inter).map(|_| r.random_range(0.0005f32..0.002)).collect();
        let sgu = fp8v(&mut r, 2 * inter * h);
        let sgus: Vec<f32> = (0..2 * inter).map(|_| r.random_range(0.0005f32..0.002)).collect();
        let wd = fp8v(&mut r, e * h * inter);
        let wds: Vec<f32> = (0..e * h).map(|_| r.random_range(0.0005f32..0.002)).collect();
        let sd = fp8v(&mut r, h * inter);
        let sds: Vec<f32> = (0..h).map(|_| r.random_range(0.0005f32..0.002)).collect();
        // CPU reference block: gate rows then up rows of each [2·inter, h] gate_up matrix.
        fn mlp<'a>(gu: &'a [u8], gus: &'a [f32], dn: &'a [u8], dns: &'a [f32], inter: usize, h: usize) -> Mlp<'a> {
            Mlp {
                gate: LinearWeight::Fp8 { w: &gu[..inter * h], scale: &gus[..inter] },
                up: LinearWeight::Fp8 { w: &gu[inter * h..], scale: &gus[inter..] },
                down: LinearWeight::Fp8 { w: dn, scale: dns },
            }
        }
        let experts: Vec<Mlp> = (0..e)
            .map(|ex| {
                let (g0, d0) = (ex * 2 * inter, ex * h);
                let (gu, gus) = (&wgu[g0 * h..(g0 + 2 * inter) * h], &wgus[g0..g0 + 2 * inter]);
                mlp(gu, gus, &wd[d0 * inter..(d0 + h) * inter], &wds[d0..d0 + h], inter, h)
            })
            .collect();
        let wts = MoeWeights {
            router: &router[..e * h],
            experts: &experts,
            moe_inter: inter,
            shared: mlp(&sgu, &sgus, &sd, &sds, inter, h),
            shared_inter: inter,
            shared_gate: &router[e * h..],
            top_k: k,
        };
        let mut want = vec![bf16::ZERO; tokens * h];
        moe(&x, tokens, h, &wts, &mut want);
        // GPU chain inputs: the CPU's codes, scales and logits.
        let (mut xq, mut xs) = (vec![0u8; tokens * h], vec![0f32; tokens]);
        for t in 0..tokens {
            xs[t] = crate::cpu::fp8::quantize_act_row(&x[t * h..(t + 1) * h], &mut xq[t * h..(t + 1) * h]);
        }
        let mut logits = vec![bf16::ZERO; tokens * (e + 1)];
        linear_bf16(&x, &router, tokens, h, e + 1, &mut logits);
        let logits = bits(&logits);
        let dl = c.upload(&logits).unwrap();
        let mut idx = c.upload(&vec![-1i32; tokens * k]).unwrap();
        let mut wt = c.upload(&vec![f32::NAN; tokens * k]).unwrap();
        c.moe_router(&dl, &mut idx, &mut wt, tokens, e, k, e + 1).unwrap();
        let rl: Vec<bf16> = (0..tokens).flat_map(|t| bv(&logits[t * (e + 1)..t * (e + 1) + e])).collect();
        let (mut cidx, mut cw) = (vec![0u32; tokens * k], vec![bf16::ZERO; tokens * k]);
        crate::cpu::moe::route(&rl, tokens, e, k, &mut cidx, &mut cw);
        let gidx = c.download(&idx).unwrap();
        for a in 0..tokens * k {
            assert_eq!(gidx[a], cidx[a] as i32, "router: token {} slot {}", a / k, a % k);
        }
        let (dxq, dxs) = (c.upload(&xq).unwrap(), c.upload(&xs).unwrap());
        let (dwgu, dwgus, dsgu, dsgus) =
            (c.upload(&wgu).unwrap(), c.upload(&wgus).unwrap(), c.upload(&sgu).unwrap(), c.upload(&sgus).unwrap());
        let (dwd, dwds, dsd, dsds) =
            (c.upload(&wd).unwrap(), c.upload(&wds).unwrap(), c.upload(&sd).unwrap(), c.upload(&sds).unwrap());
        let mut gu = c.upload(&vec![POISON; tokens * slots * 2 * inter]).unwrap();
        let a1 = MoeGemvArgs {
            xq: &dxq,
            xs: &dxs,
            idx: &idx,
            w: &dwgu,
            ws: &dwgus,
            shared_w: &dsgu,
            shared_ws: &dsgus,
            tokens,
            top_k: k,
            experts: e,
            in_: h,
            out: 2 * inter,
            x_tok_stride: h,
            x_slot_stride: 0,
            xs_tok_stride: 1,
            xs_slot_stride: 0,
        };
        c.moe_gemv(&a1, &mut gu).unwrap();
        let rows = tokens * slots;
        let mut aq = c.upload(&vec![0xAAu8; rows * inter]).unwrap();
        let mut asc = c.upload(&vec![-1f32; rows]).unwrap();
        c.swiglu_quant(&gu, &mut aq, &mut asc, rows, inter).unwrap();
        let mut ys = c.upload(&vec![POISON; rows * h]).unwrap();
        let a2 = MoeGemvArgs {
            xq: &aq,
            xs: &asc,
            idx: &idx,
            w: &dwd,
            ws: &dwds,
            shared_w: &dsd,
            shared_ws: &dsds,
            tokens,
            top_k: k,
            experts: e,
            in_: inter,
            out: h,
            x_tok_stride: slots * inter,
            x_slot_stride: inter,
            xs_tok_stride: slots,
            xs_slot_stride: 1,
        };
        c.moe_gemv(&a2, &mut ys).unwrap();
        let mut out = c.upload(&vec![POISON; tokens * h]).unwrap();
        let gate = c.upload(&logits[e..]).unwrap(); // shared-gate logit at column e of each row
        c.moe_combine(&ys, &wt, &gate, &mut out, tokens, k, h, e + 1).unwrap();
        let got = c.download(&out).unwrap();
        // Bound of `prefill_tests::moe_prefill_matches_reference` (see the doc comment).
        let want = wf(&want);
        let rms = (want.iter().map(|w| w * w).sum::<f64>() / want.len() as f64).sqrt();
        let ulp = |v: f64| 2f64.powi(v.abs().max(1e-30).log2().floor() as i32 - 7);
        let (mut num, mut den, mut worst) = (0f64, 0f64, 0f64);
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let g = f(g);
            assert!(g.is_finite(), "moe chain e{e} t{tokens} [{i}]: got {g} (unwritten or NaN), want {w}");
            let d = (g - w).abs();
            assert!(d <= 3.0 * ulp(w) + rms / 128.0, "moe chain e{e} t{tokens} [{i}]: got {g}, want {w} (rms {rms})");
            worst = worst.max(d / rms);
            num += d * d;
            den += w * w;
        }
        let rel = (num / den.max(1e-300)).sqrt();
        eprintln!("moe decode chain vs cpu::moe e{e} t{tokens}: max |d|/rms {worst:.2e}, rel L2 {rel:.2e}");
        assert!(rel <= 1.0 / 128.0, "moe chain e{e} t{tokens}: relative L2 {rel:.3e} > 2^-7");
    }
}
