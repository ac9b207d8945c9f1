//! The plan of a synthetic checkpoint: every tensor's name, dtype, shape and initialiser, its
//! shard and byte range, and each shard's exact header bytes — pure metadata, no tensor data.
//! The writer streams data to these byte ranges; tests can build the full preset's index and
//! headers from the plan alone.

use super::config::VENDOR_IGNORE;
use super::init::Init;
use super::preset::Preset;
use model_spec::quant::IgnoreList;
use model_spec::DType;
use std::collections::BTreeMap;
use std::path::Path;

/// Which compressed-tensors scheme quantises the Linears the ignore list does not keep BF16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, clap::ValueEnum)]
pub enum Quant {
    /// FP8_DYNAMIC (`float-quantized`): the vendor's served export.
    #[default]
    Fp8,
    /// NVFP4A16 (`nvfp4-pack-quantized`): E2M1 weights in groups of 16, BF16 activations.
    Nvfp4a16,
}

/// The global scale of every synthetic NVFP4 Linear: compressed-tensors' `448 · 6 / amax` for an
/// amax of six standard deviations of [`Init::WEIGHT`] (the weights are drawn before quantising,
/// and the rare value beyond 6σ saturates at ±6 of its group's scale).
pub fn nvfp4_global_scale() -> f32 {
    let Init::Normal { std, .. } = Init::WEIGHT else { unreachable!("Linear weights are normal") };
    model_spec::nvfp4::global_scale_for(6.0 * std)
}

/// How a tensor's bytes are produced.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    /// Values drawn from `init`, cast to the stored dtype (BF16 or F32).
    Dense(Init),
    /// An FP8 Linear weight `[out, in]`: each row drawn from `init` (f32), then quantised with
    /// `model_spec::fp8::quantize_weight_row`.
    Fp8Weight(Init),
    /// The `[out, 1]` BF16 scales of the FP8 weight `weight` (whose values come from `init`
    /// with rows of `in_features`).
    Fp8Scale { weight: String, init: Init, in_features: usize },
    /// An NVFP4 Linear's `weight_packed` `[out, in/2]`: each row drawn from `init` (f32, the
    /// stream of the `.weight_packed` tensor's name), then quantised with
    /// `model_spec::nvfp4::quantize_row` and [`nvfp4_global_scale`].
    Nvfp4Packed(Init),
    /// The `[out, in/16]` E4M3 group scales of the NVFP4 weight `packed`.
    Nvfp4Scale { packed: String, init: Init, in_features: usize },
}

#[derive(Debug, Clone, PartialEq)]
pub struct PlannedTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub kind: Kind,
    /// Byte range inside the shard's data section.
    pub data_offsets: (u64, u64),
}

impl PlannedTensor {
    pub fn nbytes(&self) -> u64 {
        self.data_offsets.1 - self.data_offsets.0
    }
}

#[derive(Debug, Clone)]
pub struct ShardPlan {
    pub file: String,
    /// The JSON header, space-padded to a multiple of 8 bytes (as safetensors does).
    pub header: Vec<u8>,
    pub tensors: Vec<PlannedTensor>,
    pub data_len: u64,
}

impl ShardPlan {
    pub fn file_len(&self) -> u64 {
        8 + self.header.len() as u64 + self.data_len
    }
}

#[derive(Debug, Clone)]
pub struct Plan {
    pub preset: Preset,
    pub seed: u64,
    pub quant: Quant,
    pub shards: Vec<ShardPlan>,
}

impl Plan {
    pub fn tensor_count(&self) -> usize {
        self.shards.iter().map(|s| s.tensors.len()).sum()
    }
    /// Sum of all tensor byte lengths (the index's `metadata.total_size`).
    pub fn total_size(&self) -> u64 {
        self.shards.iter().map(|s| s.data_len).sum()
    }
    pub fn tensors(&self) -> impl Iterator<Item = (&ShardPlan, &PlannedTensor)> {
        self.shards.iter().flat_map(|s| s.tensors.iter().map(move |t| (s, t)))
    }
    pub fn find(&self, name: &str) -> Option<(&ShardPlan, &PlannedTensor)> {
        self.tensors().find(|(_, t)| t.name == name)
    }
    /// `model.safetensors.index.json` (keys sorted, like huggingface_hub writes it).
    pub fn index_json(&self) -> serde_json::Value {
        let map: BTreeMap<&str, &str> = self.tensors().map(|(s, t)| (t.name.as_str(), s.file.as_str())).collect();
        let mut weight_map = serde_json::Map::new();
        for (k, v) in map {
            weight_map.insert(k.to_string(), serde_json::Value::String(v.to_string()));
        }
        serde_json::json!({ "metadata": { "total_size": self.total_size() }, "weight_map": weight_map })
    }
}

