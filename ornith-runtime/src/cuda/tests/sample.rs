//! The device argmax (sample.cu) against the CPU sampler.
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
