//! How long the prompt of a coding agent's turn takes to encode: a conversation of source files
//! (the repository's own Rust, ~200K tokens), rendered by the checkpoint's chat template, encoded
//! by the library's whole pipeline (`encode_uncached`), by `encode` from a cold cache, by `encode`
//! again (warm), and by `encode` of the next turn (the same conversation plus one message); then
//! the same sources as one message (one piece, cut at its seams), whole pipeline and cold.
//! Medians of `--runs` runs; one JSON line on stdout.
//!
//!     cargo run --release -p ornith-runtime --example encode_bench -- --model DIR [--kib 800] [--runs 5]
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use ornith_runtime::chat::ChatTemplate;
use ornith_runtime::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)?.map(|e| e.map(|e| e.path())).collect::<Result<_, _>>()?;
    entries.sort();
    for p in entries {
        if p.is_dir() {
            sources(&p, out)?;
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
    Ok(())
}

fn median_ms(mut f: impl FnMut() -> Result<()>, runs: usize) -> Result<f64> {
    let mut t = Vec::with_capacity(runs);
    for _ in 0..runs {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let opt = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let model = PathBuf::from(
        opt("--model").context("--model DIR (a checkpoint with tokenizer.json and chat_template.jinja)")?,
    );
    let kib: usize = opt("--kib").map_or(Ok(800), |v| v.parse())?;
    let runs: usize = opt("--runs").map_or(Ok(5), |v| v.parse())?;
    let tpl = ChatTemplate::from_file(&model.join("chat_template.jinja"))?;
    let mut files = Vec::new();
    sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut files)?;
    let mut messages = vec![json!({"role": "system", "content": "You are a coding agent."})];
    let mut bytes = 0;
    for (i, f) in files.iter().cycle().enumerate() {
        if bytes >= kib << 10 {
            break;
        }
        let text = std::fs::read_to_string(f)?;
        bytes += text.len();
        messages.push(json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": text}));
    }
    let render = |m: &[Value]| tpl.render(&Value::Array(m.to_vec()), None, true, &Map::new());
    let text = render(&messages)?;
    let mut next = messages.clone();
    next.push(json!({"role": "user", "content": "Now run the tests and fix what fails.\n".repeat(20)}));
    let next_text = render(&next)?;
    let render_ms = median_ms(|| render(&messages).map(|_| ()), runs)?;
    let tok = || Tokenizer::from_file(&model.join("tokenizer.json"));
    let t = tok()?;
    let tokens = t.encode_uncached(&text)?.len();
    let whole_ms = median_ms(|| t.encode_uncached(&text).map(|_| ()), runs)?;
    // Cold: a fresh tokenizer (an empty cache) per run, its loading not timed.
    let cold_ms = |text: &str| -> Result<f64> {
        let mut t = Vec::with_capacity(runs);
        for _ in 0..runs {
            let fresh = tok()?;
            let s = Instant::now();
            fresh.encode(text)?;
            t.push(s.elapsed().as_secs_f64() * 1e3);
        }
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2])
    };
    let encode_cold_ms = cold_ms(&text)?;
    // The same sources as one message (one piece: cut at its seams instead of between messages).
    let one: String = messages[1..].iter().map(|m| m["content"].as_str().unwrap_or_default()).collect();
    let one_text = render(&[json!({"role": "user", "content": one})])?;
    let one_whole_ms = median_ms(|| t.encode_uncached(&one_text).map(|_| ()), runs)?;
    let one_cold_ms = cold_ms(&one_text)?;
    let warm_ms = median_ms(|| t.encode(&text).map(|_| ()), runs)?;
    let next_ms = median_ms(|| t.encode(&next_text).map(|_| ()), runs)?;
    let out = json!({
        "bytes": text.len(), "messages": messages.len(), "tokens": tokens, "runs": runs,
        "threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "render_ms": render_ms, "encode_whole_ms": whole_ms, "encode_cold_ms": encode_cold_ms,
        "encode_warm_ms": warm_ms, "encode_next_turn_ms": next_ms,
        "one_message_encode_whole_ms": one_whole_ms, "one_message_encode_cold_ms": one_cold_ms,
    });
    println!("{out}");
    Ok(())
}
