//! Sampling on the device (`kernels/cuda/sample.cu`): the greedy argmax, and temperature, min-p,
//! top-k, top-p and the seeded draw, bit-identical to [`crate::sampling::sample`]. Only the
//! sampled ids come back to the host.
//!
//! Penalties first, where a row has them: `apply_penalties` edits that row's logits in place
//! (one launch per penalised row, its seen tokens uploaded to the scratch; `sampling::penalize`).
//!
//! Four launches per call, in stream order (the kernels' math is in the shared header,
//! `OrnithSampleParams`): `sample_prep` (zero each row's 65,536-bin key histogram, per-block
//! maxima), `sample_hist` (histogram of the keys that keep a nonzero weight), `sample_select`
//! (top-k and top-p thresholds from the histogram, one block per row), `sample_draw` (per-block
//! kept mass; the last block to finish walks the slice that holds the target).
//!
//! When every row has min-p off and a top-k of 1 to [`TOPK_MAX`] (the checkpoint's default,
//! top-k 20, among them: [`topk_lists`]), three launches: `sample_topk_block` (each 2,048-logit
//! block's distinct keys at or above its own k-th largest, with counts) and `sample_select_topk`
//! (the row's k-th largest key from those lists, then the same thresholds) in place of the first
//! three — no histogram to clear or fill — and the same `sample_draw`. `sample.cu` proves the
//! lists hold every key the histogram path keeps; the ids are the same bits either way.
use super::{i32of, need, CudaContext, Launch, Ptr};
use crate::engine::SamplingParams;
use crate::sampling::{draw_bits, PenaltyState, Prepared, PreparedPenalties};
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use ornith_kernels::bindings::*;

type Bf = CudaSlice<u16>;

const SLICE: usize = ORNITH_SAMPLE_SLICE as usize;
const BINS: usize = ORNITH_SAMPLE_BINS as usize;
/// The largest top-k the candidate-list kernels take.
pub const TOPK_MAX: usize = ORNITH_SAMPLE_TOPK_MAX as usize;
/// `OrnithSampleRow` as u32 words: inv_t, min_p, top_p, top_k, bits (lo, hi).
const ROW_WORDS: usize = 6;
const _: () = assert!(std::mem::size_of::<OrnithSampleRow>() == ROW_WORDS * 4);

/// Device buffers of the sampler for up to `rows` rows of up to `n` candidate columns.
pub struct SampleScratch {
    rows: usize,
    n: usize,
    row: CudaSlice<u32>,
    hist: CudaSlice<u32>,
    part_max: CudaSlice<u32>,
    part_sum: CudaSlice<u64>,
    sel: CudaSlice<u64>,
    done: CudaSlice<u32>,
    idx: CudaSlice<i32>,
    /// The logits row of each sampled row.
    logit_row: CudaSlice<i32>,
    /// One row's penalised tokens (id, tag), at most `n` (ids past `n` are not uploaded).
    pen: CudaSlice<u32>,
}

fn blocks_for(n: usize) -> usize {
    n.div_ceil(SLICE)
}

impl SampleScratch {
    pub fn new(cx: &CudaContext, rows: usize, n: usize) -> Result<Self> {
        ensure!(rows > 0 && n > 0 && n < 1 << 23, "sampler scratch for {rows} rows of {n} logits");
        let b = blocks_for(n);
        Ok(SampleScratch {
            rows,
            n,
            row: cx.alloc(rows * ROW_WORDS)?,
            hist: cx.alloc(rows * BINS)?,
            part_max: cx.alloc(rows * b)?,
            part_sum: cx.alloc(rows * b)?,
            sel: cx.alloc(rows * 2)?,
            done: cx.alloc(rows)?,
            idx: cx.alloc(rows)?,
            logit_row: cx.alloc(rows)?,
            pen: cx.alloc(2 * n)?,
        })
    }

