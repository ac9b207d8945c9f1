//! compressed-tensors quantization config: the supported scheme and the ignore list.
//!
//! Ignore semantics (compressed-tensors `match_name`): an entry that starts with `re:` is a
//! Python regular expression applied with `re.match` — anchored at the start of the module
//! name, not at the end; any other entry must equal the module name exactly. The vendor export
//! writes six patterns; llm-compressor writes the list expanded to explicit module names. Both
//! forms go through the same matcher.

use crate::config::{QuantArgs, QuantGroup, QuantizationConfig};
use crate::{Precision, Result, SpecError};
use regex::Regex;
use std::path::Path;

#[derive(Debug, Clone)]
enum Entry {
    Exact(String),
    Regex(String, Regex),
}

/// The compiled ignore list.
#[derive(Debug, Clone, Default)]
pub struct IgnoreList {
    entries: Vec<Entry>,
}

impl IgnoreList {
    pub fn compile(path: &Path, raw: &[String]) -> Result<Self> {
        let mut entries = Vec::with_capacity(raw.len());
        for p in raw {
            if let Some(re) = p.strip_prefix("re:") {
                // `re.match` anchors at the start only.
                let compiled = Regex::new(&format!("^(?:{re})")).map_err(|e| SpecError::IgnorePattern {
                    path: path.to_path_buf(),
                    pattern: p.clone(),
                    reason: format!("not a regular expression this engine can evaluate exactly: {e}. Fix: rewrite the pattern without look-around or back-references."),
                })?;
                entries.push(Entry::Regex(p.clone(), compiled));
            } else {
                entries.push(Entry::Exact(p.clone()));
            }
        }
        Ok(IgnoreList { entries })
    }

    /// The first entry that matches `module`, as written in the config.
    pub fn matching(&self, module: &str) -> Option<&str> {
        self.entries.iter().find_map(|e| match e {
            Entry::Exact(s) if s == module => Some(s.as_str()),
            Entry::Regex(s, r) if r.is_match(module) => Some(s.as_str()),
            _ => None,
        })
    }
}

/// `value` for a present option, `absent` otherwise (for refusal messages).
fn show<T: std::fmt::Debug>(v: &Option<T>) -> String {
    match v {
        Some(x) => format!("{x:?}"),
        None => "absent".into(),
    }
}

/// A present JSON value as JSON (`false`, `"local"`), `absent` otherwise.
fn show_json(v: &Option<serde_json::Value>) -> String {
    v.as_ref().map(|x| x.to_string()).unwrap_or_else(|| "absent".into())
}

fn dynamic_is(args: &QuantArgs, want: bool) -> bool {
    match &args.dynamic {
        Some(serde_json::Value::Bool(b)) => *b == want,
        None => !want,
        _ => false,
    }
}

/// The compressed-tensors `format` of an FP8 W8A8 export.
pub const FORMAT_FP8: &str = "float-quantized";
/// The compressed-tensors `format` of an NVFP4A16 export.
pub const FORMAT_NVFP4: &str = "nvfp4-pack-quantized";

/// Accepts exactly one of two compressed-tensors schemes and returns the precision of every
/// Linear it quantises (the ignore list keeps the others in BF16):
///
/// * `float-quantized`: W8A8 FP8 with per-channel static weights and dynamic per-token
///   activations (the FP8_DYNAMIC preset) → [`Precision::Fp8`];
/// * `nvfp4-pack-quantized`: NVFP4A16 — 4-bit float (E2M1) weights, strategy `tensor_group`,
///   group size 16, static, symmetric, group scales `torch.float8_e4m3fn`, no activation
///   quantisation (`input_activations: null`) → [`Precision::Nvfp4`].
///
/// Refuses everything else with a reason.
pub fn validate_scheme(path: &Path, q: &QuantizationConfig) -> Result<Precision> {
    let refuse = |what: String| Err(SpecError::Quant { path: path.to_path_buf(), what });
    if q.quant_method != "compressed-tensors" {
        return refuse(format!("quant_method: found {:?}, expected \"compressed-tensors\"", q.quant_method));
    }
    let format = q.format.as_deref().unwrap_or("");
    let precision = match format {
        FORMAT_FP8 => Precision::Fp8,
        FORMAT_NVFP4 => Precision::Nvfp4,
        _ => {
            return refuse(format!(
                "format: found {format:?}, expected \"{FORMAT_FP8}\" (FP8 W8A8) or \"{FORMAT_NVFP4}\" (NVFP4A16)"
            ))
        }
    };
    if q.config_groups.is_empty() {
        return refuse("no config_groups".into());
    }
    if q.kv_cache_scheme.as_ref().is_some_and(|v| !v.is_null()) {
        return refuse("kv_cache_scheme is set (quantised KV cache)".into());
    }
    for (name, g) in &q.config_groups {
        if g.targets != ["Linear"] {
            return refuse(format!("config_groups.{name}.targets {:?} (only [\"Linear\"])", g.targets));
        }
        if let Some(f) = &g.format {
            if f != format {
                return refuse(format!(
                    "config_groups.{name}.format {f:?} differs from the top-level format {format:?}"
                ));
            }
        }
        let Some(w) = &g.weights else { return refuse(format!("config_groups.{name} has no weights scheme")) };
        let group = match precision {
            Precision::Fp8 => validate_fp8_group(name, g, w),
            Precision::Nvfp4 => validate_nvfp4_group(name, g, w),
            Precision::Bf16 => unreachable!("no format maps to BF16"),
        };
        if let Err(what) = group {
            return refuse(what);
        }
        if g.output_activations.is_some() {
            return refuse(format!("config_groups.{name}.output_activations is set"));
        }
    }
    Ok(precision)
}

