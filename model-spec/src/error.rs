//! Every way a checkpoint can be refused. Each message names the file, the tensor (where there
//! is one), what was expected against what was found, and what to do about it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    // The underlying error is part of the message and deliberately not a `source()`: printed
    // with its chain (`{:#}`, as the binaries do), it would appear twice.
    #[error("{path}: cannot read: {err}. Fix: check the path: it must be the checkpoint directory holding this file (`--model DIR` of `cargo xtask gen` and `ornith`, the DIR of `cargo xtask inspect DIR`).")]
    Io { path: PathBuf, err: std::io::Error },

    #[error("{path}: not valid JSON for {what}: {err}. Fix: restore this file from the original checkpoint.")]
    Json { path: PathBuf, what: &'static str, err: serde_json::Error },

    #[error("{path}: {field}: expected {expected}, found {found}. Fix: {fix}")]
    Config { path: PathBuf, field: String, expected: String, found: String, fix: String },

    #[error("{path}: unsupported quantization: {what}. Ornith reads compressed-tensors FP8 W8A8 (format float-quantized, weights: 8-bit float, strategy channel, static; input activations: 8-bit float, strategy token, dynamic), compressed-tensors NVFP4A16 (format nvfp4-pack-quantized, weights: 4-bit float, strategy tensor_group, group size 16, E4M3 group scales, static; no activation quantization) or an unquantized BF16 checkpoint; it never guesses another format. Fix: use such an export.")]
    Quant { path: PathBuf, what: String },

    #[error("{path}: invalid ignore pattern {pattern:?}: {reason}")]
    IgnorePattern { path: PathBuf, pattern: String, reason: String },

    #[error("{dir}: no model.safetensors.index.json and no single model.safetensors. Fix: download the index and all shards of the checkpoint.")]
    NoIndex { dir: PathBuf },

    #[error("{path}: shard {shard} listed for tensor {tensor} does not exist. Fix: download the missing shard.")]
    MissingShard { path: PathBuf, shard: String, tensor: String },

    #[error("{path}: invalid safetensors file: {reason}. Fix: the shard is truncated or corrupt; download it again.")]
    BadShard { path: PathBuf, reason: String },

    #[error(
        "{path}: tensor {tensor}: {reason}. Fix: the index and the shards disagree; download the checkpoint again."
    )]
    IndexMismatch { path: PathBuf, tensor: String, reason: String },

    #[error("{path}: missing tensor {tensor} (expected {expected}). Fix: the checkpoint is incomplete or is not a Qwen3.5-MoE export; download it again.")]
    MissingTensor { path: PathBuf, tensor: String, expected: String },

    #[error("{path}: unexpected tensor {tensor} ({found}): it is not part of the model the config describes. Fix: remove it, or use a config.json that matches these weights.")]
    ExtraTensor { path: PathBuf, tensor: String, found: String },

    #[error("{path}: tensor {tensor}: expected {expected}, found {found}. Fix: {fix}")]
    TensorMismatch { path: PathBuf, tensor: String, expected: String, found: String, fix: String },

    #[error("spec file {path}: {reason}. Fix: run `cargo xtask gen` again.")]
    SpecFile { path: PathBuf, reason: String },
}

pub type Result<T, E = SpecError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::SpecError;
    use std::error::Error;

    /// Printed with its chain (`anyhow`'s `{:#}`, which walks `source()`), an error must not
    /// repeat its cause.
    #[test]
    fn io_and_json_causes_are_printed_once() {
        let err = serde_json::from_str::<serde_json::Value>("{ not json").unwrap_err();
        let cause = err.to_string();
        let e = SpecError::Json { path: "config.json".into(), what: "config.json", err };
        assert!(e.source().is_none());
        assert_eq!(e.to_string().matches(&cause).count(), 1, "{e}");
        let e = SpecError::Io { path: "/nonexistent".into(), err: std::io::Error::from(std::io::ErrorKind::NotFound) };
        assert!(e.source().is_none());
        let msg = e.to_string();
        assert!(msg.contains("Fix:") && msg.contains("inspect"), "{msg}");
    }
}
