//! Ornith runtime.
pub mod engine;
pub mod tokenizer;
pub mod chat;
