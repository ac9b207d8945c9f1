//! The full and shallow presets' metadata: the real Ornith 1.0 35B inventory (62,546 tensors,
//! docs/ARCHITECTURE.md §2.2 FP8), built as headers over sparse data sections.

use model_spec::{load_checkpoint, DType};
use std::collections::BTreeMap;
use std::time::Instant;
use xtask::synth::{self, Contents, Preset, SynthOptions};

/// `model.visual.*` as transformers 5.17 builds `Qwen3_5MoeVisionModel` for the real vision
/// config (depth 27, hidden 1152, intermediate 4304, 16 heads, patch 16, temporal patch 2,
/// spatial merge 2, out_hidden_size 2048, in_channels 3, 2304 position embeddings): read from
/// `state_dict()` of the model instantiated on the meta device (333 entries). Every block
/// `blocks.{0..26}` has the 12 entries listed for block `B`.
const VISION_STATE_DICT: &[(&str, &[usize])] = &[
    ("patch_embed.proj.weight", &[1152, 3, 2, 16, 16]),
    ("patch_embed.proj.bias", &[1152]),
    ("pos_embed.weight", &[2304, 1152]),
    ("blocks.B.norm1.weight", &[1152]),
    ("blocks.B.norm1.bias", &[1152]),
    ("blocks.B.norm2.weight", &[1152]),
    ("blocks.B.norm2.bias", &[1152]),
    ("blocks.B.attn.qkv.weight", &[3456, 1152]),
    ("blocks.B.attn.qkv.bias", &[3456]),
    ("blocks.B.attn.proj.weight", &[1152, 1152]),
    ("blocks.B.attn.proj.bias", &[1152]),
    ("blocks.B.mlp.linear_fc1.weight", &[4304, 1152]),
    ("blocks.B.mlp.linear_fc1.bias", &[4304]),
    ("blocks.B.mlp.linear_fc2.weight", &[1152, 4304]),
    ("blocks.B.mlp.linear_fc2.bias", &[1152]),
    ("merger.norm.weight", &[1152]),
    ("merger.norm.bias", &[1152]),
    ("merger.linear_fc1.weight", &[4608, 4608]),
    ("merger.linear_fc1.bias", &[4608]),
    ("merger.linear_fc2.weight", &[2048, 4608]),
    ("merger.linear_fc2.bias", &[2048]),
];

#[test]
fn full_preset_metadata_is_the_real_inventory() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = SynthOptions { contents: Contents::HeadersOnly, ..SynthOptions::new(Preset::Full, 0) };
    let plan = synth::synth(tmp.path(), opts).unwrap();
    assert!(plan.shards.iter().all(|s| s.data_len <= 4 << 30), "shards of at most 4 GiB");

    let spec = load_checkpoint(tmp.path()).expect("the full metadata checkpoint validates");
    assert_eq!(spec.tensors.len(), 62_546);
    assert_eq!(spec.visual_tensors, 333);
    assert_eq!(spec.mtp_tensors, 0);
    assert!(!spec.tensors.keys().any(|n| n.starts_with("mtp.")));
    assert_eq!(spec.mtp_config_layers, 1);
    assert_eq!(spec.layers.len(), 40);
    assert_eq!(spec.num_full_attention_layers(), 10);

    // Vision tower: exactly transformers' state_dict names and shapes, all BF16.
    let mut want_visual: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (n, s) in VISION_STATE_DICT {
        if n.starts_with("blocks.B.") {
            for b in 0..27 {
                want_visual
                    .insert(format!("model.visual.{}", n.replace("blocks.B.", &format!("blocks.{b}."))), s.to_vec());
            }
        } else {
            want_visual.insert(format!("model.visual.{n}"), s.to_vec());
        }
    }
    assert_eq!(want_visual.len(), 333);
    let got_visual: BTreeMap<String, Vec<usize>> = spec
        .tensors
        .iter()
        .filter(|(n, _)| n.starts_with("model.visual."))
        .map(|(n, t)| (n.clone(), t.shape.clone()))
        .collect();
    assert_eq!(got_visual, want_visual);
    assert!(spec.tensors.iter().filter(|(n, _)| n.starts_with("model.visual.")).all(|(_, t)| t.dtype == DType::BF16));

    // docs/ARCHITECTURE.md §2.2, per layer: 4 unquantised (2 norms, router, shared-expert gate) +
    // 6 shared expert (3 × weight + scale) + 1,536 routed (256 × 3 × 2) = 1,546; GDN +9
    // (5 BF16 projections, conv1d, dt_bias, A_log, norm); attention +10 (4 × 2 + q/k norm).
    let p = "model.language_model";
    for (i, layer) in spec.layers.iter().enumerate() {
        let lp = format!("{p}.layers.{i}.");
        let names: Vec<&String> = spec.tensors.keys().filter(|n| n.starts_with(&lp)).collect();
        let count = |f: &dyn Fn(&str) -> bool| names.iter().filter(|n| f(n)).count();
        let unquantised = count(&|n| {
            n.ends_with("input_layernorm.weight")
                || n.ends_with("post_attention_layernorm.weight")
                || n.ends_with(".mlp.gate.weight")
                || n.ends_with(".mlp.shared_expert_gate.weight")
        });
        assert_eq!(unquantised, 4, "layer {i}");
        assert_eq!(count(&|n| n.contains(".mlp.shared_expert.")), 6, "layer {i}");
        assert_eq!(count(&|n| n.contains(".mlp.experts.")), 1536, "layer {i}");
        let gdn = count(&|n| n.contains(".linear_attn."));
        let attn = count(&|n| n.contains(".self_attn."));
        if (i + 1) % 4 == 0 {
            assert_eq!((gdn, attn, names.len()), (0, 10, 1556), "layer {i}");
            assert_eq!(layer.kind, model_spec::LayerKind::FullAttention);
        } else {
            assert_eq!((gdn, attn, names.len()), (9, 0, 1555), "layer {i}");
            for t in ["A_log", "norm.weight"] {
                assert_eq!(spec.tensors[&format!("{lp}linear_attn.{t}")].dtype, DType::F32, "layer {i} {t}");
            }
        }
    }
    let globals = [format!("{p}.embed_tokens.weight"), format!("{p}.norm.weight"), "lm_head.weight".to_string()];
    for g in &globals {
        assert_eq!(spec.tensors[g].dtype, DType::BF16, "{g}");
    }
    assert_eq!(spec.tensors.len(), 3 + 30 * 1555 + 10 * 1556 + 333);
    let by_dtype = |d: DType| spec.tensors.values().filter(|t| t.dtype == d).count();
    assert_eq!(by_dtype(DType::F32), 60);
    // FP8: 40 × (256 × 3 + 3) + 10 × 4 = 30,880 weights (and as many BF16 scales).
    assert_eq!(by_dtype(DType::F8_E4M3), 30_880);

    let report = model_spec::report::render(&spec);
    assert!(
        report.contains("the config says mtp_num_hidden_layers: 1 but the index holds no mtp.* tensor"),
        "{report}"
    );
    assert!(report.contains("62546"), "{report}");
    assert!(report.contains("visual       333 tensors"), "{report}");
    // KV: 10 layers × (K + V) × 2 heads × 256 × 2 bytes = 20,480 B per token; × 262,144 = 5 GiB.
    assert!(report.contains("20480 B per token"), "{report}");
    assert!(report.contains("(5368709120 B) for the full 262144-token window"), "{report}");

    // `cargo xtask gen` on the full metadata: well under 10 s.
    let spec_path = tmp.path().join("out").join("spec.json");
    let start = Instant::now();
    let again = xtask::gen::gen(Some(tmp.path()), tmp.path(), &spec_path).unwrap();
    let took = start.elapsed();
    eprintln!("gen on the full preset's metadata took {took:.2?}");
    assert!(took.as_secs_f64() < 10.0, "gen took {took:?}");
    assert_eq!(again.fingerprint, spec.fingerprint);
    let read = model_spec::ModelSpec::read(&spec_path).unwrap();
    assert_eq!(read, spec);
}

