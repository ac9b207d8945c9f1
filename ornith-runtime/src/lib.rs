//! Ornith runtime.
pub mod engine;
pub mod sampling;
pub mod protocol;
