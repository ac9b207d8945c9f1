//! # model-spec
//!
//! Reads a Qwen3.5-MoE checkpoint directory — `config.json`, `model.safetensors.index.json` and
//! every shard's safetensors header (memory-mapped; tensor data is never touched) — validates it
//! completely, and produces one [`ModelSpec`]: dimensions, layer kinds, every tensor's name,
//! dtype, shape, shard and offset, and each Linear's precision (FP8 W8A8, NVFP4A16 or BF16) decided by the
//! compressed-tensors ignore list and cross-checked against the stored dtypes.
//!
//! `cargo xtask gen` writes the spec to a file; `ornith-macros` turns it into the typed model
//! graph at compile time; the runtime re-reads the checkpoint headers at load and compares the
//! fingerprint.

mod build;
pub mod config;
pub mod error;
pub mod fp8;
pub mod header;
pub mod nvfp4;
pub mod quant;
pub mod report;

#[cfg(test)]
pub(crate) mod sweep;

pub use build::{load_checkpoint, text_prefix_of};
pub use error::{Result, SpecError};

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Version of the spec file layout; bump when [`ModelSpec`] changes incompatibly.
pub const SPEC_FORMAT_VERSION: u32 = 1;

/// Tensor element types that appear in these checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum DType {
    BF16,
    F16,
    F32,
    F64,
    F8_E4M3,
    F8_E5M2,
    I8,
    U8,
    I16,
    I32,
    I64,
    U16,
    U32,
    U64,
    BOOL,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F8_E4M3 | DType::F8_E5M2 | DType::I8 | DType::U8 | DType::BOOL => 1,
            DType::BF16 | DType::F16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }
    /// The safetensors spelling ("BF16", "F8_E4M3", ...).
    pub fn as_str(self) -> &'static str {
        match self {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::F8_E4M3 => "F8_E4M3",
            DType::F8_E5M2 => "F8_E5M2",
            DType::I8 => "I8",
            DType::U8 => "U8",
            DType::I16 => "I16",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::U16 => "U16",
            DType::U32 => "U32",
            DType::U64 => "U64",
            DType::BOOL => "BOOL",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One stored tensor, located exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorInfo {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Shard file name, relative to the checkpoint directory.
    pub shard: String,
    /// Byte range inside the shard's data section (after the 8-byte length and the header).
    pub data_offsets: (u64, u64),
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn nbytes(&self) -> u64 {
        self.data_offsets.1 - self.data_offsets.0
    }
}

/// One shard file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub file: String,
    pub file_size: u64,
    /// Size of the JSON header; the data section starts at `8 + header_len`.
    pub header_len: u64,
}

impl ShardInfo {
    pub fn data_start(&self) -> u64 {
        8 + self.header_len
    }
}

/// How a Linear's weight is stored and computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Precision {
    /// `.weight` in BF16, `[out, in]`.
    Bf16,
    /// compressed-tensors W8A8 FP8: `.weight` F8_E4M3 `[out, in]` with `.weight_scale`
    /// (one scale per output channel), activations quantised per token at run time.
    Fp8,
    /// compressed-tensors NVFP4A16 (`nvfp4-pack-quantized`): `.weight_packed` U8 `[out, in/2]`
    /// (two E2M1 codes per byte, the even column in the low nibble), `.weight_scale` F8_E4M3
    /// `[out, in/16]` (one scale per 16 weights of a row), `.weight_global_scale` F32 `[1]`.
    /// The weight is `bf16(e2m1 · f32(f32(scale) / global_scale))` (compressed-tensors' decompressor:
    /// the group scale is divided by the global scale); activations stay BF16.
    Nvfp4,
}

impl Precision {
    /// The name used in reports and the generated graph ("BF16", "FP8", "NVFP4").
    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "BF16",
            Precision::Fp8 => "FP8",
            Precision::Nvfp4 => "NVFP4",
        }
    }
}

/// Kind of a decoder layer's token mixer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attn`).
    LinearAttention,
    /// Gated full attention (`self_attn`).
    FullAttention,
}

/// One Linear module of the language model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinearSpec {
    /// Module name as in the checkpoint; the weight is `{module}.weight`.
    pub module: String,
    pub precision: Precision,
    pub out_features: usize,
    pub in_features: usize,
    /// The ignore entry that kept it in BF16, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignored_by: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GdnSpec {
    pub in_proj_qkv: LinearSpec,
    pub in_proj_z: LinearSpec,
    pub in_proj_b: LinearSpec,
    pub in_proj_a: LinearSpec,
    pub out_proj: LinearSpec,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttentionSpec {
    pub q_proj: LinearSpec,
    pub k_proj: LinearSpec,
    pub v_proj: LinearSpec,
    pub o_proj: LinearSpec,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum MixerSpec {
    LinearAttention(GdnSpec),
    FullAttention(AttentionSpec),
}

/// How routed experts are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExpertLayout {
    /// `mlp.experts.{e}.{gate,up,down}_proj.weight` (+ `.weight_scale`), as in the FP8 export.
    PerExpert,
    /// `mlp.experts.gate_up_proj` `[E, 2I, H]` and `mlp.experts.down_proj` `[E, H, I]`
    /// (no `.weight` suffix), as in the BF16 base.
    Fused,
}

