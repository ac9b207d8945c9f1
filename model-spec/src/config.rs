//! Serde structs that mirror `config.json` of a `qwen3_5_moe` checkpoint.
//!
//! Field names are the file's own. Unknown fields are kept in `extra` so that nothing the
//! checkpoint says is silently dropped; fields the engine depends on are required unless the
//! transformers class has a documented default (noted per field).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// Root of `config.json` (`Qwen3_5MoeConfig`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HfConfig {
    pub model_type: String,
    #[serde(default)]
    pub architectures: Vec<String>,
    pub text_config: TextConfig,
    #[serde(default)]
    pub vision_config: Option<Value>,
    #[serde(default)]
    pub quantization_config: Option<QuantizationConfig>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub image_token_id: Option<u32>,
    #[serde(default)]
    pub video_token_id: Option<u32>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// `text_config` (`Qwen3_5MoeTextConfig`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TextConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    /// Explicit per-layer kinds; when absent derived from `full_attention_interval`.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub full_attention_interval: Option<usize>,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub attn_output_gate: Option<bool>,
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub mtp_num_hidden_layers: Option<usize>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<Value>,
    #[serde(default)]
    pub dtype: Option<String>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

fn default_act() -> String {
    "silu".into()
}
fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    32768
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_type: Option<String>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default)]
    pub mrope_section: Option<Vec<usize>>,
    #[serde(default)]
    pub mrope_interleaved: Option<bool>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// `quantization_config` as compressed-tensors writes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QuantizationConfig {
    pub quant_method: String,
    #[serde(default)]
    pub format: Option<String>,
    #[serde(default)]
    pub quantization_status: Option<String>,
    #[serde(default)]
    pub config_groups: BTreeMap<String, QuantGroup>,
    #[serde(default)]
    pub ignore: Vec<String>,
    #[serde(default)]
    pub kv_cache_scheme: Option<Value>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QuantGroup {
    #[serde(default)]
    pub targets: Vec<String>,
    #[serde(default)]
    pub weights: Option<QuantArgs>,
    #[serde(default)]
    pub input_activations: Option<QuantArgs>,
    #[serde(default)]
    pub output_activations: Option<QuantArgs>,
    #[serde(default)]
    pub format: Option<String>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QuantArgs {
    pub num_bits: u32,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub strategy: Option<String>,
    #[serde(default)]
    pub symmetric: Option<bool>,
    #[serde(default)]
    pub dynamic: Option<Value>,
    #[serde(default)]
    pub group_size: Option<usize>,
    #[serde(default)]
    pub block_structure: Option<Value>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// `model.safetensors.index.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SafetensorsIndex {
    #[serde(default)]
    pub metadata: Option<Value>,
    pub weight_map: BTreeMap<String, String>,
}