#[test]
fn shallow_preset_plan() {
    let plan = synth::plan(Preset::Shallow, 0);
    // 3 globals + 3 GDN layers + 1 attention layer + the real vision tower.
    assert_eq!(plan.tensor_count(), 3 + 3 * 1555 + 1556 + 333);
    let experts = plan
        .tensors()
        .filter(|(_, t)| t.name.contains(".layers.3.mlp.experts.") && t.name.ends_with("down_proj.weight"))
        .count();
    assert_eq!(experts, 256);
    let (_, q) = plan.find("model.language_model.layers.3.self_attn.q_proj.weight").unwrap();
    assert_eq!((q.dtype, q.shape.clone()), (DType::F8_E4M3, vec![8192, 2048]));
    assert!(plan.shards.len() >= 2 && plan.shards.iter().all(|s| s.data_len <= 4 << 30));
}

/// `--quant nvfp4a16` for the shallow and full presets: model-spec accepts the metadata, every
/// Linear the FP8 export quantises is NVFP4 here (the rest BF16), and the routed experts take
/// the 4-bit bytes: codes (half a byte per weight) plus one E4M3 scale per 16 weights and one F32
/// global scale per Linear.
#[test]
fn nvfp4_presets_validate_with_4bit_bytes() {
    for preset in [Preset::Shallow, Preset::Full] {
        let tmp = tempfile::tempdir().unwrap();
        let opts = SynthOptions {
            contents: Contents::HeadersOnly,
            quant: synth::Quant::Nvfp4a16,
            ..SynthOptions::new(preset, 0)
        };
        synth::synth(tmp.path(), opts).unwrap();
        let spec = load_checkpoint(tmp.path()).expect("the NVFP4 metadata checkpoint validates");
        let fp8 = synth::plan(preset, 0);
        let fp8_linears = fp8.tensors().filter(|(_, t)| t.dtype == DType::F8_E4M3).count();
        let packed: Vec<&String> = spec.tensors.keys().filter(|n| n.ends_with(".weight_packed")).collect();
        assert_eq!(packed.len(), fp8_linears, "{preset}: NVFP4 exactly where the FP8 export is FP8");
        for n in &packed {
            let module = n.strip_suffix(".weight_packed").unwrap();
            assert!(fp8.find(&format!("{module}.weight")).is_some_and(|(_, t)| t.dtype == DType::F8_E4M3), "{n}");
        }
        let d = &spec.dims;
        let (e, i, h, l) =
            (d.num_experts as u64, d.moe_intermediate_size as u64, d.hidden_size as u64, spec.layers.len() as u64);
        let routed: u64 = spec
            .tensors
            .iter()
            .filter(|(n, _)| model_spec::report::group_of(&spec, n) == "routed experts")
            .map(|(_, t)| t.nbytes())
            .sum();
        assert_eq!(routed, l * e * 3 * (i * h / 2 + i * h / 16 + 4), "{preset}: routed expert bytes");
        for layer in &spec.layers {
            let x = &layer.mlp.experts;
            assert_eq!([x.gate_proj, x.up_proj, x.down_proj], [model_spec::Precision::Nvfp4; 3]);
            assert_eq!(layer.mlp.shared_expert.down_proj.precision, model_spec::Precision::Nvfp4);
            assert_eq!(layer.mlp.gate.precision, model_spec::Precision::Bf16);
        }
    }
}
