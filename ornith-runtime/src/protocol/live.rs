//! One request in flight: its prompt, and what turns the engine's tokens into text, stream chunks
//! and the final body (detokenizer, stop strings, the reasoning / tool-call splitter).
//!
//! Policies (vLLM's where it has one):
//! * `max_tokens` absent → up to the end of the context window; `prompt + max_tokens` over the
//!   window → error `context_length_exceeded` (vLLM answers 400), as is a prompt that leaves no
//!   room for one token.
//! * `completion_tokens` counts every sampled token, the eos token included.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::engine::{Constraint, Forcing, GenRequest, Grammar, SamplingParams, Trigger};
use crate::logprobs::TokenLogprobs;
use crate::sampling::mix64;

use super::request::{Kind, LineError, Prompt, Request, ToolForce};
use super::split::{Delta, Message, Splitter};
use super::stop::StopStrings;
use super::structured::Grammars;
use super::toolcall::ToolCall;
use super::{PromptRenderer, TextCodec, TokenStream};

/// Why generation ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Finish {
    /// An eos / stop token (its id) or a stop string.
    StopToken(u32),
    StopString(String),
    Length,
}

fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// `call_` + 24 hex digits, unique per (run, line, choice, index).
fn call_id(run_id: u64, line: u64, choice: usize, index: usize) -> String {
    let k = index as u64 + ((choice as u64) << 32);
    let a = mix64(run_id ^ mix64(line.wrapping_mul(0x1_0000_0001).wrapping_add(k)));
    let b = mix64(a);
    format!("call_{:016x}{:08x}", a, b as u32)
}

fn tool_call_json(c: &ToolCall, id: String) -> Value {
    json!({"id": id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
}

/// The final assistant message. `content` is null when there is no text and there are tool
/// calls (OpenAI's shape); `reasoning` / `reasoning_content` (both spellings, for vLLM clients old
/// and new) are null when the model did not think.
fn message_json(m: &Message, run_id: u64, line: u64, choice: usize) -> Value {
    let content = if m.content.is_empty() && !m.tool_calls.is_empty() { Value::Null } else { json!(m.content) };
    let reasoning = if m.reasoning.is_empty() { Value::Null } else { json!(m.reasoning) };
    let calls: Vec<Value> =
        m.tool_calls.iter().enumerate().map(|(i, c)| tool_call_json(c, call_id(run_id, line, choice, i))).collect();
    json!({"role": "assistant", "content": content, "reasoning": reasoning, "reasoning_content": reasoning, "tool_calls": calls})
}

/// Builds stream chunks (collected in `out` for the caller to send).
struct Chunker {
    chat: bool,
    id: String,
    created: u64,
    model: String,
    /// The JSONL front end's `custom_id` of every chunk (the HTTP server has none).
    custom_id: Option<String>,
    line: u64,
    run_id: u64,
    out: Vec<Value>,
}

impl Chunker {
    /// One chunk of choice `index`: `delta` for chat, text for completions, with the
    /// log-probabilities of the tokens since the choice's previous chunk (null when not asked).
    fn send(&mut self, index: usize, delta: Value, logprobs: Value, finish: Option<&str>) {
        let mut v = if self.chat {
            json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})
        } else {
            json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                   "choices": [{"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}]})
        };
        if let Some(c) = &self.custom_id {
            v["custom_id"] = json!(c);
        }
        self.out.push(v);
    }
}

/// One choice of a request: a sequence of its own, and what turns its tokens into text.
struct Choice<'a> {
    index: usize,
    stops: StopStrings,
    detok: Box<dyn TokenStream + 'a>,
    splitter: Splitter,
    text: String,
    /// Bytes of `text` already streamed (fed to the splitter).
    sent: usize,
    msg: Message,
    /// Completions: the text streamed so far.
    raw_text: String,
    deltas: Vec<Delta>,
    /// Tool calls streamed so far (their `index` in the chunks).
    n_calls: usize,
    n_out: u64,
    /// Prompt tokens the prefix cache served (not prefilled).
    n_cached: usize,
    finish: Option<Finish>,
    /// The choice's entry of the body's `choices`, once it has ended and its last chunks are
    /// out.
    result: Option<Value>,
    /// With `logprobs`: the next token's (from the engine's `Logprobs` event), every output
    /// token's, how many of those the chunks have carried, and the text offset reached by them
    /// (completions' `text_offset`).
    lp_next: Option<Box<TokenLogprobs>>,
    lps: Vec<TokenLogprobs>,
    lp_sent: usize,
    lp_offset: usize,
}

impl Choice<'_> {
    /// The log-probabilities of the tokens no chunk has carried yet, in the API's shape (null
    /// without `logprobs`).
    fn unsent_logprobs(&mut self, codec: &dyn TextCodec, chat: bool, on: bool) -> Value {
        if !on {
            return Value::Null;
        }
        let part = &self.lps[self.lp_sent..];
        self.lp_sent = self.lps.len();
        if chat {
            chat_logprobs(codec, part)
        } else {
            completion_logprobs(codec, part, &mut self.lp_offset)
        }
    }

    /// Sends pending chat deltas and records them into the message; the first carries the
    /// log-probabilities not yet sent.
    fn send_deltas(&mut self, c: &mut Chunker, codec: &dyn TextCodec, lp_on: bool) {
        let deltas = std::mem::take(&mut self.deltas);
        for d in deltas {
            let delta = match &d {
                Delta::Reasoning(s) => json!({"reasoning": s, "reasoning_content": s}),
                Delta::Content(s) => json!({"content": s}),
                Delta::ToolCall(call) => {
                    let i = self.n_calls;
                    self.n_calls += 1;
                    let mut call = tool_call_json(call, call_id(c.run_id, c.line, self.index, i));
                    call.as_object_mut().expect("a JSON object").insert("index".into(), json!(i));
                    json!({"tool_calls": [call]})
                }
            };
            self.msg.add(&d);
            let lp = self.unsent_logprobs(codec, true, lp_on);
            c.send(self.index, delta, lp, None);
        }
    }
}

