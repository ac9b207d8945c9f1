//! Writes the model specs of the committed fixture checkpoints into OUT_DIR, so the tests can
//! compile typed graphs for them with `ornith_macros::model!(spec = "$OUT_DIR/<name>.spec.json")`.
//! The specs are always made fresh from the fixtures: nothing machine-specific is committed.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    for name in ["micro-fp8", "micro-bf16", "micro-nvfp4"] {
        let dir = manifest.join("fixtures").join(name);
        for f in ["config.json", "model.safetensors", "generation_config.json"] {
            println!("cargo:rerun-if-changed={}", dir.join(f).display());
        }
        let spec = model_spec::load_checkpoint(&dir).unwrap_or_else(|e| panic!("fixture {name}: {e}"));
        spec.write(&out.join(format!("{name}.spec.json"))).unwrap();
    }
}
