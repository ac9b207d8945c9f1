//! `cargo xtask` — project automation: gen, inspect, synth, expand, ptx.
use anyhow::Result;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the checkpoint report.
    Inspect { dir: PathBuf },
    /// Compile kernels/cuda/*.cu to committed PTX (sm_90, sm_121); needs nvcc (NVCC or PATH).
    Ptx,
    /// Regenerate kernels/src/bindings.rs from the shared C header; needs libclang.
    Bindgen,
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Inspect { dir } => {
            let spec = model_spec::load_checkpoint(&dir)?;
            eprint!("{}", model_spec::report::render(&spec));
        }
        Cmd::Ptx => xtask::ptx::run_ptx(&workspace_root())?,
        Cmd::Bindgen => xtask::bindgen::run_bindgen(&workspace_root())?,
    }
    Ok(())
}

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask sits in the workspace").to_path_buf()
}
