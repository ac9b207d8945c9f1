//! Ornith runtime.
pub mod cli;
pub mod engine;
pub mod load;
pub mod protocol;
pub mod sampling;
