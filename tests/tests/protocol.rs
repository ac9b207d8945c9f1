//! The JSONL serve loop driven as a library with test doubles: a byte-level codec, a ChatML
//! renderer and a generator that replays the text after `SAY:` in the prompt.

use std::io::{Cursor, Read};

use ornith_runtime::engine::{Engine, Penalties, SamplingParams};
use ornith_runtime::protocol::{self, GenerationDefaults, ServeOptions, TextCodec};
use serde_json::{json, Map, Value};

mod support;
use support::{ByteCodec, ChatMl, ScriptRunner, ENDOFTEXT, IM_END};

fn opts() -> ServeOptions {
    let defaults = GenerationDefaults {
        temperature: 1.0,
        top_k: 20,
        top_p: 0.95,
        min_p: 0.0,
        repetition_penalty: 1.0,
        eos_token_ids: vec![IM_END, ENDOFTEXT],
    };
    let mut o = ServeOptions::new("ornith-test", defaults);
    o.run_id = 0xabc;
    o.quiet = true;
    // Results in input order, so that the tests can index them by line.
    o.ordered = true;
    o
}

/// Runs `input` on an engine of one sequence at a time (so that a failing step fails only its
/// own request, as the fixture's expectations assume) and returns the output lines parsed.
fn run_with(input: impl Read + Send + 'static, o: &ServeOptions, ctx: usize) -> (Vec<Value>, Calls) {
    run_slots(input, o, ctx, 1)
}

type Calls = Vec<SamplingParams>;

/// Same with `slots` sequences at once.
fn run_slots(input: impl Read + Send + 'static, o: &ServeOptions, ctx: usize, slots: usize) -> (Vec<Value>, Calls) {
    run_timed(input, o, ctx, slots, std::time::Duration::ZERO)
}

/// Same with steps that take `step_time` each.
fn run_timed(
    input: impl Read + Send + 'static,
    o: &ServeOptions,
    ctx: usize,
    slots: usize,
    step_time: std::time::Duration,
) -> (Vec<Value>, Calls) {
    let mut runner = ScriptRunner::new(ctx, slots);
    runner.step_time = step_time;
    let calls = runner.calls.clone();
    let cfg = support::script_config(ctx);
    let engine = Engine::new(Box::new(runner), cfg).unwrap();
    let mut out = Vec::new();
    protocol::serve(std::io::BufReader::new(input), &mut out, engine, &ByteCodec, &ChatMl, o).unwrap();
    let lines = parse_lines(&out);
    let calls = calls.lock().unwrap().clone();
    (lines, calls)
}

/// Serves `lines` on an engine over `runner` (contexts of `ctx`); returns the output lines and
/// the run's stats.
fn serve_lines(runner: ScriptRunner, ctx: usize, lines: &[Value]) -> (Vec<Value>, protocol::ServeStats) {
    let cfg = support::script_config(ctx);
    let engine = Engine::new(Box::new(runner), cfg).unwrap();
    let input: String = lines.iter().map(|l| l.to_string() + "\n").collect();
    let mut out = Vec::new();
    let stats =
        protocol::serve(std::io::BufReader::new(Cursor::new(input)), &mut out, engine, &ByteCodec, &ChatMl, &opts())
            .unwrap();
    let lines = parse_lines(&out);
    (lines, stats)
}

fn is_result(v: &Value) -> bool {
    v.get("response").is_some()
}

/// Splits output into (result lines, chunk lines per result index); checks that every result
/// line has the batch shape and that chunks precede their result.
fn results(lines: &[Value]) -> (Vec<Value>, Vec<Vec<Value>>) {
    let mut res = Vec::new();
    let mut chunks = vec![Vec::new()];
    for l in lines {
        if is_result(l) {
            assert!(l["id"].as_str().unwrap().starts_with("batch_req_"));
            assert!(l["custom_id"].is_string());
            assert!(l["response"].is_null() != l["error"].is_null(), "exactly one of response / error: {l}");
            res.push(l.clone());
            chunks.push(Vec::new());
        } else {
            let obj = l["object"].as_str().unwrap();
            assert!(obj == "chat.completion.chunk" || obj == "text_completion", "{l}");
            chunks.last_mut().unwrap().push(l.clone());
        }
    }
    assert!(chunks.pop().unwrap().is_empty(), "chunk lines after the last result");
    (res, chunks)
}

fn body(r: &Value) -> &Value {
    assert_eq!(r["response"]["status_code"], 200, "{r}");
    &r["response"]["body"]
}

fn msg(r: &Value) -> &Value {
    &body(r)["choices"][0]["message"]
}

fn finish(r: &Value) -> &str {
    body(r)["choices"][0]["finish_reason"].as_str().unwrap()
}

fn err_code(r: &Value) -> &str {
    assert!(r["response"].is_null(), "expected an error: {r}");
    r["error"]["code"].as_str().unwrap()
}

/// Concatenates streamed chat deltas: (reasoning, content, tool calls, final finish_reason).
fn stream_concat(chunks: &[Value], custom_id: &str) -> (String, String, Vec<Value>, String) {
    let (mut r, mut c, mut calls, mut fin) = (String::new(), String::new(), Vec::new(), String::new());
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    for ch in chunks {
        assert_eq!(ch["custom_id"], custom_id);
        let d = &ch["choices"][0]["delta"];
        r += d["reasoning"].as_str().unwrap_or("");
        assert_eq!(d["reasoning"], d["reasoning_content"]);
        c += d["content"].as_str().unwrap_or("");
        if let Some(t) = d["tool_calls"].as_array() {
            calls.extend(t.iter().cloned());
        }
        if let Some(f) = ch["choices"][0]["finish_reason"].as_str() {
            fin = f.to_string();
        }
    }
    (r, c, calls, fin)
}

const FIXTURE: &str = include_str!("../fixtures/protocol/requests.jsonl");

// ---------------------------------------------------------------- tests

