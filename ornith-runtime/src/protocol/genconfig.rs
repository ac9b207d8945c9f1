//! Request defaults taken from the checkpoint: `generation_config.json` (sampling defaults and
//! the eos ids), falling back to `config.json`'s `eos_token_id` when the former is absent.

use std::path::Path;

use anyhow::Context;
use serde_json::Value;

/// Sampling defaults and stop tokens of a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: f32,
    /// 0 = disabled.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// 1 = disabled (transformers' `repetition_penalty`, which vLLM also takes from the
    /// generation config; the OpenAI presence and frequency penalties have no such field).
    pub repetition_penalty: f32,
    /// Token ids that end generation (unless a request sets `ignore_eos`).
    pub eos_token_ids: Vec<u32>,
}

impl Default for GenerationDefaults {
    /// Neutral sampling (vLLM's defaults without a generation config) and no stop tokens.
    fn default() -> Self {
        GenerationDefaults {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            eos_token_ids: Vec::new(),
        }
    }
}

fn ids_of(v: &Value) -> Option<Vec<u32>> {
    match v {
        Value::Number(n) => n.as_u64().and_then(|x| u32::try_from(x).ok()).map(|x| vec![x]),
        Value::Array(a) => a.iter().map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok())).collect(),
        _ => None,
    }
}

impl GenerationDefaults {
    /// Applies the fields of a `generation_config.json` document over the neutral defaults.
    /// `do_sample: false` means greedy (transformers semantics).
    pub fn from_generation_config(doc: &Value) -> anyhow::Result<Self> {
        let mut d = GenerationDefaults::default();
        let obj = doc.as_object().context("generation_config.json is not a JSON object")?;
        let num = |k: &str| -> anyhow::Result<Option<f64>> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => {
                    v.as_f64().map(Some).with_context(|| format!("generation_config.json: `{k}` is not a number"))
                }
            }
        };
        if let Some(t) = num("temperature")? {
            anyhow::ensure!(t >= 0.0, "generation_config.json: temperature {t} < 0");
            d.temperature = t as f32;
        }
        if let Some(k) = num("top_k")? {
            d.top_k = if k > 0.0 { k as usize } else { 0 };
        }
        if let Some(p) = num("top_p")? {
            anyhow::ensure!(p > 0.0 && p <= 1.0, "generation_config.json: top_p {p} outside (0, 1]");
            d.top_p = p as f32;
        }
        if let Some(p) = num("min_p")? {
            anyhow::ensure!((0.0..=1.0).contains(&p), "generation_config.json: min_p {p} outside [0, 1]");
            d.min_p = p as f32;
        }
        if let Some(r) = num("repetition_penalty")? {
            anyhow::ensure!(r > 0.0 && r.is_finite(), "generation_config.json: repetition_penalty {r} is not > 0");
            d.repetition_penalty = r as f32;
        }
        if obj.get("do_sample") == Some(&Value::Bool(false)) {
            d.temperature = 0.0;
        }
        if let Some(v) = obj.get("eos_token_id").filter(|v| !v.is_null()) {
            d.eos_token_ids =
                ids_of(v).context("generation_config.json: eos_token_id is not an id or a list of ids")?;
        }
        Ok(d)
    }

    /// Reads `dir/generation_config.json`; without it, neutral sampling and the eos ids of
    /// `dir/config.json` (`eos_token_id`, or `text_config.eos_token_id`).
    pub fn from_model_dir(dir: &Path) -> anyhow::Result<Self> {
        let gc = dir.join("generation_config.json");
        if gc.exists() {
            let text = std::fs::read_to_string(&gc).with_context(|| format!("reading {}", gc.display()))?;
            let doc: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", gc.display()))?;
            return Self::from_generation_config(&doc);
        }
        let mut d = GenerationDefaults::default();
        let cfg = dir.join("config.json");
        if cfg.exists() {
            let text = std::fs::read_to_string(&cfg).with_context(|| format!("reading {}", cfg.display()))?;
            let doc: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", cfg.display()))?;
            let v = doc.get("eos_token_id").or_else(|| doc.get("text_config").and_then(|t| t.get("eos_token_id")));
            if let Some(ids) = v.and_then(ids_of) {
                d.eos_token_ids = ids;
            }
        }
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_qwen35_generation_config() {
        let doc = serde_json::json!({
            "bos_token_id": 248044, "do_sample": true, "eos_token_id": [248046, 248044],
            "pad_token_id": 248044, "temperature": 1.0, "top_k": 20, "top_p": 0.95,
            "transformers_version": "4.57.0"
        });
        let d = GenerationDefaults::from_generation_config(&doc).unwrap();
        assert_eq!(d.eos_token_ids, vec![248046, 248044]);
        assert_eq!((d.temperature, d.top_k, d.top_p, d.min_p), (1.0, 20, 0.95, 0.0));
    }

    #[test]
    fn repetition_penalty_is_read_and_checked() {
        let d = GenerationDefaults::from_generation_config(&serde_json::json!({"repetition_penalty": 1.05})).unwrap();
        assert_eq!(d.repetition_penalty, 1.05);
        assert_eq!(GenerationDefaults::from_generation_config(&serde_json::json!({})).unwrap().repetition_penalty, 1.0);
        for bad in [serde_json::json!(0), serde_json::json!(-1.0)] {
            let e = GenerationDefaults::from_generation_config(&serde_json::json!({"repetition_penalty": bad}))
                .unwrap_err();
            assert!(format!("{e:#}").contains("repetition_penalty"), "{e:#}");
        }
    }

    #[test]
    fn do_sample_false_is_greedy_and_scalar_eos_accepted() {
        let doc = serde_json::json!({"do_sample": false, "eos_token_id": 7, "temperature": 0.6});
        let d = GenerationDefaults::from_generation_config(&doc).unwrap();
        assert_eq!(d.temperature, 0.0);
        assert_eq!(d.eos_token_ids, vec![7]);
        assert!(GenerationDefaults::from_generation_config(&serde_json::json!({"eos_token_id": "x"})).is_err());
        assert!(GenerationDefaults::from_generation_config(&serde_json::json!({"top_p": 0})).is_err());
    }

    #[test]
    fn falls_back_to_config_json_eos() {
        let dir = std::env::temp_dir().join(format!("ornith-genconfig-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), r#"{"text_config": {"eos_token_id": 248044}}"#).unwrap();
        let d = GenerationDefaults::from_model_dir(&dir).unwrap();
        assert_eq!(d.eos_token_ids, vec![248044]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
