//! End to end through the built `ornith` binary with the checkpoint `cargo xtask gen` selected
//! (the embedded tiny default in CI): good and bad request lines in, exactly one JSONL result
//! per line out, logs only on stderr.

use serde_json::Value;
use std::io::Write;
use std::process::{Command, Stdio};

#[path = "../../xtask/src/elf.rs"]
mod elf;

mod common;
use common::{http, listening_addr};

/// Runs the binary; returns (success, stdout, stderr).
fn run_raw(args: &[&str], env: &[(&str, &str)], input: &[u8]) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ornith"))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ornith");
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().unwrap();
    // A binary that refuses to start exits without reading stdin: the pipe breaks, as expected.
    match writer.join().unwrap() {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => panic!("writing to ornith's stdin: {e}"),
        _ => {}
    }
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.success(), String::from_utf8(out.stdout).expect("stdout is UTF-8"), stderr)
}

fn run_env(args: &[&str], env: &[(&str, &str)], input: &[u8]) -> (Vec<Value>, String) {
    let (ok, stdout, stderr) = run_raw(args, env, input);
    assert!(ok, "ornith failed: {stderr}");
    let lines = stdout
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {l}")))
        .collect();
    (lines, stderr)
}

fn run(args: &[&str], input: &[u8]) -> (Vec<Value>, String) {
    run_env(args, &[], input)
}

/// Result lines (streaming chunk lines carry no `response` key).
fn results(lines: &[Value]) -> Vec<&Value> {
    lines.iter().filter(|l| l.get("response").is_some()).collect()
}

fn chat(id: &str, extra: &str) -> String {
    format!(
        r#"{{"custom_id":"{id}","messages":[{{"role":"user","content":"Write a function"}}],"max_tokens":6{extra}}}"#
    )
}

