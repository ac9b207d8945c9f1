//! GPU-vs-reference tests, `#[ignore]`d (CI has no GPU): `cargo test -p ornith-runtime -- --ignored`.
//! References are straightforward f64 loops that copy the kernels' bf16 cast points (HF's);
//! tolerance rationale at `close`.
use super::launch::*;
use super::test_util::{ctx, rng, time_cold, time_it, POISON, R};
use half::bf16;
use model_spec::fp8::e4m3_to_f32;
use rand::Rng;
fn bfv(r: &mut R, n: usize, scale: f32) -> Vec<u16> {
    (0..n).map(|_| bf16::from_f32(r.random_range(-1.0f32..1.0) * scale).to_bits()).collect()
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
fn sigm(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Compares a bf16 GPU output with an f64 reference. The kernels compute in fp32 and round to
/// bf16 at the same points as the reference, so each element differs by at most about one bf16
/// rounding (relative 2^-8) of its own magnitude or of the typical magnitude (cancellation in a
/// sum), plus fp32-vs-f64 noise. Checked: no NaN/unwritten element; max |d| <= 2^-7 * (|ref| +
/// rms(ref)); and ||d|| / ||ref|| <= 4e-3 (one half-ulp rounding is 2^-9 ~ 2e-3 at most).
fn close(name: &str, got: &[u16], want: &[f64]) {
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
        assert_eq!(scale[t], s, "{name}: scale of row {t}");
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
        let got = c.download(&out).unwrap();
        for (t, &id) in ids.iter().enumerate() {
            assert_eq!(&got[t * hidden..(t + 1) * hidden], &table[id as usize * hidden..(id as usize + 1) * hidden]);
        }
    }
}

fn rmsnorm_ref(x: &[f64], w: &[u16], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, &w)| v * inv * (1.0 + f(w))).collect()
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
        let mut want = Vec::new();
        for t in 0..tokens {
            let h: Vec<f64> = (0..hidden)
                .map(|i| {
                    let v = f(res[t * hidden + i]);
                    if with_add {
                        rb(v + f(add[t * hidden + i]))
                    } else {
                        v
                    }
                })
                .collect();
            // the residual stream is bf16(r + x) exactly (one rounding of an exact f64 sum)
            for i in 0..hidden {
                assert_eq!(f(gres[t * hidden + i]), h[i], "residual [{t},{i}]");
            }
            want.extend(rmsnorm_ref(&h, &w, 1e-6));
        }
        close(&format!("rmsnorm h{hidden} t{tokens}"), &gout, &want);
        check_quant("rmsnorm q8", &gout, &gq, &gs, hidden);
    }
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

