//! NVFP4 (compressed-tensors `nvfp4-pack-quantized`, the NVFP4A16 scheme): the weight codec.
//!
//! Stored per Linear `[out, in]` (checked against compressed-tensors 0.19's
//! `NVFP4PackedCompressor` and llm-compressor 0.14's output, tests/fixtures/micro-nvfp4.json):
//! * `weight_packed` U8 `[out, in/2]`: E2M1 codes (bit 3 sign, bits 0–2 index into
//!   0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte, column `2j` in the **low** nibble and `2j+1` in
//!   the high nibble (`pack_fp4_to_uint8`: `indices[:, 0] | indices[:, 1] << 4`);
//! * `weight_scale` F8_E4M3 `[out, in/16]`: one scale per 16 consecutive weights of a row;
//! * `weight_global_scale` F32 `[1]`.
//!
//! Dequantisation, exactly as compressed-tensors' decompressor computes it
//! (`_dequantize`: `scale = scale / global_scale`, then `x_q.to(scale.dtype) * scale`, then `.to(bf16)`):
//! `w[o, i] = bf16( e2m1(code[o, i]) · f32( f32(e4m3(scale[o, i/16])) / global_scale ) )` —
//! the group scale is **divided** by the global scale, in f32, and the product rounded once
//! to bf16 (round to nearest even). The E4M3 scale is widened exactly (E4M3 ⊂ BF16 ⊂ F32).

use crate::fp8::e4m3_to_f32;
use half::bf16;

/// Weights per group scale.
pub const GROUP: usize = 16;

/// The 16 E2M1 codes decoded (code 8 is -0.0).
pub const E2M1_TABLE: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// The effective scale of one group: `f32(e4m3(scale)) / global_scale` in f32.
#[inline]
pub fn group_scale(scale: u8, global_scale: f32) -> f32 {
    e4m3_to_f32(scale) / global_scale
}

/// The group scale of every E4M3 scale byte under one global scale: `table[b] =
/// group_scale(b, global_scale)` (one f32 division per byte, done once at load): the CUDA
/// backend's dequantisation tables (`cuda::nvfp4::fp4_table` in ornith-runtime) are built from it
/// and [`dequant`], so the kernels never divide or round.
pub fn scale_table(global_scale: f32) -> [f32; 256] {
    std::array::from_fn(|b| group_scale(b as u8, global_scale))
}

/// Code of column `i` of a packed row.
#[inline]
pub fn code(packed_row: &[u8], i: usize) -> u8 {
    (packed_row[i / 2] >> ((i & 1) * 4)) & 0x0F
}

/// One weight: `bf16(e2m1(code) · group_scale)`.
#[inline]
pub fn dequant(code: u8, group_scale: f32) -> bf16 {
    bf16::from_f32(E2M1_TABLE[code as usize] * group_scale)
}

/// Dequantises one row: `packed` `[in/2]`, `scales` `[in/16]` E4M3 bytes, into `out` `[in]`.
pub fn dequantize_row(packed: &[u8], scales: &[u8], global_scale: f32, out: &mut [bf16]) {
    let n = out.len();
    assert!(n.is_multiple_of(GROUP), "NVFP4 row of {n} weights is not a whole number of groups of {GROUP}");
    assert_eq!(packed.len(), n / 2, "NVFP4 packed row length");
    assert_eq!(scales.len(), n / GROUP, "NVFP4 scale row length");
    for (g, chunk) in out.chunks_exact_mut(GROUP).enumerate() {
        let s = group_scale(scales[g], global_scale);
        for (k, w) in chunk.iter_mut().enumerate() {
            *w = dequant(code(packed, g * GROUP + k), s);
        }
    }
}

/// Dequantises a whole `[rows, cols]` weight.
pub fn dequantize(packed: &[u8], scales: &[u8], global_scale: f32, rows: usize, cols: usize) -> Vec<bf16> {
    assert_eq!(packed.len(), rows * cols / 2, "NVFP4 packed size");
    assert_eq!(scales.len(), rows * cols / GROUP, "NVFP4 scale size");
    let mut out = vec![bf16::ZERO; rows * cols];
    for (r, row) in out.chunks_exact_mut(cols.max(1)).enumerate() {
        dequantize_row(
            &packed[r * cols / 2..][..cols / 2],
            &scales[r * cols / GROUP..][..cols / GROUP],
            global_scale,
            row,
        );
    }
    out
}

/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// Encodes one value as the nearest E2M1 code (ties to the even code; saturating at ±6;
/// NaN → 0). Sign kept for -0.0.
pub fn e2m1_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0;
    }
    let sign = if x.is_sign_negative() { 8u8 } else { 0 };
    let a = x.abs();
    // The midpoints between neighbouring magnitudes, a tie going to the even code (0.25 → 0,
    // 0.75 → 2, 1.25 → 2, 1.75 → 4, 2.5 → 4, 3.5 → 6, 5 → 6), each one passed adding one to the
    // code (no branch on the value: random weights mispredicted an if-chain at every step). The
    // same code as the search below, whose f32 distances are exact there (Sterbenz), for every
    // |x| < 2^20 (`e2m1_thresholds_equal_the_search`); beyond, the search's own rounding of the
    // distances decides, as it always did.
    let c = if a < 1_048_576.0 {
        (a > 0.25) as u8
            + (a >= 0.75) as u8
            + (a > 1.25) as u8
            + (a >= 1.75) as u8
            + (a > 2.5) as u8
            + (a >= 3.5) as u8
            + (a > 5.0) as u8
    } else {
        e2m1_search(a)
    };
    sign | c
}