    /// Device bytes [`Self::new`] allocates per row (for the memory plan; [`Self::fixed_bytes`]
    /// once besides).
    pub fn row_bytes(n: usize) -> u64 {
        let b = blocks_for(n);
        (4 * ROW_WORDS + 4 * BINS + 4 * b + 8 * b + 16 + 4 + 4 + 4) as u64
    }

    /// What the scratch holds whatever its rows: one row's penalised tokens.
    pub fn fixed_bytes(n: usize) -> u64 {
        8 * n as u64
    }
}

/// Whether rows of `n` candidates with these parameters take the candidate-list kernels
/// (`sample_topk_block`, `sample_select_topk`): every row's min-p off and top-k in
/// `1..=TOPK_MAX` (as prepared for the device), and the lists fit the histogram's memory.
pub fn topk_lists(n: usize, rows: &[Prepared]) -> bool {
    blocks_for(n) * TOPK_MAX <= BINS && rows.iter().all(|p| p.min_p == 0.0 && (1..=TOPK_MAX as u32).contains(&p.top_k))
}

fn i32of_rows(r: usize) -> Result<i32> {
    i32::try_from(r).map_err(|_| anyhow::anyhow!("sample: logits row {r} does not fit the kernel's int32"))
}

/// The device words of one row's parameters.
fn row_words(pr: &Prepared, seed: u64, step: u64) -> [u32; ROW_WORDS] {
    let z = draw_bits(seed, step);
    [pr.inv_t.to_bits(), pr.min_p.to_bits(), pr.top_p.to_bits(), pr.top_k, z as u32, (z >> 32) as u32]
}

impl CudaContext {
    /// Samples, in one launch of each kernel, `rows[i] = (logits row, params, step)`: row `r`
    /// of `logits` is elements `r·stride ..`, candidate columns `0..n` (params must not be
    /// greedy: greedy rows use [`Self::argmax`]). The ids land in the scratch in `rows` order;
    /// [`Self::sampled_ids`] reads them.
    pub fn sample_rows(
        &self,
        logits: &CudaSlice<u16>,
        stride: usize,
        n: usize,
        rows: &[(usize, SamplingParams, u64)],
        s: &mut SampleScratch,
    ) -> Result<()> {
        let r = rows.len();
        ensure!(r > 0 && r <= s.rows, "sample: {r} rows, scratch for {}", s.rows);
        ensure!(n > 0 && n <= s.n && n <= stride, "sample: n {n}, stride {stride}, scratch for {}", s.n);
        let last = rows.iter().map(|x| x.0).max().unwrap_or(0);
        ensure!(last * stride + n <= logits.len(), "sample: logits buffer too small for row {last}");
        i32of_rows(last)?;
        ensure!(rows.iter().all(|(_, p, _)| !crate::sampling::is_greedy(p)), "sample: greedy rows go to argmax");
        let prepared: Vec<Prepared> = rows.iter().map(|(_, p, _)| Prepared::new(p)).collect();
        let words: Vec<u32> =
            rows.iter().zip(&prepared).flat_map(|((_, p, step), pr)| row_words(pr, p.seed, *step)).collect();
        self.stream().memcpy_htod(&words, &mut s.row)?;
        let lr: Vec<i32> = rows.iter().map(|x| x.0 as i32).collect();
        self.stream().memcpy_htod(&lr, &mut s.logit_row)?;
        let blocks = blocks_for(n);
        let p = OrnithSampleParams {
            logits: self.addr(logits) as _,
            row: self.addr(&s.row) as _,
            hist: self.addr(&s.hist) as _,
            part_max: self.addr(&s.part_max) as _,
            part_sum: self.addr(&s.part_sum) as _,
            sel: self.addr(&s.sel) as _,
            done: self.addr(&s.done) as _,
            idx: self.addr(&s.idx) as _,
            rows: r as i32,
            n: n as i32,
            stride: stride as i32,
            blocks: blocks as i32,
            logit_row: self.addr(&s.logit_row) as _,
        };
        let grid = (blocks as u32, r as u32, 1);
        let logit_bytes = (r * n * 2) as u64;
        if topk_lists(n, &prepared) {
            let list_bytes = (r * blocks * (TOPK_MAX + 1) * 4) as u64;
            self.launch(Launch::new("sample_topk_block", grid, 256, logit_bytes + list_bytes), p)?;
            self.launch(Launch::new("sample_select_topk", (r as u32, 1, 1), 256, list_bytes), p)?;
        } else {
            let hist_bytes = (r * BINS * 4) as u64;
            self.launch(Launch::new("sample_prep", grid, 256, logit_bytes + hist_bytes), p)?;
            self.launch(Launch::new("sample_hist", grid, 256, logit_bytes + hist_bytes), p)?;
            self.launch(Launch::new("sample_select", (r as u32, 1, 1), 1024, hist_bytes), p)?;
        }
        self.launch(Launch::new("sample_draw", grid, 256, logit_bytes), p)
    }

