//! Parsing and validation of one request line.
//!
//! Accepted shapes:
//! * bare chat body: `{"messages": [...], ...}` (`custom_id` or `id` names it);
//! * OpenAI Batch line: `{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
//!   "/v1/completions", "body": {...}}`;
//! * raw completion: `{"prompt": "text" | [ids], ...}` or `{"prompt_token_ids": [ids]}`.
//!
//! `null` means "absent" for every optional field (OpenAI clients send explicit nulls). Parameters
//! this build cannot honour (`allowed_tools` tool choice, `response_format` json on completions or
//! with a forced tool choice, images) are errors rather than silently ignored. The role `developer`
//! (newer OpenAI clients) is treated as `system`.

use serde_json::{Map, Value};

use crate::engine::{Penalties, SamplingParams};
use crate::logprobs::MAX_TOP_LOGPROBS;
use crate::sampling::GREEDY_EPS;

use super::GenerationDefaults;

/// A request-level error: becomes the `error` object of the result line.
#[derive(Debug, Clone, PartialEq)]
pub struct LineError {
    pub code: &'static str,
    pub message: String,
}

/// Every `error.code` a result line (of `serve` or `tokenize`) can carry, with when. README.md's
/// error table is checked against this list (tests/tests/protocol.rs), and this list against the
/// codes the protocol sources pass to [`LineError::new`] (a unit test below).
pub const ERROR_CODES: &[(&str, &str)] = &[
    ("invalid_json", "the line is not well-formed JSON"),
    ("invalid_utf8", "the line is not valid UTF-8"),
    ("empty_line", "the line is blank"),
    ("line_too_long", "the line is longer than `--max-line-bytes` (it is skipped without being held in memory)"),
    ("duplicate_custom_id", "the `custom_id` was already used by an earlier line"),
    (
        "invalid_request",
        "well-formed JSON that is not a valid request: wrong types, unknown roles, empty `messages`, a \
         sampling parameter out of range, a token id outside the vocabulary, a non-boolean \
         `chat_template_kwargs.enable_thinking`, messages the chat template refuses",
    ),
    (
        "unsupported_parameter",
        "a parameter this build cannot honour: `response_format` json on completions or with a \
         forced `tool_choice`, a `tool_choice` other than auto, none, required or a named function, `echo`, \
         several prompts in one line, `suffix` when the tokenizer has no fill-in-the-middle tokens",
    ),
    ("unsupported_content", "image, audio, video or file parts (this build serves text only)"),
    ("unsupported_url", "a Batch line whose `url` is neither `/v1/chat/completions` nor `/v1/completions`"),
    ("context_length_exceeded", "the prompt fills the context, or `max_tokens` reaches past it"),
    ("tokenizer_error", "the tokenizer failed on the text"),
    ("engine_error", "the backend failed while generating"),
    ("internal_error", "the engine panicked on this request (the next lines still run)"),
    (
        "cancelled",
        "`ornith batch` was stopped (SIGINT, SIGTERM) while the request was generating; a rerun runs it again",
    ),
];

impl LineError {
    /// An error event of the engine, whose code (a literal in `engine::core`, checked against
    /// this list by the test below) is passed through.
    pub fn from_engine(code: &'static str, message: String) -> Self {
        debug_assert!(ERROR_CODES.iter().any(|(c, _)| *c == code), "error code {code:?} is not in ERROR_CODES");
        LineError { code, message }
    }
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        debug_assert!(ERROR_CODES.iter().any(|(c, _)| *c == code), "error code {code:?} is not in ERROR_CODES");
        LineError { code, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new("invalid_request", message)
    }
    /// The tokenizer's failure on the request's text.
    pub fn tokenizer(e: anyhow::Error) -> Self {
        LineError::new("tokenizer_error", format!("{e:#}"))
    }
}

type R<T> = Result<T, LineError>;

#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    /// Fill-in-the-middle (`suffix` given): the model writes what goes between the two.
    Fim {
        prefix: String,
        suffix: String,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    Chat {
        /// Normalised messages (text content as strings, tool-call arguments as objects).
        messages: Value,
        tools: Option<Value>,
        /// Extract tool calls from the output (tools given and `tool_choice` not `none`).
        parse_tools: bool,
        kwargs: Map<String, Value>,
        /// `tool_choice` `required` (any tool) or a named function: the answer must be a call.
        force: Option<ToolForce>,
    },
    Completion {
        prompt: Prompt,
    },
}

/// A forced tool call (`tool_choice`): one of the tools, or the named one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolForce {
    Any,
    Named(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub kind: Kind,
    /// `max_completion_tokens`, else `max_tokens`; `None` = up to the end of the context.
    pub max_tokens: Option<u64>,
    pub sampling: SamplingParams,
    pub penalties: Penalties,
    /// Reasoning tokens after which the model is made to answer (chat with thinking on).
    pub thinking_budget: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub stream: bool,
    /// `n`: choices, each its own sequence sampled with `seed + i` (vLLM's children).
    pub n: usize,
    /// Report each output token's log-probability and this many most likely candidates.
    pub logprobs: Option<usize>,
    /// `response_format` json: the answer constrained to JSON (`protocol::structured`).
    pub json_output: Option<JsonOutput>,
    /// Fields the front end does not know (ignored; the request still runs), one message each.
    pub warnings: Vec<String>,
}

/// Structured output: JSON matching `schema`, or any JSON object without one.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonOutput {
    pub schema: Option<Value>,
}