/// Zero-centred RMSNorm weights (used as `1 + w`). transformers initialises them to zeros;
/// we draw small values around 0 instead so that tests exercise the weights (a zero weight
/// would hide a missing `1 +` or a wrong norm tensor).
const ZERO_CENTRED_NORM: Init = Init::Normal { mean: 0.0, std: 0.1 };
/// Plain-scale norms (GDN gated norm): transformers initialises ones; ~1 for the same reason.
const UNIT_NORM: Init = Init::Normal { mean: 1.0, std: 0.1 };

struct Lister {
    ignore: IgnoreList,
    quant: Quant,
    out: Vec<(String, DType, Vec<usize>, Kind)>,
}

impl Lister {
    fn dense(&mut self, name: String, dtype: DType, shape: Vec<usize>, init: Init) {
        self.out.push((name, dtype, shape, Kind::Dense(init)));
    }

    /// A Linear: FP8 (weight + per-channel scale) or NVFP4 (packed codes, group scales, global
    /// scale) unless an ignore pattern matches the module, exactly as compressed-tensors decides it.
    fn linear(&mut self, module: String, out_f: usize, in_f: usize) {
        let weight = format!("{module}.weight");
        if self.ignore.matching(&module).is_some() {
            self.dense(weight, DType::BF16, vec![out_f, in_f], Init::WEIGHT);
        } else if self.quant == Quant::Nvfp4a16 {
            let g = model_spec::nvfp4::GROUP;
            assert!(in_f.is_multiple_of(g), "{module}: in_features {in_f} is not a multiple of {g}");
            let packed = format!("{module}.weight_packed");
            self.dense(format!("{module}.weight_global_scale"), DType::F32, vec![1], Init::Const(nvfp4_global_scale()));
            self.out.push((
                format!("{module}.weight_scale"),
                DType::F8_E4M3,
                vec![out_f, in_f / g],
                Kind::Nvfp4Scale { packed: packed.clone(), init: Init::WEIGHT, in_features: in_f },
            ));
            self.out.push((packed, DType::U8, vec![out_f, in_f / 2], Kind::Nvfp4Packed(Init::WEIGHT)));
        } else {
            self.out.push((
                format!("{module}.weight_scale"),
                DType::BF16,
                vec![out_f, 1],
                Kind::Fp8Scale { weight: weight.clone(), init: Init::WEIGHT, in_features: in_f },
            ));
            self.out.push((weight, DType::F8_E4M3, vec![out_f, in_f], Kind::Fp8Weight(Init::WEIGHT)));
        }
    }

    /// An `nn.Linear` with bias of the vision tower (all ignored by `re:.*visual.*`: BF16).
    fn vision_linear(&mut self, module: &str, out_f: usize, in_f: usize) {
        self.dense(format!("{module}.weight"), DType::BF16, vec![out_f, in_f], Init::WEIGHT);
        self.dense(format!("{module}.bias"), DType::BF16, vec![out_f], Init::Const(0.0));
    }

    fn layer_norm(&mut self, module: &str, n: usize) {
        self.dense(format!("{module}.weight"), DType::BF16, vec![n], Init::Const(1.0));
        self.dense(format!("{module}.bias"), DType::BF16, vec![n], Init::Const(0.0));
    }
}

