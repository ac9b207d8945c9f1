//! `cargo xtask synth`: deterministic synthetic checkpoints in the vendor's exact format
//! (compressed-tensors FP8_DYNAMIC export of `Qwen3_5MoeForConditionalGeneration`, or with
//! `--quant nvfp4a16` the NVFP4A16 export of the same layout).
//!
//! Same preset and seed → byte-identical files. The [`plan`] (names, dtypes, shapes, shards,
//! offsets, header bytes) is separate from the [`write`]r, so the full 35 GB layout can be
//! produced as headers over sparse data for metadata-only tests.

pub mod config;
pub mod init;
pub mod plan;
pub mod preset;
pub mod write;

pub use plan::{plan, plan_quant, Plan, Quant};
pub use preset::Preset;
pub use write::Contents;

use anyhow::{Context, Result};
use std::path::Path;

/// Version of the generator's output; bump whenever the bytes for a given preset and seed
/// change (`cargo xtask gen` re-synthesises a cached checkpoint whose stamp differs).
pub const GENERATOR_VERSION: u32 = 2;

/// Default seed.
pub const DEFAULT_SEED: u64 = 0;

#[derive(Debug, Clone, Copy)]
pub struct SynthOptions {
    pub preset: Preset,
    pub seed: u64,
    /// The quantisation scheme of the export (FP8 unless asked).
    pub quant: Quant,
    pub contents: Contents,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

impl SynthOptions {
    pub fn new(preset: Preset, seed: u64) -> Self {
        SynthOptions { preset, seed, quant: Quant::Fp8, contents: Contents::Data, progress: false }
    }
}

/// Writes the checkpoint into `out` (created if needed): config.json, generation_config.json,
/// model.safetensors.index.json, the shards and the tokenizer files. Returns the plan.
pub fn synth(out: &Path, opts: SynthOptions) -> Result<Plan> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let plan = plan_quant(opts.preset, opts.seed, opts.quant);
    let write = |name: &str, text: String| -> Result<()> {
        let p = out.join(name);
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
    };
    write("config.json", config::to_pretty(&config::config_json_quant(opts.preset, opts.quant)))?;
    write("generation_config.json", config::to_pretty(&config::generation_config_json()))?;
    write("model.safetensors.index.json", config::to_pretty(&plan.index_json()))?;
    write::write_shards(&plan, out, opts.contents, opts.progress)?;
    crate::tokenizer::write_tokenizer_files(out)?;
    Ok(plan)
}

/// The stamp `cargo xtask gen` keeps next to a cached synthetic checkpoint.
pub fn stamp(preset: Preset, seed: u64) -> String {
    format!("{{\"preset\":\"{preset}\",\"seed\":{seed},\"generator_version\":{GENERATOR_VERSION}}}\n")
}