/// The most choices (`n`) one request may ask for: each is a sequence of its own, and one line
/// should not fill the engine's slots many times over.
pub const MAX_CHOICES: usize = 128;

/// The `custom_id` of a parsed line: `custom_id`, else (bare bodies) `id`. Numbers are
/// accepted and rendered as their JSON text.
pub fn custom_id_of(line: &Value) -> Option<String> {
    let pick = |v: &Value| match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    };
    let obj = line.as_object()?;
    obj.get("custom_id").and_then(pick).or_else(|| {
        if obj.contains_key("body") {
            None
        } else {
            obj.get("id").and_then(pick)
        }
    })
}

/// Best-effort `custom_id` of a line that is not valid JSON (or was too long to keep): the first
/// `"custom_id": "…"` string in the text.
pub fn scan_custom_id(text: &str) -> Option<String> {
    let key = "\"custom_id\"";
    let at = text.find(key)?;
    let rest = text[at + key.len()..].trim_start().strip_prefix(':')?.trim_start();
    if !rest.starts_with('"') {
        return None;
    }
    let bytes = rest.as_bytes();
    let mut i = 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return serde_json::from_str::<String>(&rest[..=i]).ok(),
            _ => i += 1,
        }
    }
    None
}

fn present<'a>(obj: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    obj.get(k).filter(|v| !v.is_null())
}

fn get_f64(obj: &Map<String, Value>, k: &str) -> R<Option<f64>> {
    match present(obj, k) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x)),
            _ => Err(LineError::invalid(format!("`{k}` must be a number, got {}", short(v)))),
        },
    }
}

fn get_i64(obj: &Map<String, Value>, k: &str) -> R<Option<i64>> {
    match present(obj, k) {
        None => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| LineError::invalid(format!("`{k}` must be an integer, got {}", short(v)))),
    }
}

fn get_bool(obj: &Map<String, Value>, k: &str) -> R<Option<bool>> {
    match present(obj, k) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(LineError::invalid(format!("`{k}` must be true or false, got {}", short(v)))),
    }
}

/// A value shown in an error message, cut to a readable length.
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() <= 60 {
        return s;
    }
    let mut end = 60;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

fn ids_array(v: &Value, what: &str) -> R<Vec<u32>> {
    let arr = v.as_array().ok_or_else(|| LineError::invalid(format!("`{what}` must be an array of token ids")))?;
    arr.iter()
        .map(|x| {
            x.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| {
                LineError::invalid(format!("`{what}` must hold non-negative integer token ids, got {}", short(x)))
            })
        })
        .collect()
}

/// Parses one JSON line. `default_seed` seeds requests that do not give a `seed`.
pub fn parse(line: &Value, defaults: &GenerationDefaults, default_seed: u64) -> R<Request> {
    let obj = line.as_object().ok_or_else(|| LineError::invalid("a request line must be a JSON object"))?;
    let (body, chat) = if let Some(body) = obj.get("body") {
        if let Some(m) = present(obj, "method") {
            if m.as_str() != Some("POST") {
                return Err(LineError::invalid(format!("`method` must be \"POST\", got {}", short(m))));
            }
        }
        let body = body.as_object().ok_or_else(|| LineError::invalid("`body` must be a JSON object"))?;
        let chat = match present(obj, "url").map(|u| u.as_str()) {
            Some(Some("/v1/chat/completions")) => true,
            Some(Some("/v1/completions")) => false,
            Some(_) => {
                return Err(LineError::new(
                    "unsupported_url",
                    format!(
                        "`url` must be \"/v1/chat/completions\" or \"/v1/completions\", got {}",
                        short(&obj["url"])
                    ),
                ))
            }
            None => !body.contains_key("prompt") && !body.contains_key("prompt_token_ids"),
        };
        (body, chat)
    } else if obj.contains_key("messages") {
        (obj, true)
    } else if obj.contains_key("prompt") || obj.contains_key("prompt_token_ids") {
        (obj, false)
    } else {
        return Err(LineError::invalid(
            "the line is neither a chat request (`messages`), a completion (`prompt`) nor a batch line (`body`)",
        ));
    };
    let mut req = parse_body(body, chat, defaults, default_seed)?;
    if obj.contains_key("body") {
        unknown_fields(obj, BATCH_LINE_FIELDS, "batch line", &mut req.warnings);
        unknown_fields(body, BODY_FIELDS, "request body", &mut req.warnings);
    } else {
        let mut known = BODY_FIELDS.to_vec();
        known.extend(["custom_id", "id"]);
        unknown_fields(obj, &known, "request", &mut req.warnings);
    }
    Ok(req)
}

