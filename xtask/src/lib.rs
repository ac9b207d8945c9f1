//! Library half of xtask, shared with the test crate.
pub mod tokenizer;
pub mod expand;
