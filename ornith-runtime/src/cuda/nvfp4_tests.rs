//! The NVFP4A16 kernels against the CPU reference (`model_spec::nvfp4`, `cpu::linear::linear_nvfp4`,
//! which CI tests against compressed-tensors' decompressor and the BF16 Linear), `#[ignore]`d
//! (CI has no GPU): `cargo test -p ornith-runtime nvfp4 -- --ignored`.
use super::nvfp4::MoeNvfp4Args;
use super::test_util::{ctx, rng, POISON, R};
use super::tests::{close, perf};
use crate::cpu::linear::linear_nvfp4;
use half::bf16;
use rand::Rng;

/// Random packed codes, E4M3 scales (finite: 0x7f / 0xff are NaN) and a global scale.
fn weight(r: &mut R, out: usize, inp: usize) -> (Vec<u8>, Vec<u8>, f32) {
    let w = (0..out * inp / 2).map(|_| r.random::<u8>()).collect();
    let ws = (0..out * inp / 16).map(|_| r.random_range(0u8..0x7f)).collect();
    (w, ws, 2688.0 / r.random_range(0.05f32..4.0))
}

/// The dequantiser is bit-identical to `model_spec::nvfp4::dequantize` (same IEEE f32 division
/// and product, one round-to-nearest-even to bf16), on a small shape and the MoE shapes.
#[test]
#[ignore]
fn nvfp4_dequant_matches_reference() {
    let c = ctx();
    let mut r = rng(41);
    for (inp, out) in [(16, 3), (64, 67), (2048, 512), (512, 2048)] {
        let (w, ws, gs) = weight(&mut r, out, inp);
        let want: Vec<u16> = model_spec::nvfp4::dequantize(&w, &ws, gs, out, inp).iter().map(|v| v.to_bits()).collect();
        let (dw, dws) = (c.upload(&w).unwrap(), c.upload(&ws).unwrap());
        let mut y = c.upload(&vec![POISON; out * inp]).unwrap();
        c.nvfp4_dequant(&dw, &dws, gs, &mut y, inp, out).unwrap();
        let got = c.download(&y).unwrap();
        let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(bad, 0, "nvfp4_dequant {inp}x{out}: {bad} of {} weights differ", want.len());
    }
}

/// The GEMV = `cpu::linear::linear_nvfp4` on the same rows (the same dequantised weights, fp32
/// sums in another order: `close`), padding untouched, and each token's row bit-identical to a
/// one-token launch on that row alone (batch invariance).
#[test]
#[ignore]
fn gemv_nvfp4_matches_reference() {
    let c = ctx();
    let mut r = rng(42);
    // (in, out, tokens, extra stride): tiny rows (one chunk), odd row counts, strided rows, every
    // token count, and the MoE decode shapes (gate/up 2048 -> 512, down 512 -> 2048).
    let shapes = [
        (32, 5, 1, 0),
        (64, 67, 3, 8),
        (2048, 512, 1, 0),
        (512, 2048, 1, 0),
        (2048, 512, 8, 0),
        (1024, 100, 5, 24),
        (4096, 33, 2, 16),
    ];
    for (inp, out, tokens, pad) in shapes {
        let (xst, yst) = (inp + pad, out + pad);
        let x: Vec<u16> = (0..tokens * xst).map(|_| bf16::from_f32(r.random_range(-1.0f32..1.0)).to_bits()).collect();
        let (w, ws, gs) = weight(&mut r, out, inp);
        let xr: Vec<bf16> =
            (0..tokens).flat_map(|t| x[t * xst..t * xst + inp].iter().map(|&b| bf16::from_bits(b))).collect();
        let mut yc = vec![bf16::ZERO; tokens * out];
        linear_nvfp4(&xr, &w, &ws, gs, tokens, inp, out, &mut yc);
        let want: Vec<f64> = yc.iter().map(|v| v.to_f64()).collect();
        let (dx, dw, dws) = (c.upload(&x).unwrap(), c.upload(&w).unwrap(), c.upload(&ws).unwrap());
        let mut y = c.upload(&vec![POISON; tokens * yst]).unwrap();
        c.gemv_nvfp4(&dx, &dw, &dws, gs, &mut y, tokens, inp, out, xst, yst).unwrap();
        let yh = c.download(&y).unwrap();
        let name = format!("gemv_nvfp4 {inp}x{out} t{tokens}");
        assert!(
            (0..tokens).all(|t| yh[t * yst + out..(t + 1) * yst].iter().all(|&b| b == POISON)),
            "{name}: wrote outside the rows"
        );
        let got: Vec<u16> = (0..tokens * out).map(|k| yh[(k / out) * yst + k % out]).collect();
        close(&name, &got, &want);
        for t in 0..tokens {
            let dx1 = c.upload(&x[t * xst..t * xst + inp]).unwrap();
            let mut y1 = c.upload(&vec![POISON; out]).unwrap();
            c.gemv_nvfp4(&dx1, &dw, &dws, gs, &mut y1, 1, inp, out, inp, out).unwrap();
            assert_eq!(c.download(&y1).unwrap(), got[t * out..(t + 1) * out], "{name}: token {t} alone differs");
        }
        if tokens == 1 && inp >= 512 {
            let bytes = (out * inp / 2 + out * inp / 16 + (inp + out) * 2) as f64;
            perf(&c, &name, bytes, || c.gemv_nvfp4(&dx, &dw, &dws, gs, &mut y, 1, inp, out, xst, yst).unwrap());
        }
    }
}

