//! Checkpoint directory → [`ModelSpec`].

use crate::config::{HfConfig, QuantizationConfig, SafetensorsIndex, TextConfig};
use crate::header::{read_header, HeaderEntry, ShardHeader};
use crate::quant::{validate_scheme, IgnoreList};
use crate::*;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};

/// What a tensor must look like.
struct Expect {
    dtypes: &'static [DType],
    /// Accepted shapes (the first is the canonical one quoted in errors).
    shapes: Vec<Vec<usize>>,
    fix: &'static str,
}

const BF16: &[DType] = &[DType::BF16];
const F8: &[DType] = &[DType::F8_E4M3];
const U8: &[DType] = &[DType::U8];
const F32: &[DType] = &[DType::F32];
/// Weights per NVFP4 group scale (`group_size` of the scheme, checked by `validate_scheme`).
pub const NVFP4_GROUP: usize = 16;
/// Small parameter vectors: stored BF16 or F32 depending on the exporter (Qwen3.5 keeps
/// `A_log` and `linear_attn.norm` in F32, Qwen3.6 in BF16); converted at load.
const VEC: &[DType] = &[DType::BF16, DType::F32];
const SCALE: &[DType] = &[DType::BF16, DType::F32];

const FIX_SHAPE: &str =
    "this tensor does not fit the dimensions in config.json; use the config.json that came with these weights";
const FIX_DTYPE: &str =
    "re-export the checkpoint with the vendor recipe (compressed-tensors FP8_DYNAMIC or NVFP4A16) or use the BF16 original";

fn io(path: &Path) -> impl Fn(std::io::Error) -> SpecError + '_ {
    move |source| SpecError::Io { path: path.to_path_buf(), err: source }
}

/// `model.language_model` when the checkpoint is a ConditionalGeneration export, `model` for a
/// text-only CausalLM export.
pub fn text_prefix_of(names: &BTreeSet<String>) -> Option<&'static str> {
    if names.contains("model.language_model.embed_tokens.weight") {
        Some("model.language_model")
    } else if names.contains("model.embed_tokens.weight") {
        Some("model")
    } else {
        None
    }
}

fn cfg_err(path: &Path, field: &str, expected: impl Into<String>, found: impl Into<String>, fix: &str) -> SpecError {
    SpecError::Config {
        path: path.to_path_buf(),
        field: field.to_string(),
        expected: expected.into(),
        found: found.into(),
        fix: fix.to_string(),
    }
}

struct Parsed {
    model_type: String,
    text: TextConfig,
    quant: Option<QuantizationConfig>,
}

fn parse_config(path: &Path, bytes: &[u8]) -> Result<Parsed> {
    let json = |source| SpecError::Json { path: path.to_path_buf(), what: "config.json", err: source };
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(json)?;
    let model_type = value.get("model_type").and_then(|v| v.as_str()).unwrap_or("").to_string();
    match model_type.as_str() {
        "qwen3_5_moe" => {
            let c: HfConfig = serde_json::from_value(value).map_err(json)?;
            Ok(Parsed { model_type, text: c.text_config, quant: c.quantization_config })
        }
        "qwen3_5_moe_text" => {
            let quant = match value.get("quantization_config") {
                Some(q) => Some(serde_json::from_value(q.clone()).map_err(json)?),
                None => None,
            };
            let text: TextConfig = serde_json::from_value(value).map_err(json)?;
            Ok(Parsed { model_type, text, quant })
        }
        other => Err(cfg_err(
            path,
            "model_type",
            "\"qwen3_5_moe\" (or \"qwen3_5_moe_text\")",
            format!("{other:?}"),
            "Ornith serves Qwen3.5-MoE checkpoints (Ornith 1.0 35B); point --model at one",
        )),
    }
}

