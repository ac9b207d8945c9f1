//! The tiny synthetic checkpoint: vendor format, precision of every Linear, determinism, and
//! the stored values against the generator's f32 values.

use half::bf16;
use model_spec::fp8::e4m3_to_f32;
use model_spec::{load_checkpoint, DType, LinearSpec, MixerSpec, ModelSpec, Precision};
use std::path::Path;
use xtask::synth::init::{rows_of, TensorKey};
use xtask::synth::plan::Kind;
use xtask::synth::{self, Preset, SynthOptions};

fn synth_tiny(dir: &Path, seed: u64) -> synth::Plan {
    synth::synth(dir, SynthOptions::new(Preset::Tiny, seed)).expect("tiny synth")
}

fn tensor_bytes(spec: &ModelSpec, name: &str) -> Vec<u8> {
    let t = spec.tensor(name).unwrap_or_else(|| panic!("{name} not in spec"));
    let shard = spec.shards.iter().find(|s| s.file == t.shard).unwrap();
    let bytes = std::fs::read(spec.model_dir.join(&t.shard)).unwrap();
    let start = (shard.data_start() + t.data_offsets.0) as usize;
    let end = (shard.data_start() + t.data_offsets.1) as usize;
    bytes[start..end].to_vec()
}

/// The vendor quantises exactly: attention q/k/v/o, every routed expert's gate/up/down and the
/// shared expert's gate/up/down. Everything else (lm_head, linear_attn.*, router, shared-expert
/// gate) stays BF16. Written out independently of the ignore-pattern matcher.
fn vendor_fp8(module: &str) -> bool {
    let attn = [".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.o_proj"]
        .iter()
        .any(|s| module.ends_with(s));
    let shared = [".shared_expert.gate_proj", ".shared_expert.up_proj", ".shared_expert.down_proj"]
        .iter()
        .any(|s| module.ends_with(s));
    attn || shared || module.contains(".mlp.experts.")
}

fn check_linear(l: &LinearSpec, spec: &ModelSpec) {
    let want = if vendor_fp8(&l.module) { Precision::Fp8 } else { Precision::Bf16 };
    assert_eq!(l.precision, want, "{}", l.module);
    let w = spec.tensor(&format!("{}.weight", l.module)).unwrap();
    assert_eq!(w.shape, vec![l.out_features, l.in_features], "{}", l.module);
    match want {
        Precision::Fp8 => {
            assert_eq!(w.dtype, DType::F8_E4M3, "{}", l.module);
            let s = spec.tensor(&format!("{}.weight_scale", l.module)).unwrap();
            assert_eq!((s.dtype, s.shape.clone()), (DType::BF16, vec![l.out_features, 1]), "{}", l.module);
        }
        Precision::Bf16 => {
            assert_eq!(w.dtype, DType::BF16, "{}", l.module);
            assert!(spec.tensor(&format!("{}.weight_scale", l.module)).is_none(), "{}", l.module);
        }
        Precision::Nvfp4 => unreachable!("the FP8 preset"),
    }
}