fn parse_body(b: &Map<String, Value>, chat: bool, defaults: &GenerationDefaults, default_seed: u64) -> R<Request> {
    let n = match get_i64(b, "n")? {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
        Some(n) => return Err(LineError::invalid(format!("`n` must be in 1..={MAX_CHOICES}, got {n}"))),
    };
    // Parameters that would change the result and are not implemented.
    let logprobs = parse_logprobs(b, chat)?;
    let json_output = parse_response_format(b, chat)?;

    // Sampling.
    let temperature = match get_f64(b, "temperature")? {
        Some(t) if t < 0.0 => return Err(LineError::invalid(format!("`temperature` must be >= 0, got {t}"))),
        Some(t) => t as f32,
        None => defaults.temperature,
    };
    let top_p = match get_f64(b, "top_p")? {
        Some(p) if !(p > 0.0 && p <= 1.0) => {
            return Err(LineError::invalid(format!("`top_p` must be in (0, 1], got {p}")))
        }
        Some(p) => p as f32,
        None => defaults.top_p,
    };
    let top_k = match get_i64(b, "top_k")? {
        // vLLM: -1 (and 0) disable top-k.
        Some(k) if k < -1 => return Err(LineError::invalid(format!("`top_k` must be -1, 0 or positive, got {k}"))),
        Some(k) if k <= 0 => 0,
        Some(k) => k as usize,
        None => defaults.top_k,
    };
    let min_p = match get_f64(b, "min_p")? {
        Some(p) if !(0.0..=1.0).contains(&p) => {
            return Err(LineError::invalid(format!("`min_p` must be in [0, 1], got {p}")))
        }
        Some(p) => p as f32,
        None => defaults.min_p,
    };
    let seed = match present(b, "seed") {
        None => default_seed,
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(u), _) => u,
            (None, Some(i)) => i as u64,
            _ => return Err(LineError::invalid(format!("`seed` must be an integer, got {}", short(v)))),
        },
    };
    let temperature = if temperature < GREEDY_EPS { 0.0 } else { temperature };
    let sampling = SamplingParams { temperature, top_k, top_p, min_p, seed };
    // Penalties: OpenAI's ranges for presence and frequency, vLLM's for repetition.
    let pm2 = |k: &str| -> R<f32> {
        match get_f64(b, k)? {
            Some(x) if !(-2.0..=2.0).contains(&x) => {
                Err(LineError::invalid(format!("`{k}` must be in [-2, 2], got {x}")))
            }
            Some(x) => Ok(x as f32),
            None => Ok(0.0),
        }
    };
    let (presence, frequency) = (pm2("presence_penalty")?, pm2("frequency_penalty")?);
    let repetition = match get_f64(b, "repetition_penalty")? {
        Some(x) if !(x > 0.0 && x.is_finite() && x as f32 > 0.0) => {
            return Err(LineError::invalid(format!("`repetition_penalty` must be > 0, got {x}")))
        }
        Some(x) => x as f32,
        None => defaults.repetition_penalty,
    };
    let penalties = Penalties { presence, frequency, repetition };
    // Qwen's own API's name for it; Anthropic's `thinking.budget_tokens` maps here.
    let thinking_budget = match get_i64(b, "thinking_budget")? {
        Some(n) if n < 0 => return Err(LineError::invalid(format!("`thinking_budget` must be >= 0, got {n}"))),
        n => n.map(|n| n as u64),
    };

    let max_tokens = match get_i64(b, "max_completion_tokens")?.or(get_i64(b, "max_tokens")?) {
        Some(m) if m < 1 => return Err(LineError::invalid(format!("`max_tokens` must be at least 1, got {m}"))),
        Some(m) => Some(m as u64),
        None => None,
    };
    let stop = match present(b, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| LineError::invalid("`stop` must be a string or a list of strings"))
            })
            .collect::<R<_>>()?,
        Some(_) => return Err(LineError::invalid("`stop` must be a string or a list of strings")),
    };
    let stop_token_ids = match present(b, "stop_token_ids") {
        None => Vec::new(),
        Some(v) => ids_array(v, "stop_token_ids")?,
    };
    let ignore_eos = get_bool(b, "ignore_eos")?.unwrap_or(false);
    let stream = get_bool(b, "stream")?.unwrap_or(false);

    let kind = if chat { parse_chat(b)? } else { parse_completion(b)? };
    if let (Some(_), Kind::Chat { force, .. }) = (&json_output, &kind) {
        if force.is_some() {
            return Err(LineError::new(
                "unsupported_parameter",
                "`response_format` json with a forced `tool_choice` (the answer cannot be both a tool call and the JSON)",
            ));
        }
        if ignore_eos {
            return Err(LineError::invalid("`response_format` json ends the answer when the JSON is complete; it cannot be combined with `ignore_eos`"));
        }
    }
    Ok(Request {
        kind,
        max_tokens,
        sampling,
        penalties,
        thinking_budget,
        stop,
        stop_token_ids,
        ignore_eos,
        stream,
        n,
        logprobs,
        json_output,
        warnings: Vec::new(),
    })
}

/// `response_format`: `{"type": "text"}` (the default), `{"type": "json_object"}` (any JSON
/// object) or `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (JSON
/// matching the schema), chat only.
fn parse_response_format(b: &Map<String, Value>, chat: bool) -> R<Option<JsonOutput>> {
    let Some(rf) = present(b, "response_format") else { return Ok(None) };
    let ty = rf.get("type").and_then(Value::as_str);
    match (ty, chat) {
        (Some("text"), _) => Ok(None),
        (Some("json_object" | "json_schema"), false) => Err(LineError::new(
            "unsupported_parameter",
            "`response_format` json is a chat parameter (`/v1/chat/completions`)",
        )),
        (Some("json_object"), true) => Ok(Some(JsonOutput { schema: None })),
        (Some("json_schema"), true) => {
            let schema = rf.pointer("/json_schema/schema").filter(|s| !s.is_null()).ok_or_else(|| {
                LineError::invalid("`response_format` json_schema needs `json_schema.schema` (a JSON schema object)")
            })?;
            if !schema.is_object() {
                return Err(LineError::invalid("`response_format.json_schema.schema` must be a JSON object"));
            }
            Ok(Some(JsonOutput { schema: Some(schema.clone()) }))
        }
        _ => Err(LineError::invalid(format!(
            "`response_format.type` must be text, json_object or json_schema, got {}",
            short(rf.get("type").unwrap_or(&Value::Null))
        ))),
    }
}

