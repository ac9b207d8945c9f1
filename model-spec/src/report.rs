//! The checkpoint report printed by `cargo xtask inspect` and `cargo xtask gen`.

use crate::{DType, ModelSpec};
use std::collections::BTreeMap;
use std::fmt::Write;

/// `model.visual.*` (ConditionalGeneration) or `visual.*`.
pub fn is_visual(name: &str) -> bool {
    name.starts_with("model.visual.") || name.starts_with("visual.")
}

/// Report group of a tensor name.
pub fn group_of(spec: &ModelSpec, name: &str) -> &'static str {
    if is_visual(name) {
        return "visual";
    }
    if name.starts_with("mtp.") {
        return "mtp";
    }
    if name == spec.embed_tokens {
        return "embeddings";
    }
    if name.starts_with("lm_head.") {
        return "lm_head";
    }
    if name.contains(".mlp.experts.") {
        return "routed experts";
    }
    if name.contains(".mlp.shared_expert_gate.") || name.contains(".mlp.gate.") {
        return "router";
    }
    if name.contains(".mlp.shared_expert.") {
        return "shared expert";
    }
    if name.contains(".linear_attn.") {
        return "linear_attn";
    }
    if name.contains(".self_attn.") {
        return "attention";
    }
    "norms"
}

/// Tensor count and bytes of the language model's Linears by precision (`NVFP4 codes`,
/// `NVFP4 scales`, `FP8 codes`, …): the bytes a decode step streams per form.
pub fn by_form(spec: &ModelSpec) -> BTreeMap<String, (usize, u64)> {
    let mut out: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    let mut add = |name: &str, b: u64| {
        let e = out.entry(name.to_string()).or_default();
        e.0 += 1;
        e.1 += b;
    };
    for (n, t) in &spec.tensors {
        if is_visual(n) || n.starts_with("mtp.") {
            continue;
        }
        let (module, suffix) = n.rsplit_once('.').unwrap_or((n, ""));
        let nvfp4 = spec.tensors.contains_key(&format!("{module}.weight_packed"));
        let fp8 = spec.tensors.get(&format!("{module}.weight")).is_some_and(|w| w.dtype == DType::F8_E4M3);
        let form = match (suffix, nvfp4, fp8) {
            ("weight_packed", true, _) => "NVFP4 codes",
            ("weight_scale" | "weight_global_scale", true, _) => "NVFP4 scales",
            ("weight", _, true) => "FP8 codes",
            ("weight_scale", _, true) => "FP8 scales",
            _ => "BF16 and vectors",
        };
        add(form, t.nbytes());
    }
    out
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB ({b} B)", b as f64 / (1u64 << 30) as f64)
}

