//! The CPU backend against the transformers oracle on the micro fixtures (made by
//! transformers 5.17 + llm-compressor 0.14; goldens by tests/generators/golden_forward.py).

use ornith_runtime::backend_cpu::CpuBackend;
use ornith_runtime::graph::Backend;
use ornith_runtime::weights::Checkpoint;
use std::path::PathBuf;

mod fp8 {
    ornith_macros::model!(spec = "$OUT_DIR/micro-fp8.spec.json");
}
mod bf16 {
    ornith_macros::model!(spec = "$OUT_DIR/micro-bf16.spec.json");
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    fn open(name: &str) -> Self {
        Golden { bytes: std::fs::read(root().join("golden").join(name).join("golden.safetensors")).unwrap() }
    }
    fn f32(&self, key: &str) -> Vec<f32> {
        let st = safetensors::SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(key).unwrap();
        match t.dtype() {
            safetensors::Dtype::BF16 => t.data().chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            safetensors::Dtype::F32 => t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            d => panic!("{key}: unexpected dtype {d:?}"),
        }
    }
    fn ids(&self, key: &str) -> Vec<u32> {
        let st = safetensors::SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(key).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::I64);
        t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
    }
}

/// max and mean |a - b|.
fn diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len());
    let mut max = 0f32;
    let mut sum = 0f64;
    for (x, y) in a.iter().zip(b) {
        let d = (x - y).abs();
        max = max.max(d);
        sum += d as f64;
    }
    (max, (sum / a.len() as f64) as f32)
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

macro_rules! golden_run {
    ($m:ident, $fixture:literal, $golden:literal) => {{
        let b = CpuBackend;
        let ck = Checkpoint::open(&root().join("fixtures").join($fixture), $m::FINGERPRINT).unwrap();
        let model = $m::Model::load(&b, &ck).unwrap();
        let g = Golden::open($golden);
        let prompt = g.ids("prompt_ids");
        let greedy = g.ids("greedy_tokens");
        let vocab = $m::DIMS.vocab_size;
        let hidden = $m::DIMS.hidden_size;

        // Prefill: logits of all 70 rows, and each layer's output for the first token (what the
        // generator stored: the decoder layer's output tensor indexed [0]).
        let mut st = $m::Model::new_state(&b, 256).unwrap();
        let mut taps: Vec<Vec<f32>> = vec![Vec::new(); $m::DIMS.num_layers];
        let logits = model
            .prefill(&b, &mut st, &prompt, true, &mut |i, h| {
                let all = b.act_to_host(h).unwrap();
                taps[i] = all[..hidden].to_vec();
            })
            .unwrap();
        let logits = b.logits_to_host(&logits).unwrap();
        let mut hid = Vec::new();
        for i in 0..$m::DIMS.num_layers {
            hid.push(diff(&taps[i], &g.f32(&format!("hidden_after_layer_{i}"))));
        }
        let pre = diff(&logits, &g.f32("prefill_logits"));
        let want_pre = g.f32("prefill_logits");
        let rows: Vec<String> = (0..prompt.len()).map(|r| format!("{:.2}", diff(&logits[r*vocab..(r+1)*vocab], &want_pre[r*vocab..(r+1)*vocab]).0)).collect();
        eprintln!("per-row max: {}", rows.join(" "));

        // Teacher-forced decode of the oracle's greedy tokens, and our own greedy choice.
        let mut step_logits = Vec::new();
        let mut ours = vec![argmax(&logits[(prompt.len() - 1) * vocab..])];
        for (s, &tok) in greedy.iter().enumerate().take(greedy.len() - 1) {
            let l = b.logits_to_host(&model.decode_step(&b, &mut st, tok).unwrap()).unwrap();
            ours.push(argmax(&l));
            step_logits.extend_from_slice(&l);
            let _ = s;
        }
        let want_steps = g.f32("step_logits");
        let steps = diff(&step_logits, &want_steps[vocab..]);
        Report { hid, pre, steps, ours, greedy }
    }};
}

#[derive(Debug)]
struct Report {
    hid: Vec<(f32, f32)>,
    pre: (f32, f32),
    steps: (f32, f32),
    ours: Vec<u32>,
    greedy: Vec<u32>,
}

#[test]
fn micro_fp8_matches_transformers() {
    let r = golden_run!(fp8, "micro-fp8", "micro-fp8");
    eprintln!("{r:#?}");
    assert_eq!(r.ours, r.greedy, "greedy continuation differs from transformers");
}

#[test]
fn micro_bf16_matches_transformers() {
    let r = golden_run!(bf16, "micro-bf16", "micro-bf16");
    eprintln!("{r:#?}");
    assert_eq!(r.ours, r.greedy, "greedy continuation differs from transformers");
}
