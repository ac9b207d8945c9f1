//! Building the engine for the checkpoint this binary was compiled for.

use std::path::{Path, PathBuf};

use anyhow::Context;
use ornith_runtime::backend_cpu::{check_host_memory, CpuBackend};
use ornith_runtime::backend_cuda::CudaBackend;
use ornith_runtime::chat::ChatTemplate;
use ornith_runtime::cli::{Args, Backend as BackendChoice};
use ornith_runtime::engine::Generator;
use ornith_runtime::protocol::{PromptRenderer, TextCodec};
use ornith_runtime::tokenizer::Tokenizer;
use ornith_runtime::weights::Checkpoint;

/// The typed graph of the checkpoint `cargo xtask gen` selected.
pub mod compiled {
    ornith_macros::model!();
}

/// The checkpoint directory: `--model`, else the one the binary was generated from (an absolute
/// path on the build machine, so a copied binary needs `--model`).
pub fn model_dir(args: &Args) -> anyhow::Result<PathBuf> {
    if let Some(d) = &args.model {
        anyhow::ensure!(
            d.is_dir(),
            "--model {}: no such directory. Fix: pass --model DIR (or set ORNITH_MODEL) with the checkpoint directory",
            d.display()
        );
        return Ok(d.clone());
    }
    let d = PathBuf::from(compiled::MODEL_DIR);
    anyhow::ensure!(
        d.is_dir(),
        "no --model given, and {} (the checkpoint this binary was generated for) does not exist here. \
         Fix: pass --model DIR (or set ORNITH_MODEL) with the checkpoint directory",
        d.display()
    );
    Ok(d)
}

/// Whether the NVIDIA driver library can be loaded. Asked before cudarc is touched: cudarc panics
/// (with a long message and, under RUST_BACKTRACE, a backtrace) when it cannot find it.
fn nvidia_driver_present() -> bool {
    // SAFETY: dlopen of libcuda (cudarc's own candidate names); nothing is called in it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Opens the checkpoint (re-validated; its fingerprint must be the compiled one) and loads the
/// backend the arguments ask for.
pub fn build_generator(args: &Args) -> anyhow::Result<Box<dyn Generator>> {
    let dir = model_dir(args)?;
    let ck = Checkpoint::open(&dir, compiled::FINGERPRINT)?;
    let max_context = context_for(args)?;
    let cuda = match args.backend {
        BackendChoice::Cpu => None,
        BackendChoice::Cuda => {
            anyhow::ensure!(
                nvidia_driver_present(),
                "--backend cuda: no NVIDIA driver found (libcuda.so could not be loaded). \
                 Fix: install the NVIDIA driver (r580 or newer), or use --backend cpu"
            );
            Some(ornith_runtime::cuda::CudaContext::new(0)?)
        }
        BackendChoice::Auto if !nvidia_driver_present() => {
            if !args.quiet {
                eprintln!("ornith: no NVIDIA driver found; using the CPU backend");
            }
            None
        }
        BackendChoice::Auto => match ornith_runtime::cuda::CudaContext::new(0) {
            Ok(cx) => Some(cx),
            Err(e) => {
                if !args.quiet {
                    eprintln!("ornith: no usable GPU ({e:#}); using the CPU backend");
                }
                None
            }
        },
    };
    let engine: Box<dyn Generator> = match cuda {
        Some(cx) => {
            let ctx = max_context;
            if !args.quiet {
                eprintln!("ornith: using the CUDA backend on '{}' (context {ctx} tokens)", cx.device_name());
            }
            let b = CudaBackend::new(cx, &ck, &compiled::DIMS, ctx, args.quiet)?;
            Box::new(compiled::Engine::load(b, &ck, ctx).with_context(|| format!("loading {}", dir.display()))?)
        }
        None => {
            check_host_memory(&ck)?;
            Box::new(
                compiled::Engine::load(CpuBackend::new(), &ck, max_context)
                    .with_context(|| format!("loading {}", dir.display()))?,
            )
        }
    };
    Ok(engine)
}

/// The context the caches are sized for: `--max-context` (default: the model's window), capped
/// by `--kv-budget` when given.
pub fn context_for(args: &Args) -> anyhow::Result<usize> {
    let window = compiled::DIMS.max_position_embeddings;
    let mut ctx = args.max_context.unwrap_or(window);
    anyhow::ensure!(ctx >= 1, "--max-context must be at least 1");
    anyhow::ensure!(ctx <= window, "--max-context {ctx} exceeds the model's window of {window} tokens");
    if let Some(budget) = args.kv_budget {
        let fit = (budget / compiled::KV_BYTES_PER_TOKEN.max(1)) as usize;
        anyhow::ensure!(
            fit >= 1,
            "--kv-budget {budget} bytes holds no token: the K/V cache needs {} bytes per token",
            compiled::KV_BYTES_PER_TOKEN
        );
        ctx = ctx.min(fit);
    }
    Ok(ctx)
}

/// The tokenizer and chat template of the checkpoint.
pub fn build_frontend(args: &Args) -> anyhow::Result<(Box<dyn TextCodec>, Box<dyn PromptRenderer>)> {
    let (tok, tpl) = load_frontend_parts(&model_dir(args)?)?;
    Ok((Box::new(tok), Box::new(tpl)))
}

/// The tokenizer and the chat template as concrete (`Send`) types, for loading on a thread.
pub fn load_frontend_parts(dir: &Path) -> anyhow::Result<(Tokenizer, ChatTemplate)> {
    ornith_runtime::protocol::adapters::load_frontend_parts(dir)
}
