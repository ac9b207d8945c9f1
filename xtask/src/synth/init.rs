//! Seeded, order-independent initial values.
//!
//! Every tensor row has its own random stream: the ChaCha8 key is
//! `sha256("ornith-synth/1" ‖ seed_le ‖ tensor name)` and the stream number is the row index, so
//! a value depends only on (seed, tensor name, row, column) — never on generation order or on
//! how rows are split across threads. "Row" is the first dimension of a tensor of rank ≥ 2; a
//! tensor of rank ≤ 1 is one row.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use sha2::{Digest, Sha256};

/// How a tensor's values are drawn (in f32, before the cast to the stored dtype).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// `mean + std · N(0, 1)`.
    Normal { mean: f32, std: f32 },
    /// `U(lo, hi)`.
    Uniform { lo: f32, hi: f32 },
    /// `ln U(lo, hi)` (the `A_log` init).
    LogUniform { lo: f32, hi: f32 },
    /// Every element equal.
    Const(f32),
}

impl Init {
    /// Linear and embedding weights: `normal(0, initializer_range = 0.02)` (transformers
    /// `_init_weights`).
    pub const WEIGHT: Init = Init::Normal { mean: 0.0, std: 0.02 };
}

/// The per-tensor key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorKey([u8; 32]);

impl TensorKey {
    pub fn new(seed: u64, name: &str) -> Self {
        let mut h = Sha256::new();
        h.update(b"ornith-synth/1");
        h.update(seed.to_le_bytes());
        h.update(name.as_bytes());
        TensorKey(h.finalize().into())
    }

    /// Fills `out` with row `row` of the tensor.
    pub fn fill_row(&self, init: Init, row: u64, out: &mut [f32]) {
        if let Init::Const(c) = init {
            out.fill(c);
            return;
        }
        let mut rng = ChaCha8Rng::from_seed(self.0);
        rng.set_stream(row);
        match init {
            Init::Normal { mean, std } => {
                for o in out.iter_mut() {
                    let z: f32 = StandardNormal.sample(&mut rng);
                    *o = mean + std * z;
                }
            }
            Init::Uniform { lo, hi } => {
                for o in out.iter_mut() {
                    *o = rng.random_range(lo..hi);
                }
            }
            Init::LogUniform { lo, hi } => {
                for o in out.iter_mut() {
                    *o = rng.random_range(lo..hi).ln();
                }
            }
            Init::Const(_) => unreachable!("handled above"),
        }
    }
}

/// Rows and row length of a shape under the row convention above.
pub fn rows_of(shape: &[usize]) -> (usize, usize) {
    let numel: usize = shape.iter().product();
    if shape.len() >= 2 {
        let rows = shape[0];
        (rows, numel.checked_div(rows).unwrap_or(0))
    } else {
        (1, numel)
    }
}
