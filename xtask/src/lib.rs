//! Library half of xtask, shared with the test crate.
pub mod gen;
pub mod synth;
pub mod tokenizer;
pub mod expand;
#[cfg(feature = "bindgen")]
pub mod bindgen;
pub mod ptx;
