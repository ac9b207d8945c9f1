//! The micro fixtures were written by the vendor tools (transformers 5.17 + llm-compressor
//! `oneshot` FP8_DYNAMIC, see tests/generators/make_micro.py). model-spec must accept them and
//! classify every Linear exactly as the tool stored it. The stored dtypes are read here with an
//! independent safetensors header parser, so a header-reading bug in model-spec cannot hide.

use model_spec::{ExpertLayout, LinearSpec, ModelSpec, Precision};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

/// name -> (dtype, shape) from every `*.safetensors` file of `dir`: u64 LE header length, then a
/// JSON object of `{name: {dtype, shape, data_offsets}}` (plus `__metadata__`).
fn stored_tensors(dir: &Path) -> BTreeMap<String, (String, Vec<usize>)> {
    let mut out = BTreeMap::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no safetensors in {}", dir.display());
    for f in files {
        let bytes = std::fs::read(&f).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        for (name, v) in header.as_object().unwrap() {
            if name == "__metadata__" {
                continue;
            }
            let dtype = v["dtype"].as_str().unwrap().to_string();
            let shape = v["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
            assert!(out.insert(name.clone(), (dtype, shape)).is_none(), "{name} stored twice");
        }
    }
    out
}

/// module -> precision for every Linear the spec describes (experts expanded per expert).
fn spec_linears(spec: &ModelSpec) -> BTreeMap<String, Precision> {
    let mut m = BTreeMap::new();
    let mut add = |l: &LinearSpec| {
        assert!(m.insert(l.module.clone(), l.precision).is_none(), "{} listed twice", l.module);
    };
    add(&spec.lm_head);
    let mut experts = Vec::new();
    for layer in &spec.layers {
        match &layer.mixer {
            model_spec::MixerSpec::LinearAttention(g) => {
                for l in [&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a, &g.out_proj] {
                    add(l);
                }
            }
            model_spec::MixerSpec::FullAttention(a) => {
                for l in [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj] {
                    add(l);
                }
            }
        }
        let mlp = &layer.mlp;
        for l in [
            &mlp.gate,
            &mlp.shared_expert.gate_proj,
            &mlp.shared_expert.up_proj,
            &mlp.shared_expert.down_proj,
            &mlp.shared_expert_gate,
        ] {
            add(l);
        }
        experts.push(mlp.experts.clone());
    }
    for x in experts {
        assert_eq!(x.layout, ExpertLayout::PerExpert, "{}: both tools write per-expert Linears", x.module);
        for e in 0..x.num_experts {
            for (proj, p) in [("gate_proj", x.gate_proj), ("up_proj", x.up_proj), ("down_proj", x.down_proj)] {
                assert!(m.insert(format!("{}.{e}.{proj}", x.module), p).is_none());
            }
        }
    }
    m
}

#[test]
fn fp8_fixture_is_classified_as_stored() {
    let dir = fixture("micro-fp8");
    let spec = model_spec::load_checkpoint(&dir)
        .unwrap_or_else(|e| panic!("model-spec rejects the llm-compressor output: {e}"));
    let stored = stored_tensors(&dir);
    let linears = spec_linears(&spec);

    let q = spec.quant.as_ref().expect("FP8 fixture has a quantization_config");
    assert_eq!(q.quant_method, "compressed-tensors");
    assert_eq!(q.format, "float-quantized");

    let mut fp8 = 0;
    for (name, (dtype, shape)) in &stored {
        let Some(module) = name.strip_suffix(".weight") else { continue };
        if module.starts_with("model.visual.") {
            assert_eq!(dtype, "BF16", "{name}: vision is ignored by the recipe");
            continue;
        }
        match linears.get(module) {
            Some(p) => {
                assert_eq!(dtype == "F8_E4M3", *p == Precision::Fp8, "{name}: stored {dtype}, spec says {p:?}");
                if *p == Precision::Fp8 {
                    fp8 += 1;
                    // per-output-channel scale, [out, 1], BF16 as llm-compressor writes it
                    let (sd, ss) = stored
                        .get(&format!("{module}.weight_scale"))
                        .unwrap_or_else(|| panic!("{module}.weight_scale missing"));
                    assert_eq!((sd.as_str(), ss.as_slice()), ("BF16", &[shape[0], 1][..]), "{module}.weight_scale");
                } else {
                    assert!(
                        !stored.contains_key(&format!("{module}.weight_scale")),
                        "{module}: BF16 Linear with a scale"
                    );
                }
            }
            // not a Linear (norms, embedding, conv1d): never FP8
            None => assert_ne!(dtype, "F8_E4M3", "{name} is FP8 but the spec knows no such Linear"),
        }
    }
    // Every Linear of the spec is stored, and the FP8 count is exactly the recipe's:
    // 4 layers x (16 experts x 3 + shared 3) + 1 attention layer x 4 = 208.
    for m in linears.keys() {
        assert!(stored.contains_key(&format!("{m}.weight")), "spec Linear {m} not stored");
    }
    assert_eq!(fp8, 208);
    assert_eq!(linears.values().filter(|p| **p == Precision::Fp8).count(), 208);
    // The vendor patterns keep these BF16.
    for l in &spec.layers {
        assert_eq!(l.mlp.gate.precision, Precision::Bf16);
        assert_eq!(l.mlp.shared_expert_gate.precision, Precision::Bf16);
        if let model_spec::MixerSpec::LinearAttention(g) = &l.mixer {
            assert_eq!(g.in_proj_qkv.precision, Precision::Bf16);
            assert_eq!(g.out_proj.precision, Precision::Bf16);
        }
    }
    assert_eq!(spec.lm_head.precision, Precision::Bf16);
    assert_eq!(spec.dims.vocab_size, 1024);
    assert_eq!(spec.dims.hidden_size, 64);
    assert_eq!(spec.eos_token_ids, vec![1023]);
}

#[test]
fn bf16_fixture_is_all_bf16() {
    let dir = fixture("micro-bf16");
    let spec =
        model_spec::load_checkpoint(&dir).unwrap_or_else(|e| panic!("model-spec rejects the transformers output: {e}"));
    assert!(spec.quant.is_none(), "BF16 fixture has no quantization_config");
    let stored = stored_tensors(&dir);
    for (name, (dtype, _)) in &stored {
        assert_ne!(dtype, "F8_E4M3", "{name}");
        assert!(!name.ends_with("_scale"), "{name}");
    }
    let linears = spec_linears(&spec);
    assert_eq!(linears.len(), 1 + 3 * 5 + 4 + 4 * 5 + 4 * 16 * 3);
    for (m, p) in &linears {
        assert_eq!(*p, Precision::Bf16, "{m}");
        assert_eq!(stored[&format!("{m}.weight")].0, "BF16", "{m}");
    }
    assert_eq!(spec.dims.vocab_size, 1024);
}

/// The NVFP4A16 export of the same model (llm-compressor `scheme="NVFP4A16"`, same six patterns,
/// tests/generators/make_micro_nvfp4.py): every Linear the tool packed is NVFP4 in the spec with
/// exactly the three tensors it wrote, every other one BF16, and the spec holds nothing else.
#[test]
fn nvfp4_fixture_is_classified_as_stored() {
    let dir = fixture("micro-nvfp4");
    let spec = model_spec::load_checkpoint(&dir)
        .unwrap_or_else(|e| panic!("model-spec rejects the llm-compressor NVFP4A16 output: {e}"));
    let stored = stored_tensors(&dir);
    let linears = spec_linears(&spec);
    let q = spec.quant.as_ref().expect("NVFP4 fixture has a quantization_config");
    assert_eq!((q.quant_method.as_str(), q.format.as_str()), ("compressed-tensors", "nvfp4-pack-quantized"));

    let mut nvfp4 = 0;
    for (m, p) in &linears {
        let w = stored.get(&format!("{m}.weight"));
        let packed = stored.get(&format!("{m}.weight_packed"));
        match p {
            Precision::Nvfp4 => {
                nvfp4 += 1;
                assert!(w.is_none(), "{m}: NVFP4 Linear also stores a plain .weight");
                let (pd, ps) = packed.unwrap_or_else(|| panic!("{m}.weight_packed missing"));
                let (out, inn) = (ps[0], ps[1] * 2);
                assert_eq!(pd, "U8", "{m}.weight_packed");
                assert_eq!(stored[&format!("{m}.weight_scale")], ("F8_E4M3".to_string(), vec![out, inn / 16]), "{m}");
                assert_eq!(stored[&format!("{m}.weight_global_scale")], ("F32".to_string(), vec![1]), "{m}");
            }
            Precision::Bf16 => {
                assert_eq!(w.map(|x| x.0.as_str()), Some("BF16"), "{m}");
                assert!(packed.is_none() && !stored.contains_key(&format!("{m}.weight_scale")), "{m}");
            }
            Precision::Fp8 => panic!("{m}: FP8 in an NVFP4 export"),
        }
    }
    // The tool packed exactly these: 4 layers x (16 experts x 3 + shared 3) + 4 attention = 208.
    assert_eq!(stored.keys().filter(|n| n.ends_with(".weight_packed")).count(), 208);
    assert_eq!(nvfp4, 208);
    for l in &spec.layers {
        assert_eq!([l.mlp.experts.gate_proj, l.mlp.experts.up_proj, l.mlp.experts.down_proj], [Precision::Nvfp4; 3]);
        assert_eq!(l.mlp.gate.precision, Precision::Bf16);
        assert_eq!(l.mlp.shared_expert_gate.precision, Precision::Bf16);
    }
    assert_eq!(spec.lm_head.precision, Precision::Bf16);
    // Every stored tensor is in the spec's inventory (model-spec refuses extras; visual counted).
    assert_eq!(spec.tensors.len(), stored.len());
}

/// `cargo xtask inspect`'s report of the NVFP4A16 fixture: the scheme, the 4-bit routed experts,
/// and the bytes by form equal to the stored tensors' (codes: half a byte per weight; scales: one
/// E4M3 byte per 16 weights plus 4 bytes of global scale per Linear).
#[test]
fn nvfp4_report_shows_the_4bit_bytes() {
    let dir = fixture("micro-nvfp4");
    let spec = model_spec::load_checkpoint(&dir).unwrap();
    let text = model_spec::report::render(&spec);
    assert!(text.contains("nvfp4-pack-quantized: NVFP4A16"), "{text}");
    assert!(text.contains("routed expert Linears: 192 NVFP4, 0 BF16"), "{text}");
    let stored = stored_tensors(&dir);
    let weights: usize =
        stored.iter().filter(|(n, _)| n.ends_with(".weight_packed")).map(|(_, (_, s))| s[0] * s[1] * 2).sum();
    let form = model_spec::report::by_form(&spec);
    assert_eq!(form["NVFP4 codes"], (208, weights as u64 / 2));
    assert_eq!(form["NVFP4 scales"], (416, weights as u64 / 16 + 208 * 4));
    assert!(text.contains("NVFP4 codes"), "{text}");
}
