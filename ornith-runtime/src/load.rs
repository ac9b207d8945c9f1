//! Building the engine from the command line. Owned by the lead: the bodies below are the
//! wiring points that the loading code replaces.

use std::path::PathBuf;

use crate::cli::Args;
use crate::engine::Generator;
use crate::protocol::{PromptRenderer, TextCodec};

/// The checkpoint directory the run uses.
pub fn model_dir(args: &Args) -> anyhow::Result<PathBuf> {
    args.model.clone().ok_or_else(|| anyhow::anyhow!("no model: pass --model DIR or set ORNITH_MODEL"))
}

/// The generator (backend) for `args`.
pub fn build_generator(_args: &Args) -> anyhow::Result<Box<dyn Generator>> {
    anyhow::bail!("model loading not wired yet")
}

/// The tokenizer and chat template of the checkpoint (see `protocol/adapters.rs`).
pub fn build_frontend(_args: &Args) -> anyhow::Result<(Box<dyn TextCodec>, Box<dyn PromptRenderer>)> {
    anyhow::bail!("tokenizer and chat template not wired yet (enable protocol/adapters.rs once ornith_runtime::tokenizer and ::chat exist)")
}
