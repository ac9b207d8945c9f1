//! The NVFP4A16 kernels against the CPU reference (`model_spec::nvfp4`, `cpu::linear::linear_nvfp4`,
//! which CI tests against compressed-tensors' decompressor and the BF16 Linear), `#[ignore]`d
//! (CI has no GPU): `cargo test -p ornith-runtime nvfp4 -- --ignored`.
//!
//! Every kernel dequantises through fp4.cuh; `nvfp4_dequant_matches_reference` proves that path
//! bit-exact on every code under every scale byte. The products then differ from the CPU only in
//! fp32 summation order (`close`), and the decode forms are batch invariant (a token alone gives
//! the same bits as in a group; per-slot and grouped MoE give the same bits).
use super::nvfp4::{Fp4Buf, MoeNvfp4Args};
use super::test_util::{
    bfv, check_combine_epilogue, check_fold, ctx, digest, rng, same_bits_with_few_blocks, POISON, R,
};
use super::tests::{close, perf};
use super::{CudaContext, Ptr};
use crate::cpu::linear::linear_nvfp4;
use cudarc::driver::CudaSlice;
use half::bf16;
use rand::Rng;

/// An NVFP4 matrix on the host: `parts` stacked matrices of `tab_rows` rows, each with its own
/// global scale (a fused gate|up has two), or `groups` experts of such matrices.
struct Fp4Host {
    w: Vec<u8>,
    ws: Vec<u8>,
    gs: Vec<f32>,
    tab_rows: usize,
    inp: usize,
}

impl Fp4Host {
    /// Random codes and finite scale bytes (0x7f / 0xff are NaN), `mats` matrices of `tab_rows`
    /// rows (`out = mats · tab_rows` in all).
    fn random(r: &mut R, mats: usize, tab_rows: usize, inp: usize) -> Self {
        let rows = mats * tab_rows;
        Fp4Host {
            w: (0..rows * inp / 2).map(|_| r.random::<u8>()).collect(),
            ws: (0..rows * inp / 16).map(|_| r.random_range(0u8..0x7f)).collect(),
            gs: (0..mats).map(|_| 2688.0 / r.random_range(0.05f32..4.0)).collect(),
            tab_rows,
            inp,
        }
    }

    /// Rows `[r0, r0 + n)` (inside one matrix) as `(codes, scales, global scale)`.
    fn rows(&self, r0: usize, n: usize) -> (&[u8], &[u8], f32) {
        let k = self.inp;
        (&self.w[r0 * k / 2..(r0 + n) * k / 2], &self.ws[r0 * k / 16..(r0 + n) * k / 16], self.gs[r0 / self.tab_rows])
    }

    /// `linear_nvfp4` of matrix rows `[r0, r0 + out)` (whole tables) on `t` rows of `x`.
    fn apply(&self, x: &[bf16], t: usize, r0: usize, out: usize) -> Vec<bf16> {
        let mut y = vec![bf16::ZERO; t * out];
        for p0 in (0..out).step_by(self.tab_rows) {
            let n = self.tab_rows.min(out - p0);
            let (w, ws, gs) = self.rows(r0 + p0, n);
            let mut yp = vec![bf16::ZERO; t * n];
            linear_nvfp4(x, w, ws, gs, t, self.inp, n, &mut yp);
            for tt in 0..t {
                y[tt * out + p0..tt * out + p0 + n].copy_from_slice(&yp[tt * n..(tt + 1) * n]);
            }
        }
        y
    }

    /// Experts of the same shape stacked into one `[experts · out, in]` matrix (as the checkpoint
    /// loader stacks them).
    fn stack(hs: &[Fp4Host]) -> Self {
        Fp4Host {
            w: hs.iter().flat_map(|h| h.w.clone()).collect(),
            ws: hs.iter().flat_map(|h| h.ws.clone()).collect(),
            gs: hs.iter().flat_map(|h| h.gs.clone()).collect(),
            tab_rows: hs[0].tab_rows,
            inp: hs[0].inp,
        }
    }

    fn upload(&self, c: &CudaContext) -> Fp4Buf {
        let tab: Vec<u8> = self.gs.iter().flat_map(|&g| super::nvfp4::fp4_table(g)).collect();
        Fp4Buf {
            w: c.upload(&super::nvfp4::fp4_device_codes(&self.w)).unwrap(),
            ws: c.upload(&self.ws).unwrap(),
            tab: c.upload(&tab).unwrap(),
            tab_rows: self.tab_rows,
        }
    }
}

