//! Building the engine for the checkpoint this binary was compiled for.

use std::path::{Path, PathBuf};

use anyhow::Context;
use ornith_runtime::backend_cpu::{available_memory, check_host_memory, plan_pools, CpuBackend, PoolSizes};
use ornith_runtime::chat::ChatTemplate;
#[cfg(feature = "cuda")]
use ornith_runtime::cli::Backend as BackendChoice;
use ornith_runtime::cli::{default_seqs, idle_step_rows, step_rows, Args};
use ornith_runtime::engine::{Capacity, PoolRequest, Runner};
use ornith_runtime::graph::KV_BLOCK;
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
#[cfg(feature = "cuda")]
fn nvidia_driver_present() -> bool {
    // SAFETY: dlopen of libcuda (cudarc's own candidate names); nothing is called in it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The loaded backend: the runner, the longest sequence one request may have and the prefill
/// rows per engine step (`cli::step_rows`, and `cli::idle_step_rows` for a step with no decode
/// row: the backend chosen decides the defaults).
pub struct Built {
    pub runner: Box<dyn Runner>,
    pub max_context: usize,
    pub step_rows: usize,
    pub idle_step_rows: usize,
}

/// The startup line's step sizes: "steps of N rows", and the idle step's when it differs.
fn steps_line(step: usize, idle: usize) -> String {
    if idle == step {
        format!("steps of {step} rows")
    } else {
        format!("steps of {step} rows ({idle} while none decodes)")
    }
}

/// Opens the checkpoint (re-validated; its fingerprint must be the compiled one), plans the
/// pools and loads the backend the arguments ask for; `throughput`: a batch front end (`run`,
/// `batch`), whose default steps are longer on CUDA.
pub fn build_runner(args: &Args, throughput: bool) -> anyhow::Result<Built> {
    let dir = model_dir(args)?;
    let ck = Checkpoint::open(&dir, compiled::FINGERPRINT)?;
    // (step, idle step) on a backend: the plan sizes the step scratch for the longer, idle one.
    let steps =
        |cuda| (step_rows(args.max_batch_tokens, throughput, cuda), idle_step_rows(args.max_batch_tokens, cuda));
    let (step, idle) = steps(false);
    let req = PoolRequest {
        max_seqs: args.max_seqs.map(|n| n as usize),
        default_seqs: default_seqs(throughput),
        kv_budget: args.kv_budget,
        max_context: context_for(args)?,
        prefix_cache: args.prefix_cache_bytes,
        max_batch_tokens: idle,
    };
    #[cfg(not(feature = "cuda"))]
    anyhow::ensure!(
        args.backend != ornith_runtime::cli::Backend::Cuda,
        "--backend cuda: this binary was built without the `cuda` feature. Fix: rebuild with default features"
    );
    #[cfg(feature = "cuda")]
    if let Some(cx) = cuda_context(args)? {
        let (step, idle) = steps(true);
        let req = PoolRequest { max_batch_tokens: idle, ..req };
        let b_name = cx.device_name().to_string();
        let (b, cap) = ornith_runtime::backend_cuda::CudaBackend::new(cx, &ck, &compiled::DIMS, &req, args.quiet)?;
        if !args.quiet {
            eprintln!(
                "{}",
                startup_line(&format!("on the CUDA backend ('{b_name}')"), &cap, req.max_context, step, idle)
            );
        }
        let r = compiled::Compiled::load(b, &ck, &cap).with_context(|| format!("loading {}", dir.display()))?;
        return Ok(Built { runner: Box::new(r), max_context: req.max_context, step_rows: step, idle_step_rows: idle });
    }
    let cap = plan_cpu_pools(&ck, &req)?;
    if !args.quiet {
        eprintln!("{}", startup_line("on the CPU", &cap, req.max_context, step, idle));
    }
    let r =
        compiled::Compiled::load(CpuBackend::new(), &ck, &cap).with_context(|| format!("loading {}", dir.display()))?;
    Ok(Built { runner: Box::new(r), max_context: req.max_context, step_rows: step, idle_step_rows: idle })
}

/// The one line `run` / `batch` / `serve` print to stderr once the pools are planned.
fn startup_line(backend: &str, cap: &Capacity, max_context: usize, step: usize, idle: usize) -> String {
    format!(
        "ornith: {} sequences at once {backend}, K/V pool {} tokens, context {max_context} tokens, {}, {}",
        cap.slots,
        cap.blocks * KV_BLOCK,
        steps_line(step, idle),
        cache_line(cap)
    )
}

fn cache_line(cap: &Capacity) -> String {
    match cap.snapshots {
        0 => "prefix cache off".into(),
        n => format!(
            "prefix cache of {n} snapshots ({:.2} GiB)",
            (n as u64 * gdn_slot_bytes()) as f64 / (1u64 << 30) as f64
        ),
    }
}

/// GPU 0's context, its kernel-compilation notes on stderr unless `--quiet`.
#[cfg(feature = "cuda")]
fn cuda_open(args: &Args) -> anyhow::Result<ornith_runtime::cuda::CudaContext> {
    let quiet = args.quiet;
    ornith_runtime::cuda::CudaContext::with_notes(0, move |m| {
        if !quiet {
            eprintln!("ornith: {m}");
        }
    })
}

/// The CUDA context the arguments ask for, or None for the CPU backend.
#[cfg(feature = "cuda")]
fn cuda_context(args: &Args) -> anyhow::Result<Option<ornith_runtime::cuda::CudaContext>> {
    Ok(match args.backend {
        BackendChoice::Cpu => None,
        BackendChoice::Cuda => {
            anyhow::ensure!(
                nvidia_driver_present(),
                "--backend cuda: no NVIDIA driver found (libcuda.so could not be loaded). \
                 Fix: install the NVIDIA driver (r580 or newer), or use --backend cpu"
            );
            Some(cuda_open(args)?)
        }
        BackendChoice::Auto if !nvidia_driver_present() => {
            if !args.quiet {
                eprintln!("ornith: no NVIDIA driver found; using the CPU backend");
            }
            None
        }
        BackendChoice::Auto => match cuda_open(args) {
            Ok(cx) => Some(cx),
            Err(e) => {
                if !args.quiet {
                    eprintln!("ornith: no usable GPU ({e:#}); using the CPU backend");
                }
                None
            }
        },
    })
}

/// Recurrent-state bytes of one sequence: conv (bf16) + fp32 state of every Gated DeltaNet layer.
pub fn gdn_slot_bytes() -> u64 {
    let gdn_layers = compiled::LAYER_KINDS.iter().filter(|k| **k == model_spec::LayerKind::LinearAttention).count();
    let (conv, ssm) = compiled::DIMS.gdn_state_elems();
    (gdn_layers * (conv * 2 + ssm * 4)) as u64
}

/// The CPU backend's pools, checked against the host's available memory before anything is
/// allocated (`backend_cpu::plan_pools`).
fn plan_cpu_pools(ck: &Checkpoint, req: &PoolRequest) -> anyhow::Result<Capacity> {
    let weights = check_host_memory(ck)?;
    let sizes = PoolSizes { weights, kv_per_token: compiled::KV_BYTES_PER_TOKEN, slot: gdn_slot_bytes() };
    plan_pools(&sizes, req, available_memory())
}

/// The longest sequence one request may have: `--max-context` (default: the model's window, or
/// what `--kv-budget` holds when only that is given).
pub fn context_for(args: &Args) -> anyhow::Result<usize> {
    let window = compiled::DIMS.max_position_embeddings;
    let ctx = match (args.max_context, args.kv_budget) {
        (Some(c), _) => c,
        (None, Some(budget)) => {
            let block = compiled::KV_BYTES_PER_TOKEN.max(1) * KV_BLOCK as u64;
            let blocks = budget / block;
            anyhow::ensure!(
                blocks >= 1,
                "--kv-budget {budget} bytes holds no K/V block ({KV_BLOCK} tokens, {block} bytes). Fix: raise --kv-budget"
            );
            window.min((blocks as usize).saturating_mul(KV_BLOCK))
        }
        (None, None) => window,
    };
    anyhow::ensure!(ctx >= 2, "--max-context must be at least 2 (a prompt token and an output token)");
    anyhow::ensure!(ctx <= window, "--max-context {ctx} exceeds the model's window of {window} tokens");
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
