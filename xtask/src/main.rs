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
    /// Write the Qwen3.5 tokenizer files (tokenizer.json, tokenizer_config.json,
    /// chat_template.jinja) into DIR.
    Tokenizer { dir: PathBuf },
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Inspect { dir } => {
            let spec = model_spec::load_checkpoint(&dir)?;
            eprint!("{}", model_spec::report::render(&spec));
        }
        Cmd::Tokenizer { dir } => xtask::tokenizer::write_tokenizer_files(&dir)?,
    }
    Ok(())
}
