//! Test support for the encoders (`fp8`, `nvfp4`): the f32 inputs their fast forms are checked on
//! against the definitions they replaced.

/// Calls `check` with the bit pattern of every 61st f32 (both signs, NaNs, infinities,
/// subnormals) and of every pattern within 64 ulps, either sign, of each of `points` and of each
/// midpoint between neighbouring `points` (where the rounding ties are).
pub(crate) fn f32_sweep(points: &[f32], check: impl Fn(u32)) {
    (0..=u32::MAX).step_by(61).for_each(&check);
    let mut p: Vec<f32> = points.iter().map(|v| v.abs()).collect();
    p.sort_by(f32::total_cmp);
    let mids: Vec<f32> = p.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
    for v in p.iter().chain(&mids) {
        for d in -64i32..=64 {
            let b = (v.to_bits() as i32 + d).max(0) as u32;
            check(b);
            check(b | 0x8000_0000);
        }
    }
}
