//! Log-probabilities of output tokens (`logprobs` / `top_logprobs`).
//!
//! What is reported is vLLM's default (`logprobs_mode = "raw_logprobs"`): the log-softmax of the
//! model's own logits over the candidate ids (the tokenizer's; the lm_head's padding rows are not
//! candidates), before penalties, temperature and truncation — the distribution the model gives,
//! not the one the sampler drew from. For a candidate row `x` (bf16 values):
//!
//! ```text
//! m = max_j x_j          lse = m + ln Σ_j exp(x_j − m)          logprob(t) = x_t − lse
//! ```
//!
//! summed in f64 (the row is 248,077 values for Ornith), reported as f32. A token whose logit is
//! −∞ (or NaN) has probability 0 and is reported as [`LOGPROB_FLOOR`] (JSON has no infinity;
//! OpenAI's API uses the same value). Both backends compute this on the host from the row the
//! sampler saw before penalties (the CUDA backend copies the rows that ask for it off the device),
//! so the figures come from the same function everywhere.

use crate::sampling::key_of;

/// Most `top_logprobs` a request may ask for (vLLM's default `max_logprobs`, OpenAI's chat limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The log-probability reported for a token the model gives probability zero.
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// One output token's log-probability and the most likely candidates at its step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The token the sequence output (a forced token's too: its probability under the model).
    pub token: u32,
    pub logprob: f32,
    /// The `top` most likely ids with theirs, most likely first (equal logits: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// [`TokenLogprobs`] of `token` and the `top` most likely ids, from a row of bf16 logits (bits)
/// holding only the candidate ids.
pub fn token_logprobs(row: &[u16], token: u32, top: usize) -> TokenLogprobs {
    let value = |b: u16| half::bf16::from_bits(b).to_f32();
    let finite = |b: u16| key_of(b).is_some();
    let m = row.iter().filter(|&&b| finite(b)).map(|&b| value(b)).fold(f32::NEG_INFINITY, f32::max);
    let lse = if m.is_finite() {
        let s: f64 = row.iter().filter(|&&b| finite(b)).map(|&b| ((value(b) - m) as f64).exp()).sum();
        m as f64 + s.ln()
    } else {
        f64::INFINITY // no finite logit: every token has probability zero
    };
    let lp = |b: u16| {
        if !finite(b) || !lse.is_finite() {
            return LOGPROB_FLOOR;
        }
        ((value(b) as f64 - lse) as f32).max(LOGPROB_FLOOR)
    };
    let logprob = row.get(token as usize).map_or(LOGPROB_FLOOR, |&b| lp(b));
    // The `top` largest finite logits, kept sorted (larger first, then lower id); one pass.
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &b) in row.iter().enumerate() {
            if !finite(b) {
                continue;
            }
            let v = value(b);
            if best.len() == top && v <= best[top - 1].1 {
                continue;
            }
            let at = best.partition_point(|&(_, w)| w >= v);
            best.insert(at, (i as u32, v));
            best.truncate(top);
        }
    }
    let top = best.into_iter().map(|(i, _)| (i, lp(row[i as usize]))).collect();
    TokenLogprobs { token, logprob, top }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn bits(v: &[f32]) -> Vec<u16> {
        v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect()
    }

    /// The textbook log-sum-exp of the bf16 row in f64, for comparison.
    fn lse(v: &[f32]) -> f64 {
        let v: Vec<f64> = v.iter().map(|&x| bf16::from_f32(x).to_f32() as f64).collect();
        let m = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        m + v.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
    }

    #[test]
    fn logprobs_match_the_formula_and_sum_to_one() {
        // A long row with a spread of values, as an lm_head row.
        let mut z = 12345u64;
        let v: Vec<f32> = (0..50_000)
            .map(|_| {
                z = crate::sampling::mix64(z);
                ((z >> 11) as f64 / (1u64 << 53) as f64 * 40.0 - 25.0) as f32
            })
            .collect();
        let row = bits(&v);
        let l = lse(&v);
        for t in [0usize, 5, 7, 49_999] {
            let r = token_logprobs(&row, t as u32, 0);
            let want = row_value(&row, t) as f64 - l;
            assert!((r.logprob as f64 - want).abs() < 1e-5, "{t}: {} vs {want}", r.logprob);
            assert!(r.top.is_empty());
        }
        // The reported probabilities of every candidate of a 2,000-logit row sum to one (each
        // call computes its row's log-sum-exp: 2,000 calls).
        let short = &row[..2000];
        let one: f64 = (0..short.len()).map(|t| (token_logprobs(short, t as u32, 0).logprob as f64).exp()).sum();
        assert!((one - 1.0).abs() < 1e-4, "{one}");
        let r = token_logprobs(&row, 3, MAX_TOP_LOGPROBS);
        assert_eq!(r.top.len(), MAX_TOP_LOGPROBS);
        // The top ids are the largest logits, in order.
        let mut order: Vec<usize> = (0..v.len()).collect();
        order.sort_by(|&a, &b| row_value(&row, b).total_cmp(&row_value(&row, a)).then(a.cmp(&b)));
        let want: Vec<u32> = order[..MAX_TOP_LOGPROBS].iter().map(|&i| i as u32).collect();
        assert_eq!(r.top.iter().map(|x| x.0).collect::<Vec<_>>(), want);
        for w in r.top.windows(2) {
            assert!(w[0].1 >= w[1].1);
        }
        assert_eq!(r.top[0].1, token_logprobs(&row, want[0], 0).logprob);
    }

    fn row_value(row: &[u16], i: usize) -> f32 {
        bf16::from_bits(row[i]).to_f32()
    }

    #[test]
    fn ties_masked_and_empty_rows() {
        let row = bits(&[1.0, 3.0, f32::NEG_INFINITY, 3.0, f32::NAN, 0.5]);
        let r = token_logprobs(&row, 2, 3);
        assert_eq!(r.logprob, LOGPROB_FLOOR, "a -inf logit has probability zero");
        assert_eq!(r.top.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 3, 0], "equal logits: lower id first");
        assert_eq!(r.top[0].1, r.top[1].1);
        assert_eq!(token_logprobs(&row, 4, 0).logprob, LOGPROB_FLOOR, "NaN");
        assert!(
            (token_logprobs(&row, 1, 0).logprob as f64 - (3.0 - (2.0 * 3f64.exp() + 1f64.exp() + 0.5f64.exp()).ln()))
                .abs()
                < 1e-6
        );
        // More asked than finite candidates; an id past the row.
        assert_eq!(token_logprobs(&row, 9, 10).top.len(), 4);
        assert_eq!(token_logprobs(&row, 9, 0).logprob, LOGPROB_FLOOR);
        let dead = bits(&[f32::NEG_INFINITY; 3]);
        let r = token_logprobs(&dead, 0, 2);
        assert_eq!((r.logprob, r.top.len()), (LOGPROB_FLOOR, 0));
    }
}
