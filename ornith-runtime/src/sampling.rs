//! Next-token sampling: the exact reference that the CUDA sampler (`kernels/cuda/sample.cu`)
//! reproduces bit for bit.
//!
//! The input is one row of bf16 logits restricted to the ids the tokenizer can decode (the lm_head
//! has padding rows past the vocabulary; the caller passes only the first `n` columns, so those
//! rows can never come out). Greedy when `temperature < 1e-5` (or NaN): the lowest id among the
//! largest finite logits. Otherwise vLLM's order of operations — temperature, min-p, top-k,
//! top-p, draw — computed in integers wherever a sum is involved, so that any summation order
//! (the GPU's parallel reductions, this file's loops) gives the same result:
//!
//! 1. **Keys.** Every finite logit `v` has a 16-bit order key (its bf16 bits mapped so that
//!    integer order is float order, `-0` folded into `+0`). All tokens with the same key have the
//!    same weight, so a 65,536-bin histogram of keys is a sufficient statistic.
//! 2. **Weights.** `x = (v - v_max) · (1/T)` in f32 (`1/T` rounded once, on the host),
//!    `w = exp_det(x)` (an f32 exponential built from single IEEE operations, so that it is
//!    bit-identical on every machine; see [`exp_det`]), `W = trunc(w · 2^40)` as an integer.
//!    Tokens with `W = 0` (more than ~27.7·T below the maximum, probability < 1e-12 of the
//!    largest) are never drawn.
//! 3. **min-p**: drop a token when `w < min_p` (`w` is its probability relative to the largest,
//!    as in vLLM's min-p processor).
//! 4. **top-k**: among the survivors, keep the keys `>=` the k-th largest key counted with
//!    multiplicity (ties with the k-th are kept, as vLLM's `logits < kth_value` mask does).
//! 5. **top-p** (nucleus): with `total = Σ W` over the survivors, keep every key whose mass
//!    ranked strictly above it satisfies `f64(above) < f64(p) · f64(total)` (the largest key is
//!    always kept; tokens with equal logits are kept or dropped together).
//! 6. **Draw**: `z = mix64(mix64(seed + γ) ^ (step + 1)·γ)` (64 random bits, counter-based, so a
//!    seed reproduces anywhere), `target = ⌊z · K / 2^64⌋` with `K = Σ W` over the kept tokens,
//!    and the result is the first kept id, in ascending id order, at which the running sum of `W`
//!    exceeds `target`. Each kept token is drawn with probability `W / K` exactly (up to the
//!    2^-64 resolution of `z`).
//!
//! The kept set and the draw depend only on integer sums and on comparisons of values computed
//! by single IEEE operations, so the CUDA kernels return the same id for the same row, params,
//! seed and step (tested in `cuda::tests::sample_matches_reference`). Compared with the
//! textbook float formulation the distribution differs only by the `2^-40` quantisation of `w`.
//!
//! A row with no finite logit is an error on every path (it means the forward pass is broken).
//!
//! **Penalties** come first, as in vLLM (before temperature): [`penalize`] changes the logits of
//! the tokens the request has seen — repetition (prompt and output), then frequency and presence
//! (output) — and rounds each changed logit to bf16, so that the row stays a row of bf16 values
//! and every step above applies unchanged. Both backends edit the row the same way (the CUDA
//! kernel `apply_penalties` with the same single IEEE operations), so they still return the same
//! id.

use anyhow::{bail, Result};

use crate::engine::{Penalties, SamplingParams};

/// The error of a logits row without a finite value (every path, both backends).
pub const NO_FINITE_LOGIT: &str = "every logit is NaN or infinite: the forward pass produced no usable row";

/// Temperatures below this are greedy (vLLM `_SAMPLING_EPS`).
pub const GREEDY_EPS: f32 = 1e-5;

const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// Fixed-point scale of the integer weights: `W = trunc(w · 2^40)`.
pub const WEIGHT_SCALE: f32 = (1u64 << 40) as f32;

/// Below this `x`, `exp(x) < 2^-40` and the weight is 0 (checked by a test).
const EXP_CUTOFF: f32 = -28.0;

/// SplitMix64 finaliser (Stafford variant 13): a bijective avalanche mix of 64 bits.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The 64 random bits of sampled token `step` of the stream `seed`:
/// `mix64(mix64(seed + γ) ^ (step + 1)·γ)` (wrapping u64 arithmetic, γ = 0x9e3779b97f4a7c15).
/// The seed is hashed first so that nearby seeds give unrelated streams.
#[inline]
pub fn draw_bits(seed: u64, step: u64) -> u64 {
    let k = mix64(seed.wrapping_add(GAMMA));
    mix64(k ^ step.wrapping_add(1).wrapping_mul(GAMMA))
}

