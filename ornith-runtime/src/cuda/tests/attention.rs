//! Decode attention (attention.cu) against the CPU reference, one sequence and groups.
use super::*;
use crate::cuda::CudaContext;

/// Random `qk_norm_rope` inputs of `tokens` rows (q|gate, k, v, q_norm, k_norm, drawn in that
/// order) on the host and the device, the 16:2 x 256 shapes with 64 rotary dims and theta 1e7.
struct QkInputs {
    tokens: usize,
    host: [Vec<u16>; 5],
    dev: [cudarc::driver::CudaSlice<u16>; 5],
}

const QK_SHAPE: (usize, usize, usize, usize, f32) = (16, 2, 256, 64, 1e7);

impl QkInputs {
    fn new(c: &CudaContext, r: &mut R, tokens: usize) -> Self {
        let (qh, kvh, d, _, _) = QK_SHAPE;
        let host = [
            bfv(r, tokens * qh * 2 * d, 2.0),
            bfv(r, tokens * kvh * d, 2.0),
            bfv(r, tokens * kvh * d, 2.0),
            bfv(r, d, 0.5),
            bfv(r, d, 0.5),
        ];
        let dev = host.clone().map(|h| c.upload(&h).unwrap());
        QkInputs { tokens, host, dev }
    }
    /// Host positions pos0.. through `table`.
    fn args<'a>(&'a self, table: &'a cudarc::driver::CudaSlice<i32>, pos0: usize) -> QkRopeArgs<'a> {
        let (qh, kvh, d, rot, theta) = QK_SHAPE;
        let [qg, k, v, q_norm, k_norm] = &self.dev;
        QkRopeArgs {
            qg,
            k,
            v,
            q_norm,
            k_norm,
            tokens: self.tokens,
            pos0,
            q_heads: qh,
            kv_heads: kvh,
            head_dim: d,
            rot,
            theta,
            eps: 1e-6,
            pos_dev: None,
            table,
            table_stride: 0,
        }
    }
    /// The CPU reference for `a` (host positions): q split from its gate, per-head zero-centred
    /// RMSNorm, then rotate-half RoPE, on q and k. Returns (q, gate, k).
    fn reference(&self, a: &QkRopeArgs) -> (Vec<bf16>, Vec<bf16>, Vec<bf16>) {
        let (t, qh, kvh, d) = (a.tokens, a.q_heads, a.kv_heads, a.head_dim);
        let [qg, k, _, qn, kn] = &self.host;
        let (mut q_raw, mut gate) = (vec![bf16::ZERO; t * qh * d], vec![bf16::ZERO; t * qh * d]);
        split_q_gate(&bv(qg), t, qh, d, &mut q_raw, &mut gate);
        let mut q = vec![bf16::ZERO; t * qh * d];
        rms_norm(&q_raw, &bv(qn), d, a.eps, &mut q);
        apply_rope(&mut q, t, qh, d, a.rot, a.pos0, a.theta);
        let mut kr = vec![bf16::ZERO; t * kvh * d];
        rms_norm(&bv(k), &bv(kn), d, a.eps, &mut kr);
        apply_rope(&mut kr, t, kvh, d, a.rot, a.pos0, a.theta);
        (q, gate, kr)
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
    let (qh, kvh, d, _, _) = QK_SHAPE;
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
        let inp = QkInputs::new(&c, &mut r, tokens);
        let v = &inp.host[2];
        let dtable = c.upload(&table).unwrap();
        let mut dkc = c.upload(&page(&kc, row, &table, &kfill)).unwrap();
        let mut dvc = c.upload(&page(&vc, row, &table, &vfill)).unwrap();
        let mut q = c.upload(&vec![POISON; tokens * qh * d]).unwrap();
        let a = inp.args(&dtable, pos0);
        c.qk_norm_rope(&a, &mut q, &mut dkc, &mut dvc).unwrap();
        let (want_q, gate, kr) = inp.reference(&a);
        kc[pos0 * row..(pos0 + tokens) * row].copy_from_slice(&bits(&kr));
        vc[pos0 * row..(pos0 + tokens) * row].copy_from_slice(v);
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
            qg: &inp.dev[0],
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

/// `qk_norm_rope` over a prefill chunk (2,048 tokens at positions 0.. and 6,000..; the decode test
/// above runs at most 3 tokens): q and the paged k, v cache rows against the CPU reference as in
/// `attention_decode_matches_reference`; the outputs' digest (bits, to compare builds) and the
/// chunk's time (PERF).
#[test]
#[ignore]
fn qk_norm_rope_chunk_matches_reference() {
    let c = ctx();
    let mut r = rng(12);
    let ((qh, kvh, d, _, _), tokens) = (QK_SHAPE, 2048usize);
    let row = kvh * d;
    for pos0 in [0usize, 6000] {
        let need = (pos0 + tokens).div_ceil(KVB);
        let table = reversed_table(need);
        let fill = bfv(&mut r, (need + 1) * KVB * row, 1.0);
        let inp = QkInputs::new(&c, &mut r, tokens);
        let v = &inp.host[2];
        let dtable = c.upload(&table).unwrap();
        let (mut dkc, mut dvc) = (c.upload(&fill).unwrap(), c.upload(&fill).unwrap());
        let mut q = c.upload(&vec![POISON; tokens * qh * d]).unwrap();
        let a = inp.args(&dtable, pos0);
        c.qk_norm_rope(&a, &mut q, &mut dkc, &mut dvc).unwrap();
        let (want_q, _, kr) = inp.reference(&a);
        let (gq, pk, pv) = (c.download(&q).unwrap(), c.download(&dkc).unwrap(), c.download(&dvc).unwrap());
        close(&format!("q rope chunk pos {pos0}"), &gq, &wf(&want_q));
        // the chunk's rows through the table; every other cache row untouched
        let (mut kc, mut vc) = (unpage(&fill, row, &table, pos0 + tokens), unpage(&fill, row, &table, pos0 + tokens));
        let gk = unpage(&pk, row, &table, pos0 + tokens);
        close(&format!("k cache chunk pos {pos0}"), &gk[pos0 * row..], &wf(&kr));
        kc[pos0 * row..].copy_from_slice(&gk[pos0 * row..]);
        vc[pos0 * row..].copy_from_slice(v);
        assert_eq!(pk, page(&kc, row, &table, &fill), "k cache: rows outside the chunk untouched");
        assert_eq!(pv, page(&vc, row, &table, &fill), "v cache (paged)");
        eprintln!("qk_norm_rope chunk pos {pos0}: bits {:016x}", digest(&gq) ^ digest(&pk).rotate_left(1));
        let s = time_it(&c, || c.qk_norm_rope(&a, &mut q, &mut dkc, &mut dvc).unwrap());
        eprintln!("PERF qk_norm_rope {tokens} tokens at {pos0}, 16 + 2 heads x 256: {:.2} us", s * 1e6);
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
/// result depends neither on the other rows nor on the grid (batch invariance). Prints the
/// group's digest (to compare builds); PERF: the ~100K row alone (K/V GB/s).
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
    eprintln!("attention decode group: bits {:016x}", digest(&got));
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
