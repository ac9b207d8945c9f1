//! CPU reference operations: the numerical oracle for the CUDA kernels.
//!
//! Pure functions over row-major slices (`[T, N]` = T rows of N), multi-threaded with rayon.
//! Activations are `bf16` between ops exactly where Hugging Face transformers (bf16 model, torch
//! CPU path) rounds them; every function documents its cast points
//! (docs/ARCHITECTURE.md §3 Forward math and §6 Cast points).
//!
//! Shape contracts are checked with `assert!` and a message naming the argument: a mismatch is a
//! bug in the caller (shapes come from the validated `ModelSpec`), not bad user input. Functions
//! that take user input (token ids) return `Result`.

pub mod attention;
pub mod conv;
pub mod embed;
pub mod fp8;
pub mod gdn;
pub mod linear;
pub mod moe;
pub mod norm;

use half::bf16;

/// Rounds an f32 to bf16 (round-to-nearest-even) and back.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// bf16 → f32, exact (a 16-bit shift; written out so loops vectorise).
#[inline(always)]
pub fn bf16_to_f32(b: bf16) -> f32 {
    f32::from_bits((b.to_bits() as u32) << 16)
}

/// Converts a bf16 slice to f32.
pub fn to_f32(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|&b| bf16_to_f32(b)).collect()
}

/// Converts an f32 slice to bf16 (one rounding per element).
pub fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// Logistic sigmoid `1 / (1 + e^-x)` in f32.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU `x · sigmoid(x)` in f32.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Panics with a clear message when a slice does not have the length its shape implies.
#[track_caller]
#[inline]
pub(crate) fn check_len(name: &str, got: usize, want: usize) {
    assert!(got == want, "{name}: length {got}, expected {want} from the given shape");
}

#[cfg(test)]
pub(crate) mod testutil {
    use half::bf16;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    pub fn rng(seed: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(seed)
    }

    /// Uniform in [-a, a).
    pub fn uniform(r: &mut ChaCha8Rng, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| r.random_range(-a..a)).collect()
    }

    /// Uniform in [-a, a), rounded to bf16.
    pub fn uniform_bf16(r: &mut ChaCha8Rng, n: usize, a: f32) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(r.random_range(-a..a))).collect()
    }

    pub fn f64s(x: &[bf16]) -> Vec<f64> {
        x.iter().map(|v| v.to_f64()).collect()
    }

    /// max |a - b| and max |b|.
    pub fn max_diff(a: &[f64], b: &[f64]) -> (f64, f64) {
        assert_eq!(a.len(), b.len());
        let mut d = 0f64;
        let mut m = 0f64;
        for (x, y) in a.iter().zip(b) {
            d = d.max((x - y).abs());
            m = m.max(y.abs());
        }
        (d, m)
    }
}
