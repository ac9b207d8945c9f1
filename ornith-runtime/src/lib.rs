//! Ornith runtime.
pub mod cpu;
pub mod engine;