fn dims_of(path: &Path, t: &TextConfig) -> Result<(Dims, Vec<LayerKind>)> {
    let fix = "use the config.json that came with the checkpoint";
    let positive = [
        ("text_config.vocab_size", t.vocab_size),
        ("text_config.hidden_size", t.hidden_size),
        ("text_config.num_hidden_layers", t.num_hidden_layers),
        ("text_config.num_attention_heads", t.num_attention_heads),
        ("text_config.num_key_value_heads", t.num_key_value_heads),
        ("text_config.head_dim", t.head_dim),
        ("text_config.linear_num_key_heads", t.linear_num_key_heads),
        ("text_config.linear_num_value_heads", t.linear_num_value_heads),
        ("text_config.linear_key_head_dim", t.linear_key_head_dim),
        ("text_config.linear_value_head_dim", t.linear_value_head_dim),
        ("text_config.linear_conv_kernel_dim", t.linear_conv_kernel_dim),
        ("text_config.num_experts", t.num_experts),
        ("text_config.num_experts_per_tok", t.num_experts_per_tok),
        ("text_config.moe_intermediate_size", t.moe_intermediate_size),
        ("text_config.shared_expert_intermediate_size", t.shared_expert_intermediate_size),
    ];
    for (field, v) in positive {
        if v == 0 {
            return Err(cfg_err(path, field, "a positive integer", "0", fix));
        }
        // Bounds far above any real model keep every derived size (products of up to three
        // of these) and the expected-tensor inventory finite: a corrupt config is refused,
        // not multiplied into an overflow or a billion-entry plan.
        let limit = match field {
            "text_config.vocab_size" => 1 << 24,
            "text_config.num_hidden_layers" => 1 << 10,
            "text_config.num_experts" => 1 << 14,
            _ => 1 << 20,
        };
        if v > limit {
            return Err(cfg_err(path, field, format!("at most {limit}"), v.to_string(), fix));
        }
    }
    if t.max_position_embeddings == 0 || t.max_position_embeddings > 1 << 32 {
        return Err(cfg_err(
            path,
            "text_config.max_position_embeddings",
            "a positive integer up to 2^32",
            t.max_position_embeddings.to_string(),
            fix,
        ));
    }
    if !t.num_attention_heads.is_multiple_of(t.num_key_value_heads) {
        return Err(cfg_err(
            path,
            "text_config.num_attention_heads",
            format!("a multiple of num_key_value_heads ({})", t.num_key_value_heads),
            t.num_attention_heads.to_string(),
            fix,
        ));
    }
    if !t.linear_num_value_heads.is_multiple_of(t.linear_num_key_heads) {
        return Err(cfg_err(
            path,
            "text_config.linear_num_value_heads",
            format!("a multiple of linear_num_key_heads ({})", t.linear_num_key_heads),
            t.linear_num_value_heads.to_string(),
            fix,
        ));
    }
    if t.num_experts_per_tok > t.num_experts {
        return Err(cfg_err(
            path,
            "text_config.num_experts_per_tok",
            format!("at most num_experts ({})", t.num_experts),
            t.num_experts_per_tok.to_string(),
            fix,
        ));
    }
    if t.hidden_act != "silu" {
        return Err(cfg_err(path, "text_config.hidden_act", "\"silu\"", format!("{:?}", t.hidden_act), fix));
    }
    if t.attention_bias == Some(true) {
        return Err(cfg_err(path, "text_config.attention_bias", "false", "true", fix));
    }
    if t.attn_output_gate == Some(false) {
        return Err(cfg_err(
            path,
            "text_config.attn_output_gate",
            "true (Qwen3.5 always gates attention)",
            "false",
            fix,
        ));
    }
    if t.norm_topk_prob == Some(false) {
        return Err(cfg_err(
            path,
            "text_config.norm_topk_prob",
            "true or absent (Qwen3.5 renormalises the top-k)",
            "false",
            fix,
        ));
    }
    if t.tie_word_embeddings == Some(true) {
        return Err(cfg_err(path, "text_config.tie_word_embeddings", "false (separate lm_head)", "true", fix));
    }
    let rp = t.rope_parameters.as_ref();
    if let Some(kind) = rp.and_then(|r| r.rope_type.as_deref()) {
        if kind != "default" {
            return Err(cfg_err(
                path,
                "text_config.rope_parameters.rope_type",
                "\"default\"",
                format!("{kind:?} (RoPE scaling is not implemented)"),
                fix,
            ));
        }
    }
    let partial = rp.and_then(|r| r.partial_rotary_factor).or(t.partial_rotary_factor).unwrap_or(0.25);
    let theta = rp.and_then(|r| r.rope_theta).or(t.rope_theta).unwrap_or(10_000_000.0);
    let rotary = (t.head_dim as f64 * partial) as usize;
    if rotary == 0
        || !rotary.is_multiple_of(2)
        || rotary > t.head_dim
        || (rotary as f64 - t.head_dim as f64 * partial).abs() > 1e-9
    {
        return Err(cfg_err(
            path,
            "text_config.partial_rotary_factor",
            format!("a factor giving an even rotary dim ≤ head_dim {}", t.head_dim),
            partial.to_string(),
            fix,
        ));
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(cfg_err(
            path,
            "text_config.rope_parameters.rope_theta",
            "a positive number",
            theta.to_string(),
            fix,
        ));
    }
    if !(t.rms_norm_eps.is_finite() && t.rms_norm_eps > 0.0) {
        return Err(cfg_err(path, "text_config.rms_norm_eps", "a positive number", t.rms_norm_eps.to_string(), fix));
    }
    let kinds = match &t.layer_types {
        Some(list) => {
            if list.len() != t.num_hidden_layers {
                return Err(cfg_err(
                    path,
                    "text_config.layer_types",
                    format!("{} entries (num_hidden_layers)", t.num_hidden_layers),
                    format!("{} entries", list.len()),
                    fix,
                ));
            }
            list.iter()
                .enumerate()
                .map(|(i, k)| match k.as_str() {
                    "linear_attention" => Ok(LayerKind::LinearAttention),
                    "full_attention" => Ok(LayerKind::FullAttention),
                    other => Err(cfg_err(
                        path,
                        &format!("text_config.layer_types[{i}]"),
                        "\"linear_attention\" or \"full_attention\"",
                        format!("{other:?}"),
                        fix,
                    )),
                })
                .collect::<Result<Vec<_>>>()?
        }
        None => {
            let interval = t.full_attention_interval.unwrap_or(4);
            if interval == 0 {
                return Err(cfg_err(path, "text_config.full_attention_interval", "a positive integer", "0", fix));
            }
            (0..t.num_hidden_layers)
                .map(|i| if (i + 1) % interval == 0 { LayerKind::FullAttention } else { LayerKind::LinearAttention })
                .collect()
        }
    };
    let dims = Dims {
        vocab_size: t.vocab_size,
        hidden_size: t.hidden_size,
        num_hidden_layers: t.num_hidden_layers,
        num_attention_heads: t.num_attention_heads,
        num_key_value_heads: t.num_key_value_heads,
        head_dim: t.head_dim,
        rotary_dim: rotary,
        rope_theta: theta,
        linear_num_key_heads: t.linear_num_key_heads,
        linear_num_value_heads: t.linear_num_value_heads,
        linear_key_head_dim: t.linear_key_head_dim,
        linear_value_head_dim: t.linear_value_head_dim,
        linear_conv_kernel_dim: t.linear_conv_kernel_dim,
        num_experts: t.num_experts,
        num_experts_per_tok: t.num_experts_per_tok,
        moe_intermediate_size: t.moe_intermediate_size,
        shared_expert_intermediate_size: t.shared_expert_intermediate_size,
        rms_norm_eps: t.rms_norm_eps,
        max_position_embeddings: t.max_position_embeddings,
    };
    Ok((dims, kinds))
}

