//! The vendor's decompressor read our synthetic tiny checkpoints back with identical dequantised
//! values (tests/generators/roundtrip_synth.py and roundtrip_synth_nvfp4.py, recorded in
//! tests/fixtures/synth_roundtrip.json and synth_roundtrip_nvfp4.json as the sha256 of each
//! Linear's dequantised BF16 weight). These tests synthesise the tiny preset now, dequantise every
//! quantised Linear in Rust and compare the digests: a change to the generator's bytes, or a
//! reading of codes, scales or packing that differs from compressed-tensors', fails here.

use std::path::PathBuf;

use half::bf16;
use sha2::{Digest, Sha256};

fn record(name: &str) -> serde_json::Value {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    serde_json::from_slice(&std::fs::read(root.join("fixtures").join(name)).unwrap()).unwrap()
}

fn sha256_bf16(w: &[bf16]) -> String {
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    format!("{:x}", Sha256::digest(&bytes))
}

/// compressed-tensors' `float-quantized` decompression of a per-channel FP8 Linear:
/// w[o, i] = bf16(e4m3(code[o, i]) * scale[o]), the product in f32 (exact: a 4-bit by 8-bit
/// significand) and one round to the scale's dtype, bf16.
#[test]
fn vendor_fp8_decompressor_reads_our_synthetic_checkpoint_identically() {
    let rec = record("synth_roundtrip.json");
    assert_eq!(rec["fp8_linears_mismatched"], 0);
    assert_eq!(rec["dequantised_equals_bf16_of_e4m3_times_scale"], true);
    assert_eq!(rec["transformers_load_and_forward"]["finite"], true);
    let want = rec["dequantised_sha256_bf16"].as_object().unwrap();

    let dir = tempfile::tempdir().unwrap();
    let opts = xtask::synth::SynthOptions::new(xtask::synth::Preset::Tiny, xtask::synth::DEFAULT_SEED);
    assert_eq!(opts.quant, xtask::synth::Quant::Fp8);
    xtask::synth::synth(dir.path(), opts).unwrap();
    let spec = model_spec::load_checkpoint(dir.path()).unwrap();
    let ck = ornith_runtime::weights::Checkpoint::open(dir.path(), &spec.fingerprint).unwrap();
    let mut checked = 0;
    for (name, t) in &spec.tensors {
        if t.dtype != model_spec::DType::F8_E4M3 {
            continue;
        }
        let module = name.strip_suffix(".weight").unwrap_or_else(|| panic!("FP8 tensor {name} is not a weight"));
        let (out, inn) = (t.shape[0], t.shape[1]);
        let codes = ck.tensor(name, &[model_spec::DType::F8_E4M3], &[out, inn]).unwrap();
        let scale = ck.tensor(&format!("{module}.weight_scale"), &[model_spec::DType::BF16], &[out, 1]).unwrap();
        let mut f = vec![0f32; inn];
        let mut w: Vec<bf16> = Vec::with_capacity(out * inn);
        for (row, s) in codes.bytes.chunks_exact(inn).zip(ornith_runtime::weights::to_f32(&scale)) {
            ornith_runtime::cpu::fp8::dequantize_row(row, s, &mut f);
            w.extend(f.iter().map(|&v| bf16::from_f32(v)));
        }
        assert_eq!(Some(sha256_bf16(&w).as_str()), want.get(module).and_then(|v| v.as_str()), "{module}");
        checked += 1;
    }
    assert_eq!(checked, want.len());
    assert_eq!(rec["fp8_linears_checked"].as_u64(), Some(checked as u64));
}

/// `cargo xtask synth --quant nvfp4a16` read back by compressed-tensors' NVFP4 decompressor
/// (tests/generators/roundtrip_synth_nvfp4.py, recorded in tests/fixtures/synth_roundtrip_nvfp4.json
/// as the sha256 of each Linear's dequantised BF16 weight): model_spec::nvfp4 on a checkpoint
/// synthesised now gives the same bytes for every NVFP4 Linear, and model-spec accepts it.
#[test]
fn vendor_nvfp4_decompressor_reads_our_synthetic_checkpoint_identically() {
    let rec = record("synth_roundtrip_nvfp4.json");
    assert_eq!(rec["transformers_load_and_forward"]["finite"], true);
    let want = rec["dequantised_sha256_bf16"].as_object().unwrap();

    let dir = tempfile::tempdir().unwrap();
    let mut opts = xtask::synth::SynthOptions::new(xtask::synth::Preset::Tiny, xtask::synth::DEFAULT_SEED);
    opts.quant = xtask::synth::Quant::Nvfp4a16;
    xtask::synth::synth(dir.path(), opts).unwrap();
    let spec = model_spec::load_checkpoint(dir.path()).unwrap();
    let ck = ornith_runtime::weights::Checkpoint::open(dir.path(), &spec.fingerprint).unwrap();
    let mut checked = 0;
    for (name, t) in &spec.tensors {
        let Some(module) = name.strip_suffix(".weight_packed") else { continue };
        let (out, inn) = (t.shape[0], t.shape[1] * 2);
        let packed = ck.tensor(name, &[model_spec::DType::U8], &[out, inn / 2]).unwrap();
        let (sname, gname) = (format!("{module}.weight_scale"), format!("{module}.weight_global_scale"));
        let scale = ck.tensor(&sname, &[model_spec::DType::F8_E4M3], &[out, inn / 16]).unwrap();
        let gs = ck.tensor(&gname, &[model_spec::DType::F32], &[1]).unwrap();
        let global = ornith_runtime::weights::to_f32(&gs)[0];
        let w = model_spec::nvfp4::dequantize(packed.bytes, scale.bytes, global, out, inn);
        assert_eq!(Some(sha256_bf16(&w).as_str()), want.get(module).and_then(|v| v.as_str()), "{module}");
        checked += 1;
    }
    assert_eq!(checked, want.len());
    assert_eq!(rec["nvfp4_linears_checked"].as_u64(), Some(checked as u64));
}