/// `exp(x)` for `x <= 0`, from single-rounded f32 operations only (no fused multiply-add, no
/// library call), so that the CUDA kernel (`exp_det` in sample.cu, written with `__fmul_rn` /
/// `__fadd_rn`, which the compiler may not contract) gives the same bits. Cody–Waite reduction
/// `x = n·ln2 + r` (`n·LN2_HI` is exact: 9 significant bits times |n| <= 41), a degree-6 Taylor
/// polynomial on |r| <= 0.347 (truncation error < 2e-10), times `2^n`. Relative error a few ulp.
/// Returns 0 below -28 (where `exp(x) < 2^-40` and the integer weight would be 0 anyway).
#[inline]
pub fn exp_det(x: f32) -> f32 {
    if x.is_nan() || x < EXP_CUTOFF {
        return 0.0;
    }
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4; // 355/512
    const LN2_LO: f32 = -2.121_944_4e-4; // ln 2 - LN2_HI
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: adding and subtracting it rounds to an integer (ties to even)
    let n = (x * LOG2E + MAGIC) - MAGIC;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0f32 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // n in [-41, 0]: 2^n is a normal f32.
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
}

/// Order key of a bf16 logit (bits), or `None` for NaN and ±inf. Integer order of keys is the
/// float order of the values; `-0` and `+0` share a key.
#[inline]
pub fn key_of(bits: u16) -> Option<u16> {
    if bits & 0x7f80 == 0x7f80 {
        return None;
    }
    let b = if bits == 0x8000 { 0 } else { bits };
    Some(if b & 0x8000 != 0 { !b } else { b | 0x8000 })
}

/// The bf16 value a key stands for.
#[inline]
pub fn value_of_key(key: u16) -> f32 {
    let bits = if key & 0x8000 != 0 { key & 0x7fff } else { !key };
    f32::from_bits((bits as u32) << 16)
}

/// The per-request numbers both samplers compute from (host-side, rounded once).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prepared {
    /// `1 / temperature` in f32.
    pub inv_t: f32,
    /// 0 disables.
    pub min_p: f32,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub top_k: u32,
}

/// True when `p` asks for greedy decoding (a NaN temperature too).
#[inline]
pub fn is_greedy(p: &SamplingParams) -> bool {
    p.temperature.is_nan() || p.temperature < GREEDY_EPS
}

impl Prepared {
    pub fn new(p: &SamplingParams) -> Self {
        Prepared {
            inv_t: 1.0f32 / p.temperature,
            min_p: p.min_p.max(0.0),
            top_p: if p.top_p > 0.0 && p.top_p < 1.0 { p.top_p } else { 1.0 },
            top_k: p.top_k.min(u32::MAX as usize) as u32,
        }
    }

    /// Integer weight of a key given the row's largest value, or 0 when the key is dropped
    /// (zero weight or below min-p).
    #[inline]
    pub fn weight(&self, key: u16, vmax: f32) -> u64 {
        let x = (value_of_key(key) - vmax) * self.inv_t;
        let w = exp_det(x);
        if w < self.min_p {
            return 0;
        }
        (w * WEIGHT_SCALE) as u64
    }
}

/// `f64(above) < f64(top_p) · f64(total)`: whether a key with mass `above` ranked strictly above
/// it survives top-p.
#[inline]
pub fn top_p_keeps(above: u64, top_p: f32, total: u64) -> bool {
    (above as f64) < (top_p as f64) * (total as f64)
}

/// `⌊z · total / 2^64⌋`.
#[inline]
pub fn draw_target(z: u64, total: u64) -> u64 {
    ((z as u128 * total as u128) >> 64) as u64
}

/// Index of the largest finite logit, lowest index on ties; an error when none is finite.
pub fn argmax(logits: &[u16]) -> Result<u32> {
    let mut best: Option<(usize, u16)> = None;
    for (i, &b) in logits.iter().enumerate() {
        let Some(k) = key_of(b) else { continue };
        match best {
            Some((_, bk)) if k <= bk => {}
            _ => best = Some((i, k)),
        }
    }
    match best {
        Some((i, _)) => Ok(i as u32),
        None => bail!(NO_FINITE_LOGIT),
    }
}