    /// The ids of the last [`Self::sample_rows`] call's `rows` rows (waits for the stream).
    /// A row without a finite logit is an error.
    pub fn sampled_ids(&self, s: &SampleScratch, rows: usize) -> Result<Vec<u32>> {
        ensure!(rows <= s.rows, "sampled_ids: {rows} rows, scratch for {}", s.rows);
        let mut ids = vec![0i32; rows];
        self.stream().memcpy_dtoh(&s.idx.slice(0..rows), &mut ids)?;
        ids.iter()
            .map(|&i| match i {
                -1 => anyhow::bail!(crate::sampling::NO_FINITE_LOGIT),
                i if i < 0 => anyhow::bail!("the device sampler drew no token (internal error, code {i})"),
                i => Ok(i as u32),
            })
            .collect()
    }
}

/// Penalties (`apply_penalties`).
impl CudaContext {
    /// Applies `st`'s penalties to row `row` (elements `row·stride ..`, candidate columns `0..n`)
    /// of `logits`, in place: [`crate::sampling::apply_penalties`] on the device. The row's seen
    /// tokens go through the scratch, so rows are penalised one launch after another (stream
    /// order keeps each launch's tokens until it has read them).
    pub fn apply_penalties(
        &self,
        logits: &CudaSlice<u16>,
        stride: usize,
        row: usize,
        n: usize,
        st: &PenaltyState,
        s: &mut SampleScratch,
    ) -> Result<()> {
        ensure!(n > 0 && n <= s.n && n <= stride, "apply_penalties: n {n}, stride {stride}, scratch for {}", s.n);
        need("apply_penalties logits", logits, row * stride + n)?;
        let words: Vec<u32> = st.tokens.iter().filter(|t| (t.id as usize) < n).flat_map(|t| [t.id, t.tag]).collect();
        if words.is_empty() {
            return Ok(());
        }
        let count = words.len() / 2;
        self.stream().memcpy_htod(&words, &mut s.pen.slice_mut(0..words.len()))?;
        let pp = PreparedPenalties::new(&st.penalties);
        let p = OrnithPenaltyParams {
            logits: (self.addr(logits) + 2 * (row * stride) as u64) as _,
            tokens: self.addr(&s.pen) as _,
            count: i32of("penalised tokens", count)?,
            n: i32of("n", n)?,
            presence: pp.presence,
            frequency: pp.frequency,
            repetition: pp.repetition,
            inv_repetition: pp.inv_repetition,
        };
        self.launch(Launch::new("apply_penalties", (count.div_ceil(256) as u32, 1, 1), 256, (count * 12) as u64), p)
    }
}

