//! End to end through the built `ornith` binary with the checkpoint `cargo xtask gen` selected
//! (the embedded tiny default in CI): good and bad request lines in, exactly one JSONL result
//! per line out, logs only on stderr.

use serde_json::Value;
use std::io::Write;
use std::process::{Command, Stdio};

fn run(args: &[&str], input: &[u8]) -> (Vec<Value>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ornith"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ornith");
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "ornith failed: {stderr}");
    let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
    let lines = stdout
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {l}")))
        .collect();
    (lines, stderr)
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
    // The tiny model's K/V cache takes 256 bytes per token (1 attention layer, 2 kv heads × 32 × bf16 K+V).
    let (lines, stderr) = run(
        &["--backend", "cpu", "--kv-budget", "2560"],
        br#"{"custom_id":"k","messages":[{"role":"user","content":"Hello there"}],"max_tokens":4}"#,
    );
    assert!(stderr.contains("context 10 tokens"), "{stderr}");
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["error"]["code"], "context_length_exceeded", "{}", lines[0]);
}