fn validate_fp8_group(name: &str, g: &QuantGroup, w: &QuantArgs) -> std::result::Result<(), String> {
    if w.num_bits != 8
        || w.kind != "float"
        || w.strategy.as_deref() != Some("channel")
        || !dynamic_is(w, false)
        || w.symmetric == Some(false)
    {
        return Err(format!(
            "config_groups.{name}.weights: found num_bits {} type {:?} strategy {} dynamic {} symmetric {}; expected num_bits 8 type \"float\" strategy \"channel\" dynamic false symmetric true",
            w.num_bits, w.kind, show(&w.strategy), show_json(&w.dynamic), show(&w.symmetric)
        ));
    }
    let Some(a) = &g.input_activations else {
        return Err(format!("config_groups.{name} has no input_activations (weight-only FP8 is not W8A8)"));
    };
    if a.num_bits != 8
        || a.kind != "float"
        || a.strategy.as_deref() != Some("token")
        || !dynamic_is(a, true)
        || a.symmetric == Some(false)
    {
        return Err(format!(
            "config_groups.{name}.input_activations: found num_bits {} type {:?} strategy {} dynamic {} symmetric {}; expected num_bits 8 type \"float\" strategy \"token\" dynamic true symmetric true",
            a.num_bits, a.kind, show(&a.strategy), show_json(&a.dynamic), show(&a.symmetric)
        ));
    }
    Ok(())
}

