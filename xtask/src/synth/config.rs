//! `config.json` and `generation_config.json` of a synthetic checkpoint, field for field as the
//! vendor export writes them: transformers 5.17 serialises `Qwen3_5MoeConfig` with sorted keys,
//! and llm-compressor 0.14 (compressed-tensors 0.19) adds the `quantization_config` of the
//! FP8_DYNAMIC preset scheme. The vendor keeps the six ignore patterns unexpanded
//! (llm-compressor itself would write one explicit module name per ignored Linear).

use super::plan::Quant;
use super::preset::Preset;
use serde_json::{json, Map, Value};

/// The vendor's ignore list (docs/DESIGN.md).
pub const VENDOR_IGNORE: [&str; 6] = [
    "re:.*lm_head",
    "re:.*embed_tokens$",
    "re:.*mlp.gate$",
    "re:.*shared_expert_gate$",
    "re:.*linear_attn.*",
    "re:.*visual.*",
];

/// Token ids of the real tokenizer (docs/ARCHITECTURE.md §1 Configuration, §5.1 Tokenizer).
pub const BOS_TOKEN_ID: u32 = 248044; // <|endoftext|>
pub const IM_END_TOKEN_ID: u32 = 248046; // <|im_end|>

/// `quantization_config` exactly as compressed-tensors 0.19 serialises the FP8_DYNAMIC scheme
/// (checked against `llmcompressor.oneshot(..., QuantizationModifier(targets="Linear",
/// scheme="FP8_DYNAMIC"))` + `save_pretrained(save_compressed=True)` in the project venv).
pub fn quantization_config() -> Value {
    json!({
        "config_groups": {
            "group_0": {
                "format": "float-quantized",
                "input_activations": {
                    "actorder": null, "block_structure": null, "dynamic": true, "group_size": null,
                    "num_bits": 8, "observer": null, "observer_kwargs": {}, "scale_dtype": null,
                    "strategy": "token", "symmetric": true, "type": "float", "zp_dtype": null
                },
                "output_activations": null,
                "targets": ["Linear"],
                "weights": {
                    "actorder": null, "block_structure": null, "dynamic": false, "group_size": null,
                    "num_bits": 8, "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": null,
                    "strategy": "channel", "symmetric": true, "type": "float", "zp_dtype": null
                }
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": null,
        "ignore": VENDOR_IGNORE,
        "kv_cache_scheme": null,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.19.0"
    })
}

/// `quantization_config` exactly as compressed-tensors 0.19 serialises the NVFP4A16 scheme
/// (checked against llm-compressor 0.14's output, tests/fixtures/micro-nvfp4/config.json), with
/// the vendor's six ignore patterns unexpanded.
pub fn quantization_config_nvfp4a16() -> Value {
    json!({
        "config_groups": {
            "group_0": {
                "format": "nvfp4-pack-quantized",
                "input_activations": null,
                "output_activations": null,
                "targets": ["Linear"],
                "weights": {
                    "actorder": null, "block_structure": null, "dynamic": false, "group_size": 16,
                    "num_bits": 4, "observer": "memoryless_minmax", "observer_kwargs": {},
                    "scale_dtype": "torch.float8_e4m3fn", "strategy": "tensor_group", "symmetric": true,
                    "type": "float", "zp_dtype": null
                }
            }
        },
        "format": "nvfp4-pack-quantized",
        "global_compression_ratio": null,
        "ignore": VENDOR_IGNORE,
        "kv_cache_scheme": null,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.19.0"
    })
}

/// The whole `config.json` of the FP8 export.
pub fn config_json(preset: Preset) -> Value {
    config_json_quant(preset, Quant::Fp8)
}

/// The whole `config.json` for `quant`.
pub fn config_json_quant(preset: Preset, quant: Quant) -> Value {
    let t = preset.text();
    let v = preset.vision();
    let layer_types: Vec<&str> = (0..t.num_hidden_layers)
        .map(|i| if t.is_full_attention(i) { "full_attention" } else { "linear_attention" })
        .collect();
    let rope = json!({
        "mrope_interleaved": true,
        "mrope_section": t.mrope_section,
        "partial_rotary_factor": t.partial_rotary_factor(),
        "rope_theta": t.rope_theta,
        "rope_type": "default"
    });
    let text = json!({
        "attention_bias": false,
        "attention_dropout": 0.0,
        "attn_output_gate": true,
        "bos_token_id": BOS_TOKEN_ID,
        "dtype": "bfloat16",
        "eos_token_id": BOS_TOKEN_ID,
        "full_attention_interval": t.full_attention_interval,
        "head_dim": t.head_dim,
        "hidden_act": "silu",
        "hidden_size": t.hidden_size,
        "initializer_range": 0.02,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": t.linear_conv_kernel_dim,
        "linear_key_head_dim": t.linear_key_head_dim,
        "linear_num_key_heads": t.linear_num_key_heads,
        "linear_num_value_heads": t.linear_num_value_heads,
        "linear_value_head_dim": t.linear_value_head_dim,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": t.max_position_embeddings,
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": t.moe_intermediate_size,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": false,
        "num_attention_heads": t.num_attention_heads,
        "num_experts": t.num_experts,
        "num_experts_per_tok": t.num_experts_per_tok,
        "num_hidden_layers": t.num_hidden_layers,
        "num_key_value_heads": t.num_key_value_heads,
        "output_router_logits": false,
        "pad_token_id": null,
        "partial_rotary_factor": t.partial_rotary_factor(),
        "rms_norm_eps": t.rms_norm_eps,
        "rope_parameters": rope,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": t.shared_expert_intermediate_size,
        "tie_word_embeddings": false,
        "use_cache": true,
        "vocab_size": t.vocab_size
    });
    let vision = json!({
        "deepstack_visual_indexes": [],
        "depth": v.depth,
        "dtype": "bfloat16",
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": v.hidden_size,
        "in_channels": v.in_channels,
        "initializer_range": 0.02,
        "intermediate_size": v.intermediate_size,
        "model_type": "qwen3_5_moe_vision",
        "num_heads": v.num_heads,
        "num_position_embeddings": v.num_position_embeddings,
        "out_hidden_size": v.out_hidden_size,
        "patch_size": v.patch_size,
        "rope_parameters": { "rope_theta": 10000.0, "rope_type": "axial" },
        "spatial_merge_size": v.spatial_merge_size,
        "temporal_patch_size": v.temporal_patch_size
    });
    sorted(json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "dtype": "bfloat16",
        "image_token_id": 248056,
        "model_type": "qwen3_5_moe",
        "quantization_config": match quant {
            Quant::Fp8 => quantization_config(),
            Quant::Nvfp4a16 => quantization_config_nvfp4a16(),
        },
        "text_config": text,
        "tie_word_embeddings": false,
        "transformers_version": "5.17.0",
        "video_token_id": 248057,
        "vision_config": vision,
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053
    }))
}

/// `generation_config.json` (the vendor's sampling defaults).
pub fn generation_config_json() -> Value {
    sorted(json!({
        "bos_token_id": BOS_TOKEN_ID,
        "do_sample": true,
        "eos_token_id": [IM_END_TOKEN_ID, BOS_TOKEN_ID],
        "pad_token_id": BOS_TOKEN_ID,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95
    }))
}

/// Recursively sorts object keys (transformers writes `json.dumps(..., sort_keys=True)`; the
/// workspace builds serde_json with `preserve_order`, so order is ours to fix).
pub fn sorted(v: Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut entries: Vec<(String, Value)> = m.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect::<Map<_, _>>())
        }
        Value::Array(a) => Value::Array(a.into_iter().map(sorted).collect()),
        other => other,
    }
}

/// Pretty JSON with a trailing newline, as `save_pretrained` writes it.
pub fn to_pretty(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).expect("JSON values serialise");
    s.push('\n');
    s
}