#[test]
fn tiny_round_trip_classifies_every_linear_as_the_vendor_does() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = synth_tiny(tmp.path(), 0);
    let spec = load_checkpoint(tmp.path()).expect("the tiny checkpoint validates");
    assert_eq!(spec.tensors.len(), plan.tensor_count());
    assert_eq!(spec.dims.vocab_size, 248_320);
    assert_eq!(spec.dims.hidden_size, 64);
    assert_eq!(spec.dims.rotary_dim, 8);
    // The preset's dims are one type with the checkpoint's: what it writes is what validates.
    assert_eq!(spec.dims, Preset::Tiny.text().dims);
    assert_eq!(spec.eos_token_ids, vec![248046, 248044]);
    assert_eq!(spec.mtp_config_layers, 1);
    assert_eq!(spec.mtp_tensors, 0);
    assert!(spec.shards.len() >= 2, "the tiny preset is sharded: {}", spec.shards.len());
    let kinds: Vec<bool> = spec.layers.iter().map(|l| matches!(l.mixer, MixerSpec::FullAttention(_))).collect();
    assert_eq!(kinds, [false, false, false, true]);

    let mut linears = vec![spec.lm_head.clone()];
    for l in &spec.layers {
        match &l.mixer {
            MixerSpec::LinearAttention(g) => linears
                .extend([&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a, &g.out_proj].map(Clone::clone)),
            MixerSpec::FullAttention(a) => {
                linears.extend([&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj].map(Clone::clone))
            }
        }
        let m = &l.mlp;
        linears.extend(
            [
                &m.gate,
                &m.shared_expert_gate,
                &m.shared_expert.gate_proj,
                &m.shared_expert.up_proj,
                &m.shared_expert.down_proj,
            ]
            .map(Clone::clone),
        );
        assert_eq!([m.experts.gate_proj, m.experts.up_proj, m.experts.down_proj], [Precision::Fp8; 3]);
        for e in 0..m.experts.num_experts {
            for (p, o, i) in [("gate_proj", 32, 64), ("up_proj", 32, 64), ("down_proj", 64, 32)] {
                let module = format!("{}.{e}.{p}", m.experts.module);
                check_linear(
                    &LinearSpec {
                        module,
                        precision: Precision::Fp8,
                        out_features: o,
                        in_features: i,
                        ignored_by: None,
                    },
                    &spec,
                );
            }
        }
    }
    assert_eq!(linears.len(), 1 + 3 * 5 + 4 + 4 * 5);
    for l in &linears {
        check_linear(l, &spec);
    }
    // Every F8 tensor is one of those Linears' weights; F32 only where the Qwen3.5 export has it.
    for (name, t) in &spec.tensors {
        if t.dtype == DType::F8_E4M3 {
            assert!(vendor_fp8(name.trim_end_matches(".weight")), "{name}");
        }
        let f32_expected = name.ends_with(".linear_attn.A_log") || name.ends_with(".linear_attn.norm.weight");
        assert_eq!(t.dtype == DType::F32, f32_expected, "{name}");
    }
    assert_eq!(spec.tensors.values().filter(|t| t.dtype == DType::F32).count(), 6);
}

