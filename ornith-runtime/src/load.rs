//! Building the engine for the checkpoint this binary was compiled for.

use std::path::PathBuf;

use anyhow::Context;
use ornith_runtime::backend_cpu::{check_host_memory, CpuBackend};
use ornith_runtime::cli::{Args, Backend as BackendChoice};
use ornith_runtime::engine::Generator;
use ornith_runtime::protocol::{PromptRenderer, TextCodec};
use ornith_runtime::weights::Checkpoint;

/// The typed graph of the checkpoint `cargo xtask gen` selected.
pub mod compiled {
    ornith_macros::model!();
}

/// The checkpoint directory: `--model`, else the one the binary was generated from.
pub fn model_dir(args: &Args) -> anyhow::Result<PathBuf> {
    Ok(args.model.clone().unwrap_or_else(|| PathBuf::from(compiled::MODEL_DIR)))
}

/// Opens the checkpoint (re-validated; its fingerprint must be the compiled one) and loads the
/// backend the arguments ask for.
pub fn build_generator(args: &Args) -> anyhow::Result<Box<dyn Generator>> {
    let dir = model_dir(args)?;
    let ck = Checkpoint::open(&dir, compiled::FINGERPRINT)?;
    let max_context = args.max_context.unwrap_or(compiled::DIMS.max_position_embeddings);
    anyhow::ensure!(max_context >= 1, "--max-context must be at least 1");
    match args.backend {
        BackendChoice::Cpu | BackendChoice::Auto => {
            if matches!(args.backend, BackendChoice::Auto) && !args.quiet {
                eprintln!("ornith: using the CPU backend");
            }
            check_host_memory(&ck)?;
            let started = std::time::Instant::now();
            let engine = compiled::Engine::load(CpuBackend::new(), &ck, max_context).with_context(|| format!("loading {}", dir.display()))?;
            if !args.quiet {
                eprintln!("ornith: loaded {} in {:.1?}", dir.display(), started.elapsed());
            }
            Ok(Box::new(engine))
        }
        BackendChoice::Cuda => anyhow::bail!(
            "the CUDA backend is not wired into the serving binary yet: the kernels exist and pass their tests on the H200, \
             the model-level CUDA backend is in progress. Use --backend cpu."
        ),
    }
}

/// The tokenizer and chat template of the checkpoint.
pub fn build_frontend(args: &Args) -> anyhow::Result<(Box<dyn TextCodec>, Box<dyn PromptRenderer>)> {
    let dir = model_dir(args)?;
    ornith_runtime::protocol::adapters::load_frontend(&dir)
}