/// Builds the expected inventory while deciding each Linear's precision.
struct Planner<'a> {
    dir: &'a Path,
    stored: &'a BTreeMap<String, (String, HeaderEntry)>,
    /// The ignore list and the precision of every Linear it does not keep in BF16.
    quant: Option<(&'a IgnoreList, Precision)>,
    expected: BTreeMap<String, Expect>,
}

impl Planner<'_> {
    fn expect(&mut self, name: String, dtypes: &'static [DType], shape: Vec<usize>, fix: &'static str) {
        self.expected.insert(name, Expect { dtypes, shapes: vec![shape], fix });
    }

    fn shard_path(&self, name: &str) -> PathBuf {
        match self.stored.get(name) {
            Some((shard, _)) => self.dir.join(shard),
            None => self.dir.to_path_buf(),
        }
    }

    /// Decides the precision of a Linear and records its tensors. `quantizable` is false for
    /// modules that are not `nn.Linear` in transformers (the router), which compressed-tensors
    /// never targets.
    fn linear(&mut self, module: String, out_f: usize, in_f: usize, quantizable: bool) -> Result<LinearSpec> {
        let (precision, ignored_by) = match self.quant {
            None => (Precision::Bf16, None),
            Some(_) if !quantizable => (Precision::Bf16, None),
            Some((ig, quantised)) => match ig.matching(&module) {
                Some(p) => (Precision::Bf16, Some(p.to_string())),
                None => (quantised, None),
            },
        };
        self.check_stored_precision(&module, precision, ignored_by.as_deref(), quantizable)?;
        let w = format!("{module}.weight");
        match precision {
            Precision::Bf16 => self.expect(w, BF16, vec![out_f, in_f], FIX_SHAPE),
            Precision::Fp8 => {
                self.expect(w, F8, vec![out_f, in_f], FIX_SHAPE);
                self.expected.insert(
                    format!("{module}.weight_scale"),
                    Expect {
                        dtypes: SCALE,
                        shapes: vec![vec![out_f, 1], vec![out_f]],
                        fix: "a per-output-channel scale is required for FP8 weights",
                    },
                );
            }
            Precision::Nvfp4 => {
                let packed = format!("{module}.weight_packed");
                if !in_f.is_multiple_of(NVFP4_GROUP) {
                    return Err(SpecError::TensorMismatch {
                        path: self.shard_path(&packed),
                        tensor: packed,
                        expected: format!("in_features a multiple of the group size {NVFP4_GROUP}"),
                        found: format!("in_features {in_f}"),
                        fix: "NVFP4 groups of 16 weights must tile every row; keep this module in BF16 with an ignore entry".into(),
                    });
                }
                self.expect(packed, U8, vec![out_f, in_f / 2], FIX_SHAPE);
                self.expected.insert(
                    format!("{module}.weight_scale"),
                    Expect {
                        dtypes: F8,
                        shapes: vec![vec![out_f, in_f / NVFP4_GROUP]],
                        fix:
                            "NVFP4 needs one F8_E4M3 scale per 16 weights of a row; re-export with the NVFP4A16 scheme",
                    },
                );
                self.expected.insert(
                    format!("{module}.weight_global_scale"),
                    Expect {
                        dtypes: F32,
                        shapes: vec![vec![1]],
                        fix: "NVFP4 needs one F32 global scale per Linear; re-export with the NVFP4A16 scheme",
                    },
                );
            }
        }
        Ok(LinearSpec { module, precision, out_features: out_f, in_features: in_f, ignored_by })
    }

    /// The ignore list and the stored tensors must tell the same story: `{module}.weight` in
    /// F8_E4M3 is FP8, `{module}.weight_packed` is NVFP4, a `{module}.weight` of any other dtype
    /// is BF16 (its dtype is checked with the rest of the inventory).
    fn check_stored_precision(
        &self,
        module: &str,
        precision: Precision,
        ignored_by: Option<&str>,
        quantizable: bool,
    ) -> Result<()> {
        let weight = format!("{module}.weight");
        let packed = format!("{module}.weight_packed");
        let (tensor, stored) = match (self.stored.get(&weight), self.stored.get(&packed)) {
            (Some((_, e)), _) if e.dtype == DType::F8_E4M3 => (weight.clone(), Precision::Fp8),
            (Some(_), _) => (weight.clone(), Precision::Bf16),
            (None, Some(_)) => (packed.clone(), Precision::Nvfp4),
            (None, None) => return Ok(()), // reported as missing later
        };
        if stored == precision {
            return Ok(());
        }
        let found = match stored {
            Precision::Bf16 => format!("{} (a plain .weight)", self.stored[&tensor].1.dtype),
            Precision::Fp8 => "F8_E4M3 (an FP8 .weight)".into(),
            Precision::Nvfp4 => "U8 .weight_packed (an NVFP4 weight)".into(),
        };
        let why = match (self.quant, ignored_by, quantizable) {
            (None, _, _) => "config.json has no quantization_config, so every Linear is BF16".to_string(),
            (Some(_), Some(p), _) => format!("ignore entry {p:?} keeps this module in BF16"),
            (Some(_), None, false) => {
                "this module is not an nn.Linear (the router), which compressed-tensors never quantises".to_string()
            }
            (Some((_, q)), None, true) => format!(
                "no entry of quantization_config.ignore matches this module, so compressed-tensors quantised it to {}",
                q.name()
            ),
        };
        let expected = match precision {
            Precision::Bf16 => format!("BF16 ({why})"),
            Precision::Fp8 => format!("F8_E4M3 ({why})"),
            Precision::Nvfp4 => format!("U8 .weight_packed with .weight_scale and .weight_global_scale ({why})"),
        };
        Err(SpecError::TensorMismatch {
            path: self.shard_path(&tensor),
            tensor,
            expected,
            found,
            fix: "the quantization_config (format and ignore patterns) disagrees with the stored tensors; restore the config.json that came with these shards".into(),
        })
    }
}

