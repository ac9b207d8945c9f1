//! The serve loop: JSONL requests in, exactly one result line per input line out.
//!
//! Result line (OpenAI Batch output shape):
//! `{"id": "batch_req_…", "custom_id": …, "response": {"status_code": 200, "request_id": …,
//! "body": {…}}, "error": null}`, or on failure `{"id", "custom_id", "response": null,
//! "error": {"code", "message", "line"}}`. `custom_id` is the request's `custom_id` (or `id` for
//! bare bodies), else `line-<n>`. With `"stream": true` the result line is preceded by chunk
//! lines (`object` `chat.completion.chunk` or `text_completion`, plus `custom_id`), which the
//! deltas of concatenate to the final message.
//!
//! Policies (vLLM's where it has one):
//! * `max_tokens` absent → up to the end of the context window; `prompt + max_tokens` over the
//!   window → error `context_length_exceeded` (vLLM answers 400), as is a prompt that leaves no
//!   room for one token.
//! * Duplicate `custom_id` (explicit ids only) → error `duplicate_custom_id` for the later line
//!   (the OpenAI Batch API refuses such files; results keyed by id would be ambiguous).
//! * `completion_tokens` counts every sampled token, the eos token included.
//! * A panic while handling a line is caught and answered with `internal_error`.

use std::collections::{BTreeMap, HashSet};
use std::io::{self, BufRead, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::engine::Generator;
use crate::sampling::mix64;

use super::lines::{LineReader, RawLine};
use super::request::{self, Kind, LineError, Prompt, Request};
use super::split::{Delta, Message, Splitter};
use super::stop::StopStrings;
use super::toolcall::ToolCall;
use super::{GenerationDefaults, PromptRenderer, TextCodec};

#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// `model` field of responses.
    pub model_name: String,
    /// Write results in input order (buffering finished ones) instead of completion order.
    pub ordered: bool,
    /// Longer lines are skipped and answered with `line_too_long`.
    pub max_line_bytes: usize,
    pub defaults: GenerationDefaults,
    /// Unique per run: goes into response ids and default seeds.
    pub run_id: u64,
    /// No per-request log lines on stderr.
    pub quiet: bool,
}

impl ServeOptions {
    pub fn new(model_name: impl Into<String>, defaults: GenerationDefaults) -> Self {
        ServeOptions {
            model_name: model_name.into(),
            ordered: false,
            max_line_bytes: 16 << 20,
            defaults,
            run_id: fresh_run_id(),
            quiet: false,
        }
    }
}

/// A run id from the clock and the process id (distinct across runs; not cryptographic).
pub fn fresh_run_id() -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    mix64(nanos ^ ((std::process::id() as u64) << 32))
}

#[derive(Debug, Default, Clone, PartialEq)]
pub struct ServeStats {
    pub lines: u64,
    pub ok: u64,
    pub errors: u64,
}

/// Writes lines, in completion order or (ordered) in input order.
struct Emitter<W: Write> {
    w: W,
    ordered: bool,
    /// Next input line (1-based) whose lines may be written in ordered mode.
    next: u64,
    /// Ordered mode: lines of later requests, and whether their result line is in.
    pending: BTreeMap<u64, (Vec<String>, bool)>,
}

impl<W: Write> Emitter<W> {
    fn write_line(&mut self, s: &str) -> io::Result<()> {
        self.w.write_all(s.as_bytes())?;
        self.w.write_all(b"\n")
    }

    /// A chunk line of request `line`.
    fn chunk(&mut self, line: u64, s: String) -> io::Result<()> {
        if !self.ordered || line == self.next {
            self.write_line(&s)?;
            return self.w.flush();
        }
        self.pending.entry(line).or_default().0.push(s);
        Ok(())
    }

    /// The result line of request `line`.
    fn result(&mut self, line: u64, s: String) -> io::Result<()> {
        if !self.ordered {
            self.write_line(&s)?;
            return self.w.flush();
        }
        let e = self.pending.entry(line).or_default();
        e.0.push(s);
        e.1 = true;
        // Write every consecutive request from `next` on; an unfinished one writes its chunks
        // so far and stops the walk.
        while let Some(entry) = self.pending.get_mut(&self.next) {
            let lines = std::mem::take(&mut entry.0);
            let done = entry.1;
            for l in &lines {
                self.write_line(l)?;
            }
            if !done {
                break;
            }
            self.pending.remove(&self.next);
            self.next += 1;
        }
        self.w.flush()
    }
}

fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn error_line(opts: &ServeOptions, line: u64, custom_id: Option<&str>, e: &LineError) -> String {
    json!({
        "id": format!("batch_req_{:016x}_{line}", opts.run_id),
        "custom_id": custom_id.map_or_else(|| format!("line-{line}"), str::to_string),
        "response": null,
        "error": {"code": e.code, "message": e.message, "line": line},
    })
    .to_string()
}

/// Runs every request of `reader` through `gen`, writing JSONL to `writer`. Returns an error only
/// when reading the input or writing the output fails.
pub fn serve<R: BufRead, W: Write>(
    reader: R,
    writer: W,
    gen: &mut dyn Generator,
    codec: &dyn TextCodec,
    renderer: &dyn PromptRenderer,
    opts: &ServeOptions,
) -> anyhow::Result<ServeStats> {
    let mut lines = LineReader::new(reader, opts.max_line_bytes);
    let mut out = Emitter { w: writer, ordered: opts.ordered, next: 1, pending: BTreeMap::new() };
    let mut seen: HashSet<String> = HashSet::new();
    let mut stats = ServeStats::default();
    let mut line_no = 0u64;
    while let Some(raw) = lines.next_line()? {
        line_no += 1;
        stats.lines += 1;
        let mut io_err: Option<io::Error> = None;
        // Set by `handle_line` as soon as it is known, so that it survives a panic.
        let mut custom_id: Option<String> = None;
        let res = catch_unwind(AssertUnwindSafe(|| {
            handle_line(raw, line_no, gen, codec, renderer, opts, &mut seen, &mut custom_id, &mut |s| {
                if io_err.is_none() {
                    if let Err(e) = out.chunk(line_no, s) {
                        io_err = Some(e);
                    }
                }
            })
        }));
        if let Some(e) = io_err {
            return Err(e.into());
        }
        let result = match res {
            Ok(r) => r,
            Err(_) => Err(LineError::new("internal_error", "the engine panicked on this request; see stderr")),
        };
        let text = match result {
            Ok(body) => {
                stats.ok += 1;
                json!({
                    "id": format!("batch_req_{:016x}_{line_no}", opts.run_id),
                    "custom_id": custom_id.clone().unwrap_or_else(|| format!("line-{line_no}")),
                    "response": {"status_code": 200, "request_id": format!("req_{:016x}_{line_no}", opts.run_id), "body": body},
                    "error": null,
                })
                .to_string()
            }
            Err(e) => {
                stats.errors += 1;
                if !opts.quiet {
                    eprintln!("[ornith] line {line_no}: {}: {}", e.code, e.message);
                }
                error_line(opts, line_no, custom_id.as_deref(), &e)
            }
        };
        out.result(line_no, text)?;
    }
    if !opts.quiet {
        eprintln!("[ornith] done: {} lines, {} ok, {} errors", stats.lines, stats.ok, stats.errors);
    }
    Ok(stats)
}

type Sink<'s> = &'s mut dyn FnMut(String);

/// Parses and runs one line. Returns the custom_id (when known) and the response body or error.
#[allow(clippy::too_many_arguments)]
fn handle_line(
    raw: RawLine,
    line: u64,
    gen: &mut dyn Generator,
    codec: &dyn TextCodec,
    renderer: &dyn PromptRenderer,
    opts: &ServeOptions,
    seen: &mut HashSet<String>,
    cid: &mut Option<String>,
    sink: Sink<'_>,
) -> Result<Value, LineError> {
    let bytes = match raw {
        RawLine::Bytes(b) => b,
        RawLine::TooLong { len, head } => {
            *cid = request::scan_custom_id(&String::from_utf8_lossy(&head));
            let msg = format!(
                "the line has {len} bytes, over the limit of {} (--max-line-bytes); it was skipped",
                opts.max_line_bytes
            );
            return Err(LineError::new("line_too_long", msg));
        }
    };
    let text = match std::str::from_utf8(&bytes) {
        Ok(t) => t,
        Err(e) => {
            *cid = request::scan_custom_id(&String::from_utf8_lossy(&bytes));
            let msg = format!("the line is not valid UTF-8 (byte {})", e.valid_up_to());
            return Err(LineError::new("invalid_utf8", msg));
        }
    };
    if text.trim().is_empty() {
        return Err(LineError::new("empty_line", "blank line; expected a JSON request"));
    }
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            *cid = request::scan_custom_id(text);
            return Err(LineError::new("invalid_json", format!("malformed JSON: {e}")));
        }
    };
    *cid = request::custom_id_of(&value);
    let custom_id = cid.clone();
    if let Some(id) = &custom_id {
        if !seen.insert(id.clone()) {
            let msg = format!("custom_id {id:?} was already used by an earlier line; ids must be unique");
            return Err(LineError::new("duplicate_custom_id", msg));
        }
    }
    let seed = mix64(opts.run_id ^ mix64(line));
    let req = request::parse(&value, &opts.defaults, seed)?;
    if !opts.quiet {
        for w in &req.warnings {
            eprintln!("[ornith] line {line}: warning: {w}");
        }
    }
    let started = Instant::now();
    let res = run(&req, line, custom_id.as_deref(), gen, codec, renderer, opts, sink, started);
    if let (Ok(body), false) = (&res, opts.quiet) {
        let u = &body["usage"];
        // One output token has no decode step to time (`decode_tok_s` is null).
        let decode = match body["decode_tok_s"].as_f64() {
            Some(r) => format!("decode {r} tok/s"),
            None => "no decode step".to_string(),
        };
        eprintln!(
            "[ornith] line {line}{}: {}+{} tokens, {}, ttft {} ms, {decode}",
            custom_id.as_deref().map(|c| format!(" ({c})")).unwrap_or_default(),
            u["prompt_tokens"],
            u["completion_tokens"],
            body["choices"][0]["finish_reason"].as_str().unwrap_or("?"),
            body["ttft_ms"],
        );
    }
    res
}