/// A log-probability as a JSON number: the shortest decimal that reads back as the f32
/// (`-0.104`, not the f64 widening `-0.10400000214576721`).
fn lp_json(x: f32) -> Value {
    let d = x.to_string().parse::<f64>().unwrap_or(x as f64);
    serde_json::Number::from_f64(d).map_or(Value::Null, Value::Number)
}

/// A token's text and bytes (the text lossy where the token ends inside a character).
fn token_text(codec: &dyn TextCodec, id: u32) -> (String, Vec<u8>) {
    let b = codec.token_bytes(id);
    (String::from_utf8_lossy(&b).into_owned(), b)
}

/// Chat's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
/// bytes}]}], "refusal": null}` (OpenAI's shape).
fn chat_logprobs(codec: &dyn TextCodec, lps: &[TokenLogprobs]) -> Value {
    let entry = |id: u32, lp: f32| {
        let (t, b) = token_text(codec, id);
        json!({"token": t, "logprob": lp_json(lp), "bytes": b})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = l.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Completions' `logprobs`: `{tokens, token_logprobs, top_logprobs: [{token: logprob}],
/// text_offset}` (OpenAI's legacy shape; `top_logprobs` holds the top `k` and the output token,
/// so up to `k + 1` entries). `offset` is where the first token's text starts (characters of
/// the tokens before it), advanced past these.
fn completion_logprobs(codec: &dyn TextCodec, lps: &[TokenLogprobs], offset: &mut usize) -> Value {
    let (mut tokens, mut lp, mut top, mut at) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for l in lps {
        let t = token_text(codec, l.token).0;
        at.push(*offset);
        *offset += t.chars().count();
        let mut m = serde_json::Map::new();
        for &(id, p) in &l.top {
            m.insert(token_text(codec, id).0, lp_json(p));
        }
        m.insert(t.clone(), lp_json(l.logprob));
        tokens.push(t);
        lp.push(lp_json(l.logprob));
        top.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": lp, "top_logprobs": top, "text_offset": at})
}

/// Where a request stands after one of its choices' events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// The choice goes on.
    Running,
    /// The choice has ended (its sequence can be cancelled); others go on.
    ChoiceDone,
    /// Every choice has ended: [`Live::body`] answers the request.
    Done,
}

/// What a front end does with a choice's event's outcome: once the choice has ended, `end_choice`
/// (cancel its sequence: a no-op when the engine ended it); returns the request's end — every
/// choice ended, or the error that ends them all — or None while it goes on.
pub fn settle(progress: Result<Progress, LineError>, end_choice: impl FnOnce()) -> Option<Result<(), LineError>> {
    match progress {
        Ok(Progress::Running) => None,
        Ok(Progress::ChoiceDone) => {
            end_choice();
            None
        }
        Ok(Progress::Done) => Some(Ok(())),
        Err(e) => Some(Err(e)),
    }
}

/// A request between its first and its last token.
pub struct Live<'a> {
    req: Request,
    codec: &'a dyn TextCodec,
    chunker: Chunker,
    eos: Vec<u32>,
    choices: Vec<Choice<'a>>,
    n_prompt: usize,
    max_tokens: u64,
    started: Instant,
    submitted: Instant,
    /// The first token of any choice.
    first: Option<Instant>,
}

/// The fill-in-the-middle tokens, in the order Qwen2.5-Coder and Qwen3(-Coder) are trained on
/// ("prefix-suffix-middle"): `<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>`, then
/// the model writes the middle (the QwenLM/Qwen2.5-Coder README, "file-level" and "repository
/// level code infilling").
pub const FIM_TOKENS: [&str; 3] = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"];

/// Tokens that also end a fill-in-the-middle completion: the README's examples stop on every FIM
/// and repository token, since the model may go on to another file or another hole after the
/// middle.
pub const FIM_STOP_TOKENS: [&str; 6] =
    ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"];

/// The prompt tokens of a fill-in-the-middle request, or `unsupported_parameter` when the
/// tokenizer has no FIM tokens. Prefix and suffix are encoded apart, so that no token spans a
/// FIM marker.
pub fn fim_prompt(codec: &dyn TextCodec, prefix: &str, suffix: &str) -> Result<Vec<u32>, LineError> {
    let [Some(p), Some(s), Some(m)] = FIM_TOKENS.map(|t| codec.token_id(t)) else {
        return Err(LineError::new(
            "unsupported_parameter",
            format!(
                "`suffix` (fill-in-the-middle) needs the tokenizer's {} tokens; this checkpoint's tokenizer lacks them",
                FIM_TOKENS.join(", ")
            ),
        ));
    };
    let tok = LineError::tokenizer;
    let mut ids = vec![p];
    ids.extend(codec.encode(prefix).map_err(tok)?);
    ids.push(s);
    ids.extend(codec.encode(suffix).map_err(tok)?);
    ids.push(m);
    Ok(ids)
}

/// What opens a tool call in the chat template's format.
const TOOL_CALL_OPEN: &str = "<tool_call>";

/// What ends the model's thinking.
const THINK_CLOSE: &str = "</think>";

/// What the chat template writes between `</think>` and the answer.
const ANSWER_GAP: &str = "\n\n";

/// What the Qwen3 technical report (section 4.3, "Thinking Budget") inserts when the reasoning
/// reaches the budget; the model then answers from the reasoning so far.
pub const STOP_THINKING: &str =
    "\n\nConsidering the limited time by the user, I have to give the solution based on the thinking directly now.\n</think>";

/// The request's forced tokens ([`Forcing`]), in order:
/// * a thinking budget (`thinking_budget`, Anthropic's `budget_tokens`; only when the prompt
///   leaves the model thinking): once the output holds that many tokens, unless the model has
///   closed its thinking itself, [`STOP_THINKING`] (the template's `\n\n` after `</think>` is
///   the model's, as when it closes its thinking itself);
/// * a forced tool call: the start of a call in the chat template's format (an assistant turn
///   that is a call renders as `<tool_call>\n<function=NAME>\n<parameter=…`), the model writing
///   the rest — for `required` `=` and the function's name too. From the first token, or, when the
///   prompt leaves the model thinking, right after `</think>` (then `\n\n`, as the template
///   writes it): the reasoning stays the model's own;
/// * `response_format` json with thinking on: `\n\n` right after `</think>`, where the
///   constrained answer starts (a grammar that starts at `</think>` would refuse the blank
///   line the model is trained to write there).
fn forcings(codec: &dyn TextCodec, req: &Request, thinking: bool) -> Result<Vec<Forcing>, LineError> {
    let tok = LineError::tokenizer;
    let Kind::Chat { force, .. } = &req.kind else { return Ok(Vec::new()) };
    let mut plans = Vec::new();
    let close = if thinking { codec.encode(THINK_CLOSE).map_err(tok)? } else { Vec::new() };
    if let (Some(budget), true) = (req.thinking_budget, thinking) {
        let tokens = codec.encode(STOP_THINKING).map_err(tok)?;
        plans.push(Forcing { when: Trigger::Count { tokens: budget, unless: close.clone() }, tokens });
    }
    if let Some(f) = force {
        let head = match f {
            // Up to a pre-token boundary of the tokenizer's split: `<function` then `=NAME` is
            // how a call's text is cut, so the model writes `=` and the name as it would unforced.
            ToolForce::Any => format!("{TOOL_CALL_OPEN}\n<function"),
            ToolForce::Named(n) => format!("{TOOL_CALL_OPEN}\n<function={n}>\n"),
        };
        let text = if thinking { format!("\n\n{head}") } else { head };
        plans.push(Forcing { when: Trigger::After(close.clone()), tokens: codec.encode(&text).map_err(tok)? });
    }
    if req.json_output.is_some() && thinking {
        plans.push(Forcing { when: Trigger::After(close), tokens: codec.encode(ANSWER_GAP).map_err(tok)? });
    }
    Ok(plans)
}

/// A `response_format` json request's constraint: the JSON is the answer, so with thinking on it
/// starts after the model's `</think>` and the `\n\n` forced after it ([`forcings`]), as the
/// template writes an answer; with tools offered the answer may be a call instead, whose marker
/// is the escape.
fn constraint(
    codec: &dyn TextCodec,
    req: &Request,
    thinking: bool,
    grammar: Box<dyn Grammar>,
) -> Result<Constraint, LineError> {
    let tok = LineError::tokenizer;
    let after = if thinking {
        [codec.encode(THINK_CLOSE).map_err(tok)?, codec.encode(ANSWER_GAP).map_err(tok)?].concat()
    } else {
        Vec::new()
    };
    let escape = match &req.kind {
        Kind::Chat { parse_tools: true, .. } => codec.encode(TOOL_CALL_OPEN).map_err(tok)?,
        _ => Vec::new(),
    };
    Ok(Constraint { after, grammar, escape })
}

/// What the front end needs of the engine to start a request.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Longest prompt + output.
    pub window: usize,
    /// Ids the tokenizer has.
    pub vocab: usize,
    /// The end-of-sequence id grammars end on (`response_format` json; None: no structured
    /// output).
    pub eos: Option<u32>,
}

