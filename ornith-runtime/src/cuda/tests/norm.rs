//! The row kernels of norm.cu (embedding gather, `rmsnorm_residual`, the FP8 quantisers) and the
//! norm prologue of the decode products, against the CPU reference.
use super::*;

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
            let p = crate::cuda::moe::combine_params(
                c.addr(&ys),
                c.addr(&wt),
                c.addr(&gl),
                delta,
                1,
                k,
                hidden,
                1,
                Some(fold),
            );
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
