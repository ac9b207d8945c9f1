//! One test per way a checkpoint can be wrong. Each builds the tiny synthetic checkpoint
//! (headers over sparse data: `load_checkpoint` reads headers only), breaks one thing, and
//! checks that the error names the file, the tensor where there is one, what was expected
//! against what was found, and a fix.

use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use tempfile::TempDir;
use xtask::synth::{self, Contents, Preset, SynthOptions};

const L: &str = "model.language_model.layers";

fn tiny() -> TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let opts = SynthOptions { contents: Contents::HeadersOnly, ..SynthOptions::new(Preset::Tiny, 0) };
    synth::synth(tmp.path(), opts).unwrap();
    model_spec::load_checkpoint(tmp.path()).expect("the unmodified checkpoint is valid");
    tmp
}

fn load_err(dir: &Path) -> String {
    let e = model_spec::load_checkpoint(dir).expect_err("the broken checkpoint must be refused").to_string();
    assert!(e.contains("Fix:"), "no fix in: {e}");
    e
}

fn assert_has(e: &str, parts: &[&str]) {
    for p in parts {
        assert!(e.contains(p), "error lacks {p:?}:\n{e}");
    }
}

fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

fn shard_of(dir: &Path, tensor: &str) -> String {
    let idx: Value = serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    idx["weight_map"][tensor].as_str().unwrap_or_else(|| panic!("{tensor} not in the index")).to_string()
}

/// The header object and the data-section length of a shard.
fn read_shard(path: &Path) -> (Map<String, Value>, u64) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header.as_object().unwrap().clone(), (bytes.len() - 8 - n) as u64)
}

