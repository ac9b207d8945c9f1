//! FP8 E4M3 (OCP `e4m3fn`: bias 7, no infinities, NaN = S.1111.111, max ±448) — the element
//! type of compressed-tensors `float-quantized` weights and activations.
//!
//! Encoding is round-to-nearest-even and saturating, as `torch.clamp(x, -448, 448).to(float8_e4m3fn)`
//! does in compressed-tensors. Values below the smallest normal (2^-6) are subnormals
//! `m · 2^-9`, m = 1..7.

use half::bf16;

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Encodes one f32 as E4M3 bits: saturating to ±448, round-to-nearest-even, NaN → 0x7F.
pub fn e4m3_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    // Subnormal range (and zero): code = round(a / 2^-9). A result of 8 is exactly the smallest
    // normal 2^-6, whose code is also 8 (exponent field 1, mantissa 0).
    if a < 0.015625 {
        let q = (a * 512.0).round_ties_even() as u8;
        return sign | q;
    }
    // Normal: a = 2^e · (1 + m / 2^23), e in [-6, 8]; the 3-bit mantissa is m / 2^20 rounded to
    // nearest even, in integers (m + 2^19 - 1 + the kept lowest bit, shifted): the value the
    // float form `round_ties_even((a / 2^e - 1) · 8)` gives, without its libm calls (`powi`,
    // `rintf`: 32% of a synthetic checkpoint's generation time). A carry out of the mantissa
    // (q = 8) moves to the next exponent, as the bits' addition does by itself. Saturation above
    // guarantees e <= 8, and q <= 6 when e == 8 (448 = 1.75 · 2^8).
    let bits = a.to_bits();
    let (e, m) = ((bits >> 23) as i32 - 127, bits & 0x7F_FFFF);
    let q = (m + 0x7_FFFF + ((m >> 20) & 1)) >> 20; // 0..=8
    sign | ((((e + 7) as u32) << 3) + q) as u8
}

/// Decodes E4M3 bits to f32 (exact).
pub fn e4m3_to_f32(b: u8) -> f32 {
    E4M3_TABLE[b as usize]
}

/// All 256 E4M3 codes decoded.
pub static E4M3_TABLE: [f32; 256] = build_table();

const fn build_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        let b = i as u8;
        let exp = ((b >> 3) & 0x0F) as i32;
        let man = (b & 0x07) as i32;
        let mag = if exp == 0x0F && man == 0x07 {
            f32::NAN
        } else if exp == 0 {
            man as f32 / 512.0
        } else {
            // (8 + man) / 8 · 2^(exp - 7)
            let mut v = (8 + man) as f32 / 8.0;
            let mut k = exp - 7;
            while k > 0 {
                v *= 2.0;
                k -= 1;
            }
            while k < 0 {
                v /= 2.0;
                k += 1;
            }
            v
        };
        t[i] = if b & 0x80 != 0 { -mag } else { mag };
        i += 1;
    }
    t
}

/// Quantises one output channel (row) of a weight the compressed-tensors way for static
/// per-channel FP8: `scale = bf16(amax / 448)`, `q = e4m3(clamp(w / scale))`. Returns the scale.
/// An all-zero row gets scale 1 (compressed-tensors clamps the scale away from zero).
pub fn quantize_weight_row(row: &[f32], out: &mut [u8]) -> bf16 {
    assert_eq!(row.len(), out.len());
    let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = if amax > 0.0 { bf16::from_f32(amax / E4M3_MAX) } else { bf16::ONE };
    let s = scale.to_f32();
    for (o, &w) in out.iter_mut().zip(row) {
        *o = e4m3_from_f32(w / s);
    }
    scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                assert_eq!(b & 0x7F, 0x7F);
                continue;
            }
            let back = e4m3_from_f32(v);
            // +0 and -0 are distinct codes and both round-trip.
            assert_eq!(back, b, "code {b:#04x} value {v}");
        }
    }

    #[test]
    fn saturates_and_rounds_to_nearest_even() {
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1e9)), 448.0);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(-500.0)), -448.0);
        // 1.0625 is halfway between 1.0 and 1.125: ties to even mantissa (1.0).
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.0625)), 1.0);
        // 1.1875 is halfway between 1.125 (odd) and 1.25 (even).
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.1875)), 1.25);
        // Subnormals: 2^-9 is the smallest; half of it ties to zero (even).
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.0 / 512.0)), 1.0 / 512.0);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.0 / 1024.0)), 0.0);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(3.0 / 1024.0)), 2.0 / 512.0);
        // Largest subnormal rounds up into the smallest normal.
        assert_eq!(e4m3_to_f32(e4m3_from_f32(7.6 / 512.0)), 8.0 / 512.0);
        assert!(e4m3_to_f32(e4m3_from_f32(f32::NAN)).is_nan());
    }

    /// The float form the integer rounding replaced (the encoder until the thirty-seventh session).
    fn e4m3_from_f32_float_form(x: f32) -> u8 {
        if x.is_nan() {
            return 0x7F;
        }
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let a = x.abs().min(E4M3_MAX);
        if a < 0.015625 {
            return sign | (a * 512.0).round_ties_even() as u8;
        }
        let e = (a.to_bits() >> 23) as i32 - 127;
        let frac = a / f32::powi(2.0, e) - 1.0;
        let mut q = (frac * 8.0).round_ties_even() as i32;
        let mut e = e;
        if q == 8 {
            q = 0;
            e += 1;
        }
        sign | (((e + 7) as u8) << 3) | q as u8
    }

    /// The integer mantissa rounding gives the float form's code on `f32_sweep` around every
    /// E4M3 value, the saturation bound and the smallest normal. (Checked over all 2^32 patterns
    /// once, when it was written.)
    #[test]
    fn integer_rounding_equals_the_float_form() {
        let mut points: Vec<f32> = (0..=255u8).map(e4m3_to_f32).filter(|v| v.is_finite()).collect();
        points.extend([E4M3_MAX * 1.0625, 0.015625]);
        crate::sweep::f32_sweep(&points, |b| {
            let x = f32::from_bits(b);
            assert_eq!(e4m3_from_f32(x), e4m3_from_f32_float_form(x), "x = {x:e} ({b:#010x})");
        });
    }

    #[test]
    fn nearest_value_everywhere() {
        // Brute force: the encoder picks a nearest representable value for a dense sweep.
        let finite: Vec<f32> = (0..=255u8).map(e4m3_to_f32).filter(|v| v.is_finite()).collect();
        let mut x = -460.0f32;
        while x < 460.0 {
            let got = e4m3_to_f32(e4m3_from_f32(x));
            let c = x.clamp(-448.0, 448.0);
            let best = finite.iter().map(|v| (v - c).abs()).fold(f32::INFINITY, f32::min);
            assert!(((got - c).abs() - best).abs() <= f32::EPSILON * c.abs(), "x={x} got={got}");
            x += 0.0137;
        }
    }
}