/// NVFP4A16 as compressed-tensors 0.19's `NVFP4A16` preset writes it (tests/fixtures/micro-nvfp4).
/// `scale_dtype` is what makes the group scales E4M3 (absent, the compressor would still write
/// E4M3, but the stored dtype is checked per tensor anyway); a null or absent `actorder` and
/// `block_structure`, and `zp_dtype` null (symmetric: no zero point is stored).
fn validate_nvfp4_group(name: &str, g: &QuantGroup, w: &QuantArgs) -> std::result::Result<(), String> {
    let null_or_absent = |v: Option<&serde_json::Value>| v.is_none_or(|v| v.is_null());
    let scale_dtype = w.extra.get("scale_dtype");
    let scale_ok = null_or_absent(scale_dtype) || scale_dtype.and_then(|v| v.as_str()) == Some("torch.float8_e4m3fn");
    if w.num_bits != 4
        || w.kind != "float"
        || w.strategy.as_deref() != Some("tensor_group")
        || w.group_size != Some(16)
        || !dynamic_is(w, false)
        || w.symmetric != Some(true)
        || !scale_ok
        || !null_or_absent(w.block_structure.as_ref())
        || !null_or_absent(w.extra.get("actorder"))
    {
        return Err(format!(
            "config_groups.{name}.weights: found num_bits {} type {:?} strategy {} group_size {} dynamic {} symmetric {} scale_dtype {} actorder {} block_structure {}; expected num_bits 4 type \"float\" strategy \"tensor_group\" group_size 16 dynamic false symmetric true scale_dtype \"torch.float8_e4m3fn\" (NVFP4A16)",
            w.num_bits,
            w.kind,
            show(&w.strategy),
            show(&w.group_size),
            show_json(&w.dynamic),
            show(&w.symmetric),
            show_json(&scale_dtype.cloned()),
            show_json(&w.extra.get("actorder").cloned()),
            show_json(&w.block_structure),
        ));
    }
    if let Some(a) = &g.input_activations {
        return Err(format!(
            "config_groups.{name}.input_activations: found num_bits {} type {:?} strategy {}; expected null (NVFP4A16 keeps activations in BF16; W4A4 NVFP4 is not supported)",
            a.num_bits, a.kind, show(&a.strategy)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(p: &[&str]) -> IgnoreList {
        IgnoreList::compile(Path::new("config.json"), &p.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn regex_is_anchored_at_start_only() {
        let l = list(&["re:.*mlp.gate$", "re:visual.*", "lm_head"]);
        assert!(l.matching("model.language_model.layers.3.mlp.gate").is_some());
        assert!(l.matching("model.language_model.layers.3.mlp.shared_expert_gate").is_none());
        // re.match: "visual.*" must match at the start of the name.
        assert!(l.matching("visual.blocks.0.attn.qkv").is_some());
        assert!(l.matching("model.visual.blocks.0.attn.qkv").is_none());
        assert_eq!(l.matching("lm_head"), Some("lm_head"));
        assert!(l.matching("lm_head2").is_none());
    }

    /// The NVFP4A16 `quantization_config` llm-compressor 0.14 wrote for tests/fixtures/micro-nvfp4.
    fn nvfp4_config() -> serde_json::Value {
        serde_json::json!({
            "config_groups": {"group_0": {
                "format": "nvfp4-pack-quantized", "input_activations": null, "output_activations": null,
                "targets": ["Linear"],
                "weights": {"actorder": null, "block_structure": null, "dynamic": false, "group_size": 16,
                    "num_bits": 4, "observer": "memoryless_minmax", "observer_kwargs": {},
                    "scale_dtype": "torch.float8_e4m3fn", "strategy": "tensor_group", "symmetric": true,
                    "type": "float", "zp_dtype": null}}},
            "format": "nvfp4-pack-quantized", "global_compression_ratio": null, "ignore": ["lm_head"],
            "kv_cache_scheme": null, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": "0.19.0"
        })
    }

    fn validate(v: serde_json::Value) -> Result<Precision> {
        validate_scheme(Path::new("config.json"), &serde_json::from_value(v).unwrap())
    }

    #[test]
    fn nvfp4a16_is_recognised_and_variants_are_refused() {
        assert_eq!(validate(nvfp4_config()).unwrap(), Precision::Nvfp4);
        let w = "/config_groups/group_0/weights";
        let cases: [(&str, serde_json::Value, &str); 6] = [
            ("group_size", 32.into(), "group_size 32"),
            ("num_bits", 8.into(), "num_bits 8"),
            ("strategy", "group".into(), "strategy \"group\""),
            ("scale_dtype", "torch.float8_e5m2".into(), "scale_dtype \"torch.float8_e5m2\""),
            ("symmetric", false.into(), "symmetric false"),
            ("actorder", "group".into(), "actorder \"group\""),
        ];
        for (field, value, shown) in cases {
            let mut c = nvfp4_config();
            *c.pointer_mut(w).unwrap().get_mut(field).unwrap() = value;
            let e = validate(c).unwrap_err().to_string();
            assert!(e.contains(shown) && e.contains("NVFP4A16") && e.contains("Fix:"), "{field}: {e}");
        }
        // W4A4 NVFP4 (activations quantised too) is a different scheme.
        let mut c = nvfp4_config();
        c["config_groups"]["group_0"]["input_activations"] = serde_json::json!({"num_bits": 4, "type": "float", "strategy": "tensor_group", "dynamic": "local", "group_size": 16});
        let e = validate(c).unwrap_err().to_string();
        assert!(e.contains("input_activations") && e.contains("W4A4"), "{e}");
        // A group format that differs from the top-level one.
        let mut c = nvfp4_config();
        c["config_groups"]["group_0"]["format"] = "float-quantized".into();
        assert!(validate(c).unwrap_err().to_string().contains("differs from the top-level format"));
        let mut c = nvfp4_config();
        c["format"] = "mxfp4-pack-quantized".into();
        let e = validate(c).unwrap_err().to_string();
        assert!(e.contains("\"mxfp4-pack-quantized\"") && e.contains("nvfp4-pack-quantized"), "{e}");
    }

    #[test]
    fn lookaround_is_refused() {
        let e = IgnoreList::compile(Path::new("c.json"), &["re:(?!x).*".to_string()]).unwrap_err();
        assert!(e.to_string().contains("(?!x)"), "{e}");
    }
}
