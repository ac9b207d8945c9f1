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
            contents: xtask::synth::Contents::HeadersOnly,
            progress: false,
        },
    )
    .unwrap();
    let spec = model_spec::load_checkpoint(dir.path()).unwrap();
    let fp8 = spec.tensors.values().filter(|t| t.dtype == model_spec::DType::F8_E4M3).count();
    assert_eq!(rec["fp8_linears_checked"].as_u64(), Some(fp8 as u64));
}
