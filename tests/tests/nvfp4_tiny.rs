//! The tiny preset in the NVFP4A16 format end to end on the CPU: `cargo xtask synth --preset tiny
//! --quant nvfp4a16`, the graph the macro compiles for its spec (4-bit experts, shared experts and
//! attention projections), the real tokenizer and chat template, and one JSONL request through
//! the serve loop, answered with one result line.

use ornith_runtime::backend_cpu::CpuBackend;
use ornith_runtime::engine::{Capacity, Engine, EngineConfig};
use ornith_runtime::protocol::{self, adapters, GenerationDefaults, ServeOptions};
use ornith_runtime::weights::Checkpoint;

mod tiny {
    ornith_macros::model!(spec = "$OUT_DIR/tiny-nvfp4.spec.json");
}

#[test]
fn tiny_nvfp4_answers_a_jsonl_request_on_the_cpu() {
    // The spec the graph was compiled from: NVFP4 routed experts in every layer.
    let spec = model_spec::ModelSpec::read(concat!(env!("OUT_DIR"), "/tiny-nvfp4.spec.json").as_ref()).unwrap();
    assert_eq!(spec.fingerprint, tiny::FINGERPRINT);
    assert!(spec.layers.iter().all(|l| l.mlp.experts.down_proj == model_spec::Precision::Nvfp4));
    let dir = tempfile::tempdir().unwrap();
    let mut opts = xtask::synth::SynthOptions::new(xtask::synth::Preset::Tiny, xtask::synth::DEFAULT_SEED);
    opts.quant = xtask::synth::Quant::Nvfp4a16;
    xtask::synth::synth(dir.path(), opts).unwrap();

    let ck = Checkpoint::open(dir.path(), tiny::FINGERPRINT).unwrap();
    let cap = Capacity { slots: 2, blocks: 4, snapshots: 0 };
    let runner = tiny::Compiled::load(CpuBackend::new(), &ck, &cap).unwrap();
    let (tok, tpl) = adapters::load_frontend_parts(dir.path()).unwrap();
    let cfg = EngineConfig {
        max_batch_tokens: 2048,
        idle_batch_tokens: 2048,
        max_context: 1024,
        sample_vocab: tok.vocab_size(),
    };
    let engine = Engine::new(Box::new(runner), cfg).unwrap();
    let mut o = ServeOptions::new("tiny-nvfp4", GenerationDefaults::from_model_dir(dir.path()).unwrap());
    o.quiet = true;
    o.ordered = true;
    let input = concat!(
        r#"{"custom_id":"q1","messages":[{"role":"user","content":"Hello"}],"max_tokens":8,"temperature":0,"ignore_eos":true}"#,
        "\n",
        r#"{"custom_id":"q2","prompt":"The capital of France is","max_tokens":4,"temperature":0,"ignore_eos":true}"#,
        "\n"
    );
    let mut out = Vec::new();
    protocol::serve(
        std::io::BufReader::new(std::io::Cursor::new(input.as_bytes().to_vec())),
        &mut out,
        engine,
        &tok,
        &tpl,
        &o,
    )
    .unwrap();
    let text = String::from_utf8(out).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2, "{text}");
    for (line, (id, n)) in lines.iter().zip([("q1", 8), ("q2", 4)]) {
        assert_eq!(line["custom_id"], id, "{line}");
        assert!(line["error"].is_null(), "{line}");
        assert_eq!(line["response"]["status_code"], 200, "{line}");
        assert_eq!(line["response"]["body"]["usage"]["completion_tokens"], n, "{line}");
    }
}
