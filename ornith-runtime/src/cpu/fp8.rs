//! Dynamic per-token FP8 E4M3 activation quantisation, the compressed-tensors way.
//!
//! compressed-tensors 0.19 (`quantization/utils/helpers.py` `compute_dynamic_scales_and_zp` +
//! `calculate_qparams`, `quantization/lifecycle/forward_helpers.py` `_quantize`), for a bf16
//! activation row `x[0..N]` under `strategy: token, dynamic, symmetric, float 8 bit`:
//!
//! ```text
//! amax  = max(|min(x, 0)|, |max(x, 0)|)            exact (bf16 values)
//! scale = bf16(amax / 448)                          a bf16 division (torch: f32 divide, round to bf16)
//! scale = 2^-7 if scale == 0                        torch.finfo(bf16).eps: all-zero rows, and rows so
//!                                                   small that amax/448 underflows bf16
//! v_i   = bf16(x_i / scale) + 0.0                   a bf16 division; `+ zero_point` (0) turns -0 into +0
//! q_i   = e4m3(clamp(v_i, -448, 448))               round-to-nearest-even, saturating
//! ```
//!
//! Note the double rounding (x/scale is rounded to bf16 before E4M3): it changes codes near E4M3
//! rounding ties (see the test row `double_rounding`). A tiny negative `x_i` that is not -0 keeps
//! its sign and can give code 0x80 (-0). NaN in the row propagates to the scale (torch.amax
//! propagates NaN) and every code becomes 0x7F (NaN).
//!
//! The scale returned is the bf16 value widened to f32 (exact).

use super::check_len;
use half::bf16;
use model_spec::fp8::{e4m3_from_f32, e4m3_to_f32, E4M3_MAX};

/// bf16 machine epsilon 2^-7: compressed-tensors' replacement for a zero scale.
const BF16_EPS: f32 = 0.0078125;

/// Quantises one activation row to E4M3 codes (`q.len() == x.len()`); returns the per-token scale
/// `sx` such that `x ≈ sx · e4m3_to_f32(q)`. Semantics: see the module doc.
pub fn quantize_act_row(x: &[bf16], q: &mut [u8]) -> f32 {
    check_len("quantize_act_row q", q.len(), x.len());
    let mut amax = 0f32;
    let mut nan = false;
    for &v in x {
        let f = v.to_f32();
        nan |= f.is_nan();
        amax = amax.max(f.abs());
    }
    if nan {
        q.fill(0x7F);
        return f32::NAN;
    }
    let mut scale = bf16::from_f32(amax / E4M3_MAX).to_f32();
    if scale == 0.0 {
        scale = BF16_EPS;
    }
    for (o, &v) in q.iter_mut().zip(x) {
        // bf16 division, then `+ 0.0` (the zero point) which maps -0 to +0 and nothing else.
        let s = bf16::from_f32(v.to_f32() / scale).to_f32() + 0.0;
        *o = e4m3_from_f32(s.clamp(-E4M3_MAX, E4M3_MAX));
    }
    scale
}