/// Routed experts of one layer, normalised over both layouts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertsSpec {
    /// `{prefix}.layers.{L}.mlp.experts`
    pub module: String,
    pub layout: ExpertLayout,
    pub num_experts: usize,
    pub intermediate_size: usize,
    pub hidden_size: usize,
    pub gate_proj: Precision,
    pub up_proj: Precision,
    pub down_proj: Precision,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MlpSpec {
    pub gate_proj: LinearSpec,
    pub up_proj: LinearSpec,
    pub down_proj: LinearSpec,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeSpec {
    /// Router `mlp.gate` (`[E, H]`).
    pub gate: LinearSpec,
    pub experts: ExpertsSpec,
    pub shared_expert: MlpSpec,
    /// `mlp.shared_expert_gate` (`[1, H]`).
    pub shared_expert_gate: LinearSpec,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerSpec {
    pub index: usize,
    pub kind: LayerKind,
    /// `{prefix}.layers.{L}`
    pub module: String,
    pub mixer: MixerSpec,
    pub mlp: MoeSpec,
}

/// Model dimensions (from `text_config`, validated), with config.json's names: the one dims type
/// (the generated model's `DIMS` is one, which the backends read).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Dims {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Rotated dims per head: `head_dim * partial_rotary_factor`.
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
}

impl Dims {
    pub const fn key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    pub const fn value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Channels of the depthwise conv: `[q | k | v]`.
    pub const fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Elements of one sequence's state in one Gated DeltaNet layer: the conv state
    /// `[K-1, conv_dim]` (bf16) and the recurrent state `[Hv, dk, dv]` (f32).
    pub const fn gdn_state_elems(&self) -> (usize, usize) {
        (
            (self.linear_conv_kernel_dim - 1) * self.conv_dim(),
            self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim,
        )
    }
    /// KV-cache bytes per token (BF16 K and V over all full-attention layers).
    pub const fn kv_bytes_per_token(&self, full_attention_layers: usize) -> u64 {
        (full_attention_layers * 2 * self.num_key_value_heads * self.head_dim * 2) as u64
    }
}

/// What the quantization_config said.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantSpec {
    pub quant_method: String,
    pub format: String,
    /// The ignore list exactly as written.
    pub ignore: Vec<String>,
}

/// Everything the engine needs to know about a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub format_version: u32,
    /// sha256 over config.json, the index and every shard's size and header.
    pub fingerprint: String,
    /// Absolute path of the checkpoint directory the spec was made from.
    pub model_dir: PathBuf,
    pub model_type: String,
    /// `model.language_model` (ConditionalGeneration) or `model` (text-only CausalLM).
    pub text_prefix: String,
    pub dims: Dims,
    pub layers: Vec<LayerSpec>,
    pub embed_tokens: String,
    pub final_norm: String,
    pub lm_head: LinearSpec,
    pub quant: Option<QuantSpec>,
    /// `mtp_num_hidden_layers` from the config (0 if absent).
    pub mtp_config_layers: usize,
    /// Number of `mtp.*` tensors actually stored.
    pub mtp_tensors: usize,
    /// Number of `*visual.*` tensors stored (not used by this text-only engine).
    pub visual_tensors: usize,
    pub eos_token_ids: Vec<u32>,
    pub shards: Vec<ShardInfo>,
    pub tensors: BTreeMap<String, TensorInfo>,
}

impl ModelSpec {
    pub fn layer_kinds(&self) -> Vec<LayerKind> {
        self.layers.iter().map(|l| l.kind).collect()
    }

    pub fn num_full_attention_layers(&self) -> usize {
        self.layers.iter().filter(|l| l.kind == LayerKind::FullAttention).count()
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Bytes of the language-model weights the engine uploads (everything but visual.* and mtp.*).
    pub fn device_weight_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|(n, _)| !report::is_visual(n) && !n.starts_with("mtp."))
            .map(|(_, t)| t.nbytes())
            .sum()
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("ModelSpec serialises")
    }

    /// Writes the spec atomically (temp file + rename): a failed gen leaves the old spec intact.
    pub fn write(&self, path: &Path) -> Result<()> {
        let io = |source| SpecError::Io { path: path.to_path_buf(), err: source };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, self.to_json()).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| SpecError::Io { path: path.to_path_buf(), err: source })?;
        let spec: ModelSpec = serde_json::from_slice(&bytes)
            .map_err(|e| SpecError::SpecFile { path: path.to_path_buf(), reason: format!("not a valid spec: {e}") })?;
        if spec.format_version != SPEC_FORMAT_VERSION {
            return Err(SpecError::SpecFile {
                path: path.to_path_buf(),
                reason: format!("format version {} but this build reads {}", spec.format_version, SPEC_FORMAT_VERSION),
            });
        }
        Ok(spec)
    }
}