/// Samples one token id from a row of bf16 logits (`logits` holds only candidate ids: the
/// caller cuts off the lm_head's padding rows). `step` counts the request's sampled tokens.
pub fn sample(logits: &[u16], p: &SamplingParams, step: u64) -> Result<u32> {
    assert!(logits.len() < 1 << 23, "a row of {} logits would overflow the integer weights", logits.len());
    if is_greedy(p) {
        return argmax(logits);
    }
    let pr = Prepared::new(p);
    let Some(kmax) = logits.iter().filter_map(|&b| key_of(b)).max() else {
        bail!(NO_FINITE_LOGIT);
    };
    let vmax = value_of_key(kmax);
    // The distinct keys present, ascending, with their counts: sorted for short rows, through a
    // dense 65,536-bin histogram for long ones (the lm_head row).
    let mut present: Vec<(u16, u64)> = Vec::new();
    if logits.len() < 8192 {
        let mut keys: Vec<u16> = logits.iter().filter_map(|&b| key_of(b)).collect();
        keys.sort_unstable();
        for k in keys {
            match present.last_mut() {
                Some((pk, c)) if *pk == k => *c += 1,
                _ => present.push((k, 1)),
            }
        }
    } else {
        let mut hist = vec![0u32; 1 << 16];
        for k in logits.iter().filter_map(|&b| key_of(b)) {
            hist[k as usize] += 1;
        }
        present.extend(hist.iter().enumerate().filter(|(_, &c)| c > 0).map(|(k, &c)| (k as u16, c as u64)));
    }
    // Surviving keys (nonzero weight), ascending: (key, count, weight).
    let surv: Vec<(u16, u64, u64)> = present
        .into_iter()
        .filter_map(|(k, c)| {
            let w = pr.weight(k, vmax);
            (w > 0).then_some((k, c, w))
        })
        .collect();
    let mass = |j: usize| surv[j].1 * surv[j].2;
    // top-k: the k-th largest surviving key (all keys when fewer survive).
    let mut thr_k = 0usize;
    if pr.top_k > 0 {
        let mut seen = 0u64;
        for j in (0..surv.len()).rev() {
            seen += surv[j].1;
            if seen >= pr.top_k as u64 {
                thr_k = j;
                break;
            }
        }
    }
    // top-p over the survivors of top-k.
    let mut thr = thr_k;
    if pr.top_p < 1.0 {
        let total: u64 = (thr_k..surv.len()).map(mass).sum();
        let mut above = 0u64;
        for j in (thr_k..surv.len()).rev() {
            if !top_p_keeps(above, pr.top_p, total) {
                break;
            }
            thr = j;
            above += mass(j);
        }
    }
    let kept: u64 = (thr..surv.len()).map(mass).sum();
    debug_assert!(kept > 0, "the largest key always has weight 2^40");
    let thr_key = surv[thr].0;
    let target = draw_target(draw_bits(p.seed, step), kept);
    let mut acc = 0u64;
    for (i, &b) in logits.iter().enumerate() {
        let Some(k) = key_of(b) else { continue };
        if k >= thr_key {
            acc += pr.weight(k, vmax);
            if acc > target {
                return Ok(i as u32);
            }
        }
    }
    unreachable!("the running sum reaches the kept mass, which exceeds the target")
}

/// One token a request has seen, for its penalties: the id, and in `tag` the number of times the
/// request has generated it (low 31 bits) and whether the prompt holds it ([`Self::PROMPT`]).
/// The layout is the device's (`apply_penalties` reads pairs of u32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct PenaltyToken {
    pub id: u32,
    pub tag: u32,
}

impl PenaltyToken {
    /// The bit of `tag` that says the prompt holds the token.
    pub const PROMPT: u32 = 1 << 31;

    /// Times the request has generated the token.
    pub fn count(&self) -> u32 {
        self.tag & !Self::PROMPT
    }

    pub fn in_prompt(&self) -> bool {
        self.tag & Self::PROMPT != 0
    }
}

/// A sequence's penalties and the tokens they apply to: every distinct token of its output and,
/// when the repetition penalty is on, of its prompt, ascending by id. The engine keeps it and
/// adds each sampled token ([`Self::add_output`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PenaltyState {
    pub penalties: Penalties,
    pub tokens: Vec<PenaltyToken>,
}

impl PenaltyState {
    /// The state before the first sampled token: the prompt's distinct ids when the repetition
    /// penalty is on (only it looks at the prompt), else none.
    pub fn new(penalties: Penalties, prompt: &[u32]) -> Self {
        let mut tokens = Vec::new();
        if penalties.repetition != 1.0 {
            let mut ids = prompt.to_vec();
            ids.sort_unstable();
            ids.dedup();
            tokens = ids.into_iter().map(|id| PenaltyToken { id, tag: PenaltyToken::PROMPT }).collect();
        }
        PenaltyState { penalties, tokens }
    }

    /// Counts one more sampled `id`.
    pub fn add_output(&mut self, id: u32) {
        match self.tokens.binary_search_by_key(&id, |t| t.id) {
            Ok(i) => {
                let t = &mut self.tokens[i];
                if t.count() < !PenaltyToken::PROMPT {
                    t.tag += 1;
                }
            }
            Err(i) => self.tokens.insert(i, PenaltyToken { id, tag: 1 }),
        }
    }
}

/// The numbers [`penalize`] computes with (host-side, rounded once): vLLM scales a repeated
/// token's positive logit by `1 / repetition` (rounded to f32 once), its other logits by
/// `repetition`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PreparedPenalties {
    pub presence: f32,
    pub frequency: f32,
    pub repetition: f32,
    pub inv_repetition: f32,
}