/// `logprobs` as each API spells it: chat `logprobs: true` with `top_logprobs: k` (0 when
/// absent), completions `logprobs: k`; `k` at most [`MAX_TOP_LOGPROBS`]. None: off.
fn parse_logprobs(b: &Map<String, Value>, chat: bool) -> R<Option<usize>> {
    let top = |v: i64, key: &str| -> R<usize> {
        if (0..=MAX_TOP_LOGPROBS as i64).contains(&v) {
            Ok(v as usize)
        } else {
            Err(LineError::invalid(format!("`{key}` must be in 0..={MAX_TOP_LOGPROBS}, got {v}")))
        }
    };
    if chat {
        let on = get_bool(b, "logprobs")?.unwrap_or(false);
        match (on, get_i64(b, "top_logprobs")?) {
            (true, k) => Ok(Some(k.map_or(Ok(0), |k| top(k, "top_logprobs"))?)),
            (false, None) => Ok(None),
            (false, Some(_)) => Err(LineError::invalid("`top_logprobs` needs `logprobs: true`")),
        }
    } else {
        if present(b, "top_logprobs").is_some() {
            return Err(LineError::invalid("`top_logprobs` is a chat parameter; completions take `logprobs: N`"));
        }
        get_i64(b, "logprobs")?.map(|k| top(k, "logprobs")).transpose()
    }
}

/// Fields a request body may carry: those read above, and those clients send that do not change
/// the result (`model`: this binary serves one; `user`, `metadata`, `store`: bookkeeping;
/// `stream_options`: usage is always in the result line; `parallel_tool_calls`: the model decides).
pub const BODY_FIELDS: &[&str] = &[
    "messages",
    "prompt",
    "prompt_token_ids",
    "suffix",
    "echo",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "response_format",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "tools",
    "tool_choice",
    "thinking_budget",
    "chat_template_kwargs",
    "model",
    "user",
    "metadata",
    "store",
    "stream_options",
    "parallel_tool_calls",
];
/// Fields of an OpenAI Batch line around its `body`.
pub const BATCH_LINE_FIELDS: &[&str] = &["custom_id", "method", "url", "body"];

/// Levenshtein distance (for "did you mean" hints on short field names).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// One warning per key of `obj` outside `known`, with the closest known name as a hint.
fn unknown_fields(obj: &Map<String, Value>, known: &[&str], what: &str, out: &mut Vec<String>) {
    for k in obj.keys() {
        if known.contains(&k.as_str()) {
            continue;
        }
        let hint = known.iter().map(|c| (edit_distance(k, c), *c)).min().filter(|(d, _)| *d <= 2);
        out.push(match hint {
            Some((_, c)) => format!("unknown field `{k}` in the {what} was ignored (did you mean `{c}`?)"),
            None => format!("unknown field `{k}` in the {what} was ignored"),
        });
    }
}

fn parse_completion(b: &Map<String, Value>) -> R<Kind> {
    if b.contains_key("messages") {
        return Err(LineError::invalid("a completion request takes `prompt`, not `messages`"));
    }
    let prompt = match (present(b, "prompt"), present(b, "prompt_token_ids")) {
        (Some(_), Some(_)) => return Err(LineError::invalid("give either `prompt` or `prompt_token_ids`, not both")),
        (None, None) => return Err(LineError::invalid("a completion request needs `prompt` or `prompt_token_ids`")),
        (None, Some(ids)) => Prompt::Ids(ids_array(ids, "prompt_token_ids")?),
        (Some(Value::String(s)), None) => Prompt::Text(s.clone()),
        (Some(Value::Array(a)), None) => match a.first() {
            Some(Value::String(_)) | Some(Value::Array(_)) if a.len() != 1 => {
                return Err(LineError::new(
                    "unsupported_parameter",
                    "one prompt per request line (a list of prompts is not supported)",
                ))
            }
            Some(Value::String(s)) => Prompt::Text(s.clone()),
            Some(inner @ Value::Array(_)) => Prompt::Ids(ids_array(inner, "prompt")?),
            _ => Prompt::Ids(ids_array(&b["prompt"], "prompt")?),
        },
        (Some(v), None) => {
            return Err(LineError::invalid(format!(
                "`prompt` must be a string or a list of token ids, got {}",
                short(v)
            )))
        }
    };
    if get_bool(b, "echo")? == Some(true) {
        return Err(LineError::new("unsupported_parameter", "`echo` is not supported by this build"));
    }
    let prompt = match (present(b, "suffix"), prompt) {
        (None, p) => p,
        (Some(Value::String(suffix)), Prompt::Text(prefix)) => {
            // An empty prefix is a cursor at the start of the file.
            return Ok(Kind::Completion { prompt: Prompt::Fim { prefix, suffix: suffix.clone() } });
        }
        (Some(Value::String(_)), _) => {
            return Err(LineError::invalid("`suffix` (fill-in-the-middle) needs a text `prompt`, not token ids"))
        }
        (Some(v), _) => return Err(LineError::invalid(format!("`suffix` must be a string, got {}", short(v)))),
    };
    let empty = match &prompt {
        Prompt::Text(s) => s.is_empty(),
        Prompt::Ids(ids) => ids.is_empty(),
        Prompt::Fim { .. } => false,
    };
    if empty {
        return Err(LineError::invalid("the prompt is empty"));
    }
    Ok(Kind::Completion { prompt })
}