/// Every tensor of the preset (unordered), with its dtype, shape and how to make it.
fn list_tensors(preset: Preset, quant: Quant) -> Vec<(String, DType, Vec<usize>, Kind)> {
    let patterns: Vec<String> = VENDOR_IGNORE.iter().map(|s| s.to_string()).collect();
    let ignore = IgnoreList::compile(Path::new("config.json"), &patterns).expect("the vendor ignore patterns compile");
    let mut l = Lister { ignore, quant, out: Vec::new() };
    let t = preset.text();
    let (h, v) = (t.hidden_size, t.vocab_size);
    let p = "model.language_model";

    l.dense(format!("{p}.embed_tokens.weight"), DType::BF16, vec![v, h], Init::WEIGHT);
    l.dense(format!("{p}.norm.weight"), DType::BF16, vec![h], ZERO_CENTRED_NORM);
    l.linear("lm_head".into(), v, h);

    for i in 0..t.num_hidden_layers {
        let lp = format!("{p}.layers.{i}");
        l.dense(format!("{lp}.input_layernorm.weight"), DType::BF16, vec![h], ZERO_CENTRED_NORM);
        l.dense(format!("{lp}.post_attention_layernorm.weight"), DType::BF16, vec![h], ZERO_CENTRED_NORM);
        if t.is_full_attention(i) {
            let m = format!("{lp}.self_attn");
            let (nh, nkv, hd) = (t.num_attention_heads, t.num_key_value_heads, t.head_dim);
            l.linear(format!("{m}.q_proj"), nh * hd * 2, h); // query + output gate per head
            l.linear(format!("{m}.k_proj"), nkv * hd, h);
            l.linear(format!("{m}.v_proj"), nkv * hd, h);
            l.linear(format!("{m}.o_proj"), h, nh * hd);
            l.dense(format!("{m}.q_norm.weight"), DType::BF16, vec![hd], ZERO_CENTRED_NORM);
            l.dense(format!("{m}.k_norm.weight"), DType::BF16, vec![hd], ZERO_CENTRED_NORM);
        } else {
            let m = format!("{lp}.linear_attn");
            let hv = t.linear_num_value_heads;
            l.linear(format!("{m}.in_proj_qkv"), t.conv_dim(), h);
            l.linear(format!("{m}.in_proj_z"), t.value_dim(), h);
            l.linear(format!("{m}.in_proj_b"), hv, h);
            l.linear(format!("{m}.in_proj_a"), hv, h);
            l.linear(format!("{m}.out_proj"), h, t.value_dim());
            // Depthwise Conv1d [C, 1, K]: torch's default init, kaiming_uniform(a=√5), is
            // U(±1/√fan_in) with fan_in = (in/groups)·K = K. (transformers 5.17 re-draws it as
            // normal(0, 0.02); the torch scale is closer to a trained conv and exercises it.)
            let k = t.linear_conv_kernel_dim;
            let bound = 1.0 / (k as f32).sqrt();
            l.dense(
                format!("{m}.conv1d.weight"),
                DType::BF16,
                vec![t.conv_dim(), 1, k],
                Init::Uniform { lo: -bound, hi: bound },
            );
            // transformers: dt_bias = ones; ±0.1 around it so that the per-head values differ.
            l.dense(format!("{m}.dt_bias"), DType::BF16, vec![hv], Init::Normal { mean: 1.0, std: 0.1 });
            // transformers 5.17: A_log = log(U(0.01, 16)). Stored F32 in the Qwen3.5 export.
            l.dense(format!("{m}.A_log"), DType::F32, vec![hv], Init::LogUniform { lo: 0.01, hi: 16.0 });
            l.dense(format!("{m}.norm.weight"), DType::F32, vec![t.linear_value_head_dim], UNIT_NORM);
        }
        let m = format!("{lp}.mlp");
        l.linear(format!("{m}.gate"), t.num_experts, h);
        l.linear(format!("{m}.shared_expert_gate"), 1, h);
        let is = t.shared_expert_intermediate_size;
        l.linear(format!("{m}.shared_expert.gate_proj"), is, h);
        l.linear(format!("{m}.shared_expert.up_proj"), is, h);
        l.linear(format!("{m}.shared_expert.down_proj"), h, is);
        let ie = t.moe_intermediate_size;
        for e in 0..t.num_experts {
            l.linear(format!("{m}.experts.{e}.gate_proj"), ie, h);
            l.linear(format!("{m}.experts.{e}.up_proj"), ie, h);
            l.linear(format!("{m}.experts.{e}.down_proj"), h, ie);
        }
    }

    // Vision tower, names and shapes of transformers' Qwen3_5MoeVisionModel state_dict.
    let vd = preset.vision();
    let vp = "model.visual";
    let hv = vd.hidden_size;
    l.dense(
        format!("{vp}.patch_embed.proj.weight"),
        DType::BF16,
        vec![hv, vd.in_channels, vd.temporal_patch_size, vd.patch_size, vd.patch_size],
        Init::WEIGHT,
    );
    l.dense(format!("{vp}.patch_embed.proj.bias"), DType::BF16, vec![hv], Init::Const(0.0));
    l.dense(format!("{vp}.pos_embed.weight"), DType::BF16, vec![vd.num_position_embeddings, hv], Init::WEIGHT);
    for b in 0..vd.depth {
        let bp = format!("{vp}.blocks.{b}");
        l.layer_norm(&format!("{bp}.norm1"), hv);
        l.layer_norm(&format!("{bp}.norm2"), hv);
        l.vision_linear(&format!("{bp}.attn.qkv"), 3 * hv, hv);
        l.vision_linear(&format!("{bp}.attn.proj"), hv, hv);
        l.vision_linear(&format!("{bp}.mlp.linear_fc1"), vd.intermediate_size, hv);
        l.vision_linear(&format!("{bp}.mlp.linear_fc2"), hv, vd.intermediate_size);
    }
    // Patch merger: LayerNorm over the tower width, then 2×2 neighbouring patches concatenated.
    let merged = hv * vd.spatial_merge_size * vd.spatial_merge_size;
    l.layer_norm(&format!("{vp}.merger.norm"), hv);
    l.vision_linear(&format!("{vp}.merger.linear_fc1"), merged, merged);
    l.vision_linear(&format!("{vp}.merger.linear_fc2"), vd.out_hidden_size, merged);
    l.out
}

