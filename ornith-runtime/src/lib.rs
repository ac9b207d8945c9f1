//! Ornith runtime.
pub mod engine;
#[cfg(feature = "cuda")]
pub mod cuda;
