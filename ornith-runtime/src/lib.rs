//! Ornith runtime.