impl PreparedPenalties {
    pub fn new(p: &Penalties) -> Self {
        PreparedPenalties {
            presence: p.presence,
            frequency: p.frequency,
            repetition: p.repetition,
            inv_repetition: 1.0f32 / p.repetition,
        }
    }
}

/// The penalised bf16 logit of a token the request has seen (`bits`: its bf16 logit), in vLLM's
/// order, each step one f32 operation: `v = f32(bits)`; if the prompt or the output holds it and
/// the repetition penalty is not 1, `v = v > 0 ? v · (1/r) : v · r`; `v = v − f · count`;
/// `v = v − p` when `count > 0`; the result rounded to bf16 (nearest, ties to even). NaN and ±inf
/// logits are left as they are (the sampler never draws them).
pub fn penalize(bits: u16, t: PenaltyToken, p: &PreparedPenalties) -> u16 {
    if bits & 0x7f80 == 0x7f80 {
        return bits;
    }
    let count = t.count();
    let mut v = f32::from_bits((bits as u32) << 16);
    if p.repetition != 1.0 && (count > 0 || t.in_prompt()) {
        v = if v > 0.0 { v * p.inv_repetition } else { v * p.repetition };
    }
    v -= p.frequency * count as f32;
    if count > 0 {
        v -= p.presence;
    }
    half::bf16::from_f32(v).to_bits()
}

/// Applies a sequence's penalties to its row of candidate logits (ids past the row are ignored).
pub fn apply_penalties(row: &mut [u16], st: &PenaltyState) {
    let p = PreparedPenalties::new(&st.penalties);
    for t in &st.tokens {
        if let Some(b) = row.get_mut(t.id as usize) {
            *b = penalize(*b, *t, &p);
        }
    }
}