/// A request's prompt made ready by a preparation thread: its tokens, whether the prompt leaves
/// the model thinking, and its grammar (`response_format` json).
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub thinking: bool,
    pub grammar: Option<Box<dyn Grammar>>,
}

/// [`prompt_tokens`], and the grammar of a `response_format` json request (compiled here, off
/// the thread that streams).
pub fn prepare(
    req: &Request,
    codec: &dyn TextCodec,
    renderer: &dyn PromptRenderer,
    limits: &Limits,
    grammars: &Grammars,
) -> Result<Prepared, LineError> {
    let (prompt, thinking) = prompt_tokens(req, codec, renderer, limits)?;
    let grammar = match &req.json_output {
        None => None,
        Some(j) => {
            let eos = limits.eos.ok_or_else(|| {
                LineError::new("unsupported_parameter", "`response_format` json needs an end-of-sequence token")
            })?;
            Some(grammars.json(codec, eos, j.schema.as_ref())?)
        }
    };
    Ok(Prepared { prompt, thinking, grammar })
}

/// Threads that render and tokenize prompts beside the thread that turns the engine's tokens into
/// output (both front ends; the tokenizer spreads one long encode over threads of its own). Two,
/// so that a short prompt read after a long one is not queued behind it.
pub const PREPARE_THREADS: usize = 2;

