//! The Gated DeltaNet decode kernels (gdn.cu; the output projection of gemv.cu) against the CPU
//! reference.
use super::*;

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