#[test]
fn every_line_gets_exactly_one_result_and_good_lines_generate() {
    let mut input = Vec::new();
    let good = [
        chat("greedy", r#","temperature":0"#),
        chat("seeded-a", r#","temperature":0.8,"top_p":0.9,"seed":7"#),
        chat("seeded-b", r#","temperature":0.8,"top_p":0.9,"seed":7"#),
        chat("stream", r#","temperature":0,"stream":true"#),
        r#"{"custom_id":"batch","method":"POST","url":"/v1/chat/completions","body":{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"chat_template_kwargs":{"enable_thinking":false}}}"#.to_string(),
        r#"{"custom_id":"raw","prompt":"fn main() {","max_tokens":4,"temperature":0}"#.to_string(),
        r#"{"custom_id":"raw-ids","prompt_token_ids":[1,2,3],"max_tokens":4,"temperature":0}"#.to_string(),
    ];
    for l in &good {
        input.extend_from_slice(l.as_bytes());
        input.push(b'\n');
    }
    let bad: [&[u8]; 9] = [
        b"{\"custom_id\":\"broken\",",
        b"{\"custom_id\":\"utf8\",\"prompt\":\"\xff\xfe\"}",
        br#"{"custom_id":"role","messages":[{"role":"wizard","content":"x"}]}"#,
        br#"{"custom_id":"image","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
        br#"{"custom_id":"empty","messages":[]}"#,
        br#"{"custom_id":"temp","messages":[{"role":"user","content":"x"}],"temperature":-1}"#,
        br#"{"custom_id":"top-p","messages":[{"role":"user","content":"x"}],"top_p":0}"#,
        br#"{"custom_id":"window","messages":[{"role":"user","content":"x"}],"max_tokens":1000000}"#,
        br#"{"custom_id":"greedy","messages":[{"role":"user","content":"duplicate"}]}"#,
    ];
    for l in bad {
        input.extend_from_slice(l);
        input.push(b'\n');
    }
    let n_lines = good.len() + bad.len();
    let (lines, stderr) = run(&["--backend", "cpu", "--max-context", "512", "--ordered"], &input);
    let res = results(&lines);
    assert_eq!(res.len(), n_lines, "one result per input line; stderr: {stderr}");
    assert!(stderr.contains("ornith:"), "logs go to stderr");

    for (i, r) in res.iter().enumerate().take(good.len()) {
        assert!(r["error"].is_null(), "line {}: {r}", i + 1);
        let body = &r["response"]["body"];
        let usage = &body["usage"];
        assert!(usage["completion_tokens"].as_u64().unwrap() >= 1, "line {}: {r}", i + 1);
        assert!(usage["prompt_tokens"].as_u64().unwrap() >= 1);
        let fin = body["choices"][0]["finish_reason"].as_str().unwrap();
        assert!(["stop", "length", "tool_calls"].contains(&fin), "{fin}");
    }
    let ids: Vec<&str> = res.iter().map(|r| r["custom_id"].as_str().unwrap_or("")).collect();
    assert_eq!(&ids[..good.len()], ["greedy", "seeded-a", "seeded-b", "stream", "batch", "raw", "raw-ids"]);
    // The same seed reproduces the same sampled output.
    let text = |r: &Value| r["response"]["body"]["choices"][0]["message"].to_string();
    assert_eq!(text(res[1]), text(res[2]));
    // Streaming: chunk lines for "stream" come before its result line.
    let first_result = lines.iter().position(|l| l["custom_id"] == "stream" && l.get("response").is_some()).unwrap();
    let chunks = lines
        .iter()
        .take(first_result)
        .filter(|l| l["custom_id"] == "stream" && l["object"] == "chat.completion.chunk")
        .count();
    assert!(chunks >= 1, "streamed deltas precede the final line");

    for (k, r) in res.iter().enumerate().skip(good.len()) {
        let err = &r["error"];
        assert!(!err.is_null() && r["response"].is_null(), "line {} must be an error: {r}", k + 1);
        assert_eq!(err["line"].as_u64(), Some(k as u64 + 1), "{r}");
        assert!(!err["message"].as_str().unwrap().is_empty());
    }
    // Recoverable ids are echoed on error lines too.
    assert_eq!(res[good.len() + 2]["custom_id"], "role");
    assert!(res[good.len() + 3]["error"]["message"].as_str().unwrap().contains("text only"), "{}", res[good.len() + 3]);
}

/// `n` = 3 on the real model (CPU backend): choice `i` is exactly what one request seeded
/// `seed + i` generates alone — the choices are sequences of the engine, batched with each other
/// and with the single requests, and a sequence's tokens do not depend on its company.
#[test]
fn n_choices_equal_single_requests_seeded_seed_plus_index() {
    let sampled = r#","temperature":0.8,"top_p":0.95"#;
    let lines = [
        chat("three", &format!(r#"{sampled},"seed":7,"n":3"#)),
        chat("s7", &format!(r#"{sampled},"seed":7"#)),
        chat("s8", &format!(r#"{sampled},"seed":8"#)),
        chat("s9", &format!(r#"{sampled},"seed":9"#)),
        format!(r#"{{"custom_id":"raw","prompt":"fn main() {{","max_tokens":5{sampled},"seed":3,"n":2}}"#),
        format!(r#"{{"custom_id":"raw4","prompt":"fn main() {{","max_tokens":5{sampled},"seed":4}}"#),
    ];
    let input = lines.join("\n") + "\n";
    let (out, stderr) = run(&["--backend", "cpu", "--max-context", "512", "--ordered"], input.as_bytes());
    let res = results(&out);
    assert_eq!(res.len(), lines.len(), "stderr: {stderr}");
    let body = |k: usize| &res[k]["response"]["body"];
    let three = body(0)["choices"].as_array().unwrap_or_else(|| panic!("{}", res[0]));
    assert_eq!(three.len(), 3);
    let singles: Vec<&Value> = (1..4).map(|k| &body(k)["choices"][0]["message"]).collect();
    for (i, c) in three.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(&c["message"], singles[i], "choice {i} vs the request seeded {}", 7 + i);
    }
    assert!(singles[0] != singles[1] || singles[1] != singles[2], "seeds 7, 8, 9 sampled the same text");
    let n_out: u64 = (1..4).map(|k| body(k)["usage"]["completion_tokens"].as_u64().unwrap()).sum();
    assert_eq!(body(0)["usage"]["completion_tokens"], n_out);
    assert_eq!(body(0)["usage"]["prompt_tokens"], body(1)["usage"]["prompt_tokens"]);
    // Completions: choice 1 of seed 3 is the request seeded 4.
    assert_eq!(body(4)["choices"][1]["text"], body(5)["choices"][0]["text"], "{}", res[4]);
}

/// `logprobs` on the real model (CPU backend): the model's own distribution — greedy picks the
/// top entry, the top entries are sorted and no more than certain, a repetition penalty changes
/// no reported figure — and the entries' tokens spell the output.
#[test]
fn logprobs_on_the_model() {
    let lines = [
        r#"{"custom_id":"g","prompt":"fn main() {","max_tokens":6,"temperature":0,"logprobs":5,"ignore_eos":true}"#,
        r#"{"custom_id":"p","prompt":"fn main() {","max_tokens":6,"temperature":0,"logprobs":5,"ignore_eos":true,"repetition_penalty":1.8}"#,
        r#"{"custom_id":"c","messages":[{"role":"user","content":"Write a function"}],"max_tokens":6,"temperature":0.8,"seed":3,"logprobs":true,"top_logprobs":3}"#,
    ];
    let input = lines.join("\n") + "\n";
    let (out, stderr) = run(&["--backend", "cpu", "--max-context", "512", "--ordered"], input.as_bytes());
    let res = results(&out);
    assert_eq!(res.len(), 3, "stderr: {stderr}");
    let choice = |k: usize| &res[k]["response"]["body"]["choices"][0];
    let lp = |k: usize| choice(k)["logprobs"].clone();
    let g = lp(0);
    let tokens = g["tokens"].as_array().unwrap_or_else(|| panic!("{}", res[0]));
    assert_eq!(tokens.len(), 6);
    let spelled: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(spelled, choice(0)["text"].as_str().unwrap(), "the tokens spell the text");
    for (i, t) in tokens.iter().enumerate() {
        let chosen = g["token_logprobs"][i].as_f64().unwrap();
        let top = g["top_logprobs"][i].as_object().unwrap();
        assert!((5..=6).contains(&top.len()), "{top:?}");
        let best = top.values().map(|v| v.as_f64().unwrap()).fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(chosen, best, "greedy takes the most likely token ({t})");
        assert_eq!(top[t.as_str().unwrap()].as_f64(), Some(chosen));
        let mass: f64 = top.values().map(|v| v.as_f64().unwrap().exp()).sum();
        assert!(chosen <= 0.0 && mass <= 1.0 + 1e-4, "{chosen} {mass}");
    }
    // The penalty moves the picks after the first, never the figures of a step: the first
    // step's distribution is the same with and without it.
    let p = lp(1);
    assert_eq!(p["top_logprobs"][0], g["top_logprobs"][0]);
    // Chat, sampled: one entry per output token, each with the top three, sorted.
    let c = lp(2);
    let content = c["content"].as_array().unwrap_or_else(|| panic!("{}", res[2]));
    assert_eq!(content.len() as u64, res[2]["response"]["body"]["usage"]["completion_tokens"].as_u64().unwrap());
    for e in content {
        let top: Vec<f64> =
            e["top_logprobs"].as_array().unwrap().iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert_eq!(top.len(), 3);
        assert!(top.windows(2).all(|w| w[0] >= w[1]), "{top:?}");
        assert!(e["logprob"].as_f64().unwrap() <= top[0], "{e}");
        assert!(!e["bytes"].as_array().unwrap().is_empty());
    }
}

/// `response_format` json_schema on the real model (CPU backend, the real tokenizer): a model of
/// random weights writes JSON that matches the schema, greedy and sampled, because the grammar
/// allows nothing else; `json_object` gives an object.
#[test]
fn response_format_json_schema_on_the_model() {
    let schema = r#"{"type":"object","properties":{"answer":{"enum":["yes","no"]},"score":{"type":"integer","minimum":0,"maximum":9}},"required":["answer","score"],"additionalProperties":false}"#;
    let line = |id: &str, extra: &str| {
        format!(
            r#"{{"custom_id":"{id}","messages":[{{"role":"user","content":"Is it?"}}],"max_tokens":40,"chat_template_kwargs":{{"enable_thinking":false}}{extra}}}"#
        )
    };
    let rf = format!(r#","response_format":{{"type":"json_schema","json_schema":{{"name":"r","schema":{schema}}}}}"#);
    let lines = [
        line("greedy", &format!(r#"{rf},"temperature":0"#)),
        line("sampled", &format!(r#"{rf},"seed":5,"n":2"#)),
        line("object", r#","response_format":{"type":"json_object"},"temperature":0,"max_tokens":60"#),
    ];
    let input = lines.join("\n") + "\n";
    let (out, stderr) = run(&["--backend", "cpu", "--max-context", "512", "--ordered"], input.as_bytes());
    let res = results(&out);
    assert_eq!(res.len(), 3, "stderr: {stderr}");
    for (k, n) in [(0, 1), (1, 2)] {
        let choices = res[k]["response"]["body"]["choices"].as_array().unwrap_or_else(|| panic!("{}", res[k]));
        assert_eq!(choices.len(), n);
        for c in choices {
            let text = c["message"]["content"].as_str().unwrap();
            let v: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            assert!(v["answer"] == "yes" || v["answer"] == "no", "{v}");
            assert!(v["score"].as_u64().is_some_and(|s| s <= 9), "{v}");
            assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
            assert_eq!(c["finish_reason"], "stop", "the grammar ends the answer: {c}");
        }
    }
    let c = &res[2]["response"]["body"]["choices"][0];
    let text = c["message"]["content"].as_str().unwrap();
    if c["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(text).is_ok(), "{text:?}");
    } else {
        assert!(text.starts_with('{'), "an object, cut at max_tokens: {text:?}");
    }
}

#[test]
fn tokenize_counts_tokens() {
    let (lines, _) = run(
        &["tokenize"],
        b"{\"text\":\"hello world\"}\n{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}\nnot json\n",
    );
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["count"].as_u64(), Some(lines[0]["ids"].as_array().unwrap().len() as u64));
    assert!(lines[0]["count"].as_u64().unwrap() >= 2);
    assert!(lines[1]["count"].as_u64().unwrap() > 3, "the chat template adds its markers");
    assert!(!lines[2]["error"].is_null());
}

#[test]
fn kv_budget_caps_the_context() {
    // The tiny model's K/V takes 256 bytes per token (1 attention layer, 2 kv heads × 32 × bf16 K+V),
    // so a block of 256 positions is 64 KiB: a budget of two blocks holds 512 tokens.
    let input = concat!(
        r#"{"custom_id":"k","messages":[{"role":"user","content":"Hello there"}],"max_tokens":600}"#,
        "\n",
        r#"{"custom_id":"ok","messages":[{"role":"user","content":"Hello there"}],"max_tokens":4}"#,
        "\n"
    );
    let (lines, stderr) = run(&["--backend", "cpu", "--kv-budget", "131072", "--ordered"], input.as_bytes());
    assert!(stderr.contains("context 512 tokens"), "{stderr}");
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["error"]["code"], "context_length_exceeded", "{}", lines[0]);
    assert!(lines[1]["error"].is_null(), "{}", lines[1]);
    // Less than one block is refused at startup, naming the flag.
    let (ok, _, stderr) = run_raw(&["--backend", "cpu", "--kv-budget", "2560"], &[], b"");
    assert!(!ok && stderr.contains("--kv-budget 2560 bytes holds no K/V block"), "{stderr}");
}

/// Whether this machine has the NVIDIA driver (the no-driver tests only mean something without).
#[cfg(feature = "cuda")]
fn driver_present() -> bool {
    // SAFETY: dlopen of libcuda; nothing is called in it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

const HELLO: &[u8] = br#"{"custom_id":"h","messages":[{"role":"user","content":"Hello"}],"max_tokens":2}"#;

#[test]
#[cfg(feature = "cuda")]
fn auto_backend_without_a_driver_says_so_once_and_does_not_panic() {
    if driver_present() {
        eprintln!("skipped: this machine has an NVIDIA driver");
        return;
    }
    let (lines, stderr) = run_env(&[], &[("RUST_BACKTRACE", "1")], HELLO);
    assert_eq!(stderr.matches("no NVIDIA driver found; using the CPU backend").count(), 1, "{stderr}");
    assert_eq!(stderr.matches("CPU backend").count(), 1, "{stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("stack backtrace"), "{stderr}");
    assert!(lines[0]["error"].is_null(), "{}", lines[0]);
}

#[test]
#[cfg(feature = "cuda")]
fn cuda_backend_without_a_driver_is_one_clear_error() {
    if driver_present() {
        eprintln!("skipped: this machine has an NVIDIA driver");
        return;
    }
    let (ok, stdout, stderr) = run_raw(&["--backend", "cuda"], &[("RUST_BACKTRACE", "1")], HELLO);
    assert!(!ok, "must fail: {stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(!stderr.contains("panicked") && !stderr.contains("stack backtrace"), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("ornith: error:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(errors[0].contains("no NVIDIA driver found") && errors[0].contains("--backend cpu"), "{stderr}");
}

#[test]
fn boolean_environment_variables_accept_1_yes_on() {
    for (v, quiet) in [("1", true), ("yes", true), ("on", true), ("true", true), ("0", false), ("off", false)] {
        let (lines, stderr) = run_env(&["--backend", "cpu"], &[("ORNITH_QUIET", v), ("ORNITH_ORDERED", v)], HELLO);
        assert_eq!(lines.len(), 1, "ORNITH_QUIET={v}: {stderr}");
        assert_eq!(stderr.is_empty(), quiet, "ORNITH_QUIET={v}: {stderr}");
    }
    let (ok, _, stderr) = run_raw(&["--backend", "cpu"], &[("ORNITH_QUIET", "maybe")], HELLO);
    assert!(!ok && stderr.contains("maybe"), "{stderr}");
}

#[test]
fn startup_and_request_log_lines_are_single_and_sensible() {
    let input = [
        r#"{"custom_id":"one","prompt":"hi","max_tokens":1,"seed":1}"#,
        r#"{"custom_id":"sys","messages":[{"role":"system","content":"only a system turn"}]}"#,
        r#"{"custom_id":"think","messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"enable_thinking":"no"}}"#,
    ]
    .join("\n");
    let (lines, stderr) = run(&["--backend", "cpu", "--ordered"], input.as_bytes());
    assert_eq!(lines.len(), 3, "{stderr}");
    assert!(lines[0]["error"].is_null(), "{}", lines[0]);
    // The startup time covers the whole load (tokenizer included), reported once.
    assert_eq!(stderr.matches("ornith: loaded").count(), 1, "{stderr}");
    assert!(stderr.contains("tokenizer and chat template"), "{stderr}");
    // max_tokens 1 has no decode step: no "null" rate in the log.
    assert!(!stderr.contains("null"), "{stderr}");
    assert!(stderr.contains("no decode step"), "{stderr}");
    let msg = lines[1]["error"]["message"].as_str().unwrap();
    assert_eq!(msg.matches("chat template").count(), 1, "{msg}");
    assert_eq!(lines[2]["error"]["code"], "invalid_request", "{}", lines[2]);
    assert!(lines[2]["error"]["message"].as_str().unwrap().contains("enable_thinking"), "{}", lines[2]);
}

#[test]
fn a_missing_checkpoint_says_pass_model() {
    let dir = std::env::temp_dir().join(format!("ornith-no-such-checkpoint-{}", std::process::id()));
    let (ok, _, stderr) = run_raw(&["--backend", "cpu", "--model", dir.to_str().unwrap()], &[], HELLO);
    assert!(!ok);
    assert!(stderr.contains("--model"), "{stderr}");
    assert_eq!(stderr.lines().filter(|l| l.starts_with("ornith: error:")).count(), 1, "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_broken_config_is_reported_once() {
    let tmp = std::env::temp_dir().join(format!("ornith-bad-config-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("config.json"), "{ not json").unwrap();
    let (ok, _, stderr) = run_raw(&["--backend", "cpu", "--model", tmp.to_str().unwrap()], &[], HELLO);
    std::fs::remove_dir_all(&tmp).unwrap();
    assert!(!ok);
    let err = stderr.lines().find(|l| l.starts_with("ornith: error:")).unwrap_or_else(|| panic!("{stderr}"));
    assert_eq!(err.matches("key must be a string").count(), 1, "{err}");
}

/// The binary links only glibc's own libraries (what `cargo xtask dist` ships; the release
/// binary's DT_NEEDED is the same as this test-profile one's, so CI needs no release build).
#[test]
fn the_binary_links_only_glibc() {
    let needs = elf::dynamic_needs_of(std::path::Path::new(env!("CARGO_BIN_EXE_ornith"))).unwrap();
    assert!(needs.needed.iter().any(|n| n == "libc.so.6"), "{needs:?}");
    assert!(needs.beyond_glibc().is_empty(), "links beyond glibc: {:?}", needs.beyond_glibc());
    let glibc = needs.max_glibc().expect("references GLIBC_ versions");
    eprintln!("DT_NEEDED {:?}; newest glibc symbol version {}.{}", needs.needed, glibc.0, glibc.1);
    assert!(glibc >= (2, 2), "{glibc:?}");
}

#[test]
fn serve_answers_http_on_the_real_model_and_keeps_stdout_empty() {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_ornith"))
        .args(["serve", "--backend", "cpu", "--max-context", "512", "--port", "0", "--served-model-name", "tiny"])
        .args(["--max-seqs", "1", "--max-queue", "3"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ornith serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = listening_addr(&mut lines);
    // Keep reading stderr so that the server never blocks on a full pipe.
    let logs = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());
    let (st, body) = http(&addr, "GET", "/health", "");
    assert_eq!(st, 200, "{body}");
    let (st, body) = http(&addr, "GET", "/v1/models", "");
    assert_eq!(st, 200);
    let models: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["max_model_len"], 512);
    let chat =
        r#"{"model":"tiny","messages":[{"role":"user","content":"Write a function"}],"max_tokens":6,"temperature":0}"#;
    let (st, body) = http(&addr, "POST", "/v1/chat/completions", chat);
    assert_eq!(st, 200, "{body}");
    let b: Value = serde_json::from_str(&body).unwrap();
    assert!(b["usage"]["completion_tokens"].as_u64().unwrap() >= 1, "{b}");
    let (st, body) = http(&addr, "POST", "/v1/chat/completions", &chat.replace("\"tiny\"", "\"other\""));
    assert_eq!(st, 404, "{body}");
    // Fill-in-the-middle and the Responses API on the real tokenizer and template.
    let fim = r#"{"prompt":"def f(","suffix":"):\n    pass\n","max_tokens":3,"temperature":0}"#;
    let (st, body) = http(&addr, "POST", "/v1/completions", fim);
    assert_eq!(st, 200, "{body}");
    let resp = r#"{"model":"tiny","input":[{"role":"user","content":"hi"}],"instructions":"Be brief.","max_output_tokens":4,"stream":true}"#;
    let (st, body) = http(&addr, "POST", "/v1/responses", resp);
    assert_eq!(st, 200, "{body}");
    assert!(body.contains("event: response.created") && body.contains("\"sequence_number\""), "{body}");
    assert!(body.contains("event: response.completed") || body.contains("event: response.incomplete"), "{body}");
    let msg = r#"{"model":"tiny","max_tokens":4,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let (st, body) = http(&addr, "POST", "/v1/messages", msg);
    assert_eq!(st, 200);
    assert!(body.contains("event: message_start") && body.contains("event: message_stop"), "{body}");
    // --max-queue reaches the server (one slot + 3 places to wait); the engine's figures reach /metrics.
    let (st, text) = http(&addr, "GET", "/metrics", "");
    assert_eq!(st, 200);
    let sample = |name: &str| -> f64 {
        let line = text.lines().find(|l| l.split(' ').next() == Some(name));
        line.unwrap_or_else(|| panic!("no {name} in {text}")).rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(sample("ornith_requests_in_flight_limit"), 4.0, "{text}");
    assert_eq!(sample("ornith_requests_in_flight"), 0.0, "{text}");
    assert_eq!(sample("ornith_pool_slots_total"), 1.0, "{text}");
    assert!(sample("ornith_inter_token_seconds_count") >= 1.0, "{text}");
    assert!(sample("ornith_prefix_cache_snapshots_capacity") >= 0.0, "{text}");
    // Ctrl-C (SIGINT) stops it cleanly.
    let int = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(int.success());
    let out = child.wait_with_output().unwrap();
    let logs = logs.join().unwrap();
    assert!(out.status.success(), "{:?}: {logs:?}", out.status);
    assert!(logs.iter().any(|l| l.contains("stopping")), "{logs:?}");
    assert!(out.stdout.is_empty(), "stdout must stay empty: {:?}", String::from_utf8_lossy(&out.stdout));
    assert!(logs.iter().any(|l| l.starts_with("[ornith] request")), "per-request logs go to stderr: {logs:?}");
}

// ------------------------------------------------------------------ ornith batch (resumable)

/// The batch tests' input: `n` lines of greedy and seeded-sampled chat and completion requests
/// of 1–3 tokens (the tiny model on the CPU costs ~10 ms a decode step; the streamed ones, which
/// `batch` writes without chunks, run 12 so that some are generating at any time), lines without
/// a `custom_id` (matched as `line-N`) and bad lines (answered with an error line, which a resume
/// keeps too).
fn batch_input(n: usize) -> String {
    let mut s = String::new();
    for i in 1..=n {
        let line = match i % 10 {
            0 => format!(r#"{{"custom_id":"bad{i}","messages":[{{"role":"user""#), // broken JSON
            1 => format!(r#"{{"prompt":"fn f{i}(","max_tokens":{},"temperature":0}}"#, 1 + i % 3),
            2 | 5 => format!(
                r#"{{"custom_id":"s{i}","messages":[{{"role":"user","content":"Say {i}"}}],"max_tokens":{},"temperature":0.9,"top_k":40,"seed":{i}}}"#,
                1 + i % 3
            ),
            3 => format!(
                r#"{{"custom_id":"st{i}","messages":[{{"role":"user","content":"Stream {i}"}}],"max_tokens":12,"temperature":0,"stream":true}}"#
            ),
            _ => format!(
                r#"{{"custom_id":"g{i}","method":"POST","url":"/v1/chat/completions","body":{{"messages":[{{"role":"user","content":"Count to {i}"}}],"max_tokens":{},"temperature":0}}}}"#,
                1 + i % 3
            ),
        };
        s += &line;
        s.push('\n');
    }
    s
}

const BATCH_ARGS: &[&str] = &["--backend", "cpu", "--max-context", "256", "--max-seqs", "32"];

/// A scratch directory of this test process.
fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ornith-e2e-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn batch_command(input: &std::path::Path, output: &std::path::Path) -> Command {
    batch_command_q(input, output, true)
}

fn batch_command_q(input: &std::path::Path, output: &std::path::Path, quiet: bool) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ornith"));
    c.arg("batch").arg("--input").arg(input).arg("--output").arg(output).args(BATCH_ARGS);
    if quiet {
        c.arg("--quiet");
    }
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// Runs `ornith batch` to the end; asserts it succeeded with nothing on stdout.
fn batch_to_end(input: &std::path::Path, output: &std::path::Path) -> String {
    let out = batch_command(input, output).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "ornith batch failed ({:?}): {stderr}", out.status);
    assert!(out.stdout.is_empty(), "stdout must stay empty: {:?}", String::from_utf8_lossy(&out.stdout));
    stderr
}

/// What of a result line must not depend on the run: the answer and its usage, or the error.
fn essence(r: &Value) -> Value {
    if r["error"].is_null() {
        let b = &r["response"]["body"];
        serde_json::json!({"choices": b["choices"], "usage": b["usage"]})
    } else {
        serde_json::json!({"code": r["error"]["code"], "message": r["error"]["message"], "line": r["error"]["line"]})
    }
}

/// The output file's lines by custom_id; asserts every line is a complete result line and that
/// no custom_id appears twice.
fn results_by_id(path: &std::path::Path) -> std::collections::BTreeMap<String, Value> {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.is_empty() || text.ends_with('\n'), "the output ends with a complete line");
    let mut m = std::collections::BTreeMap::new();
    for l in text.lines() {
        let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v.get("response").is_some(), "only result lines: {l}");
        let id = v["custom_id"].as_str().unwrap().to_string();
        assert!(m.insert(id.clone(), v).is_none(), "custom_id {id} appears twice");
    }
    m
}

fn line_count(path: &std::path::Path) -> usize {
    std::fs::read(path).map(|b| b.iter().filter(|&&c| c == b'\n').count()).unwrap_or(0)
}

/// Waits until `path` has `at` lines while `child` runs. Fails if the child ends first or if no
/// line is added for 120 s (a stall, not a slow machine: each new line restarts the clock, so
/// the test holds on 2 cores or under emulation, where a whole round can take minutes).
fn wait_for_lines(child: &mut std::process::Child, path: &std::path::Path, at: usize, what: &str) {
    let (mut seen, mut last) = (line_count(path), std::time::Instant::now());
    while seen < at {
        assert!(child.try_wait().unwrap().is_none(), "{what}: ornith batch ended before line {at}");
        std::thread::sleep(std::time::Duration::from_millis(2));
        let n = line_count(path);
        if n > seen {
            (seen, last) = (n, std::time::Instant::now());
        }
        assert!(last.elapsed().as_secs() < 120, "{what}: no new line for 120 s (stuck at {seen} of {at})");
    }
}

const BATCH_N: usize = 500;

/// The uninterrupted run of the 500-line file (computed once, shared by the batch tests).
fn batch_reference() -> &'static (std::path::PathBuf, std::collections::BTreeMap<String, Value>) {
    static REF: std::sync::OnceLock<(std::path::PathBuf, std::collections::BTreeMap<String, Value>)> =
        std::sync::OnceLock::new();
    REF.get_or_init(|| {
        let dir = scratch("batch-ref");
        let input = dir.join("in.jsonl");
        std::fs::write(&input, batch_input(BATCH_N)).unwrap();
        let output = dir.join("out.jsonl");
        batch_to_end(&input, &output);
        let m = results_by_id(&output);
        assert_eq!(m.len(), BATCH_N, "one result line per input line");
        assert!(m.contains_key("line-1") && m.contains_key("line-491"), "lines without custom_id are line-N");
        assert_eq!(m["bad10"]["error"]["code"], "invalid_json");
        assert!(m["g4"]["error"].is_null(), "{}", m["g4"]);
        // A second run over the complete output has nothing left to do and changes nothing.
        let before = std::fs::read(&output).unwrap();
        let stderr = {
            let out = batch_command_q(&input, &output, false).output().unwrap();
            assert!(out.status.success());
            String::from_utf8_lossy(&out.stderr).into_owned()
        };
        assert_eq!(std::fs::read(&output).unwrap(), before, "{stderr}");
        assert!(
            stderr.contains(&format!("{BATCH_N}/{BATCH_N} lines answered ({BATCH_N} from an earlier run")),
            "{stderr}"
        );
        (input, m)
    })
}

fn assert_same_as_reference(output: &std::path::Path) {
    let (_, want) = batch_reference();
    let got = results_by_id(output);
    assert_eq!(got.len(), want.len(), "every custom_id exactly once");
    for (id, w) in want {
        let g = got.get(id).unwrap_or_else(|| panic!("{id} is missing"));
        assert_eq!(essence(g), essence(w), "{id} differs from the uninterrupted run");
    }
}

#[test]
fn batch_resumes_after_kill_9_without_duplicating_or_dropping_a_request() {
    use rand::{Rng, SeedableRng};
    let (input, _) = batch_reference();
    let seed: u64 = std::env::var("ORNITH_KILL_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(14);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = scratch("batch-kill");
    let output = dir.join("out.jsonl");
    // Kill at a random point of the run (after K result lines), then once more in the resumed
    // run, then let it finish.
    for round in 0..2 {
        let at = line_count(&output) + rng.random_range(20..200);
        let mut child = batch_command(input, &output).spawn().unwrap();
        wait_for_lines(&mut child, &output, at, &format!("round {round}"));
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        assert!(!status.success(), "seed {seed}: killed");
        let n = line_count(&output);
        eprintln!("seed {seed} round {round}: killed after {n} result lines");
        assert!(n < BATCH_N, "seed {seed}: the kill came after the end");
        // A kill in the middle of a write leaves an unfinished line: make sure one is there.
        let mut f = std::fs::OpenOptions::new().append(true).open(&output).unwrap();
        f.write_all(br#"{"id":"batch_req_x","custom_id":"g4","response":{"status_co"#).unwrap();
    }
    let stderr = batch_to_end(input, &output);
    assert!(stderr.is_empty(), "--quiet: {stderr}");
    assert_same_as_reference(&output);
}

#[test]
fn batch_stops_on_sigint_with_cancelled_lines_and_a_rerun_completes_it() {
    let (input, _) = batch_reference();
    let dir = scratch("batch-int");
    let output = dir.join("out.jsonl");
    let mut child = batch_command(input, &output).spawn().unwrap();
    wait_for_lines(&mut child, &output, 60, "SIGINT run");
    let int = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(int.success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "SIGINT exits with 128 + 2: {stderr}");
    assert!(out.stdout.is_empty());
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("stopped by signal 2") && stderr.contains("rerun the same command"), "{stderr}");
    let part = results_by_id(&output);
    assert!(part.len() < BATCH_N, "it stopped before the end ({} lines)", part.len());
    let cancelled: Vec<&Value> = part.values().filter(|r| r["error"]["code"] == "cancelled").collect();
    assert!(!cancelled.is_empty(), "the requests generating at the signal are answered `cancelled`");
    assert!(cancelled.len() <= 32, "at most --max-seqs requests generate at once: {}", cancelled.len());
    assert!(cancelled[0]["error"]["message"].as_str().unwrap().contains("signal 2"), "{}", cancelled[0]);
    // The rerun drops the cancelled lines, runs those requests again and the rest.
    batch_to_end(input, &output);
    assert_same_as_reference(&output);
}

/// `suffix` (fill-in-the-middle) through the real Qwen3.5 tokenizer: the prompt is exactly
/// `<|fim_prefix|>` prefix `<|fim_suffix|>` suffix `<|fim_middle|>` (the tokenizer's own ids).
#[test]
fn fim_suffix_uses_the_tokenizers_fim_tokens() {
    let (prefix, suffix) = ("def add(a, b):\n    ", "\n    return c\n");
    let fim =
        serde_json::json!({"custom_id": "fim", "prompt": prefix, "suffix": suffix, "max_tokens": 3, "temperature": 0});
    let batch = serde_json::json!({"custom_id": "fim-batch", "url": "/v1/completions",
                                   "body": {"prompt": prefix, "suffix": suffix, "max_tokens": 3, "temperature": 0}});
    let input = format!("{fim}\n{batch}\n");
    let (lines, stderr) = run(&["--backend", "cpu", "--max-context", "256", "--ordered"], input.as_bytes());
    assert_eq!(lines.len(), 2, "{stderr}");
    for l in &lines {
        assert!(l["error"].is_null(), "{l}");
        assert_eq!(l["response"]["body"]["object"], "text_completion");
    }
    let text = format!("<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>");
    let (tok, _) = run(&["tokenize"], format!("{}\n", serde_json::json!({"text": text})).as_bytes());
    let ids = tok[0]["ids"].as_array().unwrap();
    assert_eq!(ids[0], 248060, "<|fim_prefix|> is one token");
    assert_eq!(ids[ids.len() - 1], 248061, "<|fim_middle|> ends the prompt");
    assert!(ids.contains(&serde_json::json!(248062)), "<|fim_suffix|>");
    for l in &lines {
        assert_eq!(l["response"]["body"]["usage"]["prompt_tokens"], tok[0]["count"], "{l}");
    }
    // Same answer either way (greedy).
    assert_eq!(lines[0]["response"]["body"]["choices"], lines[1]["response"]["body"]["choices"]);
}
