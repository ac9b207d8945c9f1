//! Snapshots of the code `model!()` generates for the 4-layer micro fixtures (BF16, and the FP8
//! and NVFP4A16 exports made by llm-compressor), so every change to the generated graph is reviewed as a diff.
//! `UPDATE_SNAPSHOTS=1 cargo test -p ornith-macros` rewrites the snapshot.

#[path = "../src/codegen.rs"]
mod codegen;

use std::path::PathBuf;

fn expand(fixture: &str) -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let spec = model_spec::load_checkpoint(&root.join("tests/fixtures").join(fixture)).unwrap();
    let file: syn::File = syn::parse2(codegen::generate(&spec)).expect("generated code parses");
    let text = prettyplease::unparse(&file);
    // The checkpoint's absolute path is the one machine-specific line.
    text.replace(&spec.model_dir.display().to_string(), &format!("<workspace>/tests/fixtures/{fixture}"))
}

fn check(fixture: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots").join(format!("{fixture}.rs.snap"));
    let got = expand(fixture);
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(got == want, "generated code for {fixture} changed; review `UPDATE_SNAPSHOTS=1 cargo test -p ornith-macros` and commit the snapshot");
}

#[test]
fn micro_fp8_expansion_matches_snapshot() {
    check("micro-fp8");
}

#[test]
fn micro_bf16_expansion_matches_snapshot() {
    check("micro-bf16");
}

#[test]
fn micro_nvfp4_expansion_matches_snapshot() {
    check("micro-nvfp4");
}

#[test]
fn precision_follows_the_checkpoint() {
    // Same model, two exports: FP8 Linears appear exactly where llm-compressor quantised.
    let fp8 = expand("micro-fp8");
    let bf16 = expand("micro-bf16");
    assert!(
        fp8.contains("graph::GatedAttention<B, Fp8, Fp8, Fp8, Fp8>"),
        "attention q/k/v/o are FP8 in the FP8 export"
    );
    assert!(
        fp8.contains("graph::GatedDeltaNet<B, Bf16, Bf16, Bf16, Bf16, Bf16>"),
        "linear_attn stays BF16 (ignore pattern)"
    );
    // Only the import names Fp8 in the BF16 export: no Linear has it as its type.
    assert_eq!(bf16.matches("Fp8").count(), 1, "the BF16 export has no FP8 Linear");
    assert_ne!(fp8, bf16);
    // The NVFP4A16 export of the same model: 4-bit exactly where the FP8 export is FP8.
    let nvfp4 = expand("micro-nvfp4");
    assert!(nvfp4.contains("graph::GatedAttention<B, Nvfp4, Nvfp4, Nvfp4, Nvfp4>"), "attention q/k/v/o are NVFP4");
    assert!(nvfp4.contains("graph::GatedDeltaNet<B, Bf16, Bf16, Bf16, Bf16, Bf16>"), "linear_attn stays BF16");
    assert_eq!(nvfp4.matches("Fp8").count(), 1, "the NVFP4 export has no FP8 Linear");
    assert_eq!(nvfp4.matches("Nvfp4").count(), fp8.matches("Fp8").count(), "NVFP4 where the FP8 export is FP8");
    assert_eq!(fp8.matches("Nvfp4").count(), 1, "the FP8 export has no NVFP4 Linear");
}