#[test]
fn tiny_writes_the_vendor_config_files() {
    let tmp = tempfile::tempdir().unwrap();
    synth_tiny(tmp.path(), 0);
    let read =
        |n: &str| -> serde_json::Value { serde_json::from_slice(&std::fs::read(tmp.path().join(n)).unwrap()).unwrap() };
    let c = read("config.json");
    assert_eq!(c["model_type"], "qwen3_5_moe");
    assert_eq!(c["architectures"], serde_json::json!(["Qwen3_5MoeForConditionalGeneration"]));
    assert_eq!(c["tie_word_embeddings"], false);
    assert_eq!(
        c["text_config"]["layer_types"],
        serde_json::json!(["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    );
    assert_eq!(c["text_config"]["mtp_num_hidden_layers"], 1);
    assert_eq!(c["vision_config"]["depth"], 1);
    let q = &c["quantization_config"];
    assert_eq!(q["quant_method"], "compressed-tensors");
    assert_eq!(q["format"], "float-quantized");
    assert_eq!(q["quantization_status"], "compressed");
    assert!(q["kv_cache_scheme"].is_null());
    assert_eq!(
        q["ignore"],
        serde_json::json!([
            "re:.*lm_head",
            "re:.*embed_tokens$",
            "re:.*mlp.gate$",
            "re:.*shared_expert_gate$",
            "re:.*linear_attn.*",
            "re:.*visual.*"
        ])
    );
    let g = &q["config_groups"]["group_0"];
    assert_eq!(g["targets"], serde_json::json!(["Linear"]));
    assert_eq!(
        (g["weights"]["num_bits"].as_u64(), g["weights"]["type"].as_str(), g["weights"]["strategy"].as_str()),
        (Some(8), Some("float"), Some("channel"))
    );
    assert_eq!((g["weights"]["dynamic"].as_bool(), g["weights"]["symmetric"].as_bool()), (Some(false), Some(true)));
    let a = &g["input_activations"];
    assert_eq!(
        (a["num_bits"].as_u64(), a["type"].as_str(), a["strategy"].as_str(), a["dynamic"].as_bool()),
        (Some(8), Some("float"), Some("token"), Some(true))
    );
    assert!(g["output_activations"].is_null());

    let gc = read("generation_config.json");
    assert_eq!(gc["eos_token_id"], serde_json::json!([248046, 248044]));
    assert_eq!((gc["pad_token_id"].as_u64(), gc["bos_token_id"].as_u64()), (Some(248044), Some(248044)));
    assert_eq!(
        (gc["do_sample"].as_bool(), gc["temperature"].as_f64(), gc["top_k"].as_u64(), gc["top_p"].as_f64()),
        (Some(true), Some(1.0), Some(20), Some(0.95))
    );

    let idx = read("model.safetensors.index.json");
    let map = idx["weight_map"].as_object().unwrap();
    let spec = load_checkpoint(tmp.path()).unwrap();
    assert_eq!(map.len(), spec.tensors.len());
    let total: u64 = spec.tensors.values().map(|t| t.nbytes()).sum();
    assert_eq!(idx["metadata"]["total_size"].as_u64(), Some(total));
    for s in &spec.shards {
        let re_ok =
            s.file.starts_with("model-") && s.file.ends_with(&format!("-of-{:05}.safetensors", spec.shards.len()));
        assert!(re_ok, "{}", s.file);
    }
}

#[test]
fn tiny_is_deterministic_per_seed() {
    let (a, b, c) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let plan = synth_tiny(a.path(), 7);
    synth_tiny(b.path(), 7);
    synth_tiny(c.path(), 8);
    let mut files: Vec<String> = plan.shards.iter().map(|s| s.file.clone()).collect();
    files.extend(["config.json", "generation_config.json", "model.safetensors.index.json"].map(String::from));
    for f in &files {
        let (x, y) = (std::fs::read(a.path().join(f)).unwrap(), std::fs::read(b.path().join(f)).unwrap());
        assert!(x == y, "{f} differs between two runs with the same seed");
    }
    for s in &plan.shards {
        let (x, z) = (std::fs::read(a.path().join(&s.file)).unwrap(), std::fs::read(c.path().join(&s.file)).unwrap());
        assert_eq!(x.len(), z.len());
        assert!(x != z, "{} is the same for seeds 7 and 8", s.file);
    }
}

/// Stored values are the generator's f32 values, encoded: BF16 rounding for dense tensors, F32
/// exact, and for FP8 weights `e4m3(w / s) · s` within E4M3 precision with `s = bf16(amax/448)`.
#[test]
fn stored_values_match_the_generated_f32() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = synth_tiny(tmp.path(), 3);
    let spec = load_checkpoint(tmp.path()).unwrap();
    let mut fp8_checked = 0;
    for (_, t) in plan.tensors() {
        let stored = tensor_bytes(&spec, &t.name);
        let (rows, row_len) = rows_of(&t.shape);
        let key = TensorKey::new(3, &t.name);
        let mut row = vec![0f32; row_len];
        match &t.kind {
            Kind::Dense(init) => {
                // Embeddings are 248k rows: check the first and last 64.
                let sample: Vec<usize> =
                    if rows > 256 { (0..64).chain(rows - 64..rows).collect() } else { (0..rows).collect() };
                for r in sample {
                    key.fill_row(*init, r as u64, &mut row);
                    for (j, &x) in row.iter().enumerate() {
                        let k = r * row_len + j;
                        let got = match t.dtype {
                            DType::BF16 => bf16::from_le_bytes([stored[2 * k], stored[2 * k + 1]]).to_f32(),
                            DType::F32 => f32::from_le_bytes(stored[4 * k..4 * k + 4].try_into().unwrap()),
                            d => panic!("{}: dense {d}", t.name),
                        };
                        let want = if t.dtype == DType::BF16 { bf16::from_f32(x).to_f32() } else { x };
                        assert_eq!(got.to_bits(), want.to_bits(), "{}[{r},{j}]", t.name);
                    }
                }
            }
            Kind::Fp8Weight(init) => {
                let scales = tensor_bytes(&spec, &format!("{}_scale", t.name));
                for r in 0..rows {
                    key.fill_row(*init, r as u64, &mut row);
                    let s = bf16::from_le_bytes([scales[2 * r], scales[2 * r + 1]]).to_f32();
                    let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                    assert_eq!(s, bf16::from_f32(amax / 448.0).to_f32(), "{} row {r} scale", t.name);
                    for (j, &w) in row.iter().enumerate() {
                        let deq = e4m3_to_f32(stored[r * row_len + j]) * s;
                        // E4M3 keeps 3 mantissa bits: round-to-nearest error ≤ 2^-4 relative for
                        // normals; below 2^-6 (subnormals, spacing 2^-9) ≤ 2^-10 absolute, in
                        // units of the scale. Saturation from the BF16-rounded scale (amax/s ≤
                        // 448·(1 + 2^-8)) stays inside the same bound. 1e-6 relative for the
                        // f32 products.
                        let bound = (w.abs() / 16.0).max(s / 1024.0) * (1.0 + 1e-6);
                        assert!((deq - w).abs() <= bound, "{}[{r},{j}]: w {w} deq {deq} s {s}", t.name);
                    }
                }
                fp8_checked += 1;
            }
            Kind::Fp8Scale { .. } => {} // checked with its weight
            Kind::Nvfp4Packed(_) | Kind::Nvfp4Scale { .. } => panic!("{}: NVFP4 in the FP8 plan", t.name),
        }
    }
    // q/k/v/o of the one attention layer + 3 shared-expert and 16 × 3 routed Linears per layer.
    assert_eq!(fp8_checked, 4 + 4 * 3 + 4 * 16 * 3);
}

/// `--quant nvfp4a16`: the same Linears as the FP8 export are NVFP4 (the rest identical: BF16 and
/// F32 tensors are the same bytes as in the FP8 export of the same seed), each stored row is the
/// generator's f32 row quantised by `model_spec::nvfp4::quantize_row` with the plan's global
/// scale, and every dequantised weight is within half an E2M1 step of its group's grid (or
/// saturated at ±6 of its group scale).
#[test]
fn nvfp4_stored_values_are_the_generated_rows_quantised() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut opts = SynthOptions::new(Preset::Tiny, 3);
    opts.quant = synth::Quant::Nvfp4a16;
    let plan = synth::synth(a.path(), opts).unwrap();
    synth_tiny(b.path(), 3);
    let (spec, fp8) = (load_checkpoint(a.path()).unwrap(), load_checkpoint(b.path()).unwrap());
    let global = synth::plan::nvfp4_global_scale();
    let mut checked = 0;
    for (_, t) in plan.tensors() {
        match &t.kind {
            Kind::Dense(_) if !t.name.ends_with(".weight_global_scale") => {
                assert_eq!(tensor_bytes(&spec, &t.name), tensor_bytes(&fp8, &t.name), "{}", t.name)
            }
            Kind::Dense(_) => {
                assert_eq!(tensor_bytes(&spec, &t.name), global.to_le_bytes(), "{}", t.name);
            }
            Kind::Nvfp4Packed(init) => {
                let module = t.name.strip_suffix(".weight_packed").unwrap();
                assert!(fp8.tensor(&format!("{module}.weight")).unwrap().dtype == DType::F8_E4M3, "{module}");
                let (packed, scales) =
                    (tensor_bytes(&spec, &t.name), tensor_bytes(&spec, &format!("{module}.weight_scale")));
                let (rows, n_in) = (t.shape[0], t.shape[1] * 2);
                let key = TensorKey::new(3, &t.name);
                let mut row = vec![0f32; n_in];
                for r in 0..rows {
                    key.fill_row(*init, r as u64, &mut row);
                    let (mut p, mut s) = (vec![0u8; n_in / 2], vec![0u8; n_in / 16]);
                    model_spec::nvfp4::quantize_row(&row, global, &mut p, &mut s);
                    assert_eq!(p, packed[r * n_in / 2..][..n_in / 2], "{} row {r}", t.name);
                    assert_eq!(s, scales[r * n_in / 16..][..n_in / 16], "{} row {r} scales", t.name);
                    // Each group's scale is its amax / 6 to E4M3's precision (3 mantissa bits:
                    // within 2^-4 relative, or its smallest subnormal step 2^-9 / global) — not
                    // merely one under which the codes fit.
                    for (g, chunk) in row.chunks_exact(16).enumerate() {
                        let want = chunk.iter().fold(0f32, |m, v| m.max(v.abs())) / 6.0;
                        let gs = model_spec::nvfp4::group_scale(s[g], global);
                        let tol = want / 16.0 + 2f32.powi(-9) / global;
                        assert!((gs - want).abs() <= tol, "{} row {r} group {g}: scale {gs}, amax / 6 {want}", t.name);
                    }
                    let deq = model_spec::nvfp4::dequantize(&p, &s, global, 1, n_in);
                    for (j, (&w, d)) in row.iter().zip(&deq).enumerate() {
                        let gs = model_spec::nvfp4::group_scale(s[j / 16], global);
                        let sat = w.abs() >= 6.0 * gs && d.to_f32().abs() == bf16::from_f32(6.0 * gs).to_f32();
                        // Half the widest E2M1 step (4 → 6: 2·gs) is gs; the product is then rounded
                        // to bf16 (half an ulp, at most 2^-8 of the value).
                        let bound = gs * (1.0 + 1e-6) + d.to_f32().abs() / 256.0;
                        assert!(sat || (d.to_f32() - w).abs() <= bound, "{}[{r},{j}]: {w} -> {d} (gs {gs})", t.name);
                    }
                }
                checked += 1;
            }
            Kind::Nvfp4Scale { .. } => {} // checked with its packed weight
            Kind::Fp8Weight(_) | Kind::Fp8Scale { .. } => panic!("{}: FP8 in the NVFP4 plan", t.name),
        }
    }
    assert_eq!(checked, 4 + 4 * 3 + 4 * 16 * 3);
}

/// Scale of the values: weights ~ N(0, 0.02), A_log = ln U(0.01, 16).
#[test]
fn values_have_the_intended_distribution() {
    let key = TensorKey::new(0, "x");
    let mut v = vec![0f32; 1 << 16];
    key.fill_row(xtask::synth::init::Init::WEIGHT, 0, &mut v);
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let std = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
    // Standard error of the mean is 0.02/256 ≈ 8e-5; of the std ≈ 0.02/√(2n) ≈ 5.5e-5.
    assert!(mean.abs() < 4e-4, "mean {mean}");
    assert!((std - 0.02).abs() < 3e-4, "std {std}");
    key.fill_row(xtask::synth::init::Init::LogUniform { lo: 0.01, hi: 16.0 }, 1, &mut v);
    assert!(v.iter().all(|&x| x >= 0.01f32.ln() && x < 16f32.ln()));
    // Rows are independent streams; the same row is reproducible.
    let (mut a, mut b) = (vec![0f32; 8], vec![0f32; 8]);
    key.fill_row(xtask::synth::init::Init::WEIGHT, 5, &mut a);
    key.fill_row(xtask::synth::init::Init::WEIGHT, 5, &mut b);
    assert_eq!(a, b);
    key.fill_row(xtask::synth::init::Init::WEIGHT, 6, &mut b);
    assert_ne!(a, b);
}

/// `cargo xtask gen` without a model: synthesises the tiny preset once, reuses it while the
/// stamp matches, re-synthesises when the stamp differs.
#[test]
fn gen_default_synthesises_tiny_once() {
    let root = tempfile::tempdir().unwrap();
    let spec_path = root.path().join(".ornith").join("spec.json");
    let spec = xtask::gen::gen(None, root.path(), &spec_path).unwrap();
    let tiny = root.path().join(".ornith").join("models").join("tiny");
    assert_eq!(spec.model_dir, std::fs::canonicalize(&tiny).unwrap());
    assert_eq!(model_spec::ModelSpec::read(&spec_path).unwrap(), spec);
    let shard = tiny.join(&spec.shards[0].file);
    let mtime = || std::fs::metadata(&shard).unwrap().modified().unwrap();
    let first = mtime();
    std::thread::sleep(std::time::Duration::from_millis(20));
    xtask::gen::gen(None, root.path(), &spec_path).unwrap();
    assert_eq!(mtime(), first, "a stamped tiny checkpoint is reused");
    std::fs::write(tiny.join(".synth-stamp.json"), "{\"preset\":\"tiny\",\"seed\":0,\"generator_version\":0}\n")
        .unwrap();
    let again = xtask::gen::gen(None, root.path(), &spec_path).unwrap();
    assert_ne!(mtime(), first, "a stale stamp makes gen synthesise again");
    assert_eq!(again.fingerprint, spec.fingerprint, "same preset and seed, same checkpoint");
    assert!(!root.path().join(".ornith").join("models").join("tiny.partial").exists());
}