/// Dequantises E4M3 codes with one scale: `out_i = e4m3(q_i) · scale` in f32. Exact for a bf16
/// scale (a 4-bit by 8-bit significand product fits f32), unless the product underflows.
/// (compressed-tensors' `dequantize` additionally rounds this product to the scale's dtype.)
pub fn dequantize_row(q: &[u8], scale: f32, out: &mut [f32]) {
    check_len("dequantize_row out", out.len(), q.len());
    for (o, &c) in out.iter_mut().zip(q) {
        *o = e4m3_to_f32(c) * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(row: &[f32]) -> (f32, Vec<u8>) {
        let x: Vec<bf16> = row.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut q = vec![0u8; x.len()];
        let s = quantize_act_row(&x, &mut q);
        (s, q)
    }

    // Expected scales and codes below were produced by compressed-tensors 0.19.0 (torch 2.11.0,
    // CPU) with this snippet; each row is a bf16 tensor of shape [1, 1, N]:
    //
    //   from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType
    //   from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    //   from compressed_tensors.quantization.lifecycle.forward import quantize
    //   args = QuantizationArgs(num_bits=8, type=QuantizationType.FLOAT, strategy=QuantizationStrategy.TOKEN,
    //                           symmetric=True, dynamic=True, observer=None)
    //   x = torch.tensor([[row]], dtype=torch.bfloat16)
    //   s, zp = compute_dynamic_scales_and_zp(x, args, None)
    //   print(s.item(), quantize(x, s, zp, args, dtype=torch.float8_e4m3fn).view(torch.uint8).tolist())
    #[test]
    fn matches_compressed_tensors_edge_cases() {
        let cases: &[(&str, Vec<f32>, f32, Vec<u8>)] = &[
            ("zeros", vec![0.0; 8], 0.0078125, vec![0; 8]),
            ("signed zeros", vec![-0.0, 0.0, -0.0, 0.0], 0.0078125, vec![0; 4]),
            (
                "saturation and exact codes",
                vec![1.0, -2.0, 3.0, 448.0, -448.0, 0.5, 0.25, 1e-3],
                1.0,
                vec![56, 192, 68, 126, 254, 48, 40, 1],
            ),
            (
                "tiny row (scale far below bf16 normal range of inputs)",
                vec![1e-30, 2e-30, -3e-30, 0.0, 0.0, 0.0, 0.0, 0.0],
                6.692_606_6e-33,
                vec![113, 121, 254, 0, 0, 0, 0, 0],
            ),
            (
                "outliers, E4M3 subnormals",
                vec![1000.0, 1e-3, -1e-3, 0.01, 1.0, 0.3, 2.5, -1000.0],
                2.234375,
                vec![126, 0, 128, 2, 46, 33, 57, 254],
            ),
            (
                "mixed with -0",
                vec![3.0, 0.005859375, 1.0 / 3.0, 0.1, -0.2, 7.0, -0.0, 2.9],
                0.015625,
                vec![116, 44, 91, 77, 213, 126, 0, 116],
            ),
            (
                "bf16 subnormal inputs (amax/448 underflows: eps scale)",
                vec![1e-39, -5e-40, 2e-40, 0.0],
                0.0078125,
                vec![0, 128, 0, 0],
            ),
            (
                "large outlier, subnormal codes",
                vec![448.0 * 64.0, 1.0, -1.0, 3.0, 0.7, 20.0, -0.0, 0.02],
                64.0,
                vec![126, 8, 136, 20, 6, 42, 0, 0],
            ),
            ("leading -0", vec![-0.0, -1.0, 2.0], 0.004_455_566_4, vec![0, 246, 126]),
            ("huge values", vec![3e38, -1e38, 1.0], 6.698_063e35, vec![126, 241, 0]),
            (
                // Found by search: index 10 gives 240 here; a single f32 rounding of x/scale gives 241.
                "double_rounding",
                vec![
                    -2.65625,
                    -1.2578125,
                    -2.421875,
                    1.6953125,
                    1.828125,
                    1.3984375,
                    5.84375,
                    -3.1875,
                    -0.232_421_88,
                    0.349_609_38,
                    -1.78125,
                    -3.734375,
                    -0.306_640_63,
                    -3.09375,
                    -0.9375,
                    0.73828125,
                ],
                0.013_061_523,
                vec![245, 236, 244, 112, 113, 109, 126, 247, 217, 93, 240, 249, 220, 247, 233, 102],
            ),
        ];
        for (name, row, scale, codes) in cases {
            let (s, q) = run(row);
            assert_eq!(s, *scale, "{name}: scale");
            assert_eq!(&q, codes, "{name}: codes");
        }
    }

    #[test]
    fn single_rounding_would_differ() {
        // Negative control for the double rounding: quantising x/scale in f32 directly (no bf16
        // step) gives a different code on the `double_rounding` row, so the test above detects it.
        let x = bf16::from_f32(-1.78125).to_f32();
        let scale = 0.013_061_523_f32;
        assert_eq!(e4m3_from_f32(x / scale), 241);
        assert_eq!(e4m3_from_f32(bf16::from_f32(x / scale).to_f32()), 240);
    }

    #[test]
    fn dequantize_is_close_to_input() {
        let mut r = crate::cpu::testutil::rng(1);
        let x = crate::cpu::testutil::uniform_bf16(&mut r, 512, 5.0);
        let mut q = vec![0u8; 512];
        let s = quantize_act_row(&x, &mut q);
        let mut d = vec![0f32; 512];
        dequantize_row(&q, s, &mut d);
        // E4M3 has 3 mantissa bits: relative error ≤ 2^-4 for normals; below the smallest normal
        // (2^-6 · s) the absolute error is ≤ 2^-10 · s; plus the bf16 rounding of x/scale (≤ 2^-8 relative).
        for (a, b) in x.iter().zip(&d) {
            let a = a.to_f32();
            assert!((a - b).abs() <= a.abs() * (1.0 / 16.0 + 1.0 / 256.0) + s / 1024.0, "{a} vs {b}");
        }
        // The largest |x| maps to ±448 (±0x7E / 0xFE) exactly.
        let imax = x.iter().enumerate().max_by(|a, b| a.1.to_f32().abs().total_cmp(&b.1.to_f32().abs())).unwrap().0;
        assert_eq!(q[imax] & 0x7F, 0x7E);
    }

    #[test]
    fn nan_propagates() {
        let x = [bf16::from_f32(1.0), bf16::NAN];
        let mut q = [0u8; 2];
        assert!(quantize_act_row(&x, &mut q).is_nan());
        assert_eq!(q, [0x7F, 0x7F]);
    }
}