/// Reads and validates a checkpoint directory.
pub fn load_checkpoint(dir: &Path) -> Result<ModelSpec> {
    let dir = std::fs::canonicalize(dir).map_err(io(dir))?;
    let dir = dir.as_path();
    let config_path = dir.join("config.json");
    let config_bytes = std::fs::read(&config_path).map_err(io(&config_path))?;
    let parsed = parse_config(&config_path, &config_bytes)?;
    let (dims, kinds) = dims_of(&config_path, &parsed.text)?;

    let ignore = match &parsed.quant {
        Some(q) => {
            let precision = validate_scheme(&config_path, q)?;
            Some((IgnoreList::compile(&config_path, &q.ignore)?, precision))
        }
        None => None,
    };

    // --- index and shard headers -------------------------------------------------------
    let index_path = dir.join("model.safetensors.index.json");
    let single = dir.join("model.safetensors");
    let (index_bytes, weight_map): (Vec<u8>, BTreeMap<String, String>) = if index_path.exists() {
        let bytes = std::fs::read(&index_path).map_err(io(&index_path))?;
        let idx: SafetensorsIndex = serde_json::from_slice(&bytes).map_err(|source| SpecError::Json {
            path: index_path.clone(),
            what: "model.safetensors.index.json",
            err: source,
        })?;
        (bytes, idx.weight_map)
    } else if single.exists() {
        let h = read_header(&single)?;
        (Vec::new(), h.tensors.keys().map(|k| (k.clone(), "model.safetensors".to_string())).collect())
    } else {
        return Err(SpecError::NoIndex { dir: dir.to_path_buf() });
    };

    let shard_names: BTreeSet<&String> = weight_map.values().collect();
    let mut headers: BTreeMap<String, ShardHeader> = BTreeMap::new();
    for shard in shard_names {
        let p = dir.join(shard);
        if shard.contains('/') || shard.contains('\\') || shard.starts_with('.') {
            return Err(SpecError::IndexMismatch {
                path: index_path.clone(),
                tensor: shard.clone(),
                reason: "shard names must be plain file names inside the checkpoint directory".into(),
            });
        }
        if !p.exists() {
            let tensor = weight_map.iter().find(|(_, s)| *s == shard).map(|(t, _)| t.clone()).unwrap_or_default();
            return Err(SpecError::MissingShard { path: index_path.clone(), shard: shard.clone(), tensor });
        }
        headers.insert(shard.clone(), read_header(&p)?);
    }
    // Index ↔ headers, both directions.
    let mut stored: BTreeMap<String, (String, HeaderEntry)> = BTreeMap::new();
    for (name, shard) in &weight_map {
        let h = &headers[shard];
        let Some(e) = h.tensors.get(name) else {
            return Err(SpecError::IndexMismatch {
                path: dir.join(shard),
                tensor: name.clone(),
                reason: format!("the index places it in {shard}, but that shard's header does not contain it"),
            });
        };
        stored.insert(name.clone(), (shard.clone(), e.clone()));
    }
    for (shard, h) in &headers {
        for name in h.tensors.keys() {
            if weight_map.get(name) != Some(shard) {
                return Err(SpecError::IndexMismatch {
                    path: dir.join(shard),
                    tensor: name.clone(),
                    reason: "stored in this shard but the index does not list it here".into(),
                });
            }
        }
    }

    let names: BTreeSet<String> = stored.keys().cloned().collect();
    let prefix = text_prefix_of(&names).ok_or_else(|| SpecError::MissingTensor {
        path: index_path.clone(),
        tensor: "model.language_model.embed_tokens.weight".into(),
        expected: format!("BF16 [{}, {}]", dims.vocab_size, dims.hidden_size),
    })?;

    // --- expected inventory and precisions ----------------------------------------------
    let mut pl =
        Planner { dir, stored: &stored, quant: ignore.as_ref().map(|(l, p)| (l, *p)), expected: BTreeMap::new() };
    let h = dims.hidden_size;
    pl.expect(format!("{prefix}.embed_tokens.weight"), BF16, vec![dims.vocab_size, h], FIX_SHAPE);
    pl.expect(format!("{prefix}.norm.weight"), VEC, vec![h], FIX_SHAPE);
    let lm_head = pl.linear("lm_head".into(), dims.vocab_size, h, true)?;

    let mut layers = Vec::with_capacity(dims.num_hidden_layers);
    for (i, &kind) in kinds.iter().enumerate() {
        let l = format!("{prefix}.layers.{i}");
        pl.expect(format!("{l}.input_layernorm.weight"), VEC, vec![h], FIX_SHAPE);
        pl.expect(format!("{l}.post_attention_layernorm.weight"), VEC, vec![h], FIX_SHAPE);
        let mixer = match kind {
            LayerKind::LinearAttention => {
                let m = format!("{l}.linear_attn");
                let hv = dims.linear_num_value_heads;
                pl.expect(
                    format!("{m}.conv1d.weight"),
                    VEC,
                    vec![dims.conv_dim(), 1, dims.linear_conv_kernel_dim],
                    FIX_SHAPE,
                );
                pl.expect(format!("{m}.dt_bias"), VEC, vec![hv], FIX_SHAPE);
                pl.expect(format!("{m}.A_log"), VEC, vec![hv], FIX_SHAPE);
                pl.expect(format!("{m}.norm.weight"), VEC, vec![dims.linear_value_head_dim], FIX_SHAPE);
                MixerSpec::LinearAttention(GdnSpec {
                    in_proj_qkv: pl.linear(format!("{m}.in_proj_qkv"), dims.conv_dim(), h, true)?,
                    in_proj_z: pl.linear(format!("{m}.in_proj_z"), dims.value_dim(), h, true)?,
                    in_proj_b: pl.linear(format!("{m}.in_proj_b"), hv, h, true)?,
                    in_proj_a: pl.linear(format!("{m}.in_proj_a"), hv, h, true)?,
                    out_proj: pl.linear(format!("{m}.out_proj"), h, dims.value_dim(), true)?,
                })
            }
            LayerKind::FullAttention => {
                let m = format!("{l}.self_attn");
                let (nh, nkv, hd) = (dims.num_attention_heads, dims.num_key_value_heads, dims.head_dim);
                pl.expect(format!("{m}.q_norm.weight"), VEC, vec![hd], FIX_SHAPE);
                pl.expect(format!("{m}.k_norm.weight"), VEC, vec![hd], FIX_SHAPE);
                MixerSpec::FullAttention(AttentionSpec {
                    // Query and output gate interleaved per head: [nh, 2, hd] rows.
                    q_proj: pl.linear(format!("{m}.q_proj"), nh * hd * 2, h, true)?,
                    k_proj: pl.linear(format!("{m}.k_proj"), nkv * hd, h, true)?,
                    v_proj: pl.linear(format!("{m}.v_proj"), nkv * hd, h, true)?,
                    o_proj: pl.linear(format!("{m}.o_proj"), h, nh * hd, true)?,
                })
            }
        };
        let m = format!("{l}.mlp");
        let gate = pl.linear(format!("{m}.gate"), dims.num_experts, h, false)?;
        let shared_expert = MlpSpec {
            gate_proj: pl.linear(
                format!("{m}.shared_expert.gate_proj"),
                dims.shared_expert_intermediate_size,
                h,
                true,
            )?,
            up_proj: pl.linear(format!("{m}.shared_expert.up_proj"), dims.shared_expert_intermediate_size, h, true)?,
            down_proj: pl.linear(
                format!("{m}.shared_expert.down_proj"),
                h,
                dims.shared_expert_intermediate_size,
                true,
            )?,
        };
        let shared_expert_gate = pl.linear(format!("{m}.shared_expert_gate"), 1, h, true)?;
        let experts = plan_experts(&mut pl, &format!("{m}.experts"), &dims)?;
        layers.push(LayerSpec {
            index: i,
            kind,
            module: l,
            mixer,
            mlp: MoeSpec { gate, experts, shared_expert, shared_expert_gate },
        });
    }

    // --- compare inventory with what is stored ------------------------------------------
    let mut visual = 0;
    let mut mtp = 0;
    for (name, (shard, e)) in &stored {
        if let Some(exp) = pl.expected.get(name) {
            if !exp.dtypes.contains(&e.dtype) {
                let want: Vec<&str> = exp.dtypes.iter().map(|d| d.as_str()).collect();
                return Err(SpecError::TensorMismatch {
                    path: dir.join(shard),
                    tensor: name.clone(),
                    expected: format!("dtype {}", want.join(" or ")),
                    found: format!("dtype {}", e.dtype),
                    fix: FIX_DTYPE.into(),
                });
            }
            if !exp.shapes.contains(&e.shape) {
                return Err(SpecError::TensorMismatch {
                    path: dir.join(shard),
                    tensor: name.clone(),
                    expected: format!("shape {:?}", exp.shapes[0]),
                    found: format!("shape {:?}", e.shape),
                    fix: exp.fix.into(),
                });
            }
        } else if report::is_visual(name) {
            visual += 1;
        } else if name.starts_with("mtp.") {
            mtp += 1;
        } else {
            return Err(SpecError::ExtraTensor {
                path: dir.join(shard),
                tensor: name.clone(),
                found: format!("{} {:?}", e.dtype, e.shape),
            });
        }
    }
    for (name, exp) in &pl.expected {
        if !stored.contains_key(name) {
            let want: Vec<&str> = exp.dtypes.iter().map(|d| d.as_str()).collect();
            return Err(SpecError::MissingTensor {
                path: if index_bytes.is_empty() { single.clone() } else { index_path.clone() },
                tensor: name.clone(),
                expected: format!("{} {:?}", want.join("/"), exp.shapes[0]),
            });
        }
    }

    // --- fingerprint, shards, eos -------------------------------------------------------
    let mut hasher = Sha256::new();
    hasher.update(&config_bytes);
    hasher.update(&index_bytes);
    let mut shards = Vec::new();
    for (name, h) in &headers {
        hasher.update(name.as_bytes());
        hasher.update(h.file_size.to_le_bytes());
        hasher.update(&h.raw);
        shards.push(ShardInfo { file: name.clone(), file_size: h.file_size, header_len: h.header_len });
    }
    let fingerprint = format!("{:x}", hasher.finalize());

    let eos_token_ids = eos_ids(dir, &parsed.text);
    let tensors = stored
        .into_iter()
        .map(|(n, (shard, e))| (n, TensorInfo { dtype: e.dtype, shape: e.shape, shard, data_offsets: e.data_offsets }))
        .collect();

    Ok(ModelSpec {
        format_version: SPEC_FORMAT_VERSION,
        fingerprint,
        model_dir: dir.to_path_buf(),
        model_type: parsed.model_type,
        text_prefix: prefix.to_string(),
        dims,
        layers,
        embed_tokens: format!("{prefix}.embed_tokens.weight"),
        final_norm: format!("{prefix}.norm.weight"),
        lm_head,
        quant: parsed.quant.as_ref().map(|q| QuantSpec {
            quant_method: q.quant_method.clone(),
            format: q.format.clone().unwrap_or_default(),
            ignore: q.ignore.clone(),
        }),
        mtp_config_layers: parsed.text.mtp_num_hidden_layers.unwrap_or(0),
        mtp_tensors: mtp,
        visual_tensors: visual,
        eos_token_ids,
        shards,
        tensors,
    })
}