fn parse_chat(b: &Map<String, Value>) -> R<Kind> {
    let messages = present(b, "messages").ok_or_else(|| LineError::invalid("a chat request needs `messages`"))?;
    let messages = normalize_messages(messages)?;
    // The tools, and their names (what a forced `tool_choice` may name).
    let (mut tools, names) = match present(b, "tools") {
        None => (None, Vec::new()),
        Some(Value::Array(a)) if a.is_empty() => (None, Vec::new()),
        Some(Value::Array(a)) => {
            let names = a
                .iter()
                .map(|t| {
                    let name = t.get("function").and_then(|f| f.get("name")).and_then(|n| n.as_str());
                    name.filter(|n| !n.is_empty()).ok_or_else(|| {
                        LineError::invalid("each tool must be {\"type\": \"function\", \"function\": {\"name\": …}}")
                    })
                })
                .collect::<R<Vec<&str>>>()?;
            (Some(Value::Array(a.clone())), names)
        }
        Some(_) => return Err(LineError::invalid("`tools` must be an array")),
    };
    let mut force = None;
    let parse_tools = match present(b, "tool_choice") {
        None => true,
        Some(Value::String(s)) if s == "auto" => true,
        Some(Value::String(s)) if s == "none" => {
            // OpenAI: the model will not call a tool; the tools are left out of the prompt.
            tools = None;
            false
        }
        Some(Value::String(s)) if s == "required" => {
            force = Some(ToolForce::Any);
            true
        }
        Some(v @ Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            let name = name.ok_or_else(|| {
                LineError::invalid(format!("`tool_choice` {} needs `function.name`", short(v)))
            })?;
            force = Some(ToolForce::Named(name.to_string()));
            true
        }
        Some(v) => {
            return Err(LineError::new(
                "unsupported_parameter",
                format!(
                    "`tool_choice` {} is not supported by this build (use \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": …}}}})",
                    short(v)
                ),
            ))
        }
    } && tools.is_some();
    match &force {
        Some(ToolForce::Any) if names.is_empty() => {
            return Err(LineError::invalid("`tool_choice` \"required\" needs `tools`"));
        }
        Some(ToolForce::Named(n)) if !names.contains(&n.as_str()) => {
            return Err(LineError::invalid(format!("`tool_choice` names `{n}`, which is not among `tools`")));
        }
        // With one tool, "any tool" is that one: its name is forced too.
        Some(ToolForce::Any) if names.len() == 1 => force = Some(ToolForce::Named(names[0].to_string())),
        _ => {}
    }
    let kwargs = template_kwargs(present(b, "chat_template_kwargs"))?;
    Ok(Kind::Chat { messages, tools, parse_tools, kwargs, force })
}

/// `chat_template_kwargs`: an object; the switches the template tests with `is true` / `is false`
/// must be booleans (a string such as `"no"` would silently mean "on" there).
pub fn template_kwargs(v: Option<&Value>) -> R<Map<String, Value>> {
    let m = match v {
        None => return Ok(Map::new()),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(LineError::invalid("`chat_template_kwargs` must be an object")),
    };
    for k in ["enable_thinking"] {
        match m.get(k) {
            None | Some(Value::Null) | Some(Value::Bool(_)) => {}
            Some(v) => {
                return Err(LineError::invalid(format!(
                    "`chat_template_kwargs.{k}` must be true or false, got {}",
                    short(v)
                )))
            }
        }
    }
    Ok(m.clone())
}

const TEXT_ONLY: &str = "this build serves text only";

/// Content as a string: a string, null (empty), or a list of text parts (concatenated, as the
/// chat template does); image / audio / video parts are refused.
fn content_text(v: Option<&Value>, i: usize) -> R<String> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                let ty = p.get("type").and_then(|t| t.as_str());
                let media = [
                    "image_url",
                    "image",
                    "input_image",
                    "video",
                    "video_url",
                    "input_audio",
                    "audio",
                    "audio_url",
                    "file",
                ];
                if ty.is_some_and(|t| media.contains(&t)) || media.iter().any(|m| p.get(*m).is_some()) {
                    return Err(LineError::new("unsupported_content", format!("messages[{i}]: {TEXT_ONLY}")));
                }
                match (ty, p.get("text")) {
                    (None | Some("text") | Some("input_text"), Some(Value::String(t))) => out.push_str(t),
                    _ => {
                        return Err(LineError::invalid(format!(
                            "messages[{i}]: content parts must be {{\"type\": \"text\", \"text\": …}}"
                        )))
                    }
                }
            }
            Ok(out)
        }
        Some(v) => Err(LineError::invalid(format!(
            "messages[{i}].content must be a string or a list of parts, got {}",
            short(v)
        ))),
    }
}