/// Rewrites a shard with `header` (space-padded) and a zero data section of `data_len` bytes.
fn write_shard(path: &Path, header: &Map<String, Value>, data_len: u64) {
    let mut h = serde_json::to_vec(header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    std::fs::write(path, &out).unwrap();
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(out.len() as u64 + data_len).unwrap();
}

fn dtype_size(d: &str) -> u64 {
    match d {
        "F8_E4M3" | "U8" => 1,
        "BF16" | "F16" => 2,
        "F32" => 4,
        other => panic!("{other}"),
    }
}

/// Lays the tensors out contiguously (in header order); returns the data length.
fn relayout(header: &mut Map<String, Value>) -> u64 {
    let mut pos = 0;
    for (name, e) in header.iter_mut() {
        if name == "__metadata__" {
            continue;
        }
        let n: u64 = e["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).product::<u64>()
            * dtype_size(e["dtype"].as_str().unwrap());
        e["data_offsets"] = json!([pos, pos + n]);
        pos += n;
    }
    pos
}

/// Edits the header of the shard holding `tensor`, re-laying out the offsets consistently.
fn edit_header(dir: &Path, tensor: &str, f: impl FnOnce(&mut Map<String, Value>)) -> PathBuf {
    let path = dir.join(shard_of(dir, tensor));
    let (mut h, _) = read_shard(&path);
    f(&mut h);
    let len = relayout(&mut h);
    write_shard(&path, &h, len);
    path
}

/// Edits the header of the shard holding `tensor` verbatim (offsets may lie), keeping the data length.
fn edit_header_raw(dir: &Path, tensor: &str, f: impl FnOnce(&mut Map<String, Value>)) -> String {
    let file = shard_of(dir, tensor);
    let path = dir.join(&file);
    let (mut h, len) = read_shard(&path);
    f(&mut h);
    write_shard(&path, &h, len);
    file
}

fn quant_group(v: &mut Value) -> &mut Value {
    &mut v["quantization_config"]["config_groups"]["group_0"]
}

#[test]
fn missing_config() {
    let d = tiny();
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    let e = load_err(d.path());
    assert_has(&e, &["config.json", "cannot read", "No such file"]);
}

#[test]
fn missing_index_and_no_single_file() {
    let d = tiny();
    std::fs::remove_file(d.path().join("model.safetensors.index.json")).unwrap();
    let e = load_err(d.path());
    assert_has(&e, &["no model.safetensors.index.json and no single model.safetensors", "download the index"]);
}

#[test]
fn missing_tensor() {
    let d = tiny();
    let t = format!("{L}.1.post_attention_layernorm.weight");
    edit_header(d.path(), &t, |h| {
        h.shift_remove(&t);
    });
    edit_json(&d.path().join("model.safetensors.index.json"), |v| {
        v["weight_map"].as_object_mut().unwrap().shift_remove(&t);
    });
    let e = load_err(d.path());
    assert_has(&e, &["model.safetensors.index.json", &format!("missing tensor {t}"), "expected BF16/F32 [64]"]);
}

#[test]
fn extra_tensor() {
    let d = tiny();
    let anchor = format!("{L}.0.input_layernorm.weight");
    let extra = format!("{L}.0.mlp.bias");
    let shard = edit_header(d.path(), &anchor, |h| {
        h.insert(extra.clone(), json!({"dtype": "BF16", "shape": [64], "data_offsets": [0, 0]}));
    });
    let file = shard.file_name().unwrap().to_str().unwrap().to_string();
    edit_json(&d.path().join("model.safetensors.index.json"), |v| {
        v["weight_map"][&extra] = json!(file);
    });
    let e = load_err(d.path());
    assert_has(&e, &[&file, &format!("unexpected tensor {extra}"), "BF16 [64]", "not part of the model"]);
}

#[test]
fn mistyped_tensor() {
    let d = tiny();
    let t = format!("{L}.0.input_layernorm.weight");
    let file = edit_header(d.path(), &t, |h| h[&t]["dtype"] = json!("F16"));
    let e = load_err(d.path());
    assert_has(&e, &[file.file_name().unwrap().to_str().unwrap(), &t, "expected dtype BF16 or F32, found dtype F16"]);
}

#[test]
fn misshaped_tensor() {
    let d = tiny();
    let t = format!("{L}.3.self_attn.q_norm.weight");
    let file = edit_header(d.path(), &t, |h| h[&t]["shape"] = json!([16]));
    let e = load_err(d.path());
    assert_has(
        &e,
        &[file.file_name().unwrap().to_str().unwrap(), &t, "expected shape [32], found shape [16]", "config.json"],
    );
}

#[test]
fn unknown_quant_method() {
    let d = tiny();
    edit_json(&d.path().join("config.json"), |v| v["quantization_config"]["quant_method"] = json!("gptq"));
    let e = load_err(d.path());
    assert_has(&e, &["config.json", "found \"gptq\", expected \"compressed-tensors\"", "never guesses"]);
}

#[test]
fn unknown_format() {
    let d = tiny();
    edit_json(&d.path().join("config.json"), |v| v["quantization_config"]["format"] = json!("pack-quantized"));
    let e = load_err(d.path());
    assert_has(&e, &["config.json", "format: found \"pack-quantized\", expected \"float-quantized\""]);
}

#[test]
fn unknown_weight_strategy_tensor() {
    let d = tiny();
    edit_json(&d.path().join("config.json"), |v| quant_group(v)["weights"]["strategy"] = json!("tensor"));
    let e = load_err(d.path());
    assert_has(
        &e,
        &[
            "config.json",
            "weights: found",
            "strategy \"tensor\"",
            "expected num_bits 8 type \"float\" strategy \"channel\"",
        ],
    );
}

#[test]
fn unknown_weight_strategy_block() {
    let d = tiny();
    edit_json(&d.path().join("config.json"), |v| {
        quant_group(v)["weights"]["strategy"] = json!("block");
        quant_group(v)["weights"]["block_structure"] = json!([128, 128]);
    });
    let e = load_err(d.path());
    assert_has(&e, &["config.json", "strategy \"block\"", "strategy \"channel\""]);
}

#[test]
fn static_activations_refused() {
    let d = tiny();
    edit_json(&d.path().join("config.json"), |v| {
        quant_group(v)["input_activations"]["dynamic"] = json!(false);
        quant_group(v)["input_activations"]["strategy"] = json!("tensor");
    });
    let e = load_err(d.path());
    assert_has(
        &e,
        &[
            "config.json",
            "input_activations: found",
            "strategy \"tensor\" dynamic false",
            "strategy \"token\" dynamic true",
        ],
    );
}

#[test]
fn missing_shard() {
    let d = tiny();
    let shard = "model-00002-of-00002.safetensors";
    let idx: Value =
        serde_json::from_slice(&std::fs::read(d.path().join("model.safetensors.index.json")).unwrap()).unwrap();
    let first =
        idx["weight_map"].as_object().unwrap().iter().find(|(_, s)| s.as_str() == Some(shard)).unwrap().0.clone();
    std::fs::remove_file(d.path().join(shard)).unwrap();
    let e = load_err(d.path());
    assert_has(
        &e,
        &[
            "model.safetensors.index.json",
            &format!("shard {shard}"),
            &format!("tensor {first}"),
            "does not exist",
            "download the missing shard",
        ],
    );
}

#[test]
fn truncated_shard() {
    let d = tiny();
    let file = shard_of(d.path(), "lm_head.weight");
    let path = d.path().join(&file);
    let (h, _) = read_shard(&path);
    let last = h
        .iter()
        .filter(|(n, _)| *n != "__metadata__")
        .max_by_key(|(_, e)| e["data_offsets"][1].as_u64().unwrap())
        .unwrap()
        .0
        .clone();
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 1000).unwrap();
    let e = load_err(d.path());
    assert_has(
        &e,
        &[&file, &format!("tensor {last}"), "point past the end of the data section", "truncated", "download it again"],
    );
}

#[test]
fn header_offsets_overlap() {
    let d = tiny();
    let t = format!("{L}.2.post_attention_layernorm.weight");
    let file = edit_header_raw(d.path(), &t, |h| {
        let o = h[&t]["data_offsets"].clone();
        let (s, e) = (o[0].as_u64().unwrap(), o[1].as_u64().unwrap());
        assert!(s >= 2);
        h[&t]["data_offsets"] = json!([s - 2, e - 2]);
    });
    let e = load_err(d.path());
    assert_has(&e, &[&file, &format!("tensor {t}"), "overlap tensor"]);
}

#[test]
fn header_offsets_out_of_bounds() {
    let d = tiny();
    let t = format!("{L}.2.input_layernorm.weight");
    let file = edit_header_raw(d.path(), &t, |h| {
        h[&t]["data_offsets"] = json!([1u64 << 40, (1u64 << 40) + 128]);
    });
    let e = load_err(d.path());
    assert_has(
        &e,
        &[
            &file,
            &format!("tensor {t}: data_offsets [1099511627776, 1099511627904] point past the end of the data section"),
        ],
    );
}

#[test]
fn header_dtype_times_shape_is_not_the_byte_length() {
    let d = tiny();
    let t = format!("{L}.1.input_layernorm.weight");
    let file = edit_header_raw(d.path(), &t, |h| h[&t]["dtype"] = json!("F32"));
    let e = load_err(d.path());
    assert_has(
        &e,
        &[&file, &format!("tensor {t}: dtype F32 × shape [64] = 256 bytes, but data_offsets"), "span 128 bytes"],
    );
}

#[test]
fn ignore_list_leaves_a_bf16_linear_unmatched() {
    // Without re:.*linear_attn.*, in_proj_qkv would have been quantised: the stored BF16 contradicts it.
    let d = tiny();
    edit_json(&d.path().join("config.json"), |v| {
        v["quantization_config"]["ignore"].as_array_mut().unwrap().retain(|p| p != "re:.*linear_attn.*");
    });
    let t = format!("{L}.0.linear_attn.in_proj_qkv.weight");
    let file = shard_of(d.path(), &t);
    let e = load_err(d.path());
    assert_has(
        &e,
        &[
            &file,
            &format!("tensor {t}"),
            "expected F8_E4M3 (no entry of quantization_config.ignore matches",
            "found BF16",
            "ignore patterns",
        ],
    );
}

#[test]
fn ignore_list_matches_a_stored_fp8_linear() {
    let d = tiny();
    edit_json(&d.path().join("config.json"), |v| {
        v["quantization_config"]["ignore"].as_array_mut().unwrap().push(json!("re:.*self_attn.*"));
    });
    let t = format!("{L}.3.self_attn.q_proj.weight");
    let file = shard_of(d.path(), &t);
    let e = load_err(d.path());
    assert_has(
        &e,
        &[
            &file,
            &format!("tensor {t}"),
            "expected BF16 (ignore entry \"re:.*self_attn.*\" keeps this module in BF16)",
            "found F8_E4M3",
        ],
    );
}

/// An NVFP4A16 quantization_config over FP8 shards: the first quantised Linear is named, with
/// what the config implies and what is stored.
#[test]
fn nvfp4_config_over_fp8_tensors_is_refused() {
    let d = tiny();
    edit_json(&d.path().join("config.json"), |v| {
        v["quantization_config"] = xtask::synth::config::quantization_config_nvfp4a16();
    });
    let e = load_err(d.path());
    assert_has(
        &e,
        &[
            ".weight: expected U8 .weight_packed with .weight_scale and .weight_global_scale",
            "quantised it to NVFP4",
            "found F8_E4M3 (an FP8 .weight)",
            "Fix:",
        ],
    );
}

#[test]
fn gen_on_a_bad_checkpoint_keeps_the_old_spec() {
    let d = tiny();
    let root = tempfile::tempdir().unwrap();
    let spec_path = root.path().join(".ornith").join("spec.json");
    xtask::gen::gen(Some(d.path()), root.path(), &spec_path).expect("gen on the valid checkpoint");
    let before = std::fs::read(&spec_path).unwrap();
    // Break it (a shard truncated) and run gen again: refused, old spec byte-for-byte intact.
    let path = d.path().join("model-00001-of-00002.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 8).unwrap();
    let err = xtask::gen::gen(Some(d.path()), root.path(), &spec_path).expect_err("gen must refuse");
    assert!(format!("{err:#}").contains("model-00001-of-00002.safetensors"), "{err:#}");
    assert_eq!(std::fs::read(&spec_path).unwrap(), before);
    let leftovers: Vec<_> =
        std::fs::read_dir(spec_path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("spec.json")]);
}

#[test]
fn absurd_dimensions_are_refused() {
    // 2^62 heads would overflow every derived size; the config is refused instead.
    let d = tiny();
    edit_json(&d.path().join("config.json"), |v| v["text_config"]["linear_num_key_heads"] = json!(1u64 << 62));
    let e = load_err(d.path());
    assert_has(
        &e,
        &["config.json", "text_config.linear_num_key_heads: expected at most 1048576, found 4611686018427387904"],
    );
}

#[test]
fn config_that_does_not_match_the_weights() {
    let d = tiny();
    edit_json(&d.path().join("config.json"), |v| v["text_config"]["hidden_size"] = json!(128));
    let e = load_err(d.path());
    // The first stored tensor in name order whose shape depends on hidden_size.
    assert_has(
        &e,
        &[
            "lm_head.weight",
            "expected shape [248320, 128], found shape [248320, 64]",
            "use the config.json that came with these weights",
        ],
    );
}

/// `cargo xtask gen` refuses a checkpoint without the tokenizer or the chat template, which the
/// binary reads at startup (it would otherwise fail there with a bare "No such file").
#[test]
fn gen_refuses_a_checkpoint_without_tokenizer_or_chat_template() {
    for file in xtask::gen::FRONTEND_FILES {
        let dir = tiny();
        std::fs::remove_file(dir.path().join(file)).unwrap();
        let out = tempfile::tempdir().unwrap();
        let spec_path = out.path().join("spec.json");
        let e = xtask::gen::gen(Some(dir.path()), out.path(), &spec_path).expect_err("must be refused").to_string();
        assert_has(&e, &[file, "Fix:"]);
        assert!(!spec_path.exists(), "no spec is written for a refused checkpoint");
    }
}