/// Greedy sampling (`argmax_bf16`).
impl CudaContext {
    /// Greedy sampling: the argmax of the first `n` columns of `rows` logits rows (row stride
    /// `stride`): row i of `logit_row` (device int32) when given, else row i.
    pub(crate) fn k_argmax(
        &self,
        logits: Ptr,
        idx: Ptr,
        rows: usize,
        n: usize,
        stride: usize,
        logit_row: Option<Ptr>,
    ) -> Result<()> {
        ensure!(rows > 0 && n > 0 && stride >= n, "argmax: n {n}, stride {stride}");
        let p = OrnithArgmaxParams {
            logits: logits as _,
            idx: idx as _,
            tokens: i32of("rows", rows)?,
            n: i32of("n", n)?,
            stride: i32of("stride", stride)?,
            logit_row: logit_row.map_or(std::ptr::null(), |r| r as _),
        };
        self.launch(Launch::new("argmax_bf16", (rows as u32, 1, 1), 1024, (rows * n * 2) as u64), p)
    }

    /// [`Self::k_argmax`] on buffers (row i of the logits for row i).
    pub fn argmax(&self, logits: &Bf, idx: &mut CudaSlice<i32>, tokens: usize, n: usize, stride: usize) -> Result<()> {
        ensure!(tokens > 0, "argmax: no rows");
        need("argmax logits", logits, (tokens - 1) * stride + n)?;
        need("argmax idx", idx, tokens)?;
        self.k_argmax(self.addr(logits), self.addr(idx), tokens, n, stride, None)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{ctx, rng, time_it, R};
    use super::*;
    use crate::sampling;
    use half::bf16;
    use rand::Rng;

    fn normal(r: &mut R) -> f32 {
        let (u, v): (f32, f32) = (r.random::<f32>().max(1e-7), r.random());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }

    /// A row of `stride` logits: Gaussian bulk of scale `spread`, a few large values (a peaked
    /// distribution), exact ties, NaN / inf sprinkled in, and huge padding columns past `n`.
    fn row(r: &mut R, n: usize, stride: usize, spread: f32) -> Vec<u16> {
        let mut l: Vec<u16> = (0..stride).map(|_| bf16::from_f32(normal(r) * spread).to_bits()).collect();
        for _ in 0..8 {
            let i = r.random_range(0..n);
            l[i] = bf16::from_f32(spread * 3.0 + normal(r)).to_bits();
        }
        if n > 64 {
            l[n / 2] = l[n / 3]; // a tie
            l[7] = 0x7fc0; // NaN
            l[11] = 0x7f80; // +inf
            l[13] = 0xff80; // -inf
        }
        for v in &mut l[n..] {
            *v = bf16::from_f32(1e4).to_bits(); // padding rows: never candidates
        }
        l
    }

    fn p(t: f32, k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
        SamplingParams { temperature: t, top_k: k, top_p, min_p, seed }
    }

    /// The device sampler returns exactly the reference's id: every size class (one block, a
    /// block boundary, the real vocabulary inside the padded lm_head row), every filter alone and
    /// combined, many seeds and steps; several rows in one launch.
    #[test]
    #[ignore]
    fn sample_matches_reference() {
        let c = ctx();
        let mut r = rng(0x5a3);
        let params = [
            p(1.0, 20, 0.95, 0.0, 1), // the checkpoint's default
            p(0.7, 0, 0.8, 0.0, 2),   // top-p only
            p(1.0, 0, 1.0, 0.0, 3),   // plain temperature
            p(0.3, 1, 1.0, 0.0, 4),   // top-k 1
            p(1.5, 1000, 1.0, 0.05, 5),
            p(0.6, 40, 0.5, 0.02, 6),
            p(2.0, 0, 0.999, 0.0, 7),
            p(1.0, 5, 0.01, 0.0, 8),
            p(0.05, 32, 1.0, 0.0, 9), // top-k TOPK_MAX; at spread 12 keys of zero weight inside it
            p(1.0, 32, 0.9, 0.0, 10), // top-k TOPK_MAX with top-p
            p(0.8, 20, 0.95, 0.1, 11), // the default's top-k with min-p: the histogram path
        ];
        // Both paths are exercised: the candidate lists where min-p is off and top-k <= TOPK_MAX.
        let lists: Vec<bool> = params.iter().map(|q| topk_lists(248_077, &[Prepared::new(q)])).collect();
        assert_eq!(lists, [true, false, false, true, false, false, false, true, true, true, false]);
        let mut checked = 0;
        for &(n, stride) in &[(7usize, 7usize), (1000, 1000), (2049, 2056), (4096, 4096), (248_077, 248_320)] {
            let mut s = SampleScratch::new(&c, 3, stride).unwrap();
            for &spread in &[0.5f32, 3.0, 12.0] {
                let l = row(&mut r, n, stride, spread);
                let dl = c.upload(&l).unwrap();
                for q in &params {
                    for step in [0u64, 1, 17, 1000] {
                        c.sample_rows(&dl, stride, n, &[(0, *q, step)], &mut s).unwrap();
                        let got = c.sampled_ids(&s, 1).unwrap()[0];
                        let want = sampling::sample(&l[..n], q, step).unwrap();
                        assert_eq!(got, want, "n {n}, spread {spread}, {q:?}, step {step}");
                        checked += 1;
                    }
                }
            }
            // Three rows in one launch, each with its own params and step, read out of order
            // (logits rows 2, 0, 1: the per-row indirection).
            let l: Vec<u16> = (0..3).flat_map(|_| row(&mut r, n, stride, 3.0)).collect();
            let dl = c.upload(&l).unwrap();
            let rows = [(2usize, params[0], 5u64), (0, params[1], 6), (1, params[5], 7)];
            c.sample_rows(&dl, stride, n, &rows, &mut s).unwrap();
            let got = c.sampled_ids(&s, 3).unwrap();
            for (i, (lr, q, step)) in rows.iter().enumerate() {
                let want = sampling::sample(&l[lr * stride..lr * stride + n], q, *step).unwrap();
                assert_eq!(got[i], want, "row {i} of 3 (logits row {lr}), n {n}");
            }
        }
        // Rows of heavy ties (the k-th largest key shared by hundreds of logits, or by all of
        // them), every parameter set, through both paths.
        let (n, stride) = (248_077usize, 248_320usize);
        let mut s = SampleScratch::new(&c, 1, stride).unwrap();
        let rounded: Vec<u16> = (0..stride).map(|_| bf16::from_f32(normal(&mut r).round()).to_bits()).collect();
        let mut flat = vec![bf16::from_f32(1.0).to_bits(); stride];
        flat[5] = 0x7fc0;
        for l in [&rounded, &flat] {
            let dl = c.upload(l).unwrap();
            for q in &params {
                for step in [0u64, 3] {
                    c.sample_rows(&dl, stride, n, &[(0, *q, step)], &mut s).unwrap();
                    let want = sampling::sample(&l[..n], q, step).unwrap();
                    assert_eq!(c.sampled_ids(&s, 1).unwrap()[0], want, "tie-heavy row, {q:?}, step {step}");
                    checked += 1;
                }
            }
        }
        // A row with no finite logit is an error, as on the CPU (both paths).
        let bad = vec![0x7fc0u16; 3000];
        let mut s = SampleScratch::new(&c, 1, 3000).unwrap();
        for q in [params[0], params[1]] {
            c.sample_rows(&c.upload(&bad).unwrap(), 3000, 3000, &[(0, q, 0)], &mut s).unwrap();
            assert!(c.sampled_ids(&s, 1).is_err());
        }
        eprintln!("sample_matches_reference: {checked} draws identical to the CPU reference");

        // PERF: the real vocabulary, 1 and 64 rows: default sampling (the candidate lists), the
        // same with top-k 40 (the histogram path), top-p only.
        let (n, stride) = (248_077, 248_320);
        let l: Vec<u16> = (0..64).flat_map(|_| row(&mut r, n, stride, 3.0)).collect();
        let dl = c.upload(&l).unwrap();
        let mut s = SampleScratch::new(&c, 64, stride).unwrap();
        let cases = [
            ("default (T 1, top-k 20, top-p 0.95; lists)", params[0]),
            ("T 1, top-k 40, top-p 0.95 (histogram)", p(1.0, 40, 0.95, 0.0, 1)),
            ("top-p 0.8, T 0.7 (histogram)", params[1]),
        ];
        for rows in [1usize, 64] {
            for (name, q) in cases {
                let req: Vec<(usize, SamplingParams, u64)> = (0..rows).map(|i| (i, q, 3)).collect();
                let t = time_it(&c, || c.sample_rows(&dl, stride, n, &req, &mut s).unwrap());
                eprintln!("PERF sample {rows} rows of {n} bf16 logits, {name}: {:.2} us", t * 1e6);
                let got = c.sampled_ids(&s, rows).unwrap();
                for (i, g) in got.iter().enumerate() {
                    let want = sampling::sample(&l[i * stride..i * stride + n], &q, 3).unwrap();
                    assert_eq!(*g, want, "row {i} of {rows}, {name}");
                }
            }
        }
    }

    /// The candidate-list kernels' algorithm, step by step on the host (`sample_topk_block`:
    /// each 2,048-logit block's distinct keys at or above its own k-th largest, with counts;
    /// `sample_select_topk`: the k-th largest key of their union, the distinct keys at or above it
    /// summed over blocks, weights, top-p, kept mass; then `sample_draw`'s walk), against
    /// `sampling::sample` on rows built to stress the proof in `sample.cu`: ties at the k-th key
    /// within and across blocks, every block holding the same top keys, keys of zero weight inside
    /// the top k (low temperatures), fewer finite logits than k, NaN and inf. Runs in CI (no GPU):
    /// the device test (`sample_matches_reference`) checks the kernels against the same reference.
    #[test]
    fn candidate_lists_keep_what_the_histogram_keeps() {
        use crate::sampling::{draw_bits, draw_target, key_of, top_p_keeps, value_of_key};
        fn kth(keys: impl Iterator<Item = (u16, u64)>, k: u64) -> Option<u16> {
            let mut v: Vec<(u16, u64)> = keys.collect();
            v.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
            let mut seen = 0;
            v.into_iter()
                .find(|&(_, c)| {
                    seen += c;
                    seen >= k
                })
                .map(|(key, _)| key)
        }
        // Adds `c` to key `x`'s count in a list of distinct keys.
        fn tally(list: &mut Vec<(u16, u64)>, x: u16, c: u64) {
            match list.iter_mut().find(|e| e.0 == x) {
                Some(e) => e.1 += c,
                None => list.push((x, c)),
            }
        }
        fn lists_sample(l: &[u16], q: &SamplingParams, step: u64) -> Option<u32> {
            let pr = Prepared::new(q);
            let k = pr.top_k as u64;
            // sample_topk_block: each block's list of (key, count), keys >= its k-th largest.
            let mut union: Vec<(u16, u64)> = Vec::new();
            for blk in l.chunks(SLICE) {
                let keys: Vec<u16> = blk.iter().filter_map(|&b| key_of(b)).collect();
                let t_b = kth(keys.iter().map(|&x| (x, 1)), k).unwrap_or(0);
                let mut list: Vec<(u16, u64)> = Vec::new();
                for &x in keys.iter().filter(|&&x| x >= t_b) {
                    tally(&mut list, x, 1);
                }
                assert!(list.len() <= k as usize, "a block lists at most k distinct keys");
                union.extend(list);
            }
            // sample_select_topk: T, then the distinct keys >= T with their counts summed.
            let t = kth(union.iter().copied(), k).unwrap_or(0);
            let mut keys: Vec<(u16, u64)> = Vec::new();
            for &(x, c) in union.iter().filter(|e| e.0 >= t) {
                tally(&mut keys, x, c);
            }
            assert!(keys.len() <= k as usize, "at most k distinct keys at or above T");
            keys.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
            let vmax = value_of_key(keys.first()?.0);
            let m: Vec<u64> = keys.iter().map(|&(x, c)| c * pr.weight(x, vmax)).collect();
            let total: u64 = m.iter().sum();
            let mut thr = t;
            if pr.top_p < 1.0 {
                let mut above = 0;
                thr = u16::MAX;
                for (i, &(x, _)) in keys.iter().enumerate() {
                    if m[i] > 0 && top_p_keeps(above, pr.top_p, total) {
                        thr = x;
                    }
                    above += m[i];
                }
            }
            let kept: u64 = keys.iter().zip(&m).filter(|(e, _)| e.0 >= thr).map(|(_, &w)| w).sum();
            // sample_draw: the first id (ascending) whose running kept mass passes the target.
            let target = draw_target(draw_bits(q.seed, step), kept);
            let mut acc = 0;
            for (i, &b) in l.iter().enumerate() {
                match key_of(b) {
                    Some(x) if x >= thr => acc += pr.weight(x, vmax),
                    _ => continue,
                }
                if acc > target {
                    return Some(i as u32);
                }
            }
            unreachable!("the kept mass exceeds the target")
        }
        let mut r = rng(0x11575);
        let n = 3 * SLICE + 517;
        let b = |v: f32| bf16::from_f32(v).to_bits();
        let mut rows: Vec<Vec<u16>> = Vec::new();
        for spread in [0.5f32, 3.0, 12.0] {
            rows.push(row(&mut r, n, n, spread));
        }
        rows.push((0..n).map(|_| b(normal(&mut r).round())).collect()); // hundreds tie at the k-th key
        rows.push((0..n).map(|i| b((i % 40) as f32 * 0.25)).collect()); // every block: the same top keys
        rows.push((0..n).map(|i| b(if i % 997 == 0 { 2.0 } else { -3.0 })).collect()); // top keys across blocks
        let mut few = vec![0x7fc0u16; n]; // fewer finite logits than any k > 5
        for i in [3, 2100, 4500, 4501, 6000] {
            few[i] = b(r.random_range(-2.0f32..2.0));
        }
        rows.push(few);
        let params = [
            p(1.0, 20, 0.95, 0.0, 1),
            p(0.05, 32, 1.0, 0.0, 2),
            p(0.02, 20, 0.9, 0.0, 3),
            p(1.0, 1, 1.0, 0.0, 4),
            p(0.7, 8, 0.5, 0.0, 5),
            p(1.3, 32, 0.999, 0.0, 6),
        ];
        let mut checked = 0;
        for l in &rows {
            for q in &params {
                assert!(topk_lists(n, &[Prepared::new(q)]));
                for step in 0..12 {
                    let want = sampling::sample(l, q, step).ok();
                    assert_eq!(lists_sample(l, q, step), want, "{q:?}, step {step}");
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, rows.len() * params.len() * 12);
    }

    /// The device sampler's empirical distribution is the softmax of the scaled logits over
    /// the kept set (chi-square over 20,000 seeded draws).
    #[test]
    #[ignore]
    fn sample_distribution_matches_softmax() {
        let c = ctx();
        let l: Vec<u16> =
            [1.0f32, 2.5, -0.5, 2.5, 0.3125, -3.0, 1.75, 0.0].iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        let dl = c.upload(&l).unwrap();
        let mut s = SampleScratch::new(&c, 1, l.len()).unwrap();
        let q = p(0.8, 0, 1.0, 0.0, 99);
        let n = 20_000u64;
        let mut cnt = [0u64; 8];
        for step in 0..n {
            c.sample_rows(&dl, 8, 8, &[(0, q, step)], &mut s).unwrap();
            cnt[c.sampled_ids(&s, 1).unwrap()[0] as usize] += 1;
        }
        let e: Vec<f64> = l.iter().map(|&b| ((bf16::from_bits(b).to_f64() - 2.5) / 0.8).exp()).collect();
        let tot: f64 = e.iter().sum();
        let chi2: f64 =
            cnt.iter().zip(&e).map(|(&o, &w)| (o as f64 - n as f64 * w / tot).powi(2) / (n as f64 * w / tot)).sum();
        // df = 7, p = 0.001 critical value 24.32.
        assert!(chi2 < 24.32, "chi2 {chi2}, counts {cnt:?}");
    }
}