/// The magnitude code nearest to `a` by a search of the table (f32 distances; on a tie the
/// even code): the encoder's definition, and its path for |x| ≥ 2^20.
fn e2m1_search(a: f32) -> u8 {
    let mut best = 0u8;
    for c in 1..8u8 {
        let (db, dc) = ((a - E2M1_TABLE[best as usize]).abs(), (a - E2M1_TABLE[c as usize]).abs());
        if dc < db || (dc == db && c % 2 == 0) {
            best = c;
        }
    }
    best
}

/// The global scale compressed-tensors derives from a tensor's largest magnitude:
/// `448 · 6 / amax` in f32 (so the largest group scale lands on E4M3's maximum).
pub fn global_scale_for(amax: f32) -> f32 {
    crate::fp8::E4M3_MAX * E2M1_MAX / amax
}

/// Quantises one row `[in]` with the given global scale the way compressed-tensors' NVFP4
/// observer does per group: `scale = e4m3(amax_group / 6 · global)`, codes
/// `e2m1(x / (e4m3(scale) / global))` (an all-zero group gets scale 0 and zero codes). Writes
/// `packed` `[in/2]` (even column in the low nibble) and `scales` `[in/16]`.
pub fn quantize_row(row: &[f32], global_scale: f32, packed: &mut [u8], scales: &mut [u8]) {
    let n = row.len();
    assert!(n.is_multiple_of(GROUP) && packed.len() == n / 2 && scales.len() == n / GROUP, "NVFP4 row shapes");
    packed.fill(0);
    for (g, chunk) in row.chunks_exact(GROUP).enumerate() {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        scales[g] = crate::fp8::e4m3_from_f32(amax / E2M1_MAX * global_scale);
        let s = group_scale(scales[g], global_scale);
        for (k, &x) in chunk.iter().enumerate() {
            let c = if s > 0.0 { e2m1_from_f32(x / s) } else { 0 };
            let i = g * GROUP + k;
            packed[i / 2] |= c << ((i & 1) * 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The midpoint thresholds give the search's code on `f32_sweep` around every magnitude and
    /// 2^20. (Checked over all 2^32 patterns once, when it was written.)
    #[test]
    fn e2m1_thresholds_equal_the_search() {
        let mut points = E2M1_TABLE[..8].to_vec();
        points.push(1_048_576.0);
        crate::sweep::f32_sweep(&points, |b| {
            let x = f32::from_bits(b);
            let want = if x.is_nan() { 0 } else { (if x.is_sign_negative() { 8 } else { 0 }) | e2m1_search(x.abs()) };
            assert_eq!(e2m1_from_f32(x), want, "x = {x:e} ({b:#010x})");
        });
    }

    /// compressed-tensors' `pack_fp4_to_uint8([[0.5, -6.0]])` is 0xF1 (tests/fixtures/micro-nvfp4.json,
    /// `nibbles`): 0.5 (code 1) in the low nibble, -6 (code 15) in the high one.
    #[test]
    fn first_column_is_the_low_nibble() {
        assert_eq!(E2M1_TABLE[code(&[0xF1], 0) as usize], 0.5);
        assert_eq!(E2M1_TABLE[code(&[0xF1], 1) as usize], -6.0);
    }

    #[test]
    fn scale_table_is_group_scale_of_every_byte() {
        // Values worked out by hand (E4M3: bias 7, 3 mantissa bits): 0x38 = 2^0 = 1, 0x7E = 448,
        // 0x01 = 2^-9 (the smallest subnormal), 0x00 = 0, 0x7F = NaN; divided by the global scale.
        let t = scale_table(4.0);
        assert_eq!((t[0x38], t[0x7E], t[0x01], t[0x00], t[0xB8]), (0.25, 112.0, 2f32.powi(-11), 0.0, -0.25));
        assert!(t[0x7F].is_nan() && t[0xFF].is_nan());
        for gs in [1.0f32, 2688.0, 0.37, 1e-3] {
            let t = scale_table(gs);
            for b in 0..=255u8 {
                let (got, want) = (t[b as usize], group_scale(b, gs));
                assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "byte {b} gs {gs}");
            }
        }
    }

    #[test]
    fn encoding_round_trips_every_code_and_rounds_to_nearest() {
        for c in 0..16u8 {
            assert_eq!(e2m1_from_f32(E2M1_TABLE[c as usize]), c, "code {c}");
        }
        assert_eq!(E2M1_TABLE[e2m1_from_f32(2.4) as usize], 2.0);
        assert_eq!(E2M1_TABLE[e2m1_from_f32(2.5) as usize], 2.0); // tie → even code (4)
        assert_eq!(E2M1_TABLE[e2m1_from_f32(-5.5) as usize], -6.0);
        assert_eq!(E2M1_TABLE[e2m1_from_f32(100.0) as usize], 6.0);
        // A quantised row dequantises to within half a step of each group's grid.
        let row: Vec<f32> = (0..32).map(|i| (i as f32 - 15.5) * 0.01).collect();
        let (mut p, mut s) = (vec![0u8; 16], vec![0u8; 2]);
        let g = global_scale_for(0.155);
        quantize_row(&row, g, &mut p, &mut s);
        let back = dequantize(&p, &s, g, 1, 32);
        for (x, w) in row.iter().zip(&back) {
            assert!((x - w.to_f32()).abs() <= 0.155 / 6.0 + 1e-6, "{x} -> {w}");
        }
    }

    /// The global scale divides: scale byte 0x38 is 1.0, global 4 gives a quarter.
    #[test]
    fn global_scale_divides_the_group_scale() {
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        let row = dequantize(&[0x77; 8], &[0x38], 4.0, 1, 16);
        assert!(row.iter().all(|w| w.to_f32() == 1.5), "{row:?}");
    }
}