/// bf16 bits of f32 logits that are bf16 values (the CPU backend's logits are rounded to bf16
/// by the lm_head); other values are rounded to nearest.
pub fn bf16_bits(logits: &[f32]) -> Vec<u16> {
    logits.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32, k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
        SamplingParams { temperature: t, top_k: k, top_p, min_p, seed }
    }

    fn bits(l: &[f32]) -> Vec<u16> {
        bf16_bits(l)
    }

    fn softmax(l: &[f32], t: f32) -> Vec<f64> {
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = l.iter().map(|&v| (((v - m) / t) as f64).exp()).collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|x| x / s).collect()
    }

    fn counts(l: &[f32], p: &SamplingParams, n: u64) -> Vec<u64> {
        let b = bits(l);
        let mut c = vec![0u64; l.len()];
        for step in 0..n {
            c[sample(&b, p, step).unwrap() as usize] += 1;
        }
        c
    }

    /// Pearson chi-square statistic of observed counts against expected probabilities
    /// (rows with zero expectation must have zero count).
    fn chi2(c: &[u64], probs: &[f64], n: u64) -> f64 {
        let mut x = 0.0;
        for (o, &pr) in c.iter().zip(probs) {
            if pr == 0.0 {
                assert_eq!(*o, 0, "sampled a row of probability 0");
                continue;
            }
            let e = pr * n as f64;
            x += (*o as f64 - e).powi(2) / e;
        }
        x
    }

    // bf16-exact values.
    const LOGITS: [f32; 8] = [1.0, 2.5, -0.5, 2.5, 0.3125, -3.0, 1.75, 0.0];

    #[test]
    fn exp_det_is_accurate_and_cut_off() {
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x >= EXP_CUTOFF {
            let e = (x as f64).exp();
            let rel = (exp_det(x) as f64 - e).abs() / e;
            worst = worst.max(rel);
            x -= 0.001_37;
        }
        // A few f32 ulp (2^-23 = 1.2e-7).
        assert!(worst < 6e-7, "exp_det relative error {worst}");
        assert_eq!(exp_det(0.0), 1.0);
        assert_eq!(exp_det(-28.01), 0.0);
        assert_eq!(exp_det(f32::NEG_INFINITY), 0.0);
        // Below the cutoff the integer weight would be 0 anyway.
        assert_eq!(((-28.0f64).exp() * (1u64 << 40) as f64) as u64, 0);
        assert!((exp_det(-27.7) * WEIGHT_SCALE) as u64 >= 1);
    }

    /// With min-p off a key's integer weight is zero exactly below one cut: the set of f32 `x`
    /// with `trunc(exp_det(x) · 2^40) >= 1` is an up-set. The device sampler's candidate lists
    /// (`sample_topk_block` in kernels/cuda/sample.cu) rely on it: the keys of nonzero weight are
    /// the largest ones. Every f32 in [-28, -26] is checked here (the cut lies at -27.725886);
    /// above -26, exp(x) > 5.6 · 2^-40 and the error bound above keeps exp_det over 2^-40. (A scan
    /// of every f32 in [-28, 0] gave the same cut once; exp_det is not monotone to the last ulp
    /// elsewhere — 2,983 single-ulp steps down, near -0.25 for one — so a min-p cut inside the
    /// range could leave a hole, and min-p rows keep the histogram path.)
    #[test]
    fn weight_cut_is_monotone() {
        let weight = |x: f32| (exp_det(x) * WEIGHT_SCALE) as u64;
        let (lo, hi) = ((-28.0f32).to_bits(), (-26.0f32).to_bits());
        let mut first_nonzero = None;
        // Negative f32 bits decrease as the value grows: from -28 up to -26.
        for b in (hi..=lo).rev() {
            let x = f32::from_bits(b);
            match (weight(x) >= 1, first_nonzero) {
                (true, None) => first_nonzero = Some(x),
                (false, Some(f)) => panic!("weight 0 at {x:e}, above the first nonzero weight at {f:e}"),
                _ => {}
            }
        }
        let f = first_nonzero.expect("a nonzero weight below -26");
        assert!(f > -27.73 && f < -27.72, "the cut moved: {f:e}");
        assert!((-26.0f64).exp() > 5.6 / (1u64 << 40) as f64);
    }

    #[test]
    fn keys_order_like_values() {
        let mut finite: Vec<u16> = (0..=u16::MAX).filter(|&b| key_of(b).is_some()).collect();
        finite.sort_by(|&a, &b| {
            let (x, y) = (f32::from_bits((a as u32) << 16), f32::from_bits((b as u32) << 16));
            x.partial_cmp(&y).unwrap()
        });
        for w in finite.windows(2) {
            let (ka, kb) = (key_of(w[0]).unwrap(), key_of(w[1]).unwrap());
            let (x, y) = (f32::from_bits((w[0] as u32) << 16), f32::from_bits((w[1] as u32) << 16));
            if x == y {
                assert_eq!(ka, kb); // -0 and +0
            } else {
                assert!(ka < kb, "{x} {y}");
            }
            assert_eq!(value_of_key(ka), x.abs().copysign(if x == 0.0 { 1.0 } else { x }));
        }
        assert_eq!(key_of(0x7f80), None); // +inf
        assert_eq!(key_of(0xff80), None); // -inf
        assert_eq!(key_of(0x7fc0), None); // NaN
    }

    #[test]
    fn greedy_is_argmax_lowest_index_on_ties() {
        let g = SamplingParams::greedy();
        assert_eq!(sample(&bits(&LOGITS), &g, 0).unwrap(), 1); // 2.5 at 1 and 3: lowest index
        assert_eq!(sample(&bits(&[0.0, -1.0, 7.0, f32::NAN]), &g, 5).unwrap(), 2);
        assert_eq!(sample(&bits(&[0.0, f32::INFINITY, -1.0]), &g, 5).unwrap(), 0);
        // Below the greedy epsilon counts as greedy, and so does a NaN temperature.
        assert_eq!(sample(&bits(&LOGITS), &params(1e-6, 0, 1.0, 0.0, 9), 3).unwrap(), 1);
        assert_eq!(sample(&bits(&LOGITS), &params(f32::NAN, 0, 1.0, 0.0, 9), 3).unwrap(), 1);
    }

    #[test]
    fn a_row_without_finite_logits_is_an_error_in_every_mode() {
        let row = bits(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
        for p in [SamplingParams::greedy(), params(1.0, 0, 1.0, 0.0, 1), params(0.7, 20, 0.95, 0.05, 1)] {
            let e = sample(&row, &p, 0).unwrap_err().to_string();
            assert!(e.contains("NaN"), "{e}");
        }
    }

    #[test]
    fn draw_bits_are_seeded() {
        let mut seen = std::collections::HashSet::new();
        for s in 0..50u64 {
            for step in 0..50u64 {
                seen.insert(draw_bits(s, step));
            }
        }
        assert_eq!(seen.len(), 2500);
        assert_eq!(draw_bits(7, 11), draw_bits(7, 11));
        // Pinned value so that the CUDA port checks itself against the same number.
        assert_eq!(draw_bits(7, 11), mix64(mix64(7u64.wrapping_add(GAMMA)) ^ 12u64.wrapping_mul(GAMMA)));
        assert_eq!(draw_target(u64::MAX, 10), 9);
        assert_eq!(draw_target(0, 10), 0);
        assert_eq!(draw_target(1 << 63, 10), 5);
    }

    #[test]
    fn a_seed_reproduces_and_seeds_differ() {
        let b = bits(&LOGITS);
        let p = params(1.0, 0, 1.0, 0.0, 1234);
        let a: Vec<u32> = (0..200).map(|s| sample(&b, &p, s).unwrap()).collect();
        let again: Vec<u32> = (0..200).map(|s| sample(&b, &p, s).unwrap()).collect();
        assert_eq!(a, again);
        let q = params(1.0, 0, 1.0, 0.0, 1235);
        let c: Vec<u32> = (0..200).map(|s| sample(&b, &q, s).unwrap()).collect();
        assert_ne!(a, c);
    }

    #[test]
    fn top_k_1_and_tiny_top_p_are_greedy() {
        let l = bits(&[0.1, 3.0, 2.875, -1.0, 2.9375]);
        for step in 0..500 {
            assert_eq!(sample(&l, &params(1.5, 1, 1.0, 0.0, 3), step).unwrap(), 1);
            assert_eq!(sample(&l, &params(1.5, 0, 1e-6, 0.0, 3), step).unwrap(), 1);
        }
    }

    #[test]
    fn min_p_drops_rows_below_fraction_of_max_prob() {
        // probs ∝ exp(l): ratios to max are 1, e^-1 ≈ 0.368, e^-2 ≈ 0.135, e^-3 ≈ 0.050.
        let l = [0.0f32, -1.0, -2.0, -3.0];
        let c = counts(&l, &params(1.0, 0, 1.0, 0.2, 77), 20_000);
        assert_eq!(c[2], 0);
        assert_eq!(c[3], 0);
        let s = 1.0 + (-1.0f64).exp();
        // df = 1; 10.83 is the p = 0.001 critical value.
        assert!(chi2(&c, &[1.0 / s, (-1.0f64).exp() / s, 0.0, 0.0], 20_000) < 10.83);
        // min_p = 0.1 keeps the row at 0.135.
        let c = counts(&l, &params(1.0, 0, 1.0, 0.1, 77), 20_000);
        assert!(c[2] > 0 && c[3] == 0);
    }

    #[test]
    fn empirical_distribution_matches_softmax_over_temperature() {
        // Fixed seed, N = 200,000 draws, 8 categories (df = 7). The p = 0.001 critical value of
        // chi-square(7) is 24.32: a correct sampler fails this with probability 0.1% for a random
        // seed; with the fixed seed the outcome is deterministic.
        let n = 200_000;
        for &t in &[0.7f32, 1.0, 1.8] {
            let c = counts(&LOGITS, &params(t, 0, 1.0, 0.0, 42), n);
            let x = chi2(&c, &softmax(&LOGITS, t), n);
            assert!(x < 24.32, "T={t}: chi2 = {x}");
        }
    }

    #[test]
    fn top_k_and_top_p_renormalise_the_kept_set() {
        let n = 100_000;
        // top_k = 3 keeps {1, 3} (2.5, tied) and 6 (1.75).
        let c = counts(&LOGITS, &params(1.0, 3, 1.0, 0.0, 5), n);
        let mut probs = softmax(&LOGITS, 1.0);
        for (i, pr) in probs.iter_mut().enumerate() {
            if ![1, 3, 6].contains(&i) {
                *pr = 0.0;
            }
        }
        let s: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= s);
        // df = 2; p = 0.001 critical value 13.82.
        assert!(chi2(&c, &probs, n) < 13.82);

        // Ties at the k-th value are kept: top_k = 1 with a tie keeps both.
        let c = counts(&LOGITS, &params(1.0, 1, 1.0, 0.0, 5), 2000);
        assert!(c[1] > 0 && c[3] > 0 && c[1] + c[3] == 2000);

        // Relative weights 1 : 0.5 : 0.25 (logits 0, -ln 2, -2 ln 2 are not bf16-exact, so use
        // powers of two at T = 1/ln 2: x = v · ln 2).
        let t = 1.0 / std::f32::consts::LN_2;
        let l = [0.0f32, -1.0, -2.0];
        // Probabilities 4/7, 2/7, 1/7. top_p = 4/7 exactly: mass above rank 2 is 4/7, not < p.
        let c = counts(&l, &params(t, 0, 0.571, 0.0, 5), 2000);
        assert_eq!(c, vec![2000, 0, 0]);
        // top_p = 0.6 keeps ranks 1 and 2 in ratio 2:1.
        let c = counts(&l, &params(t, 0, 0.6, 0.0, 5), n);
        assert_eq!(c[2], 0);
        // df = 1; 10.83 at p = 0.001.
        assert!(chi2(&c, &[2.0 / 3.0, 1.0 / 3.0, 0.0], n) < 10.83);
        // Ties are kept or dropped together: [a, a, b] with top_p small keeps both a's.
        let c = counts(&[1.0, 1.0, 0.0], &params(1.0, 0, 0.1, 0.0, 5), 2000);
        assert!(c[0] > 0 && c[1] > 0 && c[2] == 0);
    }

    #[test]
    fn far_tail_has_zero_weight() {
        // 30 nats below the max at T = 1: weight 0, never drawn.
        let l = [0.0f32, -30.0];
        let c = counts(&l, &params(1.0, 0, 1.0, 0.0, 5), 5000);
        assert_eq!(c[1], 0);
        // At T = 2 the same gap is 15 nats: drawable (weight ≈ 3e-7 · 2^40).
        let b = bits(&l);
        assert!(Prepared::new(&params(2.0, 0, 1.0, 0.0, 5)).weight(key_of(b[1]).unwrap(), 0.0) > 0);
    }

    #[test]
    fn non_finite_logits_are_skipped() {
        let l = bits(&[f32::NAN, 1.0, f32::INFINITY, 0.5]);
        for step in 0..1000 {
            let t = sample(&l, &params(1.0, 0, 0.9, 0.0, 2), step).unwrap();
            assert!(t == 1 || t == 3);
        }
    }

    /// The integer formulation agrees with a float formulation of the same rules (f64 weights,
    /// sort-based top-k / top-p) on which tokens are kept, for random rows and parameters.
    #[test]
    fn kept_set_matches_a_float_formulation() {
        let mut rng = 0x1234_5678u64;
        let mut next = || {
            rng = mix64(rng.wrapping_add(GAMMA));
            rng
        };
        for case in 0..300 {
            let n = 1 + (next() % 300) as usize;
            let spread = [0.5f32, 3.0, 12.0][case % 3];
            let l: Vec<f32> = (0..n)
                .map(|_| {
                    let u = (next() >> 40) as f32 / (1u64 << 24) as f32;
                    half::bf16::from_f32((u - 0.5) * 2.0 * spread).to_f32()
                })
                .collect();
            let t = [0.3f32, 0.7, 1.0, 1.6][case % 4];
            let k = [0usize, 1, 5, 20, 1000][case % 5];
            let top_p = [1.0f32, 0.95, 0.5, 0.8][(case / 5) % 4];
            let min_p = [0.0f32, 0.05][(case / 20) % 2];
            let p = params(t, k, top_p, min_p, case as u64);
            // Float formulation of the same kept set.
            let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let w: Vec<f64> = l.iter().map(|&v| (((v - m) * (1.0 / t)) as f64).exp()).collect();
            let mut order: Vec<usize> = (0..n).filter(|&i| w[i] >= min_p as f64 && w[i] > 2e-12).collect();
            order.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).unwrap().then(a.cmp(&b)));
            if k > 0 && k < order.len() {
                let kth = l[order[k - 1]];
                order.retain(|&i| l[i] >= kth);
            }
            if top_p < 1.0 {
                let total: f64 = order.iter().map(|&i| w[i]).sum();
                let mut above = 0.0;
                let mut keep = Vec::new();
                let mut r = 0;
                while r < order.len() {
                    let v = l[order[r]];
                    let group: Vec<usize> = order[r..].iter().copied().take_while(|&i| l[i] == v).collect();
                    if !keep.is_empty() && above >= top_p as f64 * total {
                        break;
                    }
                    above += group.iter().map(|&i| w[i]).sum::<f64>();
                    r += group.len();
                    keep.extend(group);
                }
                order = keep;
            }
            let total: f64 = order.iter().map(|&i| w[i]).sum();
            let kept: std::collections::HashSet<usize> = order.iter().copied().collect();
            let b = bits(&l);
            let mut drawn = std::collections::HashSet::new();
            for step in 0..400 {
                let got = sample(&b, &p, step).unwrap() as usize;
                // A float-formulation boundary within rounding of the integer one could differ;
                // with these bf16 inputs it never does, so any difference is a bug.
                assert!(
                    kept.contains(&got),
                    "case {case}: drew {got}, not in the kept set {kept:?} (row {l:?}, {p:?})"
                );
                drawn.insert(got);
            }
            // And nothing kept is left out: every kept token of renormalised probability >= 5%
            // is drawn in 400 draws (each missed with probability <= 0.95^400 ≈ 1e-9; the draws
            // are seeded, so this is a fixed check, not a flaky one).
            for &i in &order {
                assert!(
                    w[i] / total < 0.05 || drawn.contains(&i),
                    "case {case}: kept token {i} (p {:.3}) never drawn: the sampler keeps too few (row {l:?}, {p:?})",
                    w[i] / total
                );
            }
        }
    }

    fn pen(presence: f32, frequency: f32, repetition: f32) -> PreparedPenalties {
        PreparedPenalties::new(&Penalties { presence, frequency, repetition })
    }

    fn tok(id: u32, count: u32, prompt: bool) -> PenaltyToken {
        PenaltyToken { id, tag: count | if prompt { PenaltyToken::PROMPT } else { 0 } }
    }

    fn bf(v: f32) -> u16 {
        half::bf16::from_f32(v).to_bits()
    }

    /// vLLM's order on exactly representable values (every step exact in f32, so the result is
    /// the f64 formula rounded to bf16 once): repetition on a seen token (divided when positive,
    /// multiplied when not), frequency times the output count, presence once for an output token,
    /// nothing but repetition for a prompt-only token; NaN and infinities untouched.
    #[test]
    fn penalize_follows_vllms_order() {
        let p = pen(1.5, 0.25, 2.0);
        // (logit, count, in prompt, expected)
        let cases = [
            (3.0f32, 0, true, 1.5f32), // prompt only: 3 / 2
            (-3.0, 0, true, -6.0),     // prompt only, negative: -3 * 2
            (0.0, 0, true, 0.0),       // zero is "not positive": 0 * 2
            (3.0, 1, false, -0.25),    // 3 / 2 - 0.25 - 1.5
            (3.0, 4, true, -1.0),      // 3 / 2 - 1 - 1.5
            (-1.0, 2, false, -4.0),    // -1 * 2 - 0.5 - 1.5
            (8.0, 0, false, 8.0),      // neither in the prompt nor generated: untouched
        ];
        for (v, c, pr, want) in cases {
            assert_eq!(penalize(bf(v), tok(0, c, pr), &p), bf(want), "logit {v}, count {c}, prompt {pr}");
        }
        for special in [0x7fc0u16, 0x7f80, 0xff80] {
            assert_eq!(penalize(special, tok(0, 3, true), &p), special);
        }
        // Repetition 1 scales nothing; presence and frequency never touch a prompt-only token.
        assert_eq!(penalize(bf(3.0), tok(0, 0, true), &pen(2.0, 2.0, 1.0)), bf(3.0));
        assert_eq!(penalize(bf(3.0), tok(0, 2, false), &pen(-2.0, -1.0, 1.0)), bf(7.0));
    }

    /// Inexact penalties: one f32 rounding per step, then bf16 — within half a bf16 ulp (plus
    /// the f32 steps' error) of the f64 formula, checked over many logits.
    #[test]
    fn penalize_rounds_once_to_bf16() {
        let p = pen(0.3, 0.7, 1.3);
        let mut rng = 12345u64;
        for _ in 0..10_000 {
            rng = mix64(rng);
            let v = half::bf16::from_bits((rng >> 16) as u16 & 0x7fff | ((rng & 1) as u16) << 15).to_f32();
            if !v.is_finite() || v.abs() > 1e30 || (v != 0.0 && v.abs() < 1e-30) {
                continue;
            }
            let count = (rng >> 40) as u32 % 5;
            let (f, pr) = (0.7f32 as f64, 0.3f32 as f64);
            let mut x = v as f64;
            x = if x > 0.0 { x * (1.0f32 / 1.3f32) as f64 } else { x * 1.3f32 as f64 };
            x -= f * count as f64;
            if count > 0 {
                x -= pr;
            }
            let got = half::bf16::from_bits(penalize(bf(v), tok(0, count, true), &p)).to_f32() as f64;
            let ulp = 2f64.powi(x.abs().log2().floor() as i32 - 7);
            assert!((got - x).abs() <= 0.5 * ulp + x.abs() * 1e-6, "v {v}, count {count}: {got} vs {x}");
        }
    }

    /// The state the engine keeps: the prompt's distinct ids only with a repetition penalty,
    /// outputs counted, ascending by id; the row edit skips ids past the row.
    #[test]
    fn penalty_state_tracks_prompt_and_output() {
        let on = Penalties { presence: 1.0, frequency: 0.0, repetition: 1.2 };
        let mut st = PenaltyState::new(on, &[9, 3, 9, 5]);
        assert_eq!(st.tokens, vec![tok(3, 0, true), tok(5, 0, true), tok(9, 0, true)]);
        for t in [5, 7, 5, 1, 12] {
            st.add_output(t);
        }
        assert_eq!(
            st.tokens,
            vec![
                tok(1, 1, false),
                tok(3, 0, true),
                tok(5, 2, true),
                tok(7, 1, false),
                tok(9, 0, true),
                tok(12, 1, false)
            ]
        );
        let off = PenaltyState::new(Penalties { repetition: 1.0, ..on }, &[9, 3]);
        assert!(off.tokens.is_empty(), "without repetition the prompt is not looked at");
        st.tokens.push(tok(40, 1, false)); // an id past the row
        let mut row = vec![bf(2.0); 10];
        apply_penalties(&mut row, &st);
        // A seen token: 2 · f32(1 / 1.2) in f32; an output token then minus the presence 1.
        let scaled = 2.0f32 * (1.0f32 / 1.2f32);
        let want: Vec<u16> = (0..10)
            .map(|i| match i {
                1 | 5 | 7 => bf(scaled - 1.0),
                3 | 9 => bf(scaled),
                _ => bf(2.0),
            })
            .collect();
        assert_eq!(row, want);
    }

    /// Greedy with a presence penalty moves off a token the request already generated.
    #[test]
    fn a_presence_penalty_changes_the_greedy_pick() {
        let mut st = PenaltyState::new(Penalties { presence: 1.5, ..Penalties::NONE }, &[]);
        let mut row = bits(&[1.0, 3.0, 2.0, 0.5]);
        assert_eq!(argmax(&row).unwrap(), 1);
        st.add_output(1);
        apply_penalties(&mut row, &st);
        assert_eq!(argmax(&row).unwrap(), 2);
    }
}
