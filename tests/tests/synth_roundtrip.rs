//! The vendor's decompressor read our synthetic tiny checkpoint back with identical dequantised
//! values (tests/generators/roundtrip_synth.py, recorded in tests/fixtures/synth_roundtrip.json).
//! This test ties that record to the current generator: the number of FP8 Linears it checked is
//! the number the tiny preset has now, and none mismatched.

use std::path::PathBuf;

#[test]
fn vendor_decompressor_record_matches_current_tiny_preset() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("fixtures/synth_roundtrip.json")).unwrap()).unwrap();
    assert_eq!(rec["fp8_linears_mismatched"], 0);
    assert_eq!(rec["dequantised_equals_bf16_of_e4m3_times_scale"], true);
    assert_eq!(rec["transformers_load_and_forward"]["finite"], true);

    let dir = tempfile::tempdir().unwrap();
    xtask::synth::synth(
        dir.path(),
        xtask::synth::SynthOptions {
            preset: xtask::synth::Preset::Tiny,
            seed: xtask::synth::DEFAULT_SEED,
            quant: xtask::synth::Quant::Fp8,
            contents: xtask::synth::Contents::HeadersOnly,
            progress: false,
        },
    )
    .unwrap();
    let spec = model_spec::load_checkpoint(dir.path()).unwrap();
    let fp8 = spec.tensors.values().filter(|t| t.dtype == model_spec::DType::F8_E4M3).count();
    assert_eq!(rec["fp8_linears_checked"].as_u64(), Some(fp8 as u64));
}

/// `cargo xtask synth --quant nvfp4a16` read back by compressed-tensors' NVFP4 decompressor
/// (tests/generators/roundtrip_synth_nvfp4.py, recorded in tests/fixtures/synth_roundtrip_nvfp4.json
/// as the sha256 of each Linear's dequantised BF16 weight): model_spec::nvfp4 on a checkpoint
/// synthesised now gives the same bytes for every NVFP4 Linear, and model-spec accepts it.
#[test]
fn vendor_nvfp4_decompressor_reads_our_synthetic_checkpoint_identically() {
    use sha2::{Digest, Sha256};
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("fixtures/synth_roundtrip_nvfp4.json")).unwrap()).unwrap();
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
        let global = f32::from_le_bytes(gs.bytes.try_into().unwrap());
        let w = model_spec::nvfp4::dequantize(packed.bytes, scale.bytes, global, out, inn);
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let got = format!("{:x}", Sha256::digest(&bytes));
        assert_eq!(Some(got.as_str()), want.get(module).and_then(|v| v.as_str()), "{module}");
        checked += 1;
    }
    assert_eq!(checked, want.len());
    assert_eq!(rec["nvfp4_linears_checked"].as_u64(), Some(checked as u64));
}
