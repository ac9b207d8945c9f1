//! Ornith runtime: the typed model graph, backends, the JSONL front end and the HTTP server.

// Lets generated code name this crate as `::ornith_runtime` from inside it too.
extern crate self as ornith_runtime;

pub mod backend_cpu;
#[cfg(feature = "cuda")]
pub mod backend_cuda;
pub mod chat;
pub mod cli;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod engine;
pub mod graph;
pub mod http;
pub mod logprobs;
pub mod protocol;
pub mod sampling;
pub mod tokenizer;
pub mod weights;
