//! Library half of xtask, shared with the test crate.
#[cfg(feature = "bindgen")]
pub mod bindgen;
pub mod dist;
pub mod elf;
pub mod expand;
pub mod gen;
pub mod ptx;
pub mod synth;
pub mod tokenizer;