/// The prompt tokens of `req` (its messages rendered by the chat template, or its completion
/// prompt) and whether the rendered prompt leaves the model thinking.
pub fn prompt_tokens(
    req: &Request,
    codec: &dyn TextCodec,
    renderer: &dyn PromptRenderer,
    limits: &Limits,
) -> Result<(Vec<u32>, bool), LineError> {
    // The template's errors already say "chat template: …".
    let tmpl = |e: anyhow::Error| LineError::new("invalid_request", format!("{e:#}"));
    let tok = LineError::tokenizer;
    let (prompt, thinking) = match &req.kind {
        Kind::Chat { messages, tools, kwargs, .. } => {
            let text = renderer.render(messages, tools.as_ref(), true, kwargs).map_err(tmpl)?;
            // The template leaves `<think>\n` open when thinking is on.
            let thinking = text.trim_end_matches(['\n', ' ']).ends_with("<think>");
            (codec.encode(&text).map_err(tok)?, thinking)
        }
        Kind::Completion { prompt: Prompt::Text(t) } => (codec.encode(t).map_err(tok)?, false),
        Kind::Completion { prompt: Prompt::Fim { prefix, suffix } } => (fim_prompt(codec, prefix, suffix)?, false),
        Kind::Completion { prompt: Prompt::Ids(ids) } => {
            let v = limits.vocab;
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= v) {
                return Err(LineError::invalid(format!("token id {bad} is outside the vocabulary (size {v})")));
            }
            (ids.clone(), false)
        }
    };
    if prompt.is_empty() {
        return Err(LineError::invalid("the prompt encodes to no tokens"));
    }
    Ok((prompt, thinking))
}