/// Validates `messages` and rewrites them into what the chat template expects.
pub fn normalize_messages(messages: &Value) -> R<Value> {
    let arr = messages.as_array().ok_or_else(|| LineError::invalid("`messages` must be an array"))?;
    if arr.is_empty() {
        return Err(LineError::invalid("`messages` is empty"));
    }
    let mut out = Vec::with_capacity(arr.len());
    for (i, m) in arr.iter().enumerate() {
        let obj = m.as_object().ok_or_else(|| LineError::invalid(format!("messages[{i}] must be an object")))?;
        let role = match obj.get("role") {
            Some(Value::String(r)) => r.as_str(),
            _ => return Err(LineError::invalid(format!("messages[{i}] needs a string `role`"))),
        };
        let role = match role {
            "system" | "user" | "assistant" | "tool" => role,
            "developer" => "system",
            other => {
                return Err(LineError::invalid(format!(
                    "messages[{i}]: unknown role {other:?} (expected system, developer, user, assistant or tool)"
                )))
            }
        };
        let mut n = Map::new();
        n.insert("role".into(), Value::String(role.into()));
        n.insert("content".into(), Value::String(content_text(obj.get("content"), i)?));
        if role == "assistant" {
            let reasoning = present(obj, "reasoning_content").or_else(|| present(obj, "reasoning"));
            if let Some(r) = reasoning {
                let r = r
                    .as_str()
                    .ok_or_else(|| LineError::invalid(format!("messages[{i}].reasoning_content must be a string")))?;
                n.insert("reasoning_content".into(), Value::String(r.into()));
            }
            if let Some(calls) = present(obj, "tool_calls") {
                n.insert("tool_calls".into(), normalize_tool_calls(calls, i)?);
            }
        }
        for k in ["name", "tool_call_id"] {
            if let Some(Value::String(s)) = obj.get(k) {
                n.insert(k.into(), Value::String(s.clone()));
            }
        }
        out.push(Value::Object(n));
    }
    Ok(Value::Array(out))
}

