//! `cargo xtask` — project automation: gen, inspect, synth, expand, dist, ptx.
use anyhow::Result;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use xtask::synth::{self, Contents, Preset, Quant, SynthOptions};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Validate a checkpoint (default: synthesise the tiny preset) and write the spec file
    /// (.ornith/spec.json, or ORNITH_SPEC).
    Gen {
        /// Checkpoint directory.
        #[arg(long, env = "ORNITH_MODEL")]
        model: Option<PathBuf>,
    },
    /// Print the checkpoint report.
    Inspect { dir: PathBuf },
    /// Build the release `ornith` binary, stripped, into <target>/dist/ with a README.txt, and
    /// check that it links nothing beyond glibc.
    Dist,
    /// Write a deterministic synthetic checkpoint in the vendor's FP8 format (or NVFP4A16).
    Synth {
        #[arg(long, value_enum)]
        preset: Preset,
        /// The compressed-tensors scheme: fp8 (FP8_DYNAMIC, the served export) or nvfp4a16.
        #[arg(long, value_enum, default_value = "fp8")]
        quant: Quant,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = synth::DEFAULT_SEED)]
        seed: u64,
        /// Write headers only, over sparse (unwritten) data sections: a metadata checkpoint.
        #[arg(long)]
        headers_only: bool,
    },
    /// Print the code `ornith_macros::model!()` generates for the spec (default: the one
    /// `cargo xtask gen` wrote).
    Expand {
        #[arg(long)]
        spec: Option<PathBuf>,
    },
    /// Write the Qwen3.5 tokenizer files (tokenizer.json, tokenizer_config.json,
    /// chat_template.jinja) into DIR.
    Tokenizer { dir: PathBuf },
    /// Compile kernels/cuda/*.cu to committed PTX (sm_90, sm_121); needs nvcc (NVCC or PATH).
    Ptx,
    /// Assemble the committed PTX of ARCH (sm_90 or sm_121) into cubins in OUT with ptxas, for a
    /// test machine's ORNITH_CUBIN_DIR (no JIT of the PTX at its first start).
    Cubin {
        #[arg(long, default_value = "sm_90")]
        arch: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Regenerate kernels/src/bindings.rs from the shared C header; needs libclang.
    Bindgen,
}

/// Errors are printed as one line with their chain (`{:#}`), not as `main`'s Debug output (which
/// adds a backtrace under RUST_BACKTRACE and a separate "Caused by" list).
fn main() -> std::process::ExitCode {
    match run(Cli::parse().cmd) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cargo xtask: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Gen { model } => {
            let root = xtask::gen::workspace_root();
            xtask::gen::gen(model.as_deref(), &root, &xtask::gen::default_spec_path())?;
        }
        Cmd::Inspect { dir } => {
            xtask::gen::inspect(&dir)?;
        }
        Cmd::Synth { preset, quant, out, seed, headers_only } => {
            let start = std::time::Instant::now();
            let contents = if headers_only { Contents::HeadersOnly } else { Contents::Data };
            let plan = synth::synth(&out, SynthOptions { preset, seed, quant, contents, progress: true })?;
            eprintln!(
                "wrote {} tensors ({} bytes) in {} shard(s) to {} in {:.2?}",
                plan.tensor_count(),
                plan.total_size(),
                plan.shards.len(),
                out.display(),
                start.elapsed()
            );
        }
        Cmd::Dist => {
            xtask::dist::dist(&workspace_root())?;
        }
        Cmd::Expand { spec } => xtask::expand::run(spec.as_deref(), &xtask::gen::workspace_root())?,
        Cmd::Tokenizer { dir } => xtask::tokenizer::write_tokenizer_files(&dir)?,
        Cmd::Ptx => xtask::ptx::run_ptx(&workspace_root())?,
        Cmd::Cubin { arch, out } => {
            let Some(arch) = ornith_kernels::Arch::ALL.into_iter().find(|a| a.name() == arch) else {
                anyhow::bail!("--arch {arch}: one of sm_90, sm_121");
            };
            xtask::ptx::run_cubin(arch, &out)?;
        }
        #[cfg(feature = "bindgen")]
        Cmd::Bindgen => xtask::bindgen::run_bindgen(&workspace_root())?,
        #[cfg(not(feature = "bindgen"))]
        Cmd::Bindgen => anyhow::bail!("run it as `cargo run -p xtask --features bindgen -- bindgen` (needs libclang)"),
    }
    Ok(())
}

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask sits in the workspace").to_path_buf()
}