/// The grouped MoE GEMV over NVFP4 experts: every (token, slot) row equals `linear_nvfp4` of its
/// expert (`close`) and, bit for bit, `gemv_nvfp4` of that expert on that row alone — so the
/// result does not depend on which tokens share the step. Groups from the real `moe_sort`; the
/// gate/up form (one input per token) and the down form (one input per slot), 1, 5 and 13 tokens.
#[test]
#[ignore]
fn moe_gemv_nvfp4_grouped_matches_reference() {
    let c = ctx();
    let mut r = rng(43);
    let (experts, top_k) = (16usize, 4usize);
    for (inp, out, per_slot) in [(2048, 512, false), (512, 2048, true), (64, 32, true)] {
        let ws_all: Vec<(Vec<u8>, Vec<u8>, f32)> = (0..=experts).map(|_| weight(&mut r, out, inp)).collect();
        let (w, ws): (Vec<u8>, Vec<u8>) = (
            ws_all[..experts].iter().flat_map(|e| e.0.clone()).collect(),
            ws_all[..experts].iter().flat_map(|e| e.1.clone()).collect(),
        );
        let gs: Vec<f32> = ws_all[..experts].iter().map(|e| e.2).collect();
        let shared = &ws_all[experts];
        let (dw, dws, dgs) = (c.upload(&w).unwrap(), c.upload(&ws).unwrap(), c.upload(&gs).unwrap());
        let (dsw, dsws) = (c.upload(&shared.0).unwrap(), c.upload(&shared.1).unwrap());
        for tokens in [1usize, 5, 13] {
            // Distinct experts per token.
            let mut idx = Vec::new();
            for _ in 0..tokens {
                let mut chosen: Vec<i32> = Vec::new();
                while chosen.len() < top_k {
                    let e = r.random_range(0..experts as i32);
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                idx.extend(chosen);
            }
            let slots = top_k + 1;
            let (tok_stride, slot_stride) = if per_slot { (slots * inp, inp) } else { (inp, 0) };
            let x: Vec<u16> =
                (0..tokens * tok_stride).map(|_| bf16::from_f32(r.random_range(-1.0f32..1.0)).to_bits()).collect();
            let (dx, didx) = (c.upload(&x).unwrap(), c.upload(&idx).unwrap());
            let g = c.moe_groups(&didx, tokens, top_k, experts).unwrap();
            let mut y = c.upload(&vec![POISON; tokens * slots * out]).unwrap();
            let a = MoeNvfp4Args {
                x: &dx,
                w: &dw,
                ws: &dws,
                gs: &dgs,
                shared_w: &dsw,
                shared_ws: &dsws,
                shared_gs: shared.2,
                tokens,
                top_k,
                experts,
                in_: inp,
                out,
                x_tok_stride: tok_stride,
                x_slot_stride: slot_stride,
            };
            c.moe_gemv_nvfp4_grouped(&a, &g, &mut y).unwrap();
            let got = c.download(&y).unwrap();
            for t in 0..tokens {
                for j in 0..slots {
                    let e = if j < top_k { idx[t * top_k + j] as usize } else { experts };
                    let (we, wse, gse) = &ws_all[e];
                    let xrow = &x[t * tok_stride + j * slot_stride..][..inp];
                    let mut yc = vec![bf16::ZERO; out];
                    let xb: Vec<bf16> = xrow.iter().map(|&b| bf16::from_bits(b)).collect();
                    linear_nvfp4(&xb, we, wse, *gse, 1, inp, out, &mut yc);
                    let row = &got[(t * slots + j) * out..][..out];
                    let name = format!("moe_gemv_nvfp4 {inp}x{out} tokens {tokens} t{t} slot {j} expert {e}");
                    close(&name, row, &yc.iter().map(|v| v.to_f64()).collect::<Vec<_>>());
                    let (dx1, dwe, dwse) = (c.upload(xrow).unwrap(), c.upload(we).unwrap(), c.upload(wse).unwrap());
                    let mut y1 = c.upload(&vec![POISON; out]).unwrap();
                    c.gemv_nvfp4(&dx1, &dwe, &dwse, *gse, &mut y1, 1, inp, out, inp, out).unwrap();
                    assert_eq!(c.download(&y1).unwrap(), row, "{name}: differs from gemv_nvfp4 alone");
                }
            }
            if tokens == 13 && inp >= 512 {
                // Bytes: the routed experts touched (at most 16 here) and the shared one.
                let touched = idx.iter().collect::<std::collections::HashSet<_>>().len() + 1;
                let bytes = (touched * (out * inp / 2 + out * inp / 16)) as f64;
                perf(&c, &format!("moe_gemv_nvfp4_grouped {inp}x{out} tokens 13 ({touched} experts)"), bytes, || {
                    c.moe_gemv_nvfp4_grouped(&a, &g, &mut y).unwrap()
                });
            }
        }
    }
}