/// Routed experts: per-expert or fused, normalised to one description.
fn plan_experts(pl: &mut Planner<'_>, m: &str, d: &Dims) -> Result<ExpertsSpec> {
    let (e, i, h) = (d.num_experts, d.moe_intermediate_size, d.hidden_size);
    let fused = pl.stored.contains_key(&format!("{m}.gate_up_proj"));
    if fused {
        // Fused 3-D parameters are not nn.Linear modules: compressed-tensors cannot quantise
        // them, so they must be BF16.
        pl.expect(format!("{m}.gate_up_proj"), BF16, vec![e, 2 * i, h], FIX_SHAPE);
        pl.expect(format!("{m}.down_proj"), BF16, vec![e, h, i], FIX_SHAPE);
        return Ok(ExpertsSpec {
            module: m.into(),
            layout: ExpertLayout::Fused,
            num_experts: e,
            intermediate_size: i,
            hidden_size: h,
            gate_proj: Precision::Bf16,
            up_proj: Precision::Bf16,
            down_proj: Precision::Bf16,
        });
    }
    let mut prec = [None::<Precision>; 3];
    for x in 0..e {
        for (k, (proj, out_f, in_f)) in
            [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)].into_iter().enumerate()
        {
            let spec = pl.linear(format!("{m}.{x}.{proj}"), out_f, in_f, true)?;
            match prec[k] {
                None => prec[k] = Some(spec.precision),
                Some(p) if p != spec.precision => {
                    return Err(SpecError::TensorMismatch {
                        path: pl.shard_path(&weight_name(&spec)),
                        tensor: weight_name(&spec),
                        expected: format!("{p:?} like expert 0's {proj}"),
                        found: format!("{:?}", spec.precision),
                        fix: "experts of one layer must share one precision; fix the ignore list".into(),
                    })
                }
                _ => {}
            }
        }
    }
    Ok(ExpertsSpec {
        module: m.into(),
        layout: ExpertLayout::PerExpert,
        num_experts: e,
        intermediate_size: i,
        hidden_size: h,
        gate_proj: prec[0].unwrap(),
        up_proj: prec[1].unwrap(),
        down_proj: prec[2].unwrap(),
    })
}

/// The tensor holding a Linear's weight: `.weight_packed` for NVFP4, `.weight` otherwise.
fn weight_name(l: &LinearSpec) -> String {
    match l.precision {
        Precision::Nvfp4 => format!("{}.weight_packed", l.module),
        _ => format!("{}.weight", l.module),
    }
}

/// Stop tokens: generation_config.json's `eos_token_id` (int or list) when present, else the
/// text config's.
fn eos_ids(dir: &Path, t: &TextConfig) -> Vec<u32> {
    fn ids(v: &serde_json::Value) -> Vec<u32> {
        match v {
            serde_json::Value::Number(n) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            serde_json::Value::Array(a) => a.iter().flat_map(ids).collect(),
            _ => vec![],
        }
    }
    let from_gen = std::fs::read(dir.join("generation_config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v.get("eos_token_id").map(ids));
    match from_gen {
        Some(v) if !v.is_empty() => v,
        _ => t.eos_token_id.as_ref().map(ids).unwrap_or_default(),
    }
}
