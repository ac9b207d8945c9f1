//! The device argmax and penalties (sample.cu) against the CPU sampler.
use super::*;

/// `argmax_bf16` = the CPU backend's greedy choice, `crate::sampling::argmax` (the largest finite
/// logit, the lowest index on ties; the data hold a NaN, +inf, -inf and a tie).
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
            l[6] = 0x7f80; // nor +inf
            l[8] = 0xff80; // nor -inf
            let m = l[..n].iter().map(|&b| f(b)).filter(|v| v.is_finite()).fold(f64::MIN, f64::max);
            let mb = bf16::from_f64(m).to_bits();
            l[n - 1] = mb; // a tie with a later index: the first one wins
        }
        let mut idx = c.upload(&vec![-7i32; tokens]).unwrap();
        c.argmax(&c.upload(&l).unwrap(), &mut idx, tokens, n, n).unwrap();
        let got = c.download(&idx).unwrap();
        for t in 0..tokens {
            let want = crate::sampling::argmax(&l[t * n..(t + 1) * n]).unwrap();
            assert_eq!(got[t], want as i32, "argmax row {t} of {n}");
        }
        if n == 248320 {
            let dl = c.upload(&l).unwrap();
            let s = time_it(&c, || c.argmax(&dl, &mut idx, 1, n, n).unwrap());
            eprintln!("PERF argmax over {n} bf16 logits: {:.2} us", s * 1e6);
        }
    }
}

/// `apply_penalties` = `crate::sampling::apply_penalties` (the CPU backend's edit) bit for bit,
/// on one row of three: inexact penalties of either sign, prompt-only, output-only and shared
/// tokens, counts up to 40, NaN and infinite logits at penalised ids (left as they are), ids past
/// the candidate columns (not uploaded), and the other rows and the padding columns untouched.
/// Then the lm_head's row of 248,320: the same, and the penalised row sampled on the device
/// (`sample_rows`, greedy `argmax`) gives the CPU sampler's ids.
#[test]
#[ignore]
fn apply_penalties_matches_reference() {
    use crate::engine::{Penalties, SamplingParams};
    use crate::sampling::{apply_penalties, PenaltyState};
    let c = ctx();
    let mut r = rng(29);
    for (n, stride, pen) in [
        (5000, 5008, Penalties { presence: 0.3, frequency: 0.7, repetition: 1.3 }),
        (5000, 5008, Penalties { presence: -1.1, frequency: -0.35, repetition: 0.77 }),
        (248_077, 248_320, Penalties { presence: 1.5, frequency: 0.0, repetition: 1.05 }),
    ] {
        let mut l = bfv(&mut r, 3 * stride, 4.0);
        let prompt: Vec<u32> = (0..600).map(|_| r.random_range(0..n as u32)).collect();
        let mut st = PenaltyState::new(pen, &prompt);
        for _ in 0..300 {
            // Repeats (counts above 1), some prompt ids, a few ids past the candidates.
            let id = match r.random_range(0..10) {
                0 => prompt[r.random_range(0..prompt.len())],
                1 => r.random_range(n as u32..stride as u32),
                2..=4 => r.random_range(0..40),
                _ => r.random_range(0..n as u32),
            };
            st.add_output(id);
        }
        let row = stride; // row 1
        for (k, special) in [0x7fc0u16, 0x7f80, 0xff80].into_iter().enumerate() {
            l[row + st.tokens[k].id as usize] = special;
        }
        let dl = c.upload(&l).unwrap();
        let mut s = super::super::sample::SampleScratch::new(&c, 3, n).unwrap();
        c.apply_penalties(&dl, stride, 1, n, &st, &mut s).unwrap();
        let got = c.download(&dl).unwrap();
        let mut want = l.clone();
        apply_penalties(&mut want[row..row + n], &st);
        assert!(want[row..row + n] != l[row..row + n], "the penalties changed nothing");
        for i in 0..3 * stride {
            assert_eq!(got[i], want[i], "n {n}, {pen:?}: element {i} (row {}, column {})", i / stride, i % stride);
        }
        // The penalised row through the device samplers.
        let greedy = SamplingParams::greedy();
        let sampled = SamplingParams { temperature: 0.9, top_k: 50, top_p: 0.9, min_p: 0.0, seed: 5 };
        let idx = c.upload(&[-7i32]).unwrap();
        c.k_argmax(c.addr(&dl) + 2 * row as u64, c.addr(&idx), 1, n, stride, None).unwrap();
        let dev = c.download(&idx).unwrap()[0];
        assert_eq!(dev, crate::sampling::sample(&want[row..row + n], &greedy, 0).unwrap() as i32, "argmax");
        for step in 0..8u64 {
            c.sample_rows(&dl, stride, n, &[(1, sampled, step)], &mut s).unwrap();
            let dev = c.sampled_ids(&s, 1).unwrap()[0];
            assert_eq!(dev, crate::sampling::sample(&want[row..row + n], &sampled, step).unwrap(), "step {step}");
        }
    }
}
