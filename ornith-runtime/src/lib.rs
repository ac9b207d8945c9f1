//! Ornith runtime.
pub mod engine;
pub mod sampling;
