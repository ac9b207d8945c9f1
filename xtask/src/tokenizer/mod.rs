//! Tokenizer files for synthetic checkpoints (owned by the tokenizer work; see docs/DESIGN.md).
use std::path::Path;

/// Writes tokenizer.json, tokenizer_config.json and chat_template.jinja into `dir`.
pub fn write_tokenizer_files(dir: &Path) -> anyhow::Result<()> {
    anyhow::bail!("tokenizer files are not written yet (in progress): {}", dir.display())
}