/// Why generation ended.
#[derive(Debug, Clone, PartialEq)]
enum Finish {
    /// An eos / stop token (its id) or a stop string.
    StopToken(u32),
    StopString(String),
    Length,
}

#[allow(clippy::too_many_arguments)]
fn run(
    req: &Request,
    line: u64,
    custom_id: Option<&str>,
    gen: &mut dyn Generator,
    codec: &dyn TextCodec,
    renderer: &dyn PromptRenderer,
    opts: &ServeOptions,
    sink: Sink<'_>,
    started: Instant,
) -> Result<Value, LineError> {
    // The template's errors already say "chat template: …".
    let tmpl = |e: anyhow::Error| LineError::new("invalid_request", format!("{e:#}"));
    let tok = |e: anyhow::Error| LineError::new("tokenizer_error", format!("{e:#}"));
    let (prompt, thinking) = match &req.kind {
        Kind::Chat { messages, tools, kwargs, .. } => {
            let text = renderer.render(messages, tools.as_ref(), true, kwargs).map_err(tmpl)?;
            // The template leaves `<think>\n` open when thinking is on.
            let thinking = text.trim_end_matches(['\n', ' ']).ends_with("<think>");
            (codec.encode(&text).map_err(tok)?, thinking)
        }
        Kind::Completion { prompt: Prompt::Text(t) } => (codec.encode(t).map_err(tok)?, false),
        Kind::Completion { prompt: Prompt::Ids(ids) } => {
            let v = codec.vocab_size();
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= v) {
                return Err(LineError::invalid(format!("token id {bad} is outside the vocabulary (size {v})")));
            }
            (ids.clone(), false)
        }
    };
    if prompt.is_empty() {
        return Err(LineError::invalid("the prompt encodes to no tokens"));
    }
    let window = gen.max_context();
    let n_prompt = prompt.len();
    if n_prompt >= window {
        return Err(LineError::new(
            "context_length_exceeded",
            format!(
                "This model's maximum context length is {window} tokens. However, your request has {n_prompt} input tokens, which leaves no room for output. Please reduce the length of the input."
            ),
        ));
    }
    let room = (window - n_prompt) as u64;
    let max_tokens = match req.max_tokens {
        Some(m) if m > room => {
            return Err(LineError::new(
                "context_length_exceeded",
                format!(
                    "'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum context length is {window} tokens and your request has {n_prompt} input tokens ({m} > {window} - {n_prompt})."
                ),
            ))
        }
        Some(m) => m,
        None => room,
    };

    let chat = matches!(req.kind, Kind::Chat { .. });
    let (tools, parse_tools) = match &req.kind {
        Kind::Chat { tools, parse_tools, .. } => (tools.as_ref(), *parse_tools),
        _ => (None, false),
    };
    let created = now_unix();
    let resp_id = format!("{}-{:016x}-{line}", if chat { "chatcmpl" } else { "cmpl" }, opts.run_id);
    let mut chunker = Chunker {
        chat,
        id: &resp_id,
        created,
        model: &opts.model_name,
        custom_id,
        line,
        sink,
        n_calls: 0,
        run_id: opts.run_id,
    };
    if req.stream && chat {
        chunker.send(json!({"role": "assistant", "content": ""}), None);
    }

    let stops = StopStrings::new(&req.stop);
    let eos: &[u32] = if req.ignore_eos { &[] } else { &opts.defaults.eos_token_ids };
    let mut detok = codec.stream(true);
    let mut splitter = Splitter::new(thinking, tools, parse_tools);
    let mut text = String::new();
    let mut sent = 0usize; // bytes of `text` fed to the splitter
    let mut msg = Message::default();
    let mut raw_text = String::new(); // completions: the text sent so far
    let mut deltas: Vec<Delta> = Vec::new();
    let engine = |e: anyhow::Error| LineError::new("engine_error", format!("{e:#}"));

    let t_prefill = Instant::now();
    let mut next = gen.prefill(&prompt, &req.sampling).map_err(engine)?;
    let t_first = Instant::now();
    let mut n_out: u64 = 0;
    let finish = loop {
        n_out += 1;
        if eos.contains(&next) || req.stop_token_ids.contains(&next) {
            break Finish::StopToken(next);
        }
        let old = text.len();
        if let Some(piece) = detok.push(next).map_err(tok)? {
            text.push_str(&piece);
        }
        if let Some((at, s)) = stops.find(&text, old) {
            let s = s.to_string();
            text.truncate(at);
            break Finish::StopString(s);
        }
        if n_out >= max_tokens {
            break Finish::Length;
        }
        if req.stream {
            let safe = text.len() - stops.holdback(&text);
            if safe > sent {
                let fresh = &text[sent..safe];
                sent = safe;
                if chat {
                    splitter.feed(fresh, &mut deltas);
                    chunker.deltas(&mut deltas, &mut msg);
                } else {
                    raw_text.push_str(fresh);
                    chunker.send(Value::String(fresh.to_string()), None);
                }
            }
        }
        next = gen.decode(next, &req.sampling).map_err(engine)?;
    };
    let t_end = Instant::now();
    if !matches!(finish, Finish::StopString(_)) {
        let old = text.len();
        if let Some(rest) = detok.flush().map_err(tok)? {
            text.push_str(&rest);
            if let Some((at, _)) = stops.find(&text, old) {
                text.truncate(at);
            }
        }
    }
    let rest = &text[sent.min(text.len())..];
    let text_out;
    let mut message = Value::Null;
    if chat {
        splitter.feed(rest, &mut deltas);
        splitter.finish(&mut deltas);
        if req.stream {
            chunker.deltas(&mut deltas, &mut msg);
        } else {
            let mut n = 0;
            for d in deltas.drain(..) {
                if let Delta::ToolCall(_) = d {
                    n += 1;
                }
                msg.add(&d);
            }
            chunker.n_calls = n;
        }
        message = message_json(&msg, opts.run_id, line);
        text_out = String::new();
    } else {
        if req.stream && !rest.is_empty() {
            chunker.send(Value::String(rest.to_string()), None);
        }
        raw_text.push_str(rest);
        text_out = raw_text;
    }

    let (finish_reason, stop_reason) = match &finish {
        _ if chat && !msg.tool_calls.is_empty() => ("tool_calls", Value::Null),
        Finish::StopToken(t) => ("stop", if eos.contains(t) { Value::Null } else { json!(t) }),
        Finish::StopString(s) => ("stop", json!(s)),
        Finish::Length => ("length", Value::Null),
    };
    if req.stream {
        chunker.send(if chat { json!({}) } else { Value::String(String::new()) }, Some(finish_reason));
    }

    let prefill_s = (t_first - t_prefill).as_secs_f64();
    let decode_s = (t_end - t_first).as_secs_f64();
    let rate = |n: f64, s: f64| if s > 0.0 && n > 0.0 { json!((n / s * 10.0).round() / 10.0) } else { Value::Null };
    let ttft_ms = ((t_first - started).as_secs_f64() * 1e4).round() / 10.0;
    let usage = json!({"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt as u64 + n_out});
    let body = if chat {
        json!({
            "id": resp_id, "object": "chat.completion", "created": created, "model": opts.model_name,
            "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish_reason, "stop_reason": stop_reason}],
            "usage": usage,
            "ttft_ms": ttft_ms, "prefill_tok_s": rate(n_prompt as f64, prefill_s), "decode_tok_s": rate(n_out as f64 - 1.0, decode_s),
        })
    } else {
        json!({
            "id": resp_id, "object": "text_completion", "created": created, "model": opts.model_name,
            "choices": [{"index": 0, "text": text_out, "logprobs": null, "finish_reason": finish_reason, "stop_reason": stop_reason}],
            "usage": usage,
            "ttft_ms": ttft_ms, "prefill_tok_s": rate(n_prompt as f64, prefill_s), "decode_tok_s": rate(n_out as f64 - 1.0, decode_s),
        })
    };
    let mut body = body;
    if !req.warnings.is_empty() {
        body["warnings"] = json!(req.warnings);
    }
    Ok(body)
}

/// `call_` + 24 hex digits, unique per (run, line, index).
fn call_id(run_id: u64, line: u64, index: usize) -> String {
    let a = mix64(run_id ^ mix64(line.wrapping_mul(0x1_0000_0001).wrapping_add(index as u64)));
    let b = mix64(a);
    format!("call_{:016x}{:08x}", a, b as u32)
}

fn tool_call_json(c: &ToolCall, id: String) -> Value {
    json!({"id": id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
}

/// The final assistant message. `content` is null when there is no text and there are tool
/// calls (OpenAI's shape); `reasoning` / `reasoning_content` (both spellings, for vLLM clients old
/// and new) are null when the model did not think.
fn message_json(m: &Message, run_id: u64, line: u64) -> Value {
    let content = if m.content.is_empty() && !m.tool_calls.is_empty() { Value::Null } else { json!(m.content) };
    let reasoning = if m.reasoning.is_empty() { Value::Null } else { json!(m.reasoning) };
    let calls: Vec<Value> =
        m.tool_calls.iter().enumerate().map(|(i, c)| tool_call_json(c, call_id(run_id, line, i))).collect();
    json!({"role": "assistant", "content": content, "reasoning": reasoning, "reasoning_content": reasoning, "tool_calls": calls})
}

/// Builds and sends chunk lines.
struct Chunker<'a, 's> {
    chat: bool,
    id: &'a str,
    created: u64,
    model: &'a str,
    custom_id: Option<&'a str>,
    line: u64,
    sink: Sink<'s>,
    n_calls: usize,
    run_id: u64,
}

impl Chunker<'_, '_> {
    /// One chunk: `delta` for chat, text for completions.
    fn send(&mut self, delta: Value, finish: Option<&str>) {
        let custom_id = self.custom_id.map_or_else(|| format!("line-{}", self.line), str::to_string);
        let v = if self.chat {
            json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}], "custom_id": custom_id})
        } else {
            json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "text": delta, "logprobs": null, "finish_reason": finish}], "custom_id": custom_id})
        };
        (self.sink)(v.to_string());
    }

    /// Sends pending chat deltas and records them into `msg`.
    fn deltas(&mut self, deltas: &mut Vec<Delta>, msg: &mut Message) {
        for d in deltas.drain(..) {
            let delta = match &d {
                Delta::Reasoning(s) => json!({"reasoning": s, "reasoning_content": s}),
                Delta::Content(s) => json!({"content": s}),
                Delta::ToolCall(c) => {
                    let i = self.n_calls;
                    self.n_calls += 1;
                    let mut call = tool_call_json(c, call_id(self.run_id, self.line, i));
                    call.as_object_mut().unwrap().insert("index".into(), json!(i));
                    json!({"tool_calls": [call]})
                }
            };
            msg.add(&d);
            self.send(delta, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(e: &Emitter<Vec<u8>>) -> Vec<String> {
        String::from_utf8(e.w.clone()).unwrap().lines().map(str::to_string).collect()
    }

    #[test]
    fn ordered_emitter_buffers_out_of_order_completions() {
        let mut e = Emitter { w: Vec::new(), ordered: true, next: 1, pending: BTreeMap::new() };
        // Request 2 streams and finishes before request 1.
        e.chunk(2, "2a".into()).unwrap();
        e.result(2, "2r".into()).unwrap();
        assert!(lines(&e).is_empty());
        e.chunk(1, "1a".into()).unwrap();
        assert_eq!(lines(&e), ["1a"]);
        // Request 3 is half streamed when 1 finishes: 1, then 2, then 3's chunk so far.
        e.chunk(3, "3a".into()).unwrap();
        e.result(1, "1r".into()).unwrap();
        assert_eq!(lines(&e), ["1a", "1r", "2a", "2r", "3a"]);
        e.chunk(3, "3b".into()).unwrap();
        e.result(3, "3r".into()).unwrap();
        assert_eq!(lines(&e), ["1a", "1r", "2a", "2r", "3a", "3b", "3r"]);
        assert!(e.pending.is_empty());
    }

    #[test]
    fn unordered_emitter_writes_at_once() {
        let mut e = Emitter { w: Vec::new(), ordered: false, next: 1, pending: BTreeMap::new() };
        e.result(2, "2r".into()).unwrap();
        e.result(1, "1r".into()).unwrap();
        assert_eq!(lines(&e), ["2r", "1r"]);
    }
}
