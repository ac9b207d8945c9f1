//! Writes the model specs of the committed fixture checkpoints into OUT_DIR, so the tests can
//! compile typed graphs for them with `ornith_macros::model!(spec = "$OUT_DIR/<name>.spec.json")`.
//! The specs are always made fresh from the fixtures (and the synthetic tiny NVFP4A16 preset):
//! nothing machine-specific is committed.

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
    // The tiny preset as `cargo xtask synth --quant nvfp4a16` writes it, headers only: its spec
    // (and fingerprint) is that of the full checkpoint the test synthesises at run time.
    let dir = out.join("tiny-nvfp4");
    let mut opts = xtask::synth::SynthOptions::new(xtask::synth::Preset::Tiny, xtask::synth::DEFAULT_SEED);
    opts.quant = xtask::synth::Quant::Nvfp4a16;
    opts.contents = xtask::synth::Contents::HeadersOnly;
    xtask::synth::synth(&dir, opts).unwrap_or_else(|e| panic!("synth tiny nvfp4a16: {e:#}"));
    let spec = model_spec::load_checkpoint(&dir).unwrap_or_else(|e| panic!("tiny nvfp4a16: {e}"));
    spec.write(&out.join("tiny-nvfp4.spec.json")).unwrap();
}
