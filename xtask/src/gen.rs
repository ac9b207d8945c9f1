//! `cargo xtask gen` and `cargo xtask inspect`: checkpoint → validated spec file / report.

use crate::synth::{self, Preset, SynthOptions};
use anyhow::{Context, Result};
use model_spec::ModelSpec;
use std::path::{Path, PathBuf};

/// The workspace root: the parent of xtask's manifest directory.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives inside the workspace").to_path_buf()
}

/// `ORNITH_SPEC`, else `<workspace>/.ornith/spec.json`.
pub fn default_spec_path() -> PathBuf {
    match std::env::var_os("ORNITH_SPEC") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => workspace_root().join(".ornith").join("spec.json"),
    }
}

const STAMP_FILE: &str = ".synth-stamp.json";

/// Makes sure `<root>/.ornith/models/tiny` holds the tiny preset (seed [`synth::DEFAULT_SEED`],
/// this generator version), synthesising it when the stamp is missing or different. The
/// checkpoint is written into a sibling directory and renamed into place, and the stamp is
/// written last, so an interrupted synth is never mistaken for a complete one.
pub fn ensure_tiny(root: &Path) -> Result<PathBuf> {
    let models = root.join(".ornith").join("models");
    let dir = models.join("tiny");
    let want = synth::stamp(Preset::Tiny, synth::DEFAULT_SEED);
    if std::fs::read_to_string(dir.join(STAMP_FILE)).ok().as_deref() == Some(want.as_str()) {
        return Ok(dir);
    }
    let tmp = models.join("tiny.partial");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
    }
    eprintln!("synthesising the tiny checkpoint into {}", dir.display());
    let mut opts = SynthOptions::new(Preset::Tiny, synth::DEFAULT_SEED);
    opts.progress = true;
    synth::synth(&tmp, opts)?;
    std::fs::write(tmp.join(STAMP_FILE), &want).with_context(|| format!("writing the stamp in {}", tmp.display()))?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing the stale {}", dir.display()))?;
    }
    std::fs::rename(&tmp, &dir).with_context(|| format!("moving {} to {}", tmp.display(), dir.display()))?;
    Ok(dir)
}

/// Validates `model` (or the tiny default under `root`), prints the report to stderr and
/// writes the spec to `spec_path` atomically. On any error the old spec file is untouched.
pub fn gen(model: Option<&Path>, root: &Path, spec_path: &Path) -> Result<ModelSpec> {
    let dir = match model {
        Some(d) => d.to_path_buf(),
        None => ensure_tiny(root)?,
    };
    let spec = model_spec::load_checkpoint(&dir)?;
    check_frontend_files(&dir)?;
    eprint!("{}", model_spec::report::render(&spec));
    spec.write(spec_path)?;
    eprintln!("spec written to {}", spec_path.display());
    Ok(spec)
}

/// The files besides the weights that `ornith` reads at startup (its tokenizer and chat
/// template): a checkpoint without them is refused here rather than by the binary at startup.
pub const FRONTEND_FILES: [&str; 2] = ["tokenizer.json", "chat_template.jinja"];

fn check_frontend_files(dir: &Path) -> Result<()> {
    for f in FRONTEND_FILES {
        let path = dir.join(f);
        if !path.is_file() {
            let extra = if f == "chat_template.jinja" {
                " (an export that keeps the template as the \"chat_template\" string of tokenizer_config.json: \
                 write that string to chat_template.jinja)"
            } else {
                ""
            };
            anyhow::bail!(
                "{}: missing: the runtime reads the tokenizer and the chat template from the checkpoint directory. \
                 Fix: copy {f} from the original checkpoint into {}{extra}.",
                path.display(),
                dir.display()
            );
        }
    }
    Ok(())
}

/// Validates `dir` and prints the report to stderr.
pub fn inspect(dir: &Path) -> Result<ModelSpec> {
    let spec = model_spec::load_checkpoint(dir)?;
    eprint!("{}", model_spec::report::render(&spec));
    Ok(spec)
}
