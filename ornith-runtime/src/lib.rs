//! Ornith runtime.
pub mod engine;