/// PERF line for one GEMV launch: L2-warm (operands resident from the previous run) and L2-cold
/// times; the cold one is what a decode step sees.
fn perf(c: &super::CudaContext, what: &str, bytes: f64, mut f: impl FnMut()) {
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

/// Whether a GEMV shape is one whose speed is reported: the real decode shapes (batch 1).
fn decode_shape(inp: usize, tokens: usize) -> bool {
    tokens == 1 && inp >= 2048
}

/// Checks a GEMV output `y` (`tokens` rows of stride `yst`, `out` values each) against the f64
/// reference: the padding between rows untouched, values within `close`'s tolerance, and — for
/// the second kernel run on the same shape (the single-token kernel after the multi-token one,
/// which sums in the same order) — the same bits as the first.
fn check_gemv_rows(
    name: &str,
    y: &[u16],
    (inp, out, tokens, yst): (usize, usize, usize, usize),
    want: &[f64],
    first: &mut Option<Vec<u16>>,
) {
    assert!(
        (0..tokens).all(|t| y[t * yst + out..(t + 1) * yst].iter().all(|&b| b == POISON)),
        "{name}: wrote outside the rows"
    );
    let got: Vec<u16> = (0..tokens * out).map(|k| y[(k / out) * yst + k % out]).collect();
    close(&format!("{name} {inp}x{out} t{tokens}"), &got, want);
    match first {
        None => *first = Some(got),
        Some(g) => assert!(*g == got, "{name} {inp}x{out}: differs from the multi-token kernel"),
    }
}

#[test]
#[ignore]
fn gemv_bf16_matches_reference() {
    let c = ctx();
    let mut r = rng(4);
    // (in, out, tokens, extra x / y stride): odd row counts, tiny rows (in 16: one 16-byte chunk),
    // every token count, strided rows, one token in every row class of the single-token kernel
    // (chunks per row 2, 34, 64, 128, 256, 512: 8, 4, 4, 2, 1, 1 rows per warp; odd row counts
    // leave a warp's last rows empty), and the real decode shapes: GDN fused input projection
    // 2048 -> 12352, out_proj 4096 -> 2048, router (+ shared gate) 2048 -> 257, lm_head.
    let shapes = [
        (64, 67, 3, 0),
        (16, 45, 4, 8),
        (2048, 8192, 1, 0),
        (2048, 257, 2, 0),
        (4096, 2048, 8, 0),
        (2048, 33, 5, 0),
        (1024, 100, 6, 24),
        (512, 70, 7, 0),
        (4096, 77, 2, 16),
        (16, 45, 1, 0),
        (272, 33, 1, 0),
        (512, 70, 1, 0),
        (1024, 100, 1, 0),
        (4096, 77, 1, 0),
        (2048, 12352, 1, 0),
        (4096, 2048, 1, 0),
        (2048, 257, 1, 0),
        (2048, 248320, 1, 0),
    ];
    for (inp, out, tokens, pad) in shapes {
        let (xst, yst) = (inp + pad, out + pad);
        let x = bfv(&mut r, tokens * xst, 1.0);
        let w = bfv(&mut r, out * inp, 0.05);
        let (dx, dw) = (c.upload(&x).unwrap(), c.upload(&w).unwrap());
        let xf: Vec<f64> = x.iter().map(|&b| f(b)).collect();
        let want: Vec<f64> = (0..tokens * out)
            .map(|k| {
                let (t, o) = (k / out, k % out);
                (0..inp).map(|i| xf[t * xst + i] * f(w[o * inp + i])).sum()
            })
            .collect();
        let mut generic = None;
        for t1 in [false, true] {
            if t1 && (tokens != 1 || pad != 0) {
                continue;
            }
            let name = if t1 { "gemv_bf16_t1" } else { "gemv_bf16" };
            let mut y = c.upload(&vec![POISON; tokens * yst]).unwrap();
            let run = |y: &mut cudarc::driver::CudaSlice<u16>| {
                if t1 {
                    c.gemv_bf16_t1(&dx, &dw, y, inp, out)
                } else {
                    c.gemv_bf16(&dx, &dw, y, tokens, inp, out, xst, yst)
                }
                .unwrap()
            };
            run(&mut y);
            check_gemv_rows(name, &c.download(&y).unwrap(), (inp, out, tokens, yst), &want, &mut generic);
            if decode_shape(inp, tokens) {
                let bytes = (out * inp * 2 + tokens * (inp + out) * 2) as f64;
                perf(&c, &format!("{name} in {inp} out {out} tokens {tokens}"), bytes, || run(&mut y));
            }
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

#[test]
#[ignore]
fn gemv_fp8_matches_reference() {
    let c = ctx();
    let mut r = rng(5);
    // (in, out, tokens, extra x / y stride): as for BF16 (one token: chunks per row 1, 32, 64, 65,
    // 128, 256), plus the decode shapes q|k|v 2048 -> 9216 and o_proj 4096 -> 2048.
    let shapes = [
        (64, 67, 3, 0),
        (16, 40, 6, 16),
        (2048, 8192, 1, 0),
        (2048, 1024, 2, 0),
        (512, 2048, 1, 0),
        (4096, 2048, 8, 0),
        (1024, 300, 8, 32),
        (2048, 100, 4, 0),
        (4096, 77, 2, 16),
        (1024, 51, 5, 0),
        (1024, 90, 7, 0),
        (16, 40, 1, 0),
        (1024, 51, 1, 0),
        (1040, 90, 1, 0),
        (2048, 100, 1, 0),
        (4096, 77, 1, 0),
        (2048, 9216, 1, 0),
        (4096, 2048, 1, 0),
        (2048, 250000, 1, 0),
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
        let mut generic = None;
        for t1 in [false, true] {
            if t1 && (tokens != 1 || pad != 0) {
                continue;
            }
            let name = if t1 { "gemv_fp8_t1" } else { "gemv_fp8" };
            let mut y = c.upload(&vec![POISON; tokens * yst]).unwrap();
            let run = |y: &mut cudarc::driver::CudaSlice<u16>| {
                if t1 {
                    c.gemv_fp8_t1(&dxq, &dxs, &dw, &dws, y, inp, out)
                } else {
                    c.gemv_fp8(&dxq, &dxs, &dw, &dws, y, tokens, inp, out, xst, yst)
                }
            };
            run(&mut y).unwrap();
            check_gemv_rows(name, &c.download(&y).unwrap(), (inp, out, tokens, yst), &want, &mut generic);
            if decode_shape(inp, tokens) {
                let bytes = (out * inp + out * 4 + tokens * (inp + out * 2)) as f64;
                perf(&c, &format!("{name} in {inp} out {out} tokens {tokens}"), bytes, || run(&mut y).unwrap());
            }
        }
    }
}

/// The whole MoE decode chain on the device (router -> gate_up -> SwiGLU+FP8 -> down -> combine)
/// against an f64 reference with the same cast points, fed with the GPU's own intermediate codes
/// where the FP8 quantisation is checked bit for bit.
#[test]
#[ignore]
fn moe_decode_matches_reference() {
    let c = ctx();
    let mut r = rng(6);
    // (experts, top_k, hidden, inter, tokens)
    // The expert GEMV's rows per warp follow the row length (gemv1_rows): gate|up in 2048 -> 2,
    // down in 512 -> 8, in 64 / 32 -> 8, in 1024 -> 4 (with odd row counts: 96 and 1024 + 48).
    for (e, k, h, inter, tokens) in
        [(256, 8, 2048, 512, 1), (16, 4, 64, 32, 3), (256, 8, 2048, 512, 2), (8, 2, 1024, 48, 2)]
    {
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
        // router reference: fp32-exact enough in f64; top-k by probability, ties to the lower index
        for t in 0..tokens {
            let l: Vec<f64> = (0..e).map(|i| f(logits[t * (e + 1) + i])).collect();
            let m = l.iter().cloned().fold(f64::MIN, f64::max);
            let s: f64 = l.iter().map(|v| (v - m).exp()).sum();
            let p: Vec<f64> = l.iter().map(|v| (v - m).exp() / s).collect();
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap().then(a.cmp(&b)));
            let top = &order[..k];
            let ts: f64 = top.iter().map(|&i| p[i]).sum();
            for j in 0..k {
                assert_eq!(gidx[t * k + j], top[j] as i32, "router idx [{t},{j}]");
                let want = rb(p[top[j]] / ts);
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
        let act: Vec<u16> = (0..rows * inter)
            .map(|k2| {
                let (rr, i) = (k2 / inter, k2 % inter);
                let g = f(ggu[rr * 2 * inter + i]);
                let u = f(ggu[rr * 2 * inter + inter + i]);
                bf16::from_f64(rb(silu(g)) * u).to_bits()
            })
            .collect();
        check_quant("swiglu", &act, &gaq, &gasc, inter);
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
        c.conv1d_silu(&c.upload(&x).unwrap(), &c.upload(&w).unwrap(), &mut dst, &mut y, tokens, ch, ch).unwrap();
        let mut want = Vec::new();
        let mut hist: Vec<Vec<u16>> = (0..3).map(|j| st[j * ch..(j + 1) * ch].to_vec()).collect();
        for t in 0..tokens {
            let cur = &x[t * ch..(t + 1) * ch];
            for cc in 0..ch {
                let acc = f(w[cc * 4]) * f(hist[0][cc])
                    + f(w[cc * 4 + 1]) * f(hist[1][cc])
                    + f(w[cc * 4 + 2]) * f(hist[2][cc])
                    + f(w[cc * 4 + 3]) * f(cur[cc]);
                want.push(silu(rb(acc)));
            }
            hist.remove(0);
            hist.push(cur.to_vec());
        }
        close(&format!("conv c{ch} t{tokens}"), &c.download(&y).unwrap(), &want);
        assert_eq!(c.download(&dst).unwrap(), hist.concat(), "conv state = last 3 inputs");
    }
}

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
        };
        c.gdn_recurrent(&args, &mut dst, &mut o).unwrap();
        let mut s: Vec<f64> = st.iter().map(|&v| v as f64).collect();
        let mut want = Vec::new();
        for t in 0..tokens {
            let row = &qkv[t * stride..];
            for h in 0..hv {
                let kh = h / (hv / hk);
                let l2 = |off: usize| -> Vec<f64> {
                    let v: Vec<f64> = (0..d).map(|i| f(row[off + i])).collect();
                    let n = 1.0 / (v.iter().map(|x| x * x).sum::<f64>() + 1e-6).sqrt();
                    v.iter().map(|x| x * n).collect()
                };
                let q: Vec<f64> = l2(kh * d).iter().map(|x| x / (d as f64).sqrt()).collect();
                let k = l2(hk * d + kh * d);
                let v: Vec<f64> = (0..d).map(|i| f(row[2 * hk * d + h * d + i])).collect();
                let beta = rb(sigm(f(ba[t * 2 * hv + h])));
                let xa = f(ba[t * 2 * hv + hv + h]) + f(dtb[h]);
                let sp = if xa > 20.0 { xa } else { xa.exp().ln_1p() };
                let decay = (-(a_log[h] as f64).exp() * sp).exp();
                let sh = &mut s[h * d * d..(h + 1) * d * d]; // [k][v]
                sh.iter_mut().for_each(|x| *x *= decay);
                for vi in 0..d {
                    let m: f64 = (0..d).map(|ki| sh[ki * d + vi] * k[ki]).sum();
                    let dd = (v[vi] - m) * beta;
                    for ki in 0..d {
                        sh[ki * d + vi] += k[ki] * dd;
                    }
                }
                for vi in 0..d {
                    want.push((0..d).map(|ki| sh[ki * d + vi] * q[ki]).sum());
                }
            }
        }
        close(&format!("gdn o hk{hk} hv{hv} t{tokens}"), &c.download(&o).unwrap(), &want);
        // final state is fp32 end to end: relative error ~ fp32 rounding over a few steps
        let gs = c.download(&dst).unwrap();
        let num: f64 = gs.iter().zip(&s).map(|(&g, &w)| (g as f64 - w).powi(2)).sum();
        let den: f64 = s.iter().map(|w| w * w).sum();
        assert!((num / den).sqrt() < 1e-5, "gdn state rel err {}", (num / den).sqrt());
    }
}

#[test]
#[ignore]
fn gated_rmsnorm_matches_reference() {
    let c = ctx();
    let mut r = rng(9);
    for (tokens, heads, dim) in [(1, 32, 128), (3, 4, 32)] {
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
        let mut want = Vec::new();
        for row in 0..tokens * heads {
            let x: Vec<f64> = (0..dim).map(|i| f(o[row * dim + i])).collect();
            let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / dim as f64 + 1e-6).sqrt();
            for i in 0..dim {
                let n = rb(f(w[i]) * rb(x[i] * inv));
                want.push(n * silu(f(z[row * dim + i])));
            }
        }
        close("gated_rmsnorm", &c.download(&y).unwrap(), &want);
    }
}

#[test]
#[ignore]
fn attention_decode_matches_reference() {
    let c = ctx();
    let mut r = rng(10);
    let (qh, kvh, d, rot, theta) = (16usize, 2usize, 256usize, 64usize, 1e7f32);
    for (pos0, tokens, split) in [(0, 1, 64), (37, 1, 16), (1000, 1, 64), (300, 3, 128), (4095, 1, 64)] {
        let max_seq = pos0 + tokens;
        // cache rows before pos0 hold earlier tokens (already normed/rotated k, raw v)
        let mut kc = bfv(&mut r, max_seq * kvh * d, 1.0);
        let mut vc = bfv(&mut r, max_seq * kvh * d, 1.0);
        let qg = bfv(&mut r, tokens * qh * 2 * d, 2.0);
        let k = bfv(&mut r, tokens * kvh * d, 2.0);
        let v = bfv(&mut r, tokens * kvh * d, 2.0);
        let qn = bfv(&mut r, d, 0.5);
        let kn = bfv(&mut r, d, 0.5);
        let (dqg, dk, dv, dqn, dkn) = (
            c.upload(&qg).unwrap(),
            c.upload(&k).unwrap(),
            c.upload(&v).unwrap(),
            c.upload(&qn).unwrap(),
            c.upload(&kn).unwrap(),
        );
        let mut dkc = c.upload(&kc).unwrap();
        let mut dvc = c.upload(&vc).unwrap();
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
            max_seq,
            theta,
            eps: 1e-6,
            pos_dev: None,
        };
        c.qk_norm_rope(&a, &mut q, &mut dkc, &mut dvc).unwrap();
        // reference q/k: zero-centred RMSNorm then rotate-half RoPE with bf16 cos/sin and bf16 products
        let rope = |x: &[f64], pos: usize| -> Vec<f64> {
            let half = rot / 2;
            (0..d)
                .map(|i| {
                    if i >= rot {
                        return x[i];
                    }
                    let inv = 1.0 / (theta).powf((2 * (i % half)) as f32 / rot as f32);
                    let fr = pos as f32 * inv;
                    let (cs, sn) = (rb(fr.cos() as f64), rb(fr.sin() as f64));
                    let rr = if i < half { -x[i + half] } else { x[i - half] };
                    rb(rb(x[i] * cs) + rb(rr * sn))
                })
                .collect()
        };
        let norm = |src: &[u16], w: &[u16]| -> Vec<f64> {
            let x: Vec<f64> = src.iter().map(|&b| f(b)).collect();
            rmsnorm_ref(&x, w, 1e-6).into_iter().map(rb).collect()
        };
        let mut want_q = Vec::new();
        for t in 0..tokens {
            for h in 0..qh {
                want_q.extend(rope(&norm(&qg[(t * qh + h) * 2 * d..][..d], &qn), pos0 + t));
            }
            for j in 0..kvh {
                let kr = rope(&norm(&k[(t * kvh + j) * d..][..d], &kn), pos0 + t);
                for i in 0..d {
                    kc[((pos0 + t) * kvh + j) * d + i] = bf16::from_f64(kr[i]).to_bits();
                    vc[((pos0 + t) * kvh + j) * d + i] = v[(t * kvh + j) * d + i];
                }
            }
        }
        let gq = c.download(&q).unwrap();
        close(&format!("q rope pos {pos0}"), &gq, &want_q);
        let gkc = c.download(&dkc).unwrap();
        close(&format!("k cache pos {pos0}"), &gkc, &kc.iter().map(|&b| f(b)).collect::<Vec<_>>());
        assert_eq!(c.download(&dvc).unwrap(), vc, "v cache");
        // Device-position form (what a captured decode graph runs): pos0 read from device memory.
        // It must write the same q and cache rows (rewriting the rows just written).
        let dpos = c.upload(&[pos0 as i32]).unwrap();
        let (grid, min_split) = (256usize, 32usize);
        let mut q2 = c.upload(&vec![POISON; tokens * qh * d]).unwrap();
        c.qk_norm_rope(&QkRopeArgs { pos_dev: Some(&dpos), pos0: 0, ..a }, &mut q2, &mut dkc, &mut dvc).unwrap();
        assert_eq!(c.download(&q2).unwrap(), gq, "device-position q, pos {pos0}");
        assert_eq!(c.download(&dkc).unwrap(), gkc, "device-position k cache, pos {pos0}");
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
        };
        c.attention_decode(&aa, &mut po, &mut pml, &mut out).unwrap();
        let mut want = Vec::new();
        for t in 0..tokens {
            let len = pos0 + t + 1;
            for h in 0..qh {
                let j = h / (qh / kvh);
                let qv = &gq[(t * qh + h) * d..][..d];
                let sc: Vec<f64> = (0..len)
                    .map(|p| (0..d).map(|i| f(qv[i]) * f(gkc[(p * kvh + j) * d + i])).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
                for i in 0..d {
                    let o: f64 = (0..len).map(|p| (sc[p] - m).exp() / z * f(vc[(p * kvh + j) * d + i])).sum();
                    let g = rb(sigm(f(qg[(t * qh + h) * 2 * d + d + i])));
                    want.push(rb(o) * g);
                }
            }
        }
        close(&format!("attention pos {pos0} t{tokens}"), &c.download(&out).unwrap(), &want);
        // Device-position form (what a captured decode graph runs): pos0 read from device memory,
        // the split length derived on the device over a fixed grid of 256 splits (minimum 32
        // keys). It must equal the host form with the same split length bit for bit, and write
        // the same q and cache rows.
        let dsplit = max_seq.div_ceil(grid).max(min_split);
        let mut po2 = c.alloc::<f32>(tokens * qh * grid * d).unwrap();
        let mut pml2 = c.alloc::<f32>(tokens * qh * grid * 2).unwrap();
        let mut out_host = c.upload(&vec![POISON; tokens * qh * d]).unwrap();
        let mut out_dev = c.upload(&vec![POISON; tokens * qh * d]).unwrap();
        c.attention_decode(&AttnArgs { split_len: dsplit, ..aa }, &mut po2, &mut pml2, &mut out_host).unwrap();
        c.attention_decode(
            &AttnArgs { pos_dev: Some((&dpos, grid, min_split)), pos0: 0, ..aa },
            &mut po2,
            &mut pml2,
            &mut out_dev,
        )
        .unwrap();
        assert_eq!(
            c.download(&out_dev).unwrap(),
            c.download(&out_host).unwrap(),
            "device-position attention, pos {pos0} t{tokens}"
        );
        if pos0 == 4095 {
            let s = time_it(&c, || c.attention_decode(&aa, &mut po, &mut pml, &mut out).unwrap());
            let bytes = (2 * max_seq * kvh * d * 2) as f64;
            eprintln!("PERF attention_decode len {max_seq}: {:.2} us, {:.0} GB/s of KV", s * 1e6, bytes / s / 1e9);
        }
    }
}

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
            let m = l[..n].iter().map(|&b| f(b)).filter(|v| !v.is_nan()).fold(f64::MIN, f64::max);
            let mb = bf16::from_f64(m).to_bits();
            l[n - 1] = mb; // a tie with a later index: the first one wins
        }
        let mut idx = c.upload(&vec![-7i32; tokens]).unwrap();
        c.argmax(&c.upload(&l).unwrap(), &mut idx, tokens, n, n).unwrap();
        let got = c.download(&idx).unwrap();
        for t in 0..tokens {
            let row = &l[t * n..(t + 1) * n];
            let mut best = (f64::MIN, -1i32);
            for (i, &b) in row.iter().enumerate() {
                let v = f(b);
                if !v.is_nan() && (best.1 < 0 || v > best.0) {
                    best = (v, i as i32);
                }
            }
            assert_eq!(got[t], best.1, "argmax row {t} of {n}");
        }
        if n == 248320 {
            let dl = c.upload(&l).unwrap();
            let s = time_it(&c, || c.argmax(&dl, &mut idx, 1, n, n).unwrap());
            eprintln!("PERF argmax over {n} bf16 logits: {:.2} us", s * 1e6);
        }
    }
}
