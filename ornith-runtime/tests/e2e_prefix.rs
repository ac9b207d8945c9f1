//! The prefix cache end to end, as a coding agent uses it: a 10-turn conversation (a long system
//! prompt, tools, thinking on, tool calls and tool results, a new user message half way) sent
//! one turn at a time through the real binary's JSONL interface, each turn re-sending the whole
//! history. Every turn after the first is served partly from the cache, and every answer equals
//! the answer of a binary running without the cache.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

mod common;

/// A running binary that answers one JSONL line at a time.
struct Agent {
    child: std::process::Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Agent {
    fn start(extra: &[&str]) -> Agent {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ornith"))
            .args(["--backend", "cpu", "--max-context", "8192"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start ornith");
        let out = BufReader::new(child.stdout.take().unwrap());
        Agent { child, out }
    }

    fn ask(&mut self, line: &Value) -> Value {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        let mut s = String::new();
        self.out.read_line(&mut s).unwrap();
        serde_json::from_str(&s).unwrap_or_else(|e| panic!("not a JSON line ({e}): {s:?}"))
    }

    /// Closes stdin and returns stderr (the summary lines).
    fn finish(mut self) -> String {
        drop(self.child.stdin.take());
        let out = self.child.wait_with_output().unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    }
}

/// ~`words` words of code-review prose and code (a stand-in for a coding agent's system prompt
/// and for files it reads).
fn text(words: usize, salt: u64) -> String {
    let vocab = [
        "fn", "parse", "token", "let", "mut", "buffer", "return", "Result", "error", "match", "Some", "None", "the",
        "parser", "must", "handle", "escaped", "quotes", "and", "trailing", "commas", "in", "struct", "impl", "self",
        "=>", "{", "}", "(", ")", ";", "0", "1", "len", "index", "offset", "line", "column", "span", "report",
    ];
    let mut x = 0x2545_F491_4F6C_DD1Du64 ^ salt;
    (0..words)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            vocab[(x % vocab.len() as u64) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn conversation(turn: usize) -> Value {
    let mut messages = vec![
        json!({"role": "system", "content": format!("You are a careful coding agent. {}", text(1900, 1))}),
        json!({"role": "user", "content": "Fix the bug in the tokenizer's string handling."}),
    ];
    for k in 1..turn {
        if k == 5 {
            messages.push(json!({"role": "user", "content": "Good. Now also add tests for the escapes."}));
        }
        let id = format!("call_{k}");
        messages.push(json!({
            "role": "assistant",
            "content": "",
            "reasoning_content": format!("I should look at file {k} next. {}", text(20, 100 + k as u64)),
            "tool_calls": [{"id": id, "type": "function",
                            "function": {"name": "read_file", "arguments": format!("{{\"path\": \"src/f{k}.rs\"}}")}}],
        }));
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": text(170, 200 + k as u64)}));
    }
    let tools = json!([{"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]);
    let sampling =
        if turn.is_multiple_of(2) { json!({"temperature": 0}) } else { json!({"temperature": 0.8, "seed": turn}) };
    let mut line = json!({"custom_id": format!("turn-{turn}"), "messages": messages, "tools": tools, "max_tokens": 4});
    line.as_object_mut().unwrap().extend(sampling.as_object().unwrap().clone());
    line
}

#[test]
fn a_ten_turn_agent_conversation_hits_the_cache_every_turn_and_answers_as_without_it() {
    let mut with = Agent::start(&[]);
    let mut without = Agent::start(&["--prefix-cache-bytes", "0"]);
    let (mut prompt_total, mut cached_total) = (0, 0);
    for turn in 1..=10 {
        let line = conversation(turn);
        let (a, b) = (with.ask(&line), without.ask(&line));
        assert!(a["error"].is_null() && b["error"].is_null(), "turn {turn}: {a} / {b}");
        let (ba, bb) = (&a["response"]["body"], &b["response"]["body"]);
        assert_eq!(ba["choices"], bb["choices"], "turn {turn}: the cache changed the answer");
        let usage = &ba["usage"];
        let (prompt, cached) = (
            usage["prompt_tokens"].as_u64().unwrap(),
            usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
        );
        assert_eq!(bb["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "turn {turn}: no cache, no hit");
        assert_eq!(bb["usage"]["prompt_tokens"], prompt);
        eprintln!("turn {turn}: {prompt} prompt tokens, {cached} from the cache");
        if turn == 1 {
            assert!(prompt > 2048, "the first turn spans a prefill chunk ({prompt} tokens)");
            assert_eq!(cached, 0);
        } else {
            assert!(cached >= 2048 && cached < prompt, "turn {turn}: {cached} of {prompt} prompt tokens cached");
            prompt_total += prompt;
            cached_total += cached;
        }
    }
    assert!(
        cached_total * 2 >= prompt_total,
        "turns 2-10 read {cached_total} of {prompt_total} prompt tokens from the cache"
    );
    let log = with.finish();
    assert!(log.contains("prefix cache: 9 hits, 1 misses"), "{log}");
    without.finish();
}

/// A request to `ornith serve` (GET when `body` is empty): (status, the body as JSON, or as a
/// string when it is not JSON).
fn call(addr: &str, path: &str, body: &str) -> (u16, Value) {
    let (status, text) = common::http(addr, if body.is_empty() { "GET" } else { "POST" }, path, body);
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

/// The server reports what the cache served: OpenAI `prompt_tokens_details.cached_tokens`,
/// Anthropic `cache_read_input_tokens` (with `input_tokens` the rest of the prompt), and the
/// `/metrics` counter.
#[test]
fn the_http_apis_report_cached_prompt_tokens() {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_ornith"))
        .args(["serve", "--backend", "cpu", "--max-context", "8192", "--port", "0", "--served-model-name", "tiny"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ornith serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = common::listening_addr(&mut lines);
    let logs = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());
    let system = format!("You are a careful coding agent. {}", text(2600, 7));
    let chat = |q: &str| {
        json!({"model": "tiny", "max_tokens": 2, "temperature": 0,
               "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
        .to_string()
    };
    let (st, first) = call(&addr, "/v1/chat/completions", &chat("What does parse do?"));
    assert_eq!(st, 200, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (st, second) = call(&addr, "/v1/chat/completions", &chat("And what does report do?"));
    assert_eq!(st, 200, "{second}");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= 2048, "the shared system prompt comes from the cache: {second}");
    let msg = json!({"model": "tiny", "max_tokens": 2, "temperature": 0, "system": system,
                     "messages": [{"role": "user", "content": "Which function handles quotes?"}]});
    let (st, m) = call(&addr, "/v1/messages", &msg.to_string());
    assert_eq!(st, 200, "{m}");
    let (input, read) =
        (m["usage"]["input_tokens"].as_u64().unwrap(), m["usage"]["cache_read_input_tokens"].as_u64().unwrap());
    assert!(read >= 2048 && input >= 1, "{m}");
    let (st, count) = call(&addr, "/v1/messages/count_tokens", &msg.to_string());
    assert_eq!(st, 200);
    assert_eq!(count["input_tokens"].as_u64(), Some(input + read), "input + cache read = the prompt");
    let (_, metrics) = call(&addr, "/metrics", "");
    let metrics = metrics.as_str().unwrap_or_default().to_string();
    let line = metrics.lines().find(|l| l.starts_with("ornith_prompt_tokens_cached_total ")).unwrap_or_default();
    let n: u64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or(0);
    assert_eq!(n, cached + read, "{metrics}");
    let int = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(int.success());
    assert!(child.wait().unwrap().success());
    logs.join().unwrap();
}