#[test]
fn fixture_every_line_answered_in_order_with_the_right_shape() {
    // Two lines that cannot live in a text fixture: invalid UTF-8 and an over-long line.
    let mut input = FIXTURE.as_bytes().to_vec();
    input.extend_from_slice(b"{\"custom_id\": \"bad-utf8\", \"prompt\": \"\xff\xfe\"}\n");
    input.extend_from_slice(b"{\"custom_id\": \"huge\", \"prompt\": \"");
    input.extend(std::iter::repeat_n(b'a', 200_000));
    input.extend_from_slice(b"\"}\n");
    input.extend_from_slice(b"{\"custom_id\": \"after\", \"prompt\": \"SAY:still alive\"}");
    let n_in = input.split(|&b| b == b'\n').count();
    let mut o = opts();
    o.max_line_bytes = 64 << 10;
    let (lines, gen) = run_with(Cursor::new(input), &o, 1024);
    let (res, chunks) = results(&lines);
    assert_eq!(res.len(), n_in, "one result line per input line");
    for (i, r) in res.iter().enumerate() {
        if !r["error"].is_null() {
            assert_eq!(r["error"]["line"], i + 1, "{r}");
        }
    }
    let by_line = |n: usize| &res[n - 1];

    // 1: plain chat, thinking off.
    let r = by_line(1);
    assert_eq!(r["custom_id"], "c-plain");
    let b = body(r);
    assert_eq!(b["object"], "chat.completion");
    assert_eq!(b["model"], "ornith-test");
    assert!(b["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert!(b["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(
        msg(r),
        &json!({"role": "assistant", "content": "Hello, world!", "reasoning": null, "reasoning_content": null, "tool_calls": []})
    );
    assert_eq!(finish(r), "stop");
    assert_eq!(b["choices"][0]["index"], 0);
    // 13 text tokens + the eos token.
    assert_eq!(b["usage"]["completion_tokens"], 14);
    let p = b["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(b["usage"]["total_tokens"], p + 14);
    assert!(b["ttft_ms"].is_number());
    assert!(b.get("prefill_tok_s").is_some() && b.get("decode_tok_s").is_some());

    // 2: reasoning split (prompt ends with `<think>\n`).
    let m = msg(by_line(2));
    assert_eq!(m["reasoning"], "Let me think.");
    assert_eq!(m["reasoning_content"], "Let me think.");
    assert_eq!(m["content"], "The answer is 4.");

    // 3: tool call typed by the schema.
    let r = by_line(3);
    assert_eq!(finish(r), "tool_calls");
    let m = msg(r);
    assert_eq!(m["content"], "I'll check.");
    let calls = m["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "days": 3, "metric": true}));

    // 4: stop string excluded from the output.
    let r = by_line(4);
    assert_eq!(msg(r)["content"], "abc");
    assert_eq!(finish(r), "stop");
    assert_eq!(body(r)["choices"][0]["stop_reason"], "END");

    // 5: streaming with a stop string: chunks first, never a partial stop string, and the
    // deltas concatenate to the final message.
    let r = by_line(5);
    let ch = &chunks[4];
    assert!(ch.len() >= 4);
    let (re, co, calls, fin) = stream_concat(ch, "c-stream");
    assert_eq!(re, "Reasoning here");
    assert_eq!(co, "Part one ");
    assert!(calls.is_empty());
    assert_eq!(fin, "stop");
    assert!(ch.iter().all(|c| !c.to_string().contains('#')));
    assert_eq!(msg(r)["reasoning"], re);
    assert_eq!(msg(r)["content"], co);
    assert_eq!(ch[0]["id"], body(r)["id"]);

    // 6: max_tokens → length.
    let r = by_line(6);
    assert_eq!(msg(r)["content"], "abcde");
    assert_eq!(finish(r), "length");
    assert_eq!(body(r)["usage"]["completion_tokens"], 5);

    // 7, 8: bare bodies: `id` echoed, else line-<n>.
    assert_eq!(by_line(7)["custom_id"], "bare-1");
    assert_eq!(msg(by_line(7))["content"], "bare");
    assert_eq!(by_line(8)["custom_id"], "line-8");
    assert_eq!(msg(by_line(8))["content"], "no id");

    // 9, 10: raw completions.
    for (n, text) in [(9, "xyz"), (10, "hi")] {
        let b = body(by_line(n));
        assert_eq!(b["object"], "text_completion");
        assert_eq!(b["choices"][0]["text"], text);
        assert_eq!(b["choices"][0]["finish_reason"], "stop");
    }
    assert_eq!(body(by_line(10))["usage"]["prompt_tokens"], 6);

    // 11: streamed completion.
    let ch = &chunks[10];
    let streamed: String = ch.iter().map(|c| c["choices"][0]["text"].as_str().unwrap().to_string()).collect();
    assert_eq!(streamed, "streamed text");
    assert_eq!(ch.last().unwrap()["choices"][0]["finish_reason"], "stop");
    assert_eq!(body(by_line(11))["choices"][0]["text"], "streamed text");

    // Errors with their codes; the custom_id is recovered even from broken JSON.
    let expect = [
        (12, "broken", "invalid_json"),
        (13, "e-type", "invalid_request"),
        (14, "e-role", "invalid_request"),
        (15, "e-image", "unsupported_content"),
        (16, "e-empty", "invalid_request"),
        (17, "e-long-prompt", "context_length_exceeded"),
        (18, "e-max-tokens", "context_length_exceeded"),
        (19, "e-temp", "invalid_request"),
        (20, "e-top-p-0", "invalid_request"),
        (21, "e-top-p-big", "invalid_request"),
        (22, "c-plain", "duplicate_custom_id"),
        (23, "line-23", "empty_line"),
        (24, "e-engine", "engine_error"),
        (25, "e-panic", "internal_error"),
        (26, "e-url", "unsupported_url"),
        (27, "e-template", "invalid_request"),
        (33, "e-n", "invalid_request"),
        (34, "e-prompt-ids", "invalid_request"),
        (35, "e-neither", "invalid_request"),
        (36, "line-36", "invalid_request"),
        (37, "bad-utf8", "invalid_utf8"),
        (38, "huge", "line_too_long"),
    ];
    for (n, id, code) in expect {
        let r = by_line(n);
        assert_eq!(r["custom_id"], id, "line {n}");
        assert_eq!(err_code(r), code, "line {n}: {r}");
        assert!(!r["error"]["message"].as_str().unwrap().is_empty());
    }
    assert!(by_line(15)["error"]["message"].as_str().unwrap().contains("this build serves text only"));
    assert!(by_line(18)["error"]["message"].as_str().unwrap().contains("too large"));
    assert!(by_line(24)["error"]["message"].as_str().unwrap().contains("simulated device failure"));

    // 28: the second eos id (<|endoftext|>) stops too.
    assert_eq!(msg(by_line(28))["content"], "done");
    assert_eq!(finish(by_line(28)), "stop");
    // 29: ignore_eos runs through the eos token (decoded as nothing) to max_tokens.
    assert_eq!(msg(by_line(29))["content"], "abxxxxxxx");
    assert_eq!(finish(by_line(29)), "length");

    // 30: streamed tool call after reasoning.
    let r = by_line(30);
    let (re, co, calls, fin) = stream_concat(&chunks[29], "c-stream-tools");
    assert_eq!(re, "Checking.");
    assert_eq!(co, "");
    assert_eq!(fin, "tool_calls");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["index"], 0);
    let m = msg(r);
    assert_eq!(m["content"], Value::Null);
    assert_eq!(m["tool_calls"][0]["function"], calls[0]["function"]);
    assert_eq!(m["tool_calls"][0]["id"], calls[0]["id"]);

    // 31: multi-byte characters split across byte tokens, a multi-byte stop string.
    let (_, co, _, _) = stream_concat(&chunks[30], "c-utf8");
    assert_eq!(co, "héllo — 世界 ");
    assert_eq!(msg(by_line(31))["content"], co);

    // 32: developer role, text parts joined.
    assert_eq!(msg(by_line(32))["content"], "parts joined");

    // The line after the over-long one still runs.
    assert_eq!(body(by_line(39))["choices"][0]["text"], "still alive");

    // Sampling defaults from the generation config reach the generator; seeds differ by line.
    let p0 = gen[0];
    assert_eq!((p0.temperature, p0.top_k, p0.top_p, p0.min_p), (1.0, 20, 0.95, 0.0));
    assert_ne!(gen[0].seed, gen[1].seed);
}

/// A misspelt field is reported in the result body's `warnings` and the request still runs
/// (with the field ignored); a clean request has no `warnings` key.
#[test]
fn unknown_fields_are_warned_about_and_the_request_runs() {
    let input = concat!(
        r#"{"custom_id": "typo", "messages": [{"role": "user", "content": "SAY:ok"}], "max_tokenz": 1}"#,
        "\n",
        r#"{"custom_id": "clean", "messages": [{"role": "user", "content": "SAY:ok"}], "max_tokens": 4}"#,
        "\n"
    );
    let (lines, _) = run_with(Cursor::new(input), &opts(), 512);
    let (res, _) = results(&lines);
    assert_eq!(res.len(), 2);
    let w = body(&res[0])["warnings"].as_array().expect("warnings list").clone();
    assert_eq!(w.len(), 1);
    assert!(w[0].as_str().unwrap().contains("did you mean `max_tokens`"), "{w:?}");
    assert_eq!(res[0]["error"], Value::Null);
    assert!(body(&res[1]).get("warnings").is_none());
}

#[test]
fn explicit_sampling_parameters_reach_the_generator() {
    let line = r#"{"messages": [{"role": "user", "content": "SAY:a"}], "temperature": 0.5, "top_k": 7, "top_p": 0.8, "min_p": 0.05, "seed": 42}"#;
    let (lines, gen) = run_with(Cursor::new(format!("{line}\n{line}\n")), &opts(), 512);
    assert_eq!(lines.len(), 2);
    assert_eq!(gen[0], SamplingParams { temperature: 0.5, top_k: 7, top_p: 0.8, min_p: 0.05, seed: 42 });
    assert_eq!(gen[0], gen[1]);
    // temperature 0 → greedy.
    let (_, gen) = run_with(Cursor::new(r#"{"prompt": "SAY:a", "temperature": 0}"#), &opts(), 512);
    assert_eq!(gen[0].temperature, 0.0);
}

#[test]
fn penalties_reach_the_engine_and_bad_ones_are_refused() {
    // The model card's recommended settings carry a presence penalty (1.5 for thinking, general).
    let runner = ScriptRunner::new(512, 1);
    let seen = runner.penalties.clone();
    let cfg = support::script_config(512);
    let engine = Engine::new(Box::new(runner), cfg).unwrap();
    let input = [
        r#"{"messages": [{"role": "user", "content": "SAY:a"}], "presence_penalty": 1.5, "repetition_penalty": 1.05}"#,
        r#"{"prompt": "SAY:b", "frequency_penalty": -0.5}"#,
        r#"{"prompt": "SAY:c"}"#,
        r#"{"prompt": "SAY:d", "presence_penalty": 2.5}"#,
        r#"{"prompt": "SAY:e", "repetition_penalty": 0}"#,
    ]
    .join("\n");
    let mut out = Vec::new();
    protocol::serve(std::io::BufReader::new(Cursor::new(input)), &mut out, engine, &ByteCodec, &ChatMl, &opts())
        .unwrap();
    let lines = parse_lines(&out);
    let (res, _) = results(&lines);
    assert_eq!(res.len(), 5);
    for r in &res[..3] {
        assert!(r["error"].is_null(), "{r}");
    }
    for r in &res[3..] {
        assert_eq!(err_code(r), "invalid_request", "{r}");
    }
    // Prompts are prepared off the reader thread, so the engine may admit the three in any
    // order: compare them as a multiset.
    let mut seen = seen.lock().unwrap().clone();
    let key = |p: &Penalties| (p.presence.to_bits(), p.frequency.to_bits(), p.repetition.to_bits());
    seen.sort_by_key(key);
    let mut want = vec![
        Penalties { presence: 1.5, frequency: 0.0, repetition: 1.05 },
        Penalties { presence: 0.0, frequency: -0.5, repetition: 1.0 },
        Penalties::NONE,
    ];
    want.sort_by_key(key);
    assert_eq!(seen, want);
}

/// `n` choices are `n` sequences of the engine, choice `i` sampled with `seed + i` (vLLM's
/// children): the scripted model says the last digit of each sequence's seed. A choice that a
/// stop string ends is cancelled in the engine while the others go on; streamed chunks carry
/// each choice's `index`, and each choice ends with its own finish chunk.
#[test]
fn n_choices_are_sequences_seeded_seed_plus_index() {
    let mut runner = ScriptRunner::new(512, 4);
    runner.step_time = std::time::Duration::from_millis(1);
    let calls = runner.calls.clone();
    let tail = "y".repeat(120);
    let input = [
        json!({"custom_id": "chat", "messages": [{"role": "user", "content": "SAY:v$S"}], "n": 3, "seed": 7,
               "chat_template_kwargs": {"enable_thinking": false}}),
        json!({"custom_id": "stream", "prompt": format!("SAY:ab$S{tail}"), "n": 3, "seed": 17, "stop": ["8"],
               "max_tokens": 300, "stream": true}),
        json!({"custom_id": "one", "prompt": "SAY:w$S", "seed": 4, "n": 1}),
    ];
    let (lines, stats) = serve_lines(runner, 512, &input);
    let (res, chunks) = results(&lines);
    assert_eq!(res.len(), 3);

    // Chat: three choices, seeds 7, 8, 9.
    let b = body(&res[0]);
    let texts: Vec<(u64, &str, &str)> = b["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["index"].as_u64().unwrap(),
                c["message"]["content"].as_str().unwrap(),
                c["finish_reason"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(texts, [(0, "v7", "stop"), (1, "v8", "stop"), (2, "v9", "stop")]);
    // The prompt counts once, every choice's tokens (2 + `<|im_end|>` each) count.
    let prompt_tokens = b["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(b["usage"]["completion_tokens"], 9);
    assert_eq!(b["usage"]["total_tokens"], prompt_tokens + 9);
    let mut seeds: Vec<u64> = calls.lock().unwrap().iter().map(|p| p.seed).collect();
    seeds.sort();
    assert_eq!(seeds, [4, 7, 8, 9, 17, 18, 19]);

    // Streamed completion: choice 1 (seed 18) stops at "8"; the others run to the script's end.
    let b = body(&res[1]);
    let ch = b["choices"].as_array().unwrap();
    assert_eq!(ch.len(), 3);
    assert_eq!((ch[1]["text"].as_str().unwrap(), ch[1]["finish_reason"].as_str().unwrap()), ("ab", "stop"));
    assert_eq!(ch[1]["stop_reason"], "8");
    assert_eq!(ch[0]["text"], format!("ab7{tail}"));
    assert_eq!(ch[2]["text"], format!("ab9{tail}"));
    let mut streamed = vec![String::new(); 3];
    let mut finishes: Vec<usize> = Vec::new();
    for (k, c) in chunks[1].iter().enumerate() {
        assert_eq!(c["custom_id"], "stream");
        let choices = c["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 1, "one choice per chunk: {c}");
        let i = choices[0]["index"].as_u64().unwrap() as usize;
        assert!(!finishes.contains(&i), "choice {i} streamed after its finish chunk");
        streamed[i] += choices[0]["text"].as_str().unwrap();
        if !choices[0]["finish_reason"].is_null() {
            finishes.push(i);
            if i == 1 {
                assert!(k < chunks[1].len() / 2, "the stopped choice finished late (chunk {k})");
            }
        }
    }
    assert_eq!(finishes[0], 1, "the stopped choice finishes first");
    assert_eq!(finishes.len(), 3);
    for (i, c) in ch.iter().enumerate() {
        assert_eq!(streamed[i], c["text"].as_str().unwrap(), "choice {i}");
    }
    // 3 + 1 + 124 + 124 tokens: the stopped choice's sequence did not run on.
    assert_eq!(b["usage"]["completion_tokens"], 3 + 124 * 2);
    assert_eq!(stats.engine.cancelled, 1, "the stopped choice is cancelled in the engine");

    // n = 1: one choice, as before.
    let b = body(&res[2]);
    assert_eq!(b["choices"].as_array().unwrap().len(), 1);
    assert_eq!(b["choices"][0]["text"], "w4");
}

/// The choices of a prompt longer than a prefill chunk share its full chunks through the prefix
/// cache: the first choice prefills them, the others wait for them and prefill only the rest.
#[test]
fn n_choices_share_the_prompts_full_chunks() {
    let runner = ScriptRunner::new(8192, 4).with_snapshots(4);
    let prompt = format!("{}SAY:z$S", "a".repeat(4400));
    let (lines, stats) = serve_lines(runner, 8192, &[json!({"prompt": prompt, "n": 3, "seed": 0})]);
    let (res, _) = results(&lines);
    let b = body(&res[0]);
    let texts: Vec<&str> = b["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(texts, ["z0", "z1", "z2"]);
    let n = 4400 + 7;
    let c = &stats.engine.cache;
    assert_eq!((c.hits, c.misses, c.cached_tokens), (2, 1, 2 * 4096), "{c:?}");
    assert_eq!(stats.engine.prefill_rows, (n + 2 * (n - 4096)) as u64);
    // cached_tokens: the least any choice took from the cache (the first took none).
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

/// `logprobs` in each API's shape, one entry per output token (the stop token included, as
/// `completion_tokens` counts it), from the model's figures (the scripted model: `-t / 1000`
/// for token `t`, top `A`, `B`, … at -0.25, -0.5, …); streamed chunks carry their tokens' and
/// add up to the body's; a forced token is reported as the forced one; bad values are refused.
#[test]
fn logprobs_in_chat_and_completions_shapes() {
    let no_think = json!({"enable_thinking": false});
    let tools = json!([{"type": "function", "function": {"name": "ls"}}]);
    let lines = [
        json!({"messages": [{"role": "user", "content": "SAY:hi"}], "chat_template_kwargs": no_think,
               "logprobs": true, "top_logprobs": 2}),
        json!({"messages": [{"role": "user", "content": "SAY:hé"}], "chat_template_kwargs": no_think,
               "logprobs": true, "stream": true}),
        json!({"prompt": "SAY:ab", "logprobs": 1}),
        json!({"prompt": "SAY:abcdef", "logprobs": 0, "stream": true, "max_tokens": 4}),
        // A forced call: the scripted model says `yyyy…` where the forced head goes.
        json!({"messages": [{"role": "user", "content": format!("SAY:{}</function>\n</tool_call>", "y".repeat(26))}],
               "chat_template_kwargs": no_think, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "ls"}},
               "logprobs": true}),
        json!({"messages": [{"role": "user", "content": "SAY:x"}], "logprobs": true, "top_logprobs": 21}),
        json!({"messages": [{"role": "user", "content": "SAY:x"}], "top_logprobs": 2}),
        json!({"prompt": "SAY:x", "logprobs": 21}),
        json!({"prompt": "SAY:x", "top_logprobs": 1}),
        json!({"messages": [{"role": "user", "content": "SAY:x"}], "logprobs": 3}),
    ];
    let input: String = lines.iter().map(|l| l.to_string() + "\n").collect();
    let (out, _) = run_with(Cursor::new(input), &opts(), 512);
    let (res, chunks) = results(&out);
    let lp = |t: u32| (-(t as f32) / 1000.0).to_string().parse::<f64>().unwrap();
    let entry = |t: u32| json!({"token": String::from_utf8_lossy(&[t as u8]), "logprob": lp(t), "bytes": [t]});

    // Chat: h, i, <|im_end|>, each with the top two.
    let c = &body(&res[0])["choices"][0]["logprobs"];
    let top2 = json!([{"token": "A", "logprob": -0.25, "bytes": [65]}, {"token": "B", "logprob": -0.5, "bytes": [66]}]);
    let mut want: Vec<Value> = [b'h' as u32, b'i' as u32].map(entry).to_vec();
    want.push(json!({"token": "<|im_end|>", "logprob": lp(IM_END), "bytes": b"<|im_end|>".to_vec()}));
    for w in &mut want {
        w["top_logprobs"] = top2.clone();
    }
    assert_eq!(c, &json!({"content": want, "refusal": null}));
    assert_eq!(body(&res[0])["usage"]["completion_tokens"], 3);

    // Streamed chat: the chunks' entries add up to the body's (é is two byte tokens).
    let full = body(&res[1])["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    assert_eq!(full.len(), 4);
    assert_eq!(full[1]["bytes"], json!([0xc3]));
    assert_eq!(full[1]["token"], "\u{fffd}", "a token that ends inside a character: lossy text, exact bytes");
    assert_eq!(full[0]["top_logprobs"], json!([]));
    let streamed: Vec<Value> =
        chunks[1].iter().filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array()).flatten().cloned().collect();
    assert_eq!(streamed, full);
    assert!(chunks[1][0]["choices"][0]["logprobs"].is_null(), "the role chunk carries none");

    // Completions: the legacy shape; top_logprobs holds the top k and the output token.
    let c = &body(&res[2])["choices"][0]["logprobs"];
    assert_eq!(c["tokens"], json!(["a", "b", "<|im_end|>"]));
    assert_eq!(c["token_logprobs"], json!([lp(97), lp(98), lp(IM_END)]));
    assert_eq!(c["top_logprobs"][0], json!({"A": -0.25, "a": lp(97)}));
    assert_eq!(c["text_offset"], json!([0, 1, 2]));
    // Streamed completions: the chunks' pieces add up, offsets continuing.
    let full = &body(&res[3])["choices"][0]["logprobs"];
    assert_eq!(full["tokens"], json!(["a", "b", "c", "d"]));
    let (mut toks, mut offs) = (Vec::new(), Vec::new());
    for c in &chunks[3] {
        let l = &c["choices"][0]["logprobs"];
        toks.extend(l["tokens"].as_array().unwrap().iter().cloned());
        offs.extend(l["text_offset"].as_array().unwrap().iter().cloned());
    }
    assert_eq!((json!(toks), json!(offs)), (full["tokens"].clone(), full["text_offset"].clone()));

    // The forced head's tokens are reported, not the filler the model drew under them.
    let c = body(&res[4])["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    let text: String = c.iter().map(|e| e["token"].as_str().unwrap()).collect();
    assert!(text.starts_with("<tool_call>\n<function=ls>\n</function>"), "{text}");
    assert_eq!(finish(&res[4]), "tool_calls");

    for (k, want) in
        [(5, "0..=20"), (6, "needs `logprobs: true`"), (7, "0..=20"), (8, "chat parameter"), (9, "true or false")]
    {
        assert_eq!(err_code(&res[k]), "invalid_request", "{}", res[k]);
        assert!(res[k]["error"]["message"].as_str().unwrap().contains(want), "{}", res[k]);
    }
}

/// `response_format` json: the answer is what the grammar allows. The scripted model draws its
/// script where the mask allows it (else it closes what is open): a script that is the right
/// JSON comes out as it is, a junk script still comes out as JSON; with thinking on the
/// reasoning stays free and the JSON follows `</think>`; each choice has its own grammar; the
/// stream adds up to the body; with tools offered a call's marker frees the answer; bad formats
/// and combinations are refused.
#[test]
fn response_format_json_constrains_the_answer() {
    let no_think = json!({"enable_thinking": false});
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
                        "required": ["ok", "n"], "additionalProperties": false});
    let rf = json!({"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": true}});
    let good = r#"{"ok": true, "n": 12}"#;
    let chat = |say: &str, extra: Value| {
        let mut v = json!({"messages": [{"role": "user", "content": format!("SAY:{say}")}]});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };
    let lines = [
        chat(good, json!({"response_format": rf, "chat_template_kwargs": no_think})),
        chat("Sure! Here it is", json!({"response_format": {"type": "json_object"}, "chat_template_kwargs": no_think})),
        chat(&format!("Let me think.\n</think>\n\n{good}"), json!({"response_format": rf, "stream": true})),
        chat("nope", json!({"response_format": rf, "chat_template_kwargs": no_think, "n": 2, "max_tokens": 40})),
        json!({"prompt": "SAY:x", "response_format": {"type": "json_object"}}),
        chat(
            "x",
            json!({"response_format": rf, "tools": [{"type": "function", "function": {"name": "ls"}}],
                         "tool_choice": "required"}),
        ),
        chat("x", json!({"response_format": {"type": "yaml"}})),
        chat("x", json!({"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}})),
        chat("x", json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}})),
        chat("x", json!({"response_format": rf, "ignore_eos": true})),
        // With tools left out (`tool_choice: none`) the JSON is allowed.
        chat(
            good,
            json!({"response_format": rf, "chat_template_kwargs": no_think,
                          "tools": [{"type": "function", "function": {"name": "ls"}}], "tool_choice": "none"}),
        ),
        // With tools offered the answer is the JSON or a call (the call's marker frees it).
        chat(
            good,
            json!({"response_format": rf, "chat_template_kwargs": no_think, "tools": [{"type": "function", "function": {"name": "ls"}}]}),
        ),
        chat(
            "<tool_call>\n<function=ls>\n</function>\n</tool_call>",
            json!({"response_format": rf,
             "chat_template_kwargs": no_think, "tools": [{"type": "function", "function": {"name": "ls"}}]}),
        ),
    ];
    let input: String = lines.iter().map(|l| l.to_string() + "\n").collect();
    let (out, _) = run_with(Cursor::new(input), &opts(), 512);
    let (res, chunks) = results(&out);
    let content = |k: usize, i: usize| body(&res[k])["choices"][i]["message"]["content"].as_str().unwrap().to_string();

    assert_eq!(content(0, 0), good);
    assert_eq!(finish(&res[0]), "stop");
    let junk = content(1, 0);
    assert!(serde_json::from_str::<Map<String, Value>>(&junk).is_ok(), "not a JSON object: {junk}");
    let m = msg(&res[2]);
    assert_eq!((m["reasoning"].as_str(), m["content"].as_str()), (Some("Let me think."), Some(good)), "{m}");
    let (reasoning, streamed, _, fin) = stream_concat(&chunks[2], "line-3");
    assert_eq!((reasoning.as_str(), streamed.as_str(), fin.as_str()), ("Let me think.", good, "stop"));
    for i in 0..2 {
        let v: Value =
            serde_json::from_str(&content(3, i)).unwrap_or_else(|e| panic!("choice {i}: {e}: {}", content(3, i)));
        assert!(v["ok"].is_boolean() && v["n"].is_i64(), "{v}");
    }
    assert_eq!(err_code(&res[4]), "unsupported_parameter");
    assert_eq!(err_code(&res[5]), "unsupported_parameter");
    for k in [6, 7, 8, 9] {
        assert_eq!(err_code(&res[k]), "invalid_request", "{}", res[k]);
    }
    assert!(res[8]["error"]["message"].as_str().unwrap().contains("schema"), "{}", res[8]);
    assert_eq!(content(10, 0), good);
    assert_eq!((content(11, 0), finish(&res[11])), (good.to_string(), "stop"));
    let m = msg(&res[12]);
    assert_eq!((finish(&res[12]), &m["tool_calls"][0]["function"]["name"]), ("tool_calls", &json!("ls")), "{m}");
}

#[test]
fn a_forced_tool_choice_makes_the_answer_a_call() {
    // The scripted model would write filler where the call starts: forcing replaces the first
    // tokens of the answer (thinking off) or those right after `</think>` (thinking on) by the
    // start of a call in the template's format, and the model's own tokens go on from there.
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}}}}, {"type": "function", "function": {"name": "ls"}}]);
    let rest = "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>";
    let named_head = "<tool_call>\n<function=get_weather>\n";
    let any_head = "\n\n<tool_call>\n<function";
    let fill = |n: usize| "x".repeat(n);
    let lines = [
        // Named, thinking off: forced from the first token.
        json!({"custom_id": "named", "messages": [{"role": "user", "content": format!("SAY:{}{rest}", fill(named_head.len()))}],
               "tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
               "chat_template_kwargs": {"enable_thinking": false}}),
        // Any tool, thinking on: forced after `</think>`; the model names the function.
        json!({"custom_id": "any", "messages": [{"role": "user", "content": format!("SAY:Let me see.\n</think>{}=get_weather>\n{rest}", fill(any_head.len()))}],
               "tools": tools, "tool_choice": "required", "stream": true}),
        // Auto: the filler stays (the same script, no forcing).
        json!({"custom_id": "auto", "messages": [{"role": "user", "content": format!("SAY:{}{rest}", fill(named_head.len()))}],
               "tools": tools, "chat_template_kwargs": {"enable_thinking": false}}),
    ];
    let input: String = lines.iter().map(|l| l.to_string() + "\n").collect();
    let (out, _) = run_with(Cursor::new(input), &opts(), 512);
    let (res, chunks) = results(&out);
    let call = |m: &Value| {
        let c = &m["tool_calls"][0]["function"];
        (
            c["name"].as_str().unwrap().to_string(),
            serde_json::from_str::<Value>(c["arguments"].as_str().unwrap()).unwrap(),
        )
    };
    let m = msg(&res[0]);
    assert_eq!((finish(&res[0]), &m["content"]), ("tool_calls", &Value::Null), "a call alone: {m}");
    assert_eq!(call(m), ("get_weather".into(), json!({"city": "Paris"})));
    let m = msg(&res[1]);
    assert_eq!((finish(&res[1]), m["reasoning"].as_str()), ("tool_calls", Some("Let me see.")), "{m}");
    assert_eq!(call(m), ("get_weather".into(), json!({"city": "Paris"})));
    let (reasoning, content, calls, fin) = stream_concat(&chunks[1], "any");
    assert_eq!((reasoning.as_str(), content.as_str(), calls.len(), fin.as_str()), ("Let me see.", "", 1, "tool_calls"));
    let m = msg(&res[2]);
    assert!(m["content"].as_str().unwrap().starts_with("xxxx"), "without forcing the filler is the answer: {m}");
    assert_eq!(finish(&res[2]), "stop");
}

#[test]
fn a_thinking_budget_makes_the_model_answer() {
    // Once the reasoning holds `thinking_budget` tokens, the Qwen3 report's stop-thinking text
    // replaces the next draws (the scripted model's filler there) and the model's own tokens go
    // on as the answer; a model that closes its thinking within the budget is left alone; and a
    // budget's close fires a forced call.
    let stop = ornith_runtime::protocol::live::STOP_THINKING;
    let fill = |n: usize| "x".repeat(n);
    let tools = json!([{"type": "function", "function": {"name": "ls"}}]);
    let lines = [
        json!({"custom_id": "cut", "messages": [{"role": "user", "content": format!("SAY:abcde{}\n\nThe answer.", fill(stop.len()))}],
               "thinking_budget": 5}),
        json!({"custom_id": "within", "messages": [{"role": "user", "content": "SAY:ab\n</think>\n\nDone."}],
               "thinking_budget": 20}),
        json!({"custom_id": "call", "messages": [{"role": "user", "content":
               format!("SAY:abc{}{}>\n</function>\n</tool_call>", fill(stop.len()), fill("\n\n<tool_call>\n<function=ls".len()))}],
               "thinking_budget": 3, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "ls"}}}),
    ];
    let input: String = lines.iter().map(|l| l.to_string() + "\n").collect();
    let (out, _) = run_with(Cursor::new(input), &opts(), 1024);
    let (res, _) = results(&out);
    let m = msg(&res[0]);
    let cut = stop.strip_suffix("\n</think>").unwrap().trim_start();
    assert_eq!(m["reasoning"].as_str().unwrap(), format!("abcde\n\n{cut}"), "{m}");
    assert_eq!(m["content"], "The answer.");
    let m = msg(&res[1]);
    assert_eq!((m["reasoning"].as_str(), m["content"].as_str()), (Some("ab"), Some("Done.")), "{m}");
    let m = msg(&res[2]);
    assert_eq!(m["reasoning"].as_str().unwrap(), format!("abc\n\n{cut}"), "{m}");
    assert_eq!(m["tool_calls"][0]["function"]["name"], "ls", "{m}");
    assert_eq!(finish(&res[2]), "tool_calls");
    // Refused: a negative budget.
    let (out, _) = run_with(Cursor::new(r#"{"prompt": "x", "thinking_budget": -1}"#), &opts(), 64);
    assert_eq!(err_code(&results(&out).0[0]), "invalid_request");
}

#[test]
fn max_tokens_absent_runs_to_the_end_of_the_window() {
    // The script is "abc" + eos, ignored: generation must stop at the window, not past it.
    let line = r#"{"prompt": "SAY:abc", "ignore_eos": true}"#;
    let (lines, _) = run_with(Cursor::new(line), &opts(), 64);
    let b = body(&lines[0]);
    let p = b["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(p + b["usage"]["completion_tokens"].as_u64().unwrap(), 64);
    assert_eq!(b["choices"][0]["finish_reason"], "length");
}

#[test]
fn ordered_mode_gives_the_same_lines_in_input_order() {
    // Four sequences at once. The simulated step failures are left out: a failed step fails
    // every sequence it carried, and which ones share a step depends on timing.
    let input: String =
        FIXTURE.lines().filter(|l| !l.contains("FAIL") && !l.contains("PANIC")).map(|l| format!("{l}\n")).collect();
    let mut o = opts();
    let (a, _) = run_slots(Cursor::new(input.clone()), &o, 1024, 4);
    o.ordered = false;
    let (b, _) = run_slots(Cursor::new(input), &o, 1024, 4);
    let strip = |l: &Value| -> Value {
        let mut l = l.clone();
        if let Some(b) = l.get_mut("response").and_then(|r| r.get_mut("body")).and_then(|b| b.as_object_mut()) {
            for k in ["ttft_ms", "prefill_tok_s", "decode_tok_s", "created"] {
                b.remove(k);
            }
        }
        if let Some(o) = l.as_object_mut() {
            o.remove("created");
        }
        l
    };
    // Ordered: result lines in input order, each request's chunks right before its result.
    let (res, _) = results(&a);
    let order: Vec<u64> = res.iter().map(line_of).collect();
    assert_eq!(order, (1..=res.len() as u64).collect::<Vec<_>>());
    // Unordered: the same lines per request, in the same order within a request.
    let by_id = |v: &Vec<Value>| -> std::collections::BTreeMap<u64, Vec<Value>> {
        let mut m = std::collections::BTreeMap::<u64, Vec<Value>>::new();
        for l in v {
            m.entry(line_of(l)).or_default().push(strip(l));
        }
        m
    };
    assert_eq!(a.len(), b.len());
    assert!(by_id(&a) == by_id(&b), "ordered and unordered runs differ per request");
}

/// The input line a result or chunk line belongs to (its `id` ends in the line number:
/// `batch_req_<run>_<line>`, `chatcmpl-<run>-<line>`).
fn line_of(r: &Value) -> u64 {
    r["id"].as_str().unwrap().rsplit(['_', '-']).next().unwrap().parse().unwrap()
}

/// Requests run at once: a short one read after a long one is answered first, and both are
/// answered in full.
#[test]
fn a_short_request_after_a_long_one_is_answered_first() {
    let long = format!(r#"{{"custom_id": "long", "prompt": "SAY:{}"}}"#, "a".repeat(150));
    let short = r#"{"custom_id": "short", "prompt": "SAY:hi"}"#;
    let mut o = opts();
    o.ordered = false;
    // 5 ms steps: the short one must only start within the long one's ~750 ms.
    let ms = std::time::Duration::from_millis(5);
    let (lines, _) = run_timed(Cursor::new(format!("{long}\n{short}\n")), &o, 1024, 2, ms);
    let (res, _) = results(&lines);
    let ids: Vec<&str> = res.iter().map(|r| r["custom_id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["short", "long"]);
    assert_eq!(body(&res[0])["choices"][0]["text"], "hi");
    assert_eq!(body(&res[1])["choices"][0]["text"], "a".repeat(150));
    // In input order the long one comes first, the short one held back until it is written.
    o.ordered = true;
    let (lines, _) = run_timed(Cursor::new(format!("{long}\n{short}\n")), &o, 1024, 2, ms);
    let (res, _) = results(&lines);
    let ids: Vec<&str> = res.iter().map(|r| r["custom_id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["long", "short"]);
}

/// Streamed requests running at once interleave their chunk lines, each carrying its
/// `custom_id`; each request's deltas still concatenate to its message.
#[test]
fn chunk_lines_of_concurrent_streams_interleave_by_custom_id() {
    let line = |id: &str, say: &str| {
        format!(
            r#"{{"custom_id": "{id}", "stream": true, "messages": [{{"role": "user", "content": "SAY:{say}"}}], "chat_template_kwargs": {{"enable_thinking": false}}}}"#
        )
    };
    let input = format!("{}\n{}\n", line("s1", "one two three four five"), line("s2", "six seven eight nine ten"));
    let mut o = opts();
    o.ordered = false;
    // 10 ms steps: the two ~24-token streams overlap unless one starts ~240 ms after the other.
    let (lines, _) = run_timed(Cursor::new(input), &o, 1024, 2, std::time::Duration::from_millis(10));
    let chunks: Vec<&Value> = lines.iter().filter(|l| !is_result(l)).collect();
    let owners: Vec<&str> = chunks.iter().map(|c| c["custom_id"].as_str().unwrap()).collect();
    let switches = owners.windows(2).filter(|w| w[0] != w[1]).count();
    assert!(switches >= 4, "the two streams did not interleave: {owners:?}");
    for (id, want) in [("s1", "one two three four five"), ("s2", "six seven eight nine ten")] {
        let text: String = chunks
            .iter()
            .filter(|c| c["custom_id"] == id)
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, want);
        let r = lines.iter().find(|l| is_result(l) && l["custom_id"] == id).unwrap();
        assert_eq!(msg(r)["content"], want);
    }
}

/// A reader of a 100 MB line without holding it in memory.
#[test]
fn a_100_mb_line_is_skipped_without_stalling() {
    let head = Cursor::new(b"{\"custom_id\": \"big\", \"prompt\": \"".to_vec());
    let body = std::io::repeat(b'z').take(100 << 20);
    let tail = Cursor::new(b"\"}\n{\"custom_id\": \"next\", \"prompt\": \"SAY:ok\"}\n".to_vec());
    let t = std::time::Instant::now();
    let (lines, _) = run_with(head.chain(body).chain(tail), &opts(), 512);
    let (res, _) = results(&lines);
    assert_eq!(res.len(), 2);
    assert_eq!(res[0]["custom_id"], "big");
    assert_eq!(err_code(&res[0]), "line_too_long");
    assert_eq!(res[1]["response"]["body"]["choices"][0]["text"], "ok");
    // Generous bound (a pass over 100 MB takes well under a second): catches a quadratic stall.
    assert!(t.elapsed().as_secs() < 30);
}

#[test]
fn tokenize_counts_text_and_chat() {
    let input = "{\"text\": \"héllo\"}\n{\"custom_id\": \"c\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"chat_template_kwargs\": {\"enable_thinking\": false}}\n{\"messages\": []}\nnot json\n";
    let mut out = Vec::new();
    let n = protocol::tokenize(Cursor::new(input), &mut out, &ByteCodec, &ChatMl, 1 << 20).unwrap();
    assert_eq!(n, 4);
    let lines = parse_lines(&out);
    assert_eq!(lines[0], json!({"ids": [104, 195, 169, 108, 108, 111], "count": 6}));
    let rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
    let ids = ByteCodec.encode(rendered).unwrap();
    assert_eq!(lines[1]["ids"], json!(ids));
    assert_eq!(lines[1]["count"], ids.len());
    assert_eq!(lines[1]["custom_id"], "c");
    assert_eq!(lines[2]["error"]["line"], 3);
    assert_eq!(lines[3]["error"]["code"], "invalid_json");
}

// ---------------------------------------------------------------- randomized

/// xorshift64* (fixed seed: the test is deterministic).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn random_value(rng: &mut Rng, depth: u32) -> Value {
    match rng.below(if depth > 2 { 6 } else { 8 }) {
        0 => Value::Null,
        1 => json!(rng.below(2) == 0),
        2 => json!(rng.next() as i64),
        3 => json!((rng.next() % 2000) as f64 / 100.0 - 10.0),
        4 => json!(["", "user", "SAY:hi", "<tool_call>", "\u{0}", "é", "/v1/completions", "POST"][rng.below(8)]),
        5 => json!(-1),
        6 => Value::Array((0..rng.below(4)).map(|_| random_value(rng, depth + 1)).collect()),
        _ => {
            let keys = [
                "role",
                "content",
                "messages",
                "prompt",
                "max_tokens",
                "stop",
                "stream",
                "tools",
                "body",
                "custom_id",
                "type",
                "text",
            ];
            let mut m = Map::new();
            for _ in 0..rng.below(4) {
                m.insert(keys[rng.below(keys.len())].into(), random_value(rng, depth + 1));
            }
            Value::Object(m)
        }
    }
}

/// Replaces a random node of `v` by a random value.
fn mutate_tree(v: &mut Value, rng: &mut Rng) {
    let go_deeper = rng.below(3) != 0;
    match v {
        Value::Object(m) if go_deeper && !m.is_empty() => {
            let k = m.keys().nth(rng.below(m.len())).unwrap().clone();
            if rng.below(5) == 0 {
                m.remove(&k);
            } else {
                mutate_tree(m.get_mut(&k).unwrap(), rng);
            }
        }
        Value::Array(a) if go_deeper && !a.is_empty() => {
            let i = rng.below(a.len());
            mutate_tree(&mut a[i], rng);
        }
        _ => *v = random_value(rng, 0),
    }
}

fn mutate_bytes(line: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut b = line.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(b.len() + 1);
        match rng.below(4) {
            0 if !b.is_empty() => {
                let end = (at + 1 + rng.below(8)).min(b.len());
                b.drain(at.min(end)..end);
            }
            1 => b.insert(at, (rng.next() % 0x5f) as u8 + 0x20), // printable ASCII
            2 => b.insert(at, [b'{', b'"', b'[', b',', 0xff, 0xc3, b'\\', b'}'][rng.below(8)]),
            // Any byte, UTF-8 or not, now and then.
            _ if !b.is_empty() => {
                let i = at.min(b.len() - 1);
                b[i] = if rng.below(4) == 0 { rng.next() as u8 } else { (rng.next() % 0x5f) as u8 + 0x20 };
            }
            _ => {}
        }
    }
    // A newline would split the line in two; keep the line count known.
    b.iter().map(|&c| if c == b'\n' { b' ' } else { c }).collect()
}

#[test]
fn randomized_mutations_never_panic_and_never_lose_a_line() {
    let corpus: Vec<&str> = FIXTURE.lines().filter(|l| !l.contains("PANIC")).collect();
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let mut o = opts();
    o.max_line_bytes = 4096;
    let mut codes = std::collections::BTreeMap::<String, usize>::new();
    // 40 batches × 25 lines: bounded so the test stays fast.
    for _ in 0..40 {
        let mut input = Vec::new();
        let n = 25;
        for _ in 0..n {
            let src = corpus[rng.below(corpus.len())];
            let line = if rng.below(2) == 0 {
                match serde_json::from_str::<Value>(src) {
                    Ok(mut v) => {
                        for _ in 0..1 + rng.below(3) {
                            mutate_tree(&mut v, &mut rng);
                        }
                        v.to_string().into_bytes()
                    }
                    Err(_) => mutate_bytes(src.as_bytes(), &mut rng),
                }
            } else {
                mutate_bytes(src.as_bytes(), &mut rng)
            };
            input.extend_from_slice(&line);
            input.push(b'\n');
        }
        let (lines, _) = run_with(Cursor::new(input), &o, 512);
        let (res, _) = results(&lines);
        assert_eq!(res.len(), n);
        for (i, r) in res.iter().enumerate() {
            if !r["error"].is_null() {
                assert_eq!(r["error"]["line"], i + 1);
                assert_ne!(r["error"]["code"], "internal_error", "{r}");
                *codes.entry(r["error"]["code"].as_str().unwrap().to_string()).or_default() += 1;
            } else {
                *codes.entry("ok".into()).or_default() += 1;
            }
        }
    }
    // The mutations must reach past the JSON parser: successes and varied validation errors.
    eprintln!("outcomes: {codes:?}");
    assert!(codes.get("ok").copied().unwrap_or(0) >= 25, "{codes:?}");
    assert!(codes.len() >= 6, "{codes:?}");
}

// ---------------------------------------------------------------- the README's error table

/// README.md documents every error code in a table (`| code | when |`); it must list exactly the
/// codes of `protocol::ERROR_CODES`, which the protocol's own unit test ties to the sources.
#[test]
fn readme_error_table_lists_exactly_the_error_codes() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let mut lines = readme.lines().skip_while(|l| l.trim() != "| code | when |");
    assert!(lines.next().is_some(), "README.md has no `| code | when |` table");
    let documented: std::collections::BTreeSet<String> = lines
        .skip(1) // the |---|---| row
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cell = l.split('|').nth(1).unwrap().trim();
            cell.trim_matches('`').to_string()
        })
        .collect();
    let codes: std::collections::BTreeSet<String> = protocol::ERROR_CODES.iter().map(|(c, _)| c.to_string()).collect();
    assert_eq!(documented, codes, "README.md's error table and protocol::ERROR_CODES differ");
}

// ---------------------------------------------------------------- ornith batch's serve loop

/// `serve_with` under a [`protocol::BatchControl`]: (output lines, stats).
fn run_batch(
    input: &str,
    ctl: protocol::BatchControl,
    step: std::time::Duration,
) -> (Vec<Value>, protocol::ServeStats) {
    let mut out = Vec::new();
    let stats = run_batch_into(input, ctl, step, &ByteCodec, &mut out);
    (parse_lines(&out), stats)
}

/// The same over `codec`, written into `out`: two sequence slots, `step` per engine step.
fn run_batch_into(
    input: &str,
    ctl: protocol::BatchControl,
    step: std::time::Duration,
    codec: &(dyn TextCodec + Sync),
    out: &mut dyn std::io::Write,
) -> protocol::ServeStats {
    let mut runner = ScriptRunner::new(512, 2);
    runner.step_time = step;
    let cfg = support::script_config(512);
    let engine = Engine::new(Box::new(runner), cfg).unwrap();
    let mut o = opts();
    o.ordered = false;
    let input = std::io::BufReader::new(Cursor::new(input.to_string().into_bytes()));
    protocol::serve_with(input, out, engine, codec, &ChatMl, &o, ctl).unwrap()
}

/// The JSON lines a run wrote.
fn parse_lines(out: &[u8]) -> Vec<Value> {
    std::str::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {l}")))
        .collect()
}

/// The output of a stopped `ornith batch` run: once `chunks` stream chunk lines of each of
/// `requests` requests have been written — each of them has generated, as the serve loop has seen —
/// it raises `signal` on `stop`; once a result line follows that (the loop has answered what it
/// cancelled, so it has stopped), it opens `gate`. Stops that wait on what the loop wrote, not on
/// sleeps that a loaded machine may outrun.
struct StopsWhenGenerating {
    out: Vec<u8>,
    read: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicI32>,
    signal: i32,
    requests: usize,
    chunks: usize,
    seen: std::collections::HashMap<String, usize>,
    gate: Option<std::sync::Arc<support::Gate>>,
}

impl StopsWhenGenerating {
    fn new(stop: &std::sync::Arc<std::sync::atomic::AtomicI32>, signal: i32, requests: usize, chunks: usize) -> Self {
        let (out, read, stop, seen, gate) = (Vec::new(), 0, stop.clone(), Default::default(), None);
        StopsWhenGenerating { out, read, stop, signal, requests, chunks, seen, gate }
    }
    fn raised(&self) -> bool {
        self.stop.load(std::sync::atomic::Ordering::SeqCst) != 0
    }
}

impl std::io::Write for StopsWhenGenerating {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.out.extend_from_slice(buf);
        while let Some(n) = self.out[self.read..].iter().position(|&b| b == b'\n') {
            let line: Value = serde_json::from_slice(&self.out[self.read..self.read + n]).unwrap();
            self.read += n + 1;
            if is_result(&line) {
                if self.raised() {
                    if let Some(g) = self.gate.take() {
                        g.open();
                    }
                }
                continue;
            }
            *self.seen.entry(line["custom_id"].as_str().unwrap().to_string()).or_default() += 1;
            if !self.raised() && self.seen.values().filter(|&&c| c >= self.chunks).count() >= self.requests {
                self.stop.store(self.signal, std::sync::atomic::Ordering::SeqCst);
            }
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn batch_skips_what_is_done_and_still_flags_a_later_duplicate() {
    let input = [
        r#"{"custom_id":"a","messages":[{"role":"user","content":"SAY:one"}]}"#,
        r#"{"custom_id":"a","messages":[{"role":"user","content":"SAY:dup"}]}"#,
        r#"{"custom_id":"b","messages":[{"role":"user","content":"SAY:two"}],"stream":true}"#,
        r#"{"messages":[{"role":"user","content":"SAY:three"}]}"#,
        r#"{"prompt":"SAY:four"}"#,
    ]
    .join("\n");
    // The output already holds a's result and line 5's.
    let done = [("a".to_string(), 1), ("line-5".to_string(), 1)].into_iter().collect();
    let ctl = protocol::BatchControl { done, results_only: true, total_lines: Some(5), ..Default::default() };
    let (lines, stats) = run_batch(&input, ctl, std::time::Duration::ZERO);
    assert_eq!(stats.skipped, 2, "{stats:?}");
    assert!(lines.iter().all(is_result), "only result lines (no stream chunks): {lines:?}");
    let mut ids: Vec<&str> = lines.iter().map(|l| l["custom_id"].as_str().unwrap()).collect();
    ids.sort();
    assert_eq!(ids, ["a", "b", "line-4"]);
    let dup = lines.iter().find(|l| l["custom_id"] == "a").unwrap();
    assert_eq!(dup["error"]["code"], "duplicate_custom_id", "the second `a` is still a duplicate: {dup}");
    assert_eq!(dup["error"]["line"], 2);
}

#[test]
fn batch_stop_cancels_what_generates_and_leaves_the_rest_unanswered() {
    // Two long requests generate (2 slots), two more wait; stopped once each of the two has
    // streamed 10 chunk lines (by then the other two, read at once, have long been queued).
    let long = |id: &str| {
        format!(
            r#"{{"custom_id":"{id}","messages":[{{"role":"user","content":"SAY:"}}],"max_tokens":400,"ignore_eos":true,"stream":true}}"#
        )
    };
    let input = [long("p"), long("q"), long("r"), long("s")].join("\n");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
    let mut w = StopsWhenGenerating::new(&stop, 15, 2, 10);
    let ctl = protocol::BatchControl { stop, results_only: false, ..Default::default() };
    let stats = run_batch_into(&input, ctl, std::time::Duration::from_millis(5), &ByteCodec, &mut w);
    let lines: Vec<Value> = parse_lines(&w.out).into_iter().filter(is_result).collect();
    assert_eq!(stats.stopped_by, Some(15));
    assert_eq!((stats.cancelled, stats.not_run), (2, 2), "{stats:?}");
    assert_eq!(lines.len(), 2, "{lines:?}");
    // Which two generate depends on which prompts the preparation threads finish first.
    let mut ids: Vec<&str> = lines.iter().map(|l| l["custom_id"].as_str().unwrap()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 2, "{lines:?}");
    for l in &lines {
        assert_eq!(l["error"]["code"], "cancelled", "{l}");
        assert!(["p", "q", "r", "s"].contains(&l["custom_id"].as_str().unwrap()), "{l}");
        assert!(l["error"]["message"].as_str().unwrap().contains("signal 15"), "{l}");
    }
    assert_eq!(stats.engine.cancelled, 4, "every open request is cancelled in the engine");
}

// ------------------------------------------------------- prompts prepared off the main thread

/// The output of a run, which opens `gate` once it has written a result line of `custom_id`
/// (and says whether it did, i.e. found the gate still shut then — not opened by
/// [`open_later`]'s backstop).
struct OpensGate {
    out: Vec<u8>,
    gate: std::sync::Arc<support::Gate>,
    custom_id: &'static str,
    opened: bool,
}

impl std::io::Write for OpensGate {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.out.extend_from_slice(buf);
        let key = format!("\"custom_id\":\"{}\"", self.custom_id);
        let done = self.out.split(|b| *b == b'\n').any(|l| {
            let l = String::from_utf8_lossy(l);
            l.contains(&key) && l.contains("\"response\"")
        });
        if done && !self.opened {
            self.opened = !self.gate.is_open();
            self.gate.open();
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Thinking off (the replies are the message content).
const NO_THINK: &str = r#""chat_template_kwargs":{"enable_thinking":false}"#;

/// Opens `gate` after 10 s whatever happens, so that a serve loop stuck at it fails its test
/// instead of hanging it.
fn open_later(gate: &std::sync::Arc<support::Gate>) {
    let gate = gate.clone();
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(10));
        gate.open();
    });
}

#[test]
fn a_prompt_being_prepared_holds_up_no_other_line() {
    // A batch file (or a stream on stdin) whose first request is a 200K-token conversation: its
    // rendering and encoding take a while, and meanwhile the lines after it start and finish.
    // Line 1's encoding waits at the gate until line 2's result line has been written.
    let gate = std::sync::Arc::new(support::Gate::default());
    open_later(&gate);
    let input = [
        format!(
            r#"{{"custom_id":"held","messages":[{{"role":"user","content":"SAY:held {}"}}],{NO_THINK}}}"#,
            support::HOLD
        ),
        format!(
            r#"{{"custom_id":"quick","messages":[{{"role":"user","content":"SAY:one two"}}],"stream":true,{NO_THINK}}}"#
        ),
    ]
    .join("\n");
    let runner = ScriptRunner::new(512, 2);
    let cfg = support::script_config(512);
    let engine = Engine::new(Box::new(runner), cfg).unwrap();
    let mut o = opts();
    o.ordered = false;
    let mut w = OpensGate { out: Vec::new(), gate: gate.clone(), custom_id: "quick", opened: false };
    let codec = support::GatedCodec(gate.clone());
    let input = std::io::BufReader::new(Cursor::new(input.into_bytes()));
    let stats = protocol::serve(input, &mut w, engine, &codec, &ChatMl, &o).unwrap();
    assert!(w.opened, "line 2 was not answered while line 1's prompt was being made");
    assert_eq!((stats.ok, stats.errors), (2, 0), "{stats:?}");
    let lines = parse_lines(&w.out);
    let (res, chunks) = results(&lines);
    assert_eq!(res.iter().map(|r| r["custom_id"].as_str().unwrap()).collect::<Vec<_>>(), ["quick", "held"]);
    assert_eq!(stream_concat(&chunks[0], "quick").1, "one two");
    assert_eq!(msg(&res[1])["content"], format!("held {}", support::HOLD));
}

#[test]
fn batch_stop_leaves_a_line_being_prepared_unanswered() {
    // `ornith batch` stopped while line 1's prompt is still being encoded and line 2 generates:
    // line 2 is cancelled, line 1 gets no line (a resume runs it) and never reaches the engine.
    // The stop comes once line 2 has streamed two chunk lines; line 1's encoding is let go once
    // the loop has answered line 2, i.e. after it stopped.
    let gate = std::sync::Arc::new(support::Gate::default());
    open_later(&gate);
    let input = [
        format!(r#"{{"custom_id":"held","messages":[{{"role":"user","content":"SAY:{}"}}]}}"#, support::HOLD),
        r#"{"custom_id":"long","messages":[{"role":"user","content":"SAY:"}],"max_tokens":400,"ignore_eos":true,"stream":true}"#
            .to_string(),
    ]
    .join("\n");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
    let mut w = StopsWhenGenerating::new(&stop, 2, 1, 2);
    w.gate = Some(gate.clone());
    let ctl = protocol::BatchControl { stop, results_only: false, ..Default::default() };
    let codec = support::GatedCodec(gate.clone());
    let stats = run_batch_into(&input, ctl, std::time::Duration::from_millis(5), &codec, &mut w);
    assert!(w.gate.is_none(), "the loop did not answer the cancelled line");
    assert_eq!(stats.stopped_by, Some(2));
    assert_eq!((stats.lines, stats.cancelled, stats.not_run), (2, 1, 1), "{stats:?}");
    let lines: Vec<Value> = parse_lines(&w.out).into_iter().filter(is_result).collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!((lines[0]["custom_id"].as_str(), lines[0]["error"]["code"].as_str()), (Some("long"), Some("cancelled")));
    assert_eq!(stats.engine.cancelled, 1, "the held request never reached the engine: {stats:?}");
}
