//! The dense decode products of gemv.cu (BF16, FP8, FP8 with the quantisation prologue) against
//! the CPU reference.
use super::*;

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
            crate::cuda::STAGED_ALWAYS.with(|f| f.set(true));
            c.gemv_bf16(&dx, &dw, &mut y2, tokens, inp, out, xst, yst).unwrap();
            crate::cuda::STAGED_ALWAYS.with(|f| f.set(false));
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
            crate::cuda::STAGED_ALWAYS.with(|f| f.set(true));
            c.gemv_fp8(&dxq, &dxs, &dw, &dws, &mut y2, tokens, inp, out, xst, yst).unwrap();
            crate::cuda::STAGED_ALWAYS.with(|f| f.set(false));
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