/// `digest` of a grouped product's rows in an order that does not depend on moe_sort's atomics
/// (which order the rows inside an expert's group): each group's rows sorted.
fn grouped_digest(y: &[u16], group_offsets: &[i32], out: usize) -> u64 {
    let mut v = Vec::with_capacity(y.len());
    for w in group_offsets.windows(2) {
        let mut rows: Vec<&[u16]> = y[w[0] as usize * out..w[1] as usize * out].chunks(out).collect();
        rows.sort_unstable();
        rows.iter().for_each(|r| v.extend_from_slice(r));
    }
    digest(&v)
}

fn bv(b: &[u16]) -> Vec<bf16> {
    b.iter().map(|&x| bf16::from_bits(x)).collect()
}

fn wf(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// The register dequantisation (fp4.cuh, through `nvfp4_dequant`) is bit-identical to
/// `model_spec::nvfp4::dequantize` for every code under every one of the 256 scale bytes
/// (NaN bytes give NaN on both sides), several global scales, and a two-table matrix.
#[test]
#[ignore]
fn nvfp4_dequant_matches_reference() {
    let c = ctx();
    let mut r = rng(41);
    // Every scale byte, each row's two groups hold all 16 codes twice.
    let (inp, rows) = (32, 256);
    let mut w = vec![0u8; rows * inp / 2];
    for (i, b) in w.iter_mut().enumerate() {
        *b = ((2 * i) % 16) as u8 | ((((2 * i + 1) + i / 16) % 16) as u8) << 4;
    }
    let ws: Vec<u8> = (0..rows * 2).map(|i| if i % 2 == 0 { (i / 2) as u8 } else { (255 - i / 2) as u8 }).collect();
    let mut cases: Vec<Fp4Host> = [1.0f32, 2688.0, 0.37]
        .iter()
        .map(|&g| Fp4Host { w: w.clone(), ws: ws.clone(), gs: vec![g], tab_rows: rows, inp })
        .collect();
    cases.push(Fp4Host::random(&mut r, 2, 512, 2048));
    cases.push(Fp4Host::random(&mut r, 1, 67, 64));
    for h in cases {
        let out = h.gs.len() * h.tab_rows;
        let mut want = Vec::with_capacity(out * h.inp);
        for p in 0..h.gs.len() {
            let (pw, pws, g) = h.rows(p * h.tab_rows, h.tab_rows);
            want.extend(model_spec::nvfp4::dequantize(pw, pws, g, h.tab_rows, h.inp));
        }
        let b = h.upload(&c);
        let mut y = c.upload(&vec![POISON; out * h.inp]).unwrap();
        c.nvfp4_dequant(&b, &mut y, h.inp, out).unwrap();
        let got = c.download(&y).unwrap();
        let bad = got
            .iter()
            .zip(&want)
            .filter(|(&a, b)| !(a == b.to_bits() || (bf16::from_bits(a).is_nan() && b.is_nan())))
            .count();
        assert_eq!(bad, 0, "nvfp4_dequant {}x{out} gs {:?}: {bad} of {} weights differ", h.inp, h.gs, want.len());
    }
}

/// The decode product = `linear_nvfp4` on the same rows (`close`), padding untouched, and tokens
/// alone bit-identical to the group (batch invariance): every token of a group of up to 17 (the
/// second N tile of the wide build included), the first and last of larger ones; narrow and wide
/// builds; the real decode shapes' speed reported.
#[test]
#[ignore]
fn gemv_nvfp4_matches_reference() {
    let c = ctx();
    let mut r = rng(42);
    // (in, out, tables, tokens, extra stride): one-step rows (in 32: lane 0 only), odd row
    // counts, strided rows, two tables (fused gate|up), every N-tile count and two passes (70),
    // and the full preset's NVFP4 shapes: q_proj 2048 -> 8192, k/v 2048 -> 512, o_proj
    // 4096 -> 2048, shared expert gate|up 2048 -> 2 x 512, down 512 -> 2048.
    let shapes = [
        (32, 5, 1, 1, 0),
        (64, 67, 1, 3, 8),
        (64, 64, 2, 9, 0),
        (1024, 96, 2, 17, 24),
        (512, 48, 1, 70, 0),
        (2048, 8192, 1, 1, 0),
        (2048, 512, 1, 1, 0),
        (4096, 2048, 1, 1, 0),
        (2048, 1024, 2, 1, 0),
        (512, 2048, 1, 1, 0),
        (2048, 8192, 1, 8, 0),
        (2048, 1024, 2, 8, 0),
        (2048, 512, 1, 13, 0),
        (4096, 2048, 1, 13, 0),
        (4096, 2048, 1, 64, 0),
        (2048, 1024, 2, 64, 0),
    ];
    for (inp, out, mats, tokens, pad) in shapes {
        let (xst, yst) = (inp + pad, out + pad);
        let h = Fp4Host::random(&mut r, mats, out / mats, inp);
        let x = bfv(&mut r, tokens * xst, 1.0);
        let xr: Vec<bf16> = (0..tokens).flat_map(|t| bv(&x[t * xst..t * xst + inp])).collect();
        let want = wf(&h.apply(&xr, tokens, 0, out));
        let (dx, dw) = (c.upload(&x).unwrap(), h.upload(&c));
        let mut y = c.upload(&vec![POISON; tokens * yst]).unwrap();
        c.gemv_nvfp4(&dx, &dw, &mut y, tokens, inp, out, xst, yst).unwrap();
        let yh = c.download(&y).unwrap();
        let name = format!("gemv_nvfp4 {inp}x{out} ({mats} tables) t{tokens}");
        assert!(
            (0..tokens).all(|t| yh[t * yst + out..(t + 1) * yst].iter().all(|&b| b == POISON)),
            "{name}: wrote outside the rows"
        );
        let got: Vec<u16> = (0..tokens * out).map(|k| yh[(k / out) * yst + k % out]).collect();
        close(&name, &got, &want);
        let alone: Vec<usize> = if tokens <= 17 { (0..tokens).collect() } else { vec![0, tokens - 1] };
        for t in alone {
            let dx1 = c.upload(&x[t * xst..t * xst + inp]).unwrap();
            let mut y1 = c.upload(&vec![POISON; out]).unwrap();
            c.gemv_nvfp4(&dx1, &dw, &mut y1, 1, inp, out, inp, out).unwrap();
            assert_eq!(c.download(&y1).unwrap(), got[t * out..(t + 1) * out], "{name}: token {t} alone differs");
        }
        if inp >= 512 && matches!(tokens, 1 | 8 | 64) {
            let bytes = (super::nvfp4::fp4_bytes(inp, out, mats) + tokens * (inp + out) * 2) as f64;
            perf(&c, &name, bytes, || c.gemv_nvfp4(&dx, &dw, &mut y, tokens, inp, out, xst, yst).unwrap());
        }
    }
}

/// The MoE expert products over NVFP4 experts: every (token, slot) row equals `linear_nvfp4` of
/// its expert (`close`), and the grouped grid gives the bits of the per-slot grid, which computes
/// each (token, slot) alone in its own blocks — so no row depends on which tokens share the step.
/// (Not compared with `gemv_nvfp4`: the MoE forms split K for MOE_TARGET_WARPS per expert, the
/// dense one for TC_TARGET_WARPS, so their summation orders differ by design.)
/// Groups from the real `moe_sort`; the gate|up form (one input per token, two tables per
/// expert) and the down form (one input per slot); 1, 5 and 13 tokens, and 64 at the real shapes.
#[test]
#[ignore]
fn moe_gemv_nvfp4_matches_reference() {
    let c = ctx();
    let mut r = rng(43);
    let (experts, top_k) = (16usize, 4usize);
    // (in, out, tables per expert, per-slot inputs)
    for (inp, out, mats, per_slot) in
        [(2048, 1024, 2, false), (512, 2048, 1, true), (64, 64, 2, false), (32, 64, 1, true)]
    {
        let hs: Vec<Fp4Host> = (0..=experts).map(|_| Fp4Host::random(&mut r, mats, out / mats, inp)).collect();
        let (dw, dshared) = (Fp4Host::stack(&hs[..experts]).upload(&c), hs[experts].upload(&c));
        let counts: &[usize] = if inp >= 512 { &[1, 5, 13, 64] } else { &[1, 5, 13] };
        for &tokens in counts {
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
            let x = bfv(&mut r, tokens * tok_stride, 1.0);
            let (dx, didx) = (c.upload(&x).unwrap(), c.upload(&idx).unwrap());
            let g = c.moe_groups(&didx, tokens, top_k, experts).unwrap();
            let a = MoeNvfp4Args {
                x: &dx,
                idx: &didx,
                w: &dw,
                shared: &dshared,
                tokens,
                top_k,
                experts,
                in_: inp,
                out,
                x_tok_stride: tok_stride,
                x_slot_stride: slot_stride,
            };
            let mut y = c.upload(&vec![POISON; tokens * slots * out]).unwrap();
            c.moe_gemv_nvfp4_grouped(&a, &g, &mut y).unwrap();
            let got = c.download(&y).unwrap();
            let mut yp = c.upload(&vec![POISON; tokens * slots * out]).unwrap();
            c.moe_gemv_nvfp4(&a, &mut yp).unwrap();
            let name = format!("moe_gemv_nvfp4 {inp}x{out} tokens {tokens}");
            assert!(c.download(&yp).unwrap() == got, "{name}: per-slot and grouped grids differ");
            for t in 0..tokens {
                for j in 0..slots {
                    let e = if j < top_k { idx[t * top_k + j] as usize } else { experts };
                    let xrow = &x[t * tok_stride + j * slot_stride..][..inp];
                    let row = &got[(t * slots + j) * out..][..out];
                    let rn = format!("{name} t{t} slot {j} expert {e}");
                    close(&rn, row, &wf(&hs[e].apply(&bv(xrow), 1, 0, out)));
                }
            }
            if inp >= 512 && matches!(tokens, 1 | 64) {
                let touched = idx.iter().collect::<std::collections::HashSet<_>>().len() + 1;
                let bytes = (touched * super::nvfp4::fp4_bytes(inp, out, mats)) as f64;
                perf(
                    &c,
                    &format!("moe_gemv_nvfp4_grouped {inp}x{out} tokens {tokens} ({touched} experts)"),
                    bytes,
                    || c.moe_gemv_nvfp4_grouped(&a, &g, &mut y).unwrap(),
                );
            }
        }
    }
}

/// The prefill GEMMs: `gemm_nvfp4` = `linear_nvfp4` on the same rows (`close`), including a
/// partial row tile, a partial output tile, a K tail (in % 64 != 0) and two tables; and
/// `gemm_nvfp4_grouped` over `moe_sort`'s expert-sorted rows (row r reads token row_token[r])
/// = `linear_nvfp4` of that row's expert. The real prefill shapes' speed reported.
#[test]
#[ignore]
fn gemm_nvfp4_matches_reference() {
    let mut c = ctx();
    let mut r = rng(44);
    for (rows, inp, out, mats) in [(130, 2048, 1024, 2), (37, 96, 200, 1), (512, 4096, 2048, 1), (2048, 2048, 8192, 1)]
    {
        let h = Fp4Host::random(&mut r, mats, out / mats, inp);
        let x = bfv(&mut r, rows * inp, 1.0);
        let want = wf(&h.apply(&bv(&x), rows, 0, out));
        let (dx, dw) = (c.upload(&x).unwrap(), h.upload(&c));
        let mut y = c.upload(&vec![POISON; rows * out]).unwrap();
        c.gemm_nvfp4(&dx, &dw, &mut y, rows, inp, out, inp, out).unwrap();
        let name = format!("gemm_nvfp4 {rows}x{inp}x{out}");
        let got = c.download(&y).unwrap();
        close(&name, &got, &want);
        eprintln!("{name}: bits {:016x}", digest(&got));
        same_bits_with_few_blocks(&mut c, &name, &got, |c| {
            c.gemm_nvfp4(&dx, &dw, &mut y, rows, inp, out, inp, out).unwrap();
            c.download(&y).unwrap()
        });
        if rows >= 512 {
            let flops = 2.0 * (rows * inp * out) as f64;
            let bytes = (super::nvfp4::fp4_bytes(inp, out, mats) + rows * (inp + out) * 2) as f64;
            perf(&c, &format!("{name} ({:.1} GFLOP)", flops / 1e9), bytes, || {
                c.gemm_nvfp4(&dx, &dw, &mut y, rows, inp, out, inp, out).unwrap()
            });
        }
    }
    // Grouped: 2048 tokens x top-8 over 256 experts at the real shapes (64 rows per expert), small
    // cases (one with up to 3 partial 128-row tiles per expert), and 1,024- to 8,192-token steps at
    // the real shapes (32 to 256 rows per expert: where grouped_tile_rows changes height; no CPU
    // reference at those sizes). Each in 64-row tiles against the reference and in 96- and
    // 128-row tiles bit for bit against those; the real shapes' speed in every height.
    for (tokens, experts, top_k, inp, out, mats) in [
        (2048, 256, 8, 2048, 1024, 2),
        (40, 8, 2, 64, 64, 2),
        (40, 8, 2, 32, 64, 1),
        (300, 8, 4, 64, 64, 2),
        (1024, 256, 8, 2048, 1024, 2),
        (3072, 256, 8, 2048, 1024, 2),
        (4096, 256, 8, 2048, 1024, 2),
        (8192, 256, 8, 2048, 1024, 2),
    ] {
        let hs: Vec<Fp4Host> = (0..experts).map(|_| Fp4Host::random(&mut r, mats, out / mats, inp)).collect();
        let all = Fp4Host {
            w: hs.iter().flat_map(|h| h.w.clone()).collect(),
            ws: hs.iter().flat_map(|h| h.ws.clone()).collect(),
            gs: hs.iter().flat_map(|h| h.gs.clone()).collect(),
            tab_rows: out / mats,
            inp,
        };
        let idx: Vec<i32> = (0..tokens * top_k).map(|_| r.random_range(0..experts as i32)).collect();
        let x = bfv(&mut r, tokens * inp, 1.0);
        let (dx, didx, dw) = (c.upload(&x).unwrap(), c.upload(&idx).unwrap(), all.upload(&c));
        let g = c.moe_groups(&didx, tokens, top_k, experts).unwrap();
        let n = tokens * top_k;
        let poison = vec![POISON; n * out];
        let mut y = c.upload(&poison).unwrap();
        let p = ornith_kernels::bindings::OrnithGemmParams {
            a: c.addr(&dx) as _,
            a_rows: c.addr(&g.row_token) as _,
            w: c.addr(&dw.w) as _,
            y: c.addr(&y) as _,
            group_offsets: c.addr(&g.group_offsets) as _,
            tile_offsets: c.addr(&g.tile_offsets) as _,
            rows: n as i32,
            in_: inp as i32,
            out: out as i32,
            a_stride: inp as i32,
            y_stride: out as i32,
            groups: experts as i32,
            w_group_scale: c.addr(&dw.ws) as _,
            w_tab: c.addr(&dw.tab) as _,
            tab_rows: (out / mats) as i32,
            ..Default::default()
        };
        c.k_gemm_nvfp4_grouped(p, 64).unwrap();
        let (got, rt, go) =
            (c.download(&y).unwrap(), c.download(&g.row_token).unwrap(), c.download(&g.group_offsets).unwrap());
        let name = format!("gemm_nvfp4_grouped {tokens} tokens top-{top_k} of {experts} {inp}x{out}");
        if tokens <= 2048 {
            let mut want = vec![0f64; n * out];
            for e in 0..experts {
                let (a0, a1) = (go[e] as usize, go[e + 1] as usize);
                if a0 == a1 {
                    continue;
                }
                let xe: Vec<bf16> = (a0..a1).flat_map(|row| bv(&x[rt[row] as usize * inp..][..inp])).collect();
                let ye = hs[e].apply(&xe, a1 - a0, 0, out);
                want[a0 * out..a1 * out].copy_from_slice(&wf(&ye));
            }
            close(&name, &got, &want);
        }
        eprintln!("{name}: bits {:016x}", grouped_digest(&got, &go, out));
        for tiles in [64, 96, 128] {
            let name = format!("{name}, {tiles}-row tiles");
            let mut run = |c: &CudaContext| {
                c.stream().memcpy_htod(&poison, &mut y).unwrap();
                c.k_gemm_nvfp4_grouped(p, tiles).unwrap();
                c.download(&y).unwrap()
            };
            assert!(run(&c) == got, "{name}: not the 64-row tiles' bits");
            same_bits_with_few_blocks(&mut c, &name, &got, run);
        }
        if tokens >= 1024 {
            let bytes = (experts * super::nvfp4::fp4_bytes(inp, out, mats) + n * (inp + out) * 2) as f64;
            for tiles in [64, 96, 128] {
                let flops = 2.0 * (n * inp * out) as f64;
                perf(&c, &format!("{name}, {tiles}-row tiles ({:.1} GFLOP)", flops / 1e9), bytes, || {
                    c.k_gemm_nvfp4_grouped(p, tiles).unwrap()
                });
            }
        }
    }
}

/// `swiglu_bf16` = the CPU MLP's SwiGLU (`cpu::moe::Mlp::forward`: bf16(bf16(silu(g)) · u)),
/// `close` (the GPU's expf differs from the host's by ulps).
#[test]
#[ignore]
fn swiglu_bf16_matches_reference() {
    let c = ctx();
    let mut r = rng(45);
    // 65,543 rows: more than grid.y holds (an 8,192-token prefill step at top-8 has 65,536).
    for (rows, inter) in [(1, 512), (9, 512), (37, 300), (65_543, 40)] {
        let gu = bfv(&mut r, rows * 2 * inter, 1.0);
        let want: Vec<f64> = (0..rows * inter)
            .map(|k| {
                let (row, i) = (k / inter, k % inter);
                let g = bf16::from_bits(gu[row * 2 * inter + i]).to_f32();
                let u = bf16::from_bits(gu[row * 2 * inter + inter + i]).to_f32();
                let a = bf16::from_f32(crate::cpu::silu(g)).to_f32();
                bf16::from_f32(a * u).to_f64()
            })
            .collect();
        let dgu = c.upload(&gu).unwrap();
        let mut out = c.upload(&vec![POISON; rows * inter]).unwrap();
        c.swiglu_bf16(&dgu, &mut out, rows, inter).unwrap();
        close(&format!("swiglu_bf16 {rows}x{inter}"), &c.download(&out).unwrap(), &want);
    }
}

/// A launch over some rows of a stored matrix (attention's q, k, v parts of the fused
/// `[q; k; v]`, which a decode group of more than one row runs) gives those rows the bits the
/// one launch over the whole matrix gives them (a group of one), for the BF16, FP8 and NVFP4
/// decode products: the K split is chosen for the whole matrix's rows (`split_out`), not the
/// part's — at these shapes the k and v parts alone would split K 8 ways, the whole 4 ways. And
/// what the model runs: each token of a group (3: the narrow build; 13: the wide one) through the
/// parts gives the bits of that token alone through the whole.
#[test]
#[ignore]
fn gemv_parts_match_the_whole() {
    let c = ctx();
    let mut r = rng(46);
    let (inp, parts) = (2048usize, [8192usize, 512, 512]);
    let out: usize = parts.iter().sum();
    let tokens = 13;
    let x = bfv(&mut r, tokens * inp, 1.0);
    let dx = c.upload(&x).unwrap();
    let xq: Vec<u8> = (0..tokens * inp).map(|_| r.random_range(0u8..0x7e)).collect();
    let xs: Vec<f32> = (0..tokens).map(|_| r.random_range(0.01f32..0.1)).collect();
    let (dxq, dxs) = (c.upload(&xq).unwrap(), c.upload(&xs).unwrap());
    let wb = bfv(&mut r, out * inp, 1.0);
    let w8: Vec<u8> = (0..out * inp).map(|_| r.random_range(0u8..0x7e)).collect();
    let ws8: Vec<f32> = (0..out).map(|_| r.random_range(0.01f32..0.1)).collect();
    let h = Fp4Host::random(&mut r, out / 512, 512, inp);
    let (dwb, dw8, dws8, d4) = (c.upload(&wb).unwrap(), c.upload(&w8).unwrap(), c.upload(&ws8).unwrap(), h.upload(&c));
    for form in ["bf16", "fp8", "nvfp4"] {
        // Rows r0 .. r0 + n (of a matrix split for `split` rows) for tokens t0 .. t0 + tokens.
        let launch = |y: Ptr, r0: usize, n: usize, split: usize, t0: usize, tokens: usize| {
            let (dx, dxq, dxs) =
                (c.addr(&dx) + (2 * t0 * inp) as u64, c.addr(&dxq) + (t0 * inp) as u64, c.addr(&dxs) + (4 * t0) as u64);
            match form {
                "bf16" => {
                    c.k_gemv_bf16(dx, c.addr(&dwb) + (2 * r0 * inp) as u64, y, tokens, inp, n, inp, out, split, None)
                }
                "fp8" => c.k_gemv_fp8(
                    dxq,
                    dxs,
                    c.addr(&dw8) + (r0 * inp) as u64,
                    c.addr(&dws8) + (4 * r0) as u64,
                    y,
                    tokens,
                    inp,
                    n,
                    inp,
                    out,
                    split,
                    None,
                ),
                _ => {
                    let w = super::nvfp4::Fp4W {
                        w: c.addr(&d4.w) + (r0 * inp / 2) as u64,
                        ws: c.addr(&d4.ws) + (r0 * inp / 16) as u64,
                        tab: c.addr(&d4.tab) + ((r0 / 512) * super::nvfp4::TAB_BYTES) as u64,
                        tab_rows: 512,
                    };
                    c.k_gemv_nvfp4(dx, w, y, tokens, inp, n, inp, out, split, None)
                }
            }
            .unwrap()
        };
        for group in [3, tokens] {
            let whole = c.upload(&vec![POISON; group * out]).unwrap();
            launch(c.addr(&whole), 0, out, out, 0, group);
            let partial = c.upload(&vec![POISON; group * out]).unwrap();
            let mut r0 = 0;
            for &n in &parts {
                launch(c.addr(&partial) + (2 * r0) as u64, r0, n, out, 0, group);
                r0 += n;
            }
            let got = c.download(&partial).unwrap();
            assert!(c.download(&whole).unwrap() == got, "{form}: the parts differ from the whole ({group} tokens)");
            for t in 0..group {
                let alone = c.upload(&vec![POISON; out]).unwrap();
                launch(c.addr(&alone), 0, out, out, t, 1);
                assert!(
                    c.download(&alone).unwrap() == got[t * out..(t + 1) * out],
                    "{form}: token {t} of {group} through the parts differs from it alone through the whole"
                );
            }
        }
    }
}

/// The per-slot NVFP4 expert products with a prologue give the bits of the kernel they replace
/// followed by the plain per-slot product (`moe_gemv_nvfp4`), at the model's shapes (hidden 2048,
/// inter 512, 8 routed slots of 16 experts + the shared one): `moe_gemv_nvfp4_norm` (gate|up, two
/// tables per expert) against `rmsnorm_residual`'s bf16 row, with and without a pending delta, for
/// 1 and 2 tokens; `moe_gemv_nvfp4_swiglu` (down) against `swiglu_bf16`, for 1, 2 and 3 tokens, and
/// with the combine epilogue against `moe_combine` after it (`check_combine_epilogue`).
#[test]
#[ignore]
fn moe_nvfp4_prologues_match_the_kernels() {
    use ornith_kernels::bindings::OrnithNormIn;
    let c = ctx();
    let mut r = rng(47);
    let (experts, top_k, hidden, inter) = (16usize, 8usize, 2048usize, 512usize);
    let slots = top_k + 1;
    let stacked = |r: &mut R, mats: usize, out: usize, inp: usize| {
        let hs: Vec<Fp4Host> = (0..=experts).map(|_| Fp4Host::random(r, mats, out / mats, inp)).collect();
        (Fp4Host::stack(&hs[..experts]).upload(&c), hs[experts].upload(&c))
    };
    let (gu_w, gu_shared) = stacked(&mut r, 2, 2 * inter, hidden);
    let (dn_w, dn_shared) = stacked(&mut r, 1, hidden, inter);
    let params = |a: &MoeNvfp4Args, y: &CudaSlice<u16>| c.moe_nvfp4_params(a, y).unwrap();
    for tokens in [1usize, 2, 3] {
        let idx: Vec<i32> = (0..(tokens * top_k) as i32).map(|j| (j * 7 + 3) % experts as i32).collect();
        let didx = c.upload(&idx).unwrap();
        // Gate|up with the norm prologue (1 and 2 tokens).
        if tokens <= 2 {
            for with_add in [true, false] {
                let res = bfv(&mut r, tokens * hidden, 1.0);
                let add = bfv(&mut r, tokens * hidden, 1.0);
                let wn = bfv(&mut r, hidden, 1.0);
                let (dres0, dadd, dwn) = (c.upload(&res).unwrap(), c.upload(&add).unwrap(), c.upload(&wn).unwrap());
                let mut dres = c.upload(&res).unwrap();
                let mut xb = c.upload(&vec![POISON; tokens * hidden]).unwrap();
                let eps = 1e-6f32;
                c.rmsnorm_residual(
                    &mut dres,
                    with_add.then_some(&dadd),
                    &dwn,
                    Some(&mut xb),
                    None,
                    tokens,
                    hidden,
                    eps,
                )
                .unwrap();
                let a = MoeNvfp4Args {
                    x: &xb,
                    idx: &didx,
                    w: &gu_w,
                    shared: &gu_shared,
                    tokens,
                    top_k,
                    experts,
                    in_: hidden,
                    out: 2 * inter,
                    x_tok_stride: hidden,
                    x_slot_stride: 0,
                };
                let mut want = c.upload(&vec![POISON; tokens * slots * 2 * inter]).unwrap();
                c.moe_gemv_nvfp4(&a, &mut want).unwrap();
                let got = c.upload(&vec![POISON; tokens * slots * 2 * inter]).unwrap();
                let mut p = params(&a, &got);
                p.x = std::ptr::null();
                p.norm = OrnithNormIn {
                    res: c.addr(&dres0) as _,
                    add: if with_add { c.addr(&dadd) as _ } else { std::ptr::null() },
                    weight: c.addr(&dwn) as _,
                    eps,
                };
                c.k_moe_gemv_nvfp4(p, false).unwrap();
                let (g, w) = (c.download(&got).unwrap(), c.download(&want).unwrap());
                assert!(w.iter().all(|&v| v != POISON), "moe_gemv_nvfp4 left outputs unwritten");
                assert!(
                    g == w,
                    "moe_gemv_nvfp4_norm ({tokens} tokens, add {with_add}) differs from rmsnorm_residual + moe_gemv_nvfp4"
                );
            }
        }
        // Down with the SwiGLU prologue.
        let gu = bfv(&mut r, tokens * slots * 2 * inter, 1.0);
        let dgu = c.upload(&gu).unwrap();
        let mut act = c.upload(&vec![POISON; tokens * slots * inter]).unwrap();
        c.swiglu_bf16(&dgu, &mut act, tokens * slots, inter).unwrap();
        let a = MoeNvfp4Args {
            x: &act,
            idx: &didx,
            w: &dn_w,
            shared: &dn_shared,
            tokens,
            top_k,
            experts,
            in_: inter,
            out: hidden,
            x_tok_stride: slots * inter,
            x_slot_stride: inter,
        };
        let mut want = c.upload(&vec![POISON; tokens * slots * hidden]).unwrap();
        c.moe_gemv_nvfp4(&a, &mut want).unwrap();
        let got = c.upload(&vec![POISON; tokens * slots * hidden]).unwrap();
        let mut p = params(&a, &got);
        p.x = std::ptr::null();
        p.gate_up = c.addr(&dgu) as _;
        c.k_moe_gemv_nvfp4(p, false).unwrap();
        let (g, w) = (c.download(&got).unwrap(), c.download(&want).unwrap());
        assert!(w.iter().all(|&v| v != POISON), "moe_gemv_nvfp4 left outputs unwritten");
        assert!(g == w, "moe_gemv_nvfp4_swiglu ({tokens} tokens) differs from swiglu_bf16 + moe_gemv_nvfp4");
        let name = format!("moe_gemv_nvfp4_swiglu + combine ({tokens} tokens)");
        check_combine_epilogue(&c, &mut r, &want, &got, (tokens, top_k, hidden), &name, |combine| {
            c.k_moe_gemv_nvfp4(ornith_kernels::bindings::OrnithMoeGemvNvfp4Params { combine, ..p }, false).unwrap()
        });
    }
}

/// `gemv_nvfp4_norm` (the norm prologue: attention's q|k|v at one decode row) gives the bits of
/// `rmsnorm_residual` then `gemv_nvfp4`, with and without a pending delta, at the 35B q|k|v shape
/// (9,216 rows, 512 per table), one table of 64 rows, and a hidden size (544) that is not a
/// multiple of the prologue's 256 threads; and `gemv_nvfp4`'s fold (o_proj writing the next
/// delta) leaves the residual `rmsnorm_residual` would have and its own output unchanged.
#[test]
#[ignore]
fn gemv_nvfp4_norm_and_fold_match_the_kernels() {
    use ornith_kernels::bindings::OrnithNormIn;
    let c = ctx();
    let mut r = rng(53);
    let eps = 1e-6f32;
    let fw = |b: &Fp4Buf| super::nvfp4::Fp4W {
        w: c.addr(&b.w),
        ws: c.addr(&b.ws),
        tab: c.addr(&b.tab),
        tab_rows: b.tab_rows,
    };
    for (hidden, with_add) in [(2048, true), (2048, false), (544, true)] {
        let (res, add, wn) = (bfv(&mut r, hidden, 4.0), bfv(&mut r, hidden, 4.0), bfv(&mut r, hidden, 0.5));
        let (dres0, dadd, dwn) = (c.upload(&res).unwrap(), c.upload(&add).unwrap(), c.upload(&wn).unwrap());
        let mut dres = c.upload(&res).unwrap();
        let mut xb = c.upload(&vec![POISON; hidden]).unwrap();
        c.rmsnorm_residual(&mut dres, with_add.then_some(&dadd), &dwn, Some(&mut xb), None, 1, hidden, eps).unwrap();
        let res_after = c.download(&dres).unwrap();
        let norm = OrnithNormIn {
            res: c.addr(&dres0) as _,
            add: if with_add { c.addr(&dadd) as _ } else { std::ptr::null() },
            weight: c.addr(&dwn) as _,
            eps,
        };
        for (mats, tab_rows) in [(18, 512), (1, 64)] {
            let out = mats * tab_rows;
            let w = Fp4Host::random(&mut r, mats, tab_rows, hidden).upload(&c);
            let mut want = c.upload(&vec![POISON; out]).unwrap();
            c.gemv_nvfp4(&xb, &w, &mut want, 1, hidden, out, hidden, out).unwrap();
            let got = c.upload(&vec![POISON; out]).unwrap();
            c.k_gemv_nvfp4_norm(norm, fw(&w), c.addr(&got), hidden, out, out, out, None).unwrap();
            let want = c.download(&want).unwrap();
            assert!(want.iter().all(|&v| v != POISON), "gemv_nvfp4 left outputs unwritten");
            assert!(
                c.download(&got).unwrap() == want,
                "gemv_nvfp4_norm {hidden} -> {out} (add {with_add}) differs from rmsnorm_residual + gemv_nvfp4"
            );
        }
        if !with_add {
            continue;
        }
        // The fold: o_proj (NVFP4, in 512 -> hidden) adds the old delta into the residual first.
        let inw = 512;
        let xin = c.upload(&bfv(&mut r, inw, 1.0)).unwrap();
        let wo = Fp4Host::random(&mut r, 1, hidden, inw).upload(&c);
        let mut want = c.upload(&vec![POISON; hidden]).unwrap();
        c.gemv_nvfp4(&xin, &wo, &mut want, 1, inw, hidden, inw, hidden).unwrap();
        check_fold(&c, "gemv_nvfp4", &res, &add, &res_after, &c.download(&want).unwrap(), |delta, fold| {
            c.k_gemv_nvfp4(c.addr(&xin), fw(&wo), delta, 1, inw, hidden, inw, hidden, hidden, Some(fold)).unwrap()
        });
    }
}
