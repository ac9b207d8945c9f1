//! Library half of xtask, shared with the test crate.
pub mod tokenizer;
pub mod bindgen;
pub mod ptx;
