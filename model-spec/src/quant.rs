//! compressed-tensors quantization config: the supported scheme and the ignore list.
//!
//! Ignore semantics (compressed-tensors `match_name`): an entry that starts with `re:` is a
//! Python regular expression applied with `re.match` — anchored at the start of the module
//! name, not at the end; any other entry must equal the module name exactly. The vendor export
//! writes six patterns; llm-compressor writes the list expanded to explicit module names. Both
//! forms go through the same matcher.

use crate::config::{QuantArgs, QuantizationConfig};
use crate::{Result, SpecError};
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

/// Accepts exactly compressed-tensors W8A8 FP8 with per-channel static weights and dynamic
/// per-token activations (the FP8_DYNAMIC preset); refuses everything else with a reason.
pub fn validate_scheme(path: &Path, q: &QuantizationConfig) -> Result<()> {
    let refuse = |what: String| Err(SpecError::Quant { path: path.to_path_buf(), what });
    if q.quant_method != "compressed-tensors" {
        return refuse(format!("quant_method: found {:?}, expected \"compressed-tensors\"", q.quant_method));
    }
    let format = q.format.as_deref().unwrap_or("");
    if format != "float-quantized" {
        return refuse(format!("format: found {format:?}, expected \"float-quantized\""));
    }
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
            if f != "float-quantized" {
                return refuse(format!("config_groups.{name}.format {f:?}"));
            }
        }
        let Some(w) = &g.weights else { return refuse(format!("config_groups.{name} has no weights scheme")) };
        if w.num_bits != 8
            || w.kind != "float"
            || w.strategy.as_deref() != Some("channel")
            || !dynamic_is(w, false)
            || w.symmetric == Some(false)
        {
            return refuse(format!(
                "config_groups.{name}.weights: found num_bits {} type {:?} strategy {} dynamic {} symmetric {}; expected num_bits 8 type \"float\" strategy \"channel\" dynamic false symmetric true",
                w.num_bits, w.kind, show(&w.strategy), show_json(&w.dynamic), show(&w.symmetric)
            ));
        }
        let Some(a) = &g.input_activations else {
            return refuse(format!("config_groups.{name} has no input_activations (weight-only FP8 is not W8A8)"));
        };
        if a.num_bits != 8
            || a.kind != "float"
            || a.strategy.as_deref() != Some("token")
            || !dynamic_is(a, true)
            || a.symmetric == Some(false)
        {
            return refuse(format!(
                "config_groups.{name}.input_activations: found num_bits {} type {:?} strategy {} dynamic {} symmetric {}; expected num_bits 8 type \"float\" strategy \"token\" dynamic true symmetric true",
                a.num_bits, a.kind, show(&a.strategy), show_json(&a.dynamic), show(&a.symmetric)
            ));
        }
        if g.output_activations.is_some() {
            return refuse(format!("config_groups.{name}.output_activations is set"));
        }
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

    #[test]
    fn lookaround_is_refused() {
        let e = IgnoreList::compile(Path::new("c.json"), &["re:(?!x).*".to_string()]).unwrap_err();
        assert!(e.to_string().contains("(?!x)"), "{e}");
    }
}