/// Human-readable report.
pub fn render(spec: &ModelSpec) -> String {
    let mut s = String::new();
    let d = &spec.dims;
    let _ = writeln!(s, "checkpoint   {}", spec.model_dir.display());
    let _ = writeln!(s, "fingerprint  {}", spec.fingerprint);
    let _ = writeln!(s, "model_type   {}  (text prefix {})", spec.model_type, spec.text_prefix);
    let _ = writeln!(s, "tensors      {} in {} shard(s)", spec.tensors.len(), spec.shards.len());
    let full = spec.num_full_attention_layers();
    let _ = writeln!(
        s,
        "layers       {} = {} Gated DeltaNet + {} gated full attention; {} experts top-{}, hidden {}, vocab {}",
        d.num_hidden_layers,
        d.num_hidden_layers - full,
        full,
        d.num_experts,
        d.num_experts_per_tok,
        d.hidden_size,
        d.vocab_size
    );
    let mut by_dtype: BTreeMap<DType, (usize, u64)> = BTreeMap::new();
    let mut by_group: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for (n, t) in &spec.tensors {
        let e = by_dtype.entry(t.dtype).or_default();
        e.0 += 1;
        e.1 += t.nbytes();
        let g = by_group.entry(group_of(spec, n)).or_default();
        g.0 += 1;
        g.1 += t.nbytes();
    }
    let _ = writeln!(s, "bytes by dtype:");
    for (k, (n, b)) in &by_dtype {
        let _ = writeln!(s, "  {:<16} {:>6} tensors  {}", k.as_str(), n, gib(*b));
    }
    let _ = writeln!(s, "bytes by group:");
    for (k, (n, b)) in &by_group {
        let _ = writeln!(s, "  {:<16} {:>6} tensors  {}", k, n, gib(*b));
    }
    match &spec.quant {
        Some(q) => {
            let scheme = if q.format == crate::quant::FORMAT_NVFP4 {
                "NVFP4A16: E2M1 weights, one E4M3 scale per 16 weights and an F32 global scale per Linear, BF16 activations"
            } else {
                "FP8 E4M3 weights, per-channel scales, dynamic per-token activations"
            };
            let _ = writeln!(s, "quantization {} / {}: {scheme}", q.quant_method, q.format);
            let _ =
                writeln!(s, "ignore list  {} entr{}:", q.ignore.len(), if q.ignore.len() == 1 { "y" } else { "ies" });
            for p in q.ignore.iter().take(12) {
                let _ = writeln!(s, "  {p}");
            }
            if q.ignore.len() > 12 {
                let _ = writeln!(s, "  … and {} more", q.ignore.len() - 12);
            }
        }
        None => {
            let _ = writeln!(s, "quantization none: every Linear is BF16");
        }
    }
    let (mut fp8, mut nvfp4, mut bf16) = (0usize, 0usize, 0usize);
    for l in &spec.layers {
        let e = &l.mlp.experts;
        for p in [e.gate_proj, e.up_proj, e.down_proj] {
            match p {
                crate::Precision::Fp8 => fp8 += e.num_experts,
                crate::Precision::Nvfp4 => nvfp4 += e.num_experts,
                crate::Precision::Bf16 => bf16 += e.num_experts,
            }
        }
    }
    let layout = match spec.layers.first().map(|l| l.mlp.experts.layout) {
        Some(crate::ExpertLayout::PerExpert) => "per expert",
        Some(crate::ExpertLayout::Fused) => "fused gate_up_proj/down_proj",
        None => "no layers",
    };
    let quantised = if nvfp4 > 0 { format!("{nvfp4} NVFP4") } else { format!("{fp8} FP8") };
    let _ = writeln!(s, "routed expert Linears: {quantised}, {bf16} BF16 (layout: {layout})");
    let _ = writeln!(s, "bytes by form (codes and scales of each Linear precision):");
    for (k, (n, b)) in &by_form(spec) {
        let _ = writeln!(s, "  {:<16} {:>6} tensors  {}", k, n, gib(*b));
    }
    let mtp = if spec.mtp_tensors > 0 {
        format!(
            "present: {} mtp.* tensors (config mtp_num_hidden_layers: {}) — not used by this engine",
            spec.mtp_tensors, spec.mtp_config_layers
        )
    } else if spec.mtp_config_layers > 0 {
        format!(
            "absent: the config says mtp_num_hidden_layers: {} but the index holds no mtp.* tensor",
            spec.mtp_config_layers
        )
    } else {
        "absent (mtp_num_hidden_layers: 0, no mtp.* tensor)".to_string()
    };
    let _ = writeln!(s, "MTP head     {mtp}");
    let _ = writeln!(s, "visual       {} tensors (not used: this build serves text only)", spec.visual_tensors);
    let _ = writeln!(s, "device bytes for weights  {}", gib(spec.device_weight_bytes()));
    let kv = spec.dims.kv_bytes_per_token(full);
    let _ = writeln!(
        s,
        "KV cache     {kv} B per token (BF16 K+V, {full} layers); {} for the full {}-token window",
        gib(kv * spec.dims.max_position_embeddings as u64),
        spec.dims.max_position_embeddings
    );
    s
}