impl<'a> Live<'a> {
    /// Checks `req`'s prompt (what [`prompt_tokens`] gave for it) against the window, and returns
    /// the engine's requests — one per choice (`n`), choice `i` seeded with `seed + i` — with the
    /// state that will turn their tokens into the result. `line` identifies the request within
    /// the run (response and tool-call ids); `custom_id`, when given, goes into every chunk (the
    /// JSONL front end's). Both front ends make the prompt on [`PREPARE_THREADS`] threads of
    /// their own, so that a long prompt's encoding holds up no stream.
    #[allow(clippy::too_many_arguments)]
    pub fn begin(
        mut req: Request,
        Prepared { prompt, thinking, grammar }: Prepared,
        line: u64,
        custom_id: Option<&str>,
        codec: &'a dyn TextCodec,
        limits: &Limits,
        eos_ids: &[u32],
        model_name: &str,
        run_id: u64,
        started: Instant,
    ) -> Result<(Vec<GenRequest>, Live<'a>), LineError> {
        if let Kind::Completion { prompt: Prompt::Fim { .. } } = &req.kind {
            req.stop_token_ids.extend(FIM_STOP_TOKENS.iter().filter_map(|t| codec.token_id(t)));
        }
        let window = limits.window;
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
            Kind::Chat { tools, parse_tools, .. } => (tools.clone(), *parse_tools),
            _ => (None, false),
        };
        let resp_id = format!("{}-{:016x}-{line}", if chat { "chatcmpl" } else { "cmpl" }, run_id);
        let mut chunker = Chunker {
            chat,
            id: resp_id,
            created: now_unix(),
            model: model_name.to_string(),
            custom_id: custom_id.map(str::to_string),
            line,
            run_id,
            out: Vec::new(),
        };
        let n = req.n.max(1);
        if req.stream && chat {
            for i in 0..n {
                chunker.send(i, json!({"role": "assistant", "content": ""}), Value::Null, None);
            }
        }
        let eos: Vec<u32> = if req.ignore_eos { Vec::new() } else { eos_ids.to_vec() };
        let mut stop_ids = eos.clone();
        stop_ids.extend_from_slice(&req.stop_token_ids);
        let force = forcings(codec, &req, thinking)?;
        let constraint = grammar.map(|g| constraint(codec, &req, thinking, g)).transpose()?;
        let gens = (0..n)
            .map(|i| {
                let params = SamplingParams { seed: req.sampling.seed.wrapping_add(i as u64), ..req.sampling };
                GenRequest {
                    prompt: prompt.clone(),
                    max_tokens,
                    params,
                    penalties: req.penalties,
                    stop_ids: stop_ids.clone(),
                    force: force.clone(),
                    logprobs: req.logprobs,
                    constraint: constraint.clone(),
                }
            })
            .collect();
        let choices = (0..n)
            .map(|index| Choice {
                index,
                stops: StopStrings::new(&req.stop),
                detok: codec.stream(true),
                splitter: Splitter::new(thinking, tools.as_ref(), parse_tools),
                text: String::new(),
                sent: 0,
                msg: Message::default(),
                raw_text: String::new(),
                deltas: Vec::new(),
                n_calls: 0,
                n_out: 0,
                n_cached: 0,
                finish: None,
                result: None,
                lp_next: None,
                lps: Vec::new(),
                lp_sent: 0,
                lp_offset: 0,
            })
            .collect();
        let live = Live {
            codec,
            eos,
            chunker,
            choices,
            n_prompt,
            max_tokens,
            started,
            submitted: Instant::now(),
            first: None,
            req,
        };
        Ok((gens, live))
    }

    /// Chunks produced so far (to be sent before anything later of this request).
    pub fn take_chunks(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.chunker.out)
    }

    /// Tokens of the prompt.
    pub fn prompt_len(&self) -> usize {
        self.n_prompt
    }

    /// The engine admitted choice `choice`'s sequence, the first `cached_tokens` of its prompt
    /// from the prefix cache.
    pub fn on_admitted(&mut self, choice: usize, cached_tokens: usize) {
        self.choices[choice].n_cached = cached_tokens;
    }

    /// Tokens sampled so far, all choices together.
    pub fn generated(&self) -> u64 {
        self.choices.iter().map(|c| c.n_out).sum()
    }

    /// Tokens sampled so far for choice `choice`.
    pub fn generated_by(&self, choice: usize) -> u64 {
        self.choices[choice].n_out
    }

    fn progress(&self) -> Progress {
        if self.choices.iter().all(|c| c.result.is_some()) {
            Progress::Done
        } else {
            Progress::ChoiceDone
        }
    }

    /// The log-probabilities of choice `choice`'s next token (the engine sends them just
    /// before it).
    pub fn on_logprobs(&mut self, choice: usize, lp: Box<TokenLogprobs>) {
        self.choices[choice].lp_next = Some(lp);
    }

    /// Takes the next sampled token of choice `choice`.
    pub fn on_token(&mut self, choice: usize, next: u32) -> Result<Progress, LineError> {
        if self.choices[choice].result.is_some() {
            return Ok(self.progress());
        }
        if let Some(lp) = self.choices[choice].lp_next.take() {
            self.choices[choice].lps.push(*lp);
        }
        let tok = LineError::tokenizer;
        if self.first.is_none() {
            self.first = Some(Instant::now());
        }
        let (stream, max_tokens) = (self.req.stream, self.max_tokens);
        let c = &mut self.choices[choice];
        c.n_out += 1;
        if self.eos.contains(&next) || self.req.stop_token_ids.contains(&next) {
            c.finish = Some(Finish::StopToken(next));
        } else {
            let old = c.text.len();
            if let Some(piece) = c.detok.push(next).map_err(tok)? {
                c.text.push_str(&piece);
            }
            if let Some((at, s)) = c.stops.find(&c.text, old) {
                let s = s.to_string();
                c.text.truncate(at);
                c.finish = Some(Finish::StopString(s));
            } else if c.n_out >= max_tokens {
                c.finish = Some(Finish::Length);
            }
        }
        if c.finish.is_some() {
            return self.on_finished(choice);
        }
        if stream {
            let safe = c.text.len() - c.stops.holdback(&c.text);
            if safe > c.sent {
                let fresh = c.text[c.sent..safe].to_string();
                c.sent = safe;
                let lp_on = self.req.logprobs.is_some();
                if self.chunker.chat {
                    c.splitter.feed(&fresh, &mut c.deltas);
                    c.send_deltas(&mut self.chunker, self.codec, lp_on);
                } else {
                    c.raw_text.push_str(&fresh);
                    let lp = c.unsent_logprobs(self.codec, false, lp_on);
                    self.chunker.send(c.index, Value::String(fresh), lp, None);
                }
            }
        }
        Ok(Progress::Running)
    }

    /// Choice `choice` has ended (a stop token, a stop string or its length, or the engine
    /// ended its sequence: then as for its length): its text is flushed, its last chunks are
    /// made and its entry of `choices` is kept for [`Self::body`].
    pub fn on_finished(&mut self, choice: usize) -> Result<Progress, LineError> {
        let tok = LineError::tokenizer;
        let (stream, lp_on) = (self.req.stream, self.req.logprobs.is_some());
        let chat = self.chunker.chat;
        let codec = self.codec;
        let c = &mut self.choices[choice];
        if c.result.is_some() {
            return Ok(self.progress());
        }
        let finish = c.finish.clone().unwrap_or(Finish::Length);
        if !matches!(finish, Finish::StopString(_)) {
            let old = c.text.len();
            if let Some(rest) = c.detok.flush().map_err(tok)? {
                c.text.push_str(&rest);
                if let Some((at, _)) = c.stops.find(&c.text, old) {
                    c.text.truncate(at);
                }
            }
        }
        let rest = c.text[c.sent.min(c.text.len())..].to_string();
        let text_out;
        let mut message = Value::Null;
        if chat {
            c.splitter.feed(&rest, &mut c.deltas);
            c.splitter.finish(&mut c.deltas);
            if stream {
                c.send_deltas(&mut self.chunker, codec, lp_on);
            } else {
                for d in c.deltas.drain(..) {
                    c.msg.add(&d);
                }
            }
            message = message_json(&c.msg, self.chunker.run_id, self.chunker.line, c.index);
            text_out = String::new();
        } else {
            if stream && !rest.is_empty() {
                let lp = c.unsent_logprobs(codec, false, lp_on);
                self.chunker.send(c.index, Value::String(rest.clone()), lp, None);
            }
            c.raw_text.push_str(&rest);
            text_out = std::mem::take(&mut c.raw_text);
        }
        let (finish_reason, stop_reason) = match &finish {
            _ if chat && !c.msg.tool_calls.is_empty() => ("tool_calls", Value::Null),
            Finish::StopToken(t) => ("stop", if self.eos.contains(t) { Value::Null } else { json!(t) }),
            Finish::StopString(s) => ("stop", json!(s)),
            Finish::Length => ("length", Value::Null),
        };
        if stream {
            let end = if chat { json!({}) } else { Value::String(String::new()) };
            let lp = c.unsent_logprobs(codec, chat, lp_on);
            self.chunker.send(c.index, end, lp, Some(finish_reason));
        }
        // The body carries every token's log-probabilities, whatever the chunks carried.
        let logprobs = match (lp_on, chat) {
            (false, _) => Value::Null,
            (true, true) => chat_logprobs(codec, &c.lps),
            (true, false) => completion_logprobs(codec, &c.lps, &mut 0),
        };
        c.result = Some(if chat {
            json!({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason})
        } else {
            json!({"index": c.index, "text": text_out, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason})
        });
        Ok(self.progress())
    }

    /// The result body of the request (choices that have not ended end here, as for their
    /// length; the last chunk lines are in `take_chunks`). `usage` counts the prompt once and
    /// the tokens of every choice; `cached_tokens` is the least any choice's sequence took
    /// from the prefix cache.
    pub fn body(&mut self) -> Result<Value, LineError> {
        for i in 0..self.choices.len() {
            self.on_finished(i)?;
        }
        let chat = self.chunker.chat;
        let end = Instant::now();
        let first = self.first.unwrap_or(end);
        let prefill_s = (first - self.submitted).as_secs_f64();
        let decode_s = (end - first).as_secs_f64();
        let rate = |n: f64, s: f64| if s > 0.0 && n > 0.0 { json!((n / s * 10.0).round() / 10.0) } else { Value::Null };
        let ttft_ms = ((first - self.started).as_secs_f64() * 1e4).round() / 10.0;
        let (n_prompt, n_out) = (self.n_prompt, self.generated());
        let n_cached = self.choices.iter().map(|c| c.n_cached).min().unwrap_or(0);
        let usage = json!({"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt as u64 + n_out,
                           "prompt_tokens_details": {"cached_tokens": n_cached}});
        let choices: Vec<Value> = self.choices.iter_mut().map(|c| c.result.take().expect("ended above")).collect();
        // Each choice's first token came with its prefill.
        let decoded = n_out as f64 - self.choices.len() as f64;
        let c = &self.chunker;
        let mut body = json!({
            "id": c.id, "object": if chat { "chat.completion" } else { "text_completion" }, "created": c.created, "model": c.model,
            "choices": choices,
            "usage": usage,
            "ttft_ms": ttft_ms, "prefill_tok_s": rate((n_prompt - n_cached) as f64, prefill_s), "decode_tok_s": rate(decoded, decode_s),
        });
        if !self.req.warnings.is_empty() {
            body["warnings"] = json!(self.req.warnings);
        }
        Ok(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes are ids 0–255; `fim` adds `<|fim_prefix|>` 300, `<|fim_suffix|>` 301, `<|fim_middle|>` 302.
    struct Bytes {
        fim: bool,
    }

    impl TextCodec for Bytes {
        fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
            Ok(text.bytes().map(u32::from).collect())
        }
        fn decode(&self, _: &[u32], _: bool) -> anyhow::Result<String> {
            unimplemented!("not used")
        }
        fn token_id(&self, token: &str) -> Option<u32> {
            let i = FIM_TOKENS.iter().position(|t| *t == token)?;
            self.fim.then_some(300 + i as u32)
        }
        fn vocab_size(&self) -> usize {
            303
        }
        fn stream<'a>(&'a self, _: bool) -> Box<dyn TokenStream + 'a> {
            Box::new(NoText)
        }
        fn token_bytes(&self, _: u32) -> Vec<u8> {
            unimplemented!("not used")
        }
        fn is_added(&self, id: u32) -> bool {
            id >= 300
        }
    }

    /// A detokenizer that yields nothing (the tests below generate no tokens).
    struct NoText;
    impl TokenStream for NoText {
        fn push(&mut self, _: u32) -> anyhow::Result<Option<String>> {
            Ok(None)
        }
        fn flush(&mut self) -> anyhow::Result<Option<String>> {
            Ok(None)
        }
    }

    #[test]
    fn fim_prompt_is_prefix_suffix_middle() {
        let ids = fim_prompt(&Bytes { fim: true }, "ab", "c").unwrap();
        assert_eq!(ids, [300, b'a' as u32, b'b' as u32, 301, b'c' as u32, 302]);
        assert_eq!(fim_prompt(&Bytes { fim: true }, "", "").unwrap(), [300, 301, 302]);
        let e = fim_prompt(&Bytes { fim: false }, "ab", "c").unwrap_err();
        assert_eq!(e.code, "unsupported_parameter");
        assert!(e.message.contains("<|fim_prefix|>") && e.message.contains("lacks them"), "{}", e.message);
    }

    struct NoTemplate;
    impl PromptRenderer for NoTemplate {
        fn render(
            &self,
            _: &Value,
            _: Option<&Value>,
            _: bool,
            _: &serde_json::Map<String, Value>,
        ) -> anyhow::Result<String> {
            unimplemented!("completions have no template")
        }
    }

    #[test]
    fn a_fim_request_also_stops_at_the_fim_tokens() {
        let defaults = super::super::GenerationDefaults {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            eos_token_ids: vec![7],
        };
        let limits = Limits { window: 64, vocab: 303, eos: Some(7) };
        let start = |line: Value| {
            let req = super::super::request::parse(&line, &defaults, 1).unwrap();
            let codec = Bytes { fim: true };
            let prompt = prepare(&req, &codec, &NoTemplate, &limits, &Grammars::new()).unwrap();
            let (gens, _) = Live::begin(req, prompt, 1, None, &codec, &limits, &[7], "m", 1, Instant::now()).unwrap();
            gens[0].stop_ids.clone()
        };
        assert_eq!(start(json!({"prompt": "ab", "suffix": "c"})), [7, 300, 301, 302]);
        assert_eq!(start(json!({"prompt": "ab"})), [7], "a plain completion does not");
    }
}