/// OpenAI tool calls carry `arguments` as a JSON string; the template iterates them as a
/// mapping, so they are decoded here (vLLM does the same before rendering).
fn normalize_tool_calls(calls: &Value, i: usize) -> R<Value> {
    let arr =
        calls.as_array().ok_or_else(|| LineError::invalid(format!("messages[{i}].tool_calls must be an array")))?;
    let mut out = Vec::new();
    for c in arr {
        let f = c.get("function").unwrap_or(c);
        let name = f.get("name").and_then(|n| n.as_str()).filter(|n| !n.is_empty());
        let name =
            name.ok_or_else(|| LineError::invalid(format!("messages[{i}].tool_calls: each call needs function.name")))?;
        let args = match f.get("arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(Value::String(s)) if s.trim().is_empty() => Value::Object(Map::new()),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(v @ Value::Object(_)) => v,
                _ => {
                    return Err(LineError::invalid(format!(
                        "messages[{i}].tool_calls: arguments of {name:?} is not a JSON object"
                    )))
                }
            },
            Some(v @ Value::Object(_)) => v.clone(),
            Some(_) => {
                return Err(LineError::invalid(format!(
                    "messages[{i}].tool_calls: arguments of {name:?} is not a JSON object"
                )))
            }
        };
        let mut call = Map::new();
        if let Some(id) = c.get("id") {
            call.insert("id".into(), id.clone());
        }
        call.insert("type".into(), Value::String("function".into()));
        let mut func = Map::new();
        func.insert("name".into(), Value::String(name.into()));
        func.insert("arguments".into(), args);
        call.insert("function".into(), Value::Object(func));
        out.push(Value::Object(call));
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod error_code_tests {
    use super::ERROR_CODES;
    use std::collections::BTreeSet;

    /// The string literal that starts `rest` (after whitespace), if any.
    fn leading_literal(rest: &str) -> Option<&str> {
        let rest = rest.trim_start().strip_prefix('"')?;
        Some(&rest[..rest.find('"')?])
    }

    #[test]
    fn error_codes_are_exactly_the_ones_the_sources_produce() {
        let sources = [
            include_str!("request.rs"),
            include_str!("serve.rs"),
            include_str!("live.rs"),
            include_str!("tokenize.rs"),
        ];
        let mut used = BTreeSet::new();
        for src in sources {
            // Only this file's own code, not the table above or this test.
            let src = src.split("#[cfg(test)]\nmod error_code_tests").next().unwrap();
            for (i, _) in src.match_indices("LineError::new(") {
                let lit = leading_literal(&src[i + "LineError::new(".len()..]);
                let lit = lit.unwrap_or_else(|| panic!("LineError::new without a literal code: {}", &src[i..i + 60]));
                used.insert(lit.to_string());
            }
            if src.contains("LineError::invalid(") {
                used.insert("invalid_request".to_string());
            }
        }
        // The engine's error events carry their code as `code: "…"` (passed through by serve.rs).
        for src in [include_str!("../engine/core.rs"), include_str!("../engine/thread.rs")] {
            for (i, _) in src.match_indices("code: \"") {
                let lit = leading_literal(&src[i + "code: ".len()..]).expect("a code literal");
                used.insert(lit.to_string());
            }
        }
        let listed: BTreeSet<String> = ERROR_CODES.iter().map(|(c, _)| c.to_string()).collect();
        assert_eq!(listed.len(), ERROR_CODES.len(), "a code is listed twice");
        assert_eq!(used, listed, "ERROR_CODES must list exactly the codes the protocol produces");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(v: Value) -> R<Request> {
        let d = GenerationDefaults {
            temperature: 1.0,
            top_k: 20,
            top_p: 0.95,
            min_p: 0.0,
            repetition_penalty: 1.0,
            eos_token_ids: vec![1],
        };
        parse(&v, &d, 99)
    }

    #[test]
    fn bare_chat_with_defaults() {
        let r = p(json!({"messages": [{"role": "user", "content": "hi"}]})).unwrap();
        assert_eq!(r.sampling, SamplingParams { temperature: 1.0, top_k: 20, top_p: 0.95, min_p: 0.0, seed: 99 });
        assert_eq!(r.max_tokens, None);
        assert!(matches!(r.kind, Kind::Chat { parse_tools: false, .. }));
    }

    #[test]
    fn penalties_are_read_checked_and_default_to_off() {
        let chat = |extra: Value| {
            let mut v = json!({"messages": [{"role": "user", "content": "hi"}]});
            v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            p(v)
        };
        assert_eq!(chat(json!({})).unwrap().penalties, Penalties::NONE);
        // The model card's settings (thinking, general): presence 1.5.
        let r = chat(json!({"presence_penalty": 1.5, "frequency_penalty": -0.25, "repetition_penalty": 1.05})).unwrap();
        assert_eq!(r.penalties, Penalties { presence: 1.5, frequency: -0.25, repetition: 1.05 });
        let r = chat(json!({"presence_penalty": null, "repetition_penalty": null})).unwrap();
        assert_eq!(r.penalties, Penalties::NONE, "null is absent");
        for (k, v) in [
            ("presence_penalty", json!(2.5)),
            ("presence_penalty", json!(-2.01)),
            ("frequency_penalty", json!(3)),
            ("repetition_penalty", json!(0)),
            ("repetition_penalty", json!(-1)),
            ("repetition_penalty", json!(1e-60)),
        ] {
            let e = chat(json!({ k: v })).unwrap_err();
            assert_eq!(e.code, "invalid_request", "{k} = {v}: {e:?}");
            assert!(e.message.contains(k), "{e:?}");
        }
        let e = chat(json!({"presence_penalty": "high"})).unwrap_err();
        assert_eq!(e.code, "invalid_request", "{e:?}");
        assert_eq!(chat(json!({"thinking_budget": 512})).unwrap().thinking_budget, Some(512));
        assert_eq!(chat(json!({})).unwrap().thinking_budget, None);
        assert_eq!(chat(json!({"thinking_budget": -1})).unwrap_err().code, "invalid_request");
        // The checkpoint's generation config supplies the repetition penalty a request omits.
        let d = GenerationDefaults { repetition_penalty: 1.1, ..GenerationDefaults::default() };
        let r = parse(&json!({"prompt": "x"}), &d, 1).unwrap();
        assert_eq!(r.penalties, Penalties { repetition: 1.1, ..Penalties::NONE });
        let r = parse(&json!({"prompt": "x", "repetition_penalty": 1}), &d, 1).unwrap();
        assert_eq!(r.penalties, Penalties::NONE);
    }

    #[test]
    fn tool_choice_forces_any_or_a_named_tool_among_the_tools() {
        let tools = json!([{"type": "function", "function": {"name": "ls"}}, {"type": "function", "function": {"name": "cat"}}]);
        let force = |tc: Value| {
            p(json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": tc})).map(|r| {
                match r.kind {
                    Kind::Chat { force, parse_tools, .. } => (force, parse_tools),
                    _ => unreachable!(),
                }
            })
        };
        assert_eq!(force(json!("auto")).unwrap(), (None, true));
        assert_eq!(force(json!("required")).unwrap(), (Some(ToolForce::Any), true));
        let named = json!({"type": "function", "function": {"name": "cat"}});
        assert_eq!(force(named).unwrap(), (Some(ToolForce::Named("cat".into())), true));
        let e = force(json!({"type": "function", "function": {"name": "rm"}})).unwrap_err();
        assert_eq!(e.code, "invalid_request");
        assert!(e.message.contains("`rm`"), "{e:?}");
        assert_eq!(force(json!({"type": "function"})).unwrap_err().code, "invalid_request");
        assert_eq!(force(json!("sometimes")).unwrap_err().code, "unsupported_parameter");
        // One tool: `required` forces its name too.
        let one = json!({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                         "tools": [{"type": "function", "function": {"name": "ls"}}]});
        assert!(matches!(p(one).unwrap().kind, Kind::Chat { force: Some(ToolForce::Named(n)), .. } if n == "ls"));
    }

    #[test]
    fn batch_line_and_overrides() {
        let r = p(json!({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                         {"role": "user", "content": "x"}],
            "temperature": 0, "top_k": -1, "top_p": 0.5, "min_p": 0.1, "seed": -1, "max_tokens": 5,
            "max_completion_tokens": 7, "stop": "END", "stream": true, "tools": [{"type": "function", "function": {"name": "f"}}]
        }}))
        .unwrap();
        assert_eq!(r.sampling, SamplingParams { temperature: 0.0, top_k: 0, top_p: 0.5, min_p: 0.1, seed: u64::MAX });
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(r.stop, vec!["END".to_string()]);
        assert!(r.stream);
        match r.kind {
            Kind::Chat { messages, parse_tools, .. } => {
                assert!(parse_tools);
                assert_eq!(messages[0], json!({"role": "system", "content": "be brief"}));
            }
            _ => panic!(),
        }
    }

    #[test]
    fn completions() {
        let r = p(json!({"prompt": "abc"})).unwrap();
        assert_eq!(r.kind, Kind::Completion { prompt: Prompt::Text("abc".into()) });
        let r = p(json!({"url": "/v1/completions", "body": {"prompt": [1, 2]}})).unwrap();
        assert_eq!(r.kind, Kind::Completion { prompt: Prompt::Ids(vec![1, 2]) });
        assert!(p(json!({"prompt_token_ids": []})).is_err());
        assert!(p(json!({"prompt": ["a", "b"]})).is_err());
        // `suffix`: fill-in-the-middle, with a text prompt (possibly empty) only.
        let r = p(json!({"prompt": "def f(", "suffix": "):\n"})).unwrap();
        assert_eq!(r.kind, Kind::Completion { prompt: Prompt::Fim { prefix: "def f(".into(), suffix: "):\n".into() } });
        let r = p(json!({"prompt": "", "suffix": "x"})).unwrap();
        assert_eq!(r.kind, Kind::Completion { prompt: Prompt::Fim { prefix: "".into(), suffix: "x".into() } });
        assert_eq!(
            p(json!({"prompt": "a", "suffix": null})).unwrap().kind,
            Kind::Completion { prompt: Prompt::Text("a".into()) }
        );
        assert!(p(json!({"prompt": [1, 2], "suffix": "x"})).unwrap_err().message.contains("text `prompt`"));
        assert!(p(json!({"prompt": "a", "suffix": 3})).unwrap_err().message.contains("`suffix` must be a string"));
        assert_eq!(p(json!({"prompt": "a", "echo": true})).unwrap_err().code, "unsupported_parameter");
    }

    #[test]
    fn rejects_bad_values() {
        let base = |k: &str, v: Value| {
            let mut m = json!({"messages": [{"role": "user", "content": "hi"}]});
            m[k] = v;
            p(m).unwrap_err()
        };
        assert!(base("temperature", json!(-0.5)).message.contains(">= 0"));
        assert!(base("top_p", json!(0)).message.contains("(0, 1]"));
        assert!(base("top_p", json!(1.5)).message.contains("(0, 1]"));
        assert!(base("temperature", json!("hot")).message.contains("number"));
        assert!(base("max_tokens", json!(0)).message.contains("at least 1"));
        assert!(base("stop", json!(3)).message.contains("stop"));
        assert!(base("n", json!(0)).message.contains("`n` must be in 1..=128"));
        assert_eq!(base("n", json!(129)).code, "invalid_request");
        assert_eq!(p(json!({"messages": [{"role": "user", "content": "hi"}], "n": 3})).unwrap().n, 3);
        assert_eq!(p(json!({"messages": [{"role": "user", "content": "hi"}], "n": null})).unwrap().n, 1);
        assert_eq!(base("tool_choice", json!({"type": "allowed_tools"})).code, "unsupported_parameter");
        // Forcing needs the tools it names.
        assert!(base("tool_choice", json!("required")).message.contains("needs `tools`"));
        let e =
            p(json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}))
                .unwrap_err();
        assert_eq!(e.code, "unsupported_content");
        assert!(e.message.contains("text only"));
        assert!(p(json!({"messages": []})).unwrap_err().message.contains("empty"));
        assert!(p(json!({"messages": [{"role": "wizard", "content": "x"}]}))
            .unwrap_err()
            .message
            .contains("unknown role"));
        assert_eq!(p(json!({"url": "/v1/embeddings", "body": {}})).unwrap_err().code, "unsupported_url");
        assert!(p(json!([1])).is_err());
        assert!(p(json!({"hello": 1})).is_err());
    }

    #[test]
    fn tool_call_arguments_are_decoded_for_the_template() {
        let r = p(json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}))
        .unwrap();
        let Kind::Chat { messages, .. } = r.kind else { panic!() };
        assert_eq!(messages[1]["tool_calls"][0]["function"]["arguments"], json!({"a": 1}));
        assert_eq!(messages[1]["content"], json!(""));
    }

    #[test]
    fn custom_ids() {
        assert_eq!(custom_id_of(&json!({"custom_id": "x", "body": {}})), Some("x".into()));
        assert_eq!(custom_id_of(&json!({"id": 5, "messages": []})), Some("5".into()));
        assert_eq!(custom_id_of(&json!({"id": "req", "body": {}})), None);
        assert_eq!(scan_custom_id(r#"{"custom_id" : "a\"b", "body": {"#), Some("a\"b".into()));
        assert_eq!(scan_custom_id(r#"{"custom_id": 3"#), None);
        assert_eq!(scan_custom_id(r#"{"custom_id": "unterminated"#), None);
    }

    #[test]
    fn unknown_fields_warn_and_the_request_still_parses() {
        let r = p(json!({"messages": [{"role": "user", "content": "hi"}], "max_tokenz": 5, "model": "x", "foo": 1}))
            .unwrap();
        assert_eq!(r.max_tokens, None);
        assert_eq!(r.warnings.len(), 2, "{:?}", r.warnings);
        assert!(r.warnings[0].contains("`max_tokenz`") && r.warnings[0].contains("did you mean `max_tokens`"));
        assert!(r.warnings[1].contains("`foo`") && !r.warnings[1].contains("did you mean"));
        let r = p(json!({"custom_id": "a", "url": "/v1/chat/completions", "methd": "POST",
                         "body": {"messages": [{"role": "user", "content": "x"}], "temprature": 0.1}}))
        .unwrap();
        assert_eq!(r.warnings.len(), 2, "{:?}", r.warnings);
        assert!(r.warnings.iter().any(|w| w.contains("`methd`") && w.contains("batch line")));
        assert!(r.warnings.iter().any(|w| w.contains("`temprature`") && w.contains("`temperature`")));
        // Every field the parser reads is known.
        let r = p(json!({"custom_id": "c", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                         "temperature": 0.5, "top_p": 0.9, "top_k": 3, "min_p": 0.1, "seed": 1, "stop": ["x"],
                         "ignore_eos": false, "stream": false, "n": 1, "stream_options": {"include_usage": true}}))
        .unwrap();
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    }
}