/// safetensors header bytes for one shard, padded with spaces to a multiple of 8.
fn header_bytes(tensors: &[PlannedTensor]) -> Vec<u8> {
    let mut s = String::with_capacity(64 + tensors.len() * 160);
    s.push_str("{\"__metadata__\":{\"format\":\"pt\"}");
    for t in tensors {
        s.push(',');
        s.push_str(&serde_json::to_string(&t.name).expect("strings serialise"));
        s.push_str(":{\"dtype\":\"");
        s.push_str(t.dtype.as_str());
        s.push_str("\",\"shape\":[");
        let dims: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        s.push_str(&dims.join(","));
        s.push_str(&format!("],\"data_offsets\":[{},{}]}}", t.data_offsets.0, t.data_offsets.1));
    }
    s.push('}');
    while !s.len().is_multiple_of(8) {
        s.push(' ');
    }
    s.into_bytes()
}

/// The FP8 plan ([`plan_quant`] with [`Quant::Fp8`]).
pub fn plan(preset: Preset, seed: u64) -> Plan {
    plan_quant(preset, seed, Quant::Fp8)
}

/// Builds the plan: tensors in name order (so each FP8 `.weight` is directly followed by its
/// `.weight_scale`, each NVFP4 `.weight_packed` by its `.weight_scale`), filled greedily into
/// shards of at most `preset.max_shard_bytes()` of data (a single larger tensor gets a shard of
/// its own), contiguous byte ranges per shard.
pub fn plan_quant(preset: Preset, seed: u64, quant: Quant) -> Plan {
    let mut list = list_tensors(preset, quant);
    list.sort_by(|a, b| a.0.cmp(&b.0));
    let limit = preset.max_shard_bytes();
    let mut groups: Vec<Vec<PlannedTensor>> = Vec::new();
    let mut cur: Vec<PlannedTensor> = Vec::new();
    let mut cur_len = 0u64;
    for (name, dtype, shape, kind) in list {
        let n = shape.iter().product::<usize>() as u64 * dtype.size_bytes() as u64;
        if !cur.is_empty() && cur_len + n > limit {
            groups.push(std::mem::take(&mut cur));
            cur_len = 0;
        }
        cur.push(PlannedTensor { name, dtype, shape, kind, data_offsets: (cur_len, cur_len + n) });
        cur_len += n;
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    let count = groups.len();
    let shards = groups
        .into_iter()
        .enumerate()
        .map(|(i, tensors)| ShardPlan {
            file: format!("model-{:05}-of-{:05}.safetensors", i + 1, count),
            header: header_bytes(&tensors),
            data_len: tensors.last().map(|t| t.data_offsets.1).unwrap_or(0),
            tensors,
        })
        .collect();
    Plan { preset, seed, quant, shards }
}
