//! Precompiled PTX of the CUDA kernels.
