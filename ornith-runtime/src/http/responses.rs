//! The OpenAI Responses API (`POST /v1/responses`, what Codex CLI speaks) on top of the chat
//! front end: the body's `instructions` and `input` items become chat messages, its function
//! tools chat tools; the chat result (or its stream chunks) becomes a `response` object (or its
//! event stream). Stateless: nothing is stored, so `previous_response_id` is refused.
//!
//! Event names and shapes follow OpenAI's reference ("Responses streaming events",
//! developers.openai.com/api/reference/resources/responses/streaming-events): `response.created`,
//! `response.in_progress`, per output item `response.output_item.added`, for a message
//! `response.content_part.added` / `response.output_text.delta` / `response.output_text.done` /
//! `response.content_part.done`, for reasoning the same with `response.reasoning_text.*`, for a
//! function call `response.function_call_arguments.delta` / `.done`, then
//! `response.output_item.done`; last `response.completed` (`response.incomplete` when
//! `max_output_tokens` ended it, `response.failed` on an engine error). Every event carries a
//! `sequence_number` from 0; there is no `[DONE]`.

use serde_json::{json, Map, Value};

use crate::protocol::request::LineError;

/// Fields of a Responses body this server reads, and those it accepts without effect (`store`:
/// nothing is stored either way; `include`, `metadata`, `user`, `parallel_tool_calls`,
/// `truncation`, `prompt_cache_key`, `service_tier`, `safety_identifier`, `stream_options`:
/// bookkeeping). Others are warned about.
const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "tools",
    "tool_choice",
    "reasoning",
    "text",
    "previous_response_id",
    "store",
    "include",
    "metadata",
    "user",
    "parallel_tool_calls",
    "truncation",
    "prompt_cache_key",
    "service_tier",
    "safety_identifier",
    "stream_options",
];

/// Tool types a Responses request may declare that this server does not offer to the model and
/// skips with a warning instead of refusing the request: the tools OpenAI's servers run themselves
/// (web and file search, code interpreter, image generation, computer use, remote MCP, tool
/// search), which a local server cannot execute, and `namespace` groups of tools (llama.cpp
/// 91e84fed and ik_llama.cpp #1964 made the same change after Codex runs; Codex CLI sends
/// such a group beside its function tools; how a call of a grouped tool is named back is not
/// settled here, so the group's tools are not offered rather than guessed). Other non-function
/// types (`custom`, `local_shell`: the client runs them, and a skip would take away a tool the
/// agent relies on) stay an `unsupported_parameter` error.
const NOT_OFFERED: &[&str] = &[
    "web_search",
    "web_search_preview",
    "file_search",
    "code_interpreter",
    "image_generation",
    "computer",
    "computer_use_preview",
    "mcp",
    "tool_search",
    "namespace",
];

fn invalid(m: impl Into<String>) -> LineError {
    LineError::invalid(m)
}

fn unsupported(m: impl Into<String>) -> LineError {
    LineError::new("unsupported_parameter", m)
}

/// The text of a message item's `content`: a string, or `input_text` / `output_text` parts.
fn content_text(v: Option<&Value>, what: &str) -> Result<String, LineError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text" | "refusal") => {
                        let t = p.get("text").or_else(|| p.get("refusal")).and_then(Value::as_str);
                        out += t.ok_or_else(|| invalid(format!("{what}: a text part needs `text`")))?;
                    }
                    Some("input_image" | "input_file" | "input_audio") => {
                        return Err(LineError::new(
                            "unsupported_content",
                            format!("{what}: this build serves text only"),
                        ))
                    }
                    other => return Err(invalid(format!("{what}: unsupported content part {other:?}"))),
                }
            }
            Ok(out)
        }
        Some(_) => Err(invalid(format!("{what}: `content` must be a string or a list of parts"))),
    }
}

/// Converts `instructions` and `input` to chat messages: message items by role, each
/// `function_call` item into the `tool_calls` of the assistant turn it belongs to, each
/// `function_call_output` into a `tool` message, `reasoning` items into the next assistant
/// turn's `reasoning_content`.
fn messages(b: &Map<String, Value>) -> Result<Vec<Value>, LineError> {
    let mut out: Vec<Value> = Vec::new();
    if let Some(i) = b.get("instructions").filter(|v| !v.is_null()) {
        let i = i.as_str().ok_or_else(|| invalid("`instructions` must be a string"))?;
        out.push(json!({"role": "system", "content": i}));
    }
    let items = match b.get("input") {
        Some(Value::String(s)) => vec![json!({"role": "user", "content": s})],
        Some(Value::Array(a)) => a.clone(),
        _ => return Err(invalid("`input` must be a string or a list of input items")),
    };
    if items.is_empty() {
        // Empty input (Codex CLI probes a server with `input: []` and `max_output_tokens: 1`,
        // ik_llama.cpp #1964): one empty user turn, the user query the chat template requires.
        out.push(json!({"role": "user", "content": ""}));
        return Ok(out);
    }
    let mut reasoning = String::new();
    for (i, item) in items.iter().enumerate() {
        let what = format!("input[{i}]");
        let ty = item.get("type").and_then(Value::as_str);
        match ty {
            None | Some("message") => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some(r @ ("user" | "assistant" | "system")) => r,
                    Some("developer") => "system",
                    _ => return Err(invalid(format!("{what}: `role` must be user, assistant, system or developer"))),
                };
                let text = content_text(item.get("content"), &what)?;
                let mut m = json!({"role": role, "content": text});
                if role == "assistant" && !reasoning.is_empty() {
                    m["reasoning_content"] = json!(std::mem::take(&mut reasoning));
                }
                // A system turn after the first message joins the leading one (the chat
                // template takes system text at the start only).
                if role == "system" {
                    if let Some(first) = out.first_mut().filter(|f| f["role"] == "system") {
                        let joined = format!("{}\n\n{text}", first["content"].as_str().unwrap_or_default());
                        first["content"] = json!(joined);
                        continue;
                    }
                }
                out.push(m);
            }
            Some("function_call") => {
                let get = |k: &str| item.get(k).and_then(Value::as_str);
                let name = get("name").ok_or_else(|| invalid(format!("{what}: a function_call needs `name`")))?;
                let call_id =
                    get("call_id").ok_or_else(|| invalid(format!("{what}: a function_call needs `call_id`")))?;
                let call = json!({"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": get("arguments").unwrap_or("{}")}});
                // Calls right after an assistant message (or after other calls) belong to it.
                match out.last_mut().filter(|m| m["role"] == "assistant") {
                    Some(m) => {
                        if m.get("tool_calls").is_none() {
                            m["tool_calls"] = json!([]);
                        }
                        m["tool_calls"].as_array_mut().expect("an array").push(call);
                    }
                    None => {
                        let mut m = json!({"role": "assistant", "content": "", "tool_calls": [call]});
                        if !reasoning.is_empty() {
                            m["reasoning_content"] = json!(std::mem::take(&mut reasoning));
                        }
                        out.push(m);
                    }
                }
            }
            Some("function_call_output") => {
                let call_id = item
                    .get("call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("{what}: a function_call_output needs `call_id`")))?;
                let output = content_text(item.get("output"), &what)?;
                out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            Some("reasoning") => {
                for part in item.get("content").and_then(Value::as_array).into_iter().flatten() {
                    reasoning += part.get("text").and_then(Value::as_str).unwrap_or_default();
                }
            }
            Some(other) => return Err(unsupported(format!("{what}: input items of type {other:?} are not supported"))),
        }
    }
    Ok(out)
}

/// The chat-completions body of a Responses body, with a warning per field this server does not
/// know.
pub fn chat_body(body: &Value) -> Result<(Value, Vec<String>), LineError> {
    let b = body.as_object().ok_or_else(|| invalid("the request body must be a JSON object"))?;
    if let Some(p) = b.get("previous_response_id").filter(|v| !v.is_null()) {
        return Err(invalid(format!(
            "`previous_response_id` {p}: this server stores no responses (it is stateless); send the whole \
             conversation in `input` instead"
        )));
    }
    if b.get("background") == Some(&Value::Bool(true)) {
        return Err(unsupported("`background` responses are not supported by this build"));
    }
    let mut warnings: Vec<String> = b
        .keys()
        .filter(|k| !FIELDS.contains(&k.as_str()))
        .map(|k| format!("unknown field `{k}` in the request body was ignored"))
        .collect();
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages(b)?));
    if let Some(m) = b.get("max_output_tokens").filter(|v| !v.is_null()) {
        chat.insert("max_tokens".into(), m.clone());
    }
    for k in ["temperature", "top_p", "stream"] {
        if let Some(v) = b.get(k) {
            chat.insert(k.into(), v.clone());
        }
    }
    if let Some(tools) = b.get("tools").filter(|v| !v.is_null()) {
        let arr = tools.as_array().ok_or_else(|| invalid("`tools` must be an array"))?;
        let mut out = Vec::new();
        for t in arr {
            let ty = t.get("type").and_then(Value::as_str);
            if let Some(h) = ty.filter(|ty| NOT_OFFERED.contains(ty)) {
                warnings.push(format!("tool of type \"{h}\" not offered to the model (this server cannot run it)"));
                continue;
            }
            if ty != Some("function") {
                return Err(unsupported(format!(
                    "tool type {} is not supported by this build (\"function\" tools; the types {} are skipped)",
                    t.get("type").unwrap_or(&Value::Null),
                    NOT_OFFERED.join(", ")
                )));
            }
            let name = t.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
            let name = name.ok_or_else(|| invalid("each function tool needs a `name`"))?;
            let params = t.get("parameters").filter(|p| !p.is_null()).cloned();
            let mut f = json!({"name": name, "parameters": params.unwrap_or_else(|| json!({"type": "object"}))});
            if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
                f["description"] = d.clone();
            }
            out.push(json!({"type": "function", "function": f}));
        }
        chat.insert("tools".into(), Value::Array(out));
    }
    if let Some(tc) = b.get("tool_choice").filter(|v| !v.is_null()) {
        match (tc.as_str(), tc.get("type").and_then(Value::as_str)) {
            (Some(c @ ("auto" | "none" | "required")), _) => {
                chat.insert("tool_choice".into(), json!(c));
            }
            // A forced call of the named function (the chat request checks the name).
            (None, Some("function")) => {
                let name = tc.get("name").and_then(Value::as_str);
                let name = name.ok_or_else(|| invalid("`tool_choice` of type function needs a `name`"))?;
                chat.insert("tool_choice".into(), json!({"type": "function", "function": {"name": name}}));
            }
            _ => {
                return Err(unsupported(
                    "`tool_choice` other than \"auto\", \"none\", \"required\" or a function is not supported by this build",
                ))
            }
        }
    }
    // `text.format` is chat's `response_format` with the schema's fields one level up.
    if let Some(f) = b.get("text").and_then(|t| t.get("format")).filter(|f| !f.is_null()) {
        let rf = match f.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(json!({"type": "json_object"})),
            Some("json_schema") => {
                let js: serde_json::Map<String, Value> = ["name", "schema", "strict"]
                    .iter()
                    .filter_map(|k| f.get(*k).map(|v| (k.to_string(), v.clone())))
                    .collect();
                Some(json!({"type": "json_schema", "json_schema": js}))
            }
            _ => return Err(unsupported("`text.format.type` must be text, json_object or json_schema")),
        };
        if let Some(rf) = rf {
            chat.insert("response_format".into(), rf);
        }
    }
    // `reasoning.effort` "none" turns thinking off; any other effort leaves the chat template's
    // default (which thinks).
    if let Some(r) = b.get("reasoning").filter(|v| !v.is_null()) {
        if r.get("effort").and_then(Value::as_str) == Some("none") {
            chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": false}));
        }
    }
    Ok((Value::Object(chat), warnings))
}

/// What a response echoes of its request.
#[derive(Debug, Clone)]
pub struct Echo {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    pub instructions: Value,
    pub tools: Value,
    pub tool_choice: Value,
    pub temperature: Value,
    pub top_p: Value,
    pub max_output_tokens: Value,
    /// `text` as sent (its `format`), else the default text format.
    pub text: Value,
}

impl Echo {
    pub fn new(id: String, created_at: u64, model: &str, body: &Value) -> Self {
        let get = |k: &str| body.get(k).cloned().unwrap_or(Value::Null);
        let tool_choice = body.get("tool_choice").filter(|v| !v.is_null()).cloned().unwrap_or(json!("auto"));
        let tools = body.get("tools").filter(|v| !v.is_null()).cloned().unwrap_or(json!([]));
        let text = body
            .get("text")
            .filter(|t| t.get("format").is_some_and(|f| !f.is_null()))
            .cloned()
            .unwrap_or(json!({"format": {"type": "text"}}));
        Echo {
            text,
            id,
            created_at,
            model: model.to_string(),
            instructions: get("instructions"),
            tools,
            tool_choice,
            temperature: get("temperature"),
            top_p: get("top_p"),
            max_output_tokens: get("max_output_tokens"),
        }
    }

    /// The response object with `status`, `output` and (once known) `usage`.
    fn response(&self, status: &str, output: Vec<Value>, body: Option<&Value>) -> Value {
        let length = body.is_some_and(|b| b["choices"][0]["finish_reason"] == "length");
        let usage = body.map_or(Value::Null, |b| {
            let u = &b["usage"];
            json!({"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                   "output_tokens": u["completion_tokens"], "total_tokens": u["total_tokens"]})
        });
        json!({
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": null,
            "incomplete_details": if length { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "instructions": self.instructions, "tools": self.tools, "tool_choice": self.tool_choice,
            "parallel_tool_calls": true, "temperature": self.temperature, "top_p": self.top_p,
            "max_output_tokens": self.max_output_tokens, "previous_response_id": null, "store": false,
            "text": self.text, "metadata": {},
        })
    }

    fn item_id(&self, prefix: &str, index: usize) -> String {
        format!("{prefix}_{}_{index}", self.id.strip_prefix("resp_").unwrap_or(&self.id))
    }
}

fn status_of(body: &Value) -> &'static str {
    if body["choices"][0]["finish_reason"] == "length" {
        "incomplete"
    } else {
        "completed"
    }
}

fn reasoning_item(id: String, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
           "status": "completed"})
}

fn message_item(id: String, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

fn call_item(id: String, call: &Value, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call["id"], "name": call["function"]["name"],
           "arguments": call["function"]["arguments"], "status": status})
}

/// The response object of a (non-streamed) chat result.
pub fn response(echo: &Echo, body: &Value) -> Value {
    let m = &body["choices"][0]["message"];
    let mut output = Vec::new();
    if let Some(r) = m["reasoning_content"].as_str().filter(|r| !r.is_empty()) {
        output.push(reasoning_item(echo.item_id("rs", output.len()), r));
    }
    if let Some(t) = m["content"].as_str().filter(|t| !t.is_empty()) {
        output.push(message_item(echo.item_id("msg", output.len()), t, "completed"));
    }
    for c in m["tool_calls"].as_array().into_iter().flatten() {
        output.push(call_item(echo.item_id("fc", output.len()), c, "completed"));
    }
    echo.response(status_of(body), output, Some(body))
}

#[derive(Clone, Copy, PartialEq)]
enum Open {
    Reasoning,
    Text,
}

/// Turns the chat stream of one request into Responses events (type, data).
pub struct Events {
    echo: Echo,
    seq: u64,
    /// The open reasoning or message item: its kind, output index and text so far.
    open: Option<(Open, usize, String)>,
    /// Finished output items, in order.
    items: Vec<Value>,
}

pub type Event = (String, Value);

impl Events {
    pub fn new(echo: Echo) -> Self {
        Events { echo, seq: 0, open: None, items: Vec::new() }
    }

    fn push(&mut self, out: &mut Vec<Event>, ty: &str, mut v: Value) {
        v["type"] = json!(ty);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        out.push((ty.to_string(), v));
    }

    /// `response.created` and `response.in_progress`, once the request is accepted.
    pub fn start(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        let r = self.echo.response("in_progress", Vec::new(), None);
        self.push(&mut out, "response.created", json!({"response": r}));
        self.push(&mut out, "response.in_progress", json!({"response": r}));
        out
    }

    fn close(&mut self, out: &mut Vec<Event>) {
        let Some((kind, index, text)) = self.open.take() else { return };
        let (prefix, part_ty, done_ty) = match kind {
            Open::Reasoning => ("rs", "reasoning_text", "response.reasoning_text.done"),
            Open::Text => ("msg", "output_text", "response.output_text.done"),
        };
        let id = self.echo.item_id(prefix, index);
        let part = match kind {
            Open::Reasoning => json!({"type": part_ty, "text": text}),
            Open::Text => json!({"type": part_ty, "text": text, "annotations": [], "logprobs": []}),
        };
        let at = json!({"item_id": id, "output_index": index, "content_index": 0});
        let mut done = at.clone();
        done["text"] = json!(text);
        self.push(out, done_ty, done);
        let mut part_done = at;
        part_done["part"] = part;
        self.push(out, "response.content_part.done", part_done);
        let item = match kind {
            Open::Reasoning => reasoning_item(id, &text),
            Open::Text => message_item(id, &text, "completed"),
        };
        self.push(out, "response.output_item.done", json!({"output_index": index, "item": item.clone()}));
        self.items.push(item);
    }

    fn text(&mut self, kind: Open, s: &str, out: &mut Vec<Event>) {
        if s.is_empty() {
            return;
        }
        if self.open.as_ref().map(|o| o.0) != Some(kind) {
            self.close(out);
            let index = self.items.len();
            let (item, part) = match kind {
                Open::Reasoning => (
                    json!({"type": "reasoning", "id": self.echo.item_id("rs", index), "summary": [], "content": [],
                           "status": "in_progress"}),
                    json!({"type": "reasoning_text", "text": ""}),
                ),
                Open::Text => (
                    json!({"type": "message", "id": self.echo.item_id("msg", index), "status": "in_progress",
                           "role": "assistant", "content": []}),
                    json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []}),
                ),
            };
            let id = item["id"].clone();
            self.push(out, "response.output_item.added", json!({"output_index": index, "item": item}));
            self.push(
                out,
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            );
            self.open = Some((kind, index, String::new()));
        }
        let (_, index, text) = self.open.as_mut().expect("opened above");
        text.push_str(s);
        let index = *index;
        let (prefix, ty) = match kind {
            Open::Reasoning => ("rs", "response.reasoning_text.delta"),
            Open::Text => ("msg", "response.output_text.delta"),
        };
        let mut v = json!({"item_id": self.echo.item_id(prefix, index), "output_index": index, "content_index": 0,
                           "delta": s});
        if kind == Open::Text {
            v["logprobs"] = json!([]);
        }
        self.push(out, ty, v);
    }

    /// The events of one `chat.completion.chunk`.
    pub fn chunk(&mut self, chunk: &Value) -> Vec<Event> {
        let mut out = Vec::new();
        let d = &chunk["choices"][0]["delta"];
        if let Some(r) = d["reasoning_content"].as_str() {
            self.text(Open::Reasoning, r, &mut out);
        }
        if let Some(t) = d["content"].as_str() {
            self.text(Open::Text, t, &mut out);
        }
        for c in d["tool_calls"].as_array().into_iter().flatten() {
            self.close(&mut out);
            let index = self.items.len();
            let id = self.echo.item_id("fc", index);
            let mut added = call_item(id.clone(), c, "in_progress");
            added["arguments"] = json!("");
            self.push(&mut out, "response.output_item.added", json!({"output_index": index, "item": added}));
            let args = c["function"]["arguments"].clone();
            self.push(
                &mut out,
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": index, "delta": args}),
            );
            self.push(
                &mut out,
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": index, "name": c["function"]["name"], "arguments": args}),
            );
            let item = call_item(id, c, "completed");
            self.push(&mut out, "response.output_item.done", json!({"output_index": index, "item": item.clone()}));
            self.items.push(item);
        }
        out
    }

    /// The closing events and `response.completed` (or `response.incomplete`) for the final
    /// chat body.
    pub fn finish(&mut self, body: &Value) -> Vec<Event> {
        let mut out = Vec::new();
        self.close(&mut out);
        let status = status_of(body);
        let r = self.echo.response(status, std::mem::take(&mut self.items), Some(body));
        let ty = if status == "completed" { "response.completed" } else { "response.incomplete" };
        self.push(&mut out, ty, json!({"response": r}));
        out
    }

    /// `response.failed` with the error (`code`, `message`).
    pub fn failed(&mut self, code: &str, message: &str) -> Vec<Event> {
        let mut out = Vec::new();
        self.close(&mut out);
        let mut r = self.echo.response("failed", std::mem::take(&mut self.items), None);
        r["error"] = json!({"code": code, "message": message});
        self.push(&mut out, "response.failed", json!({"response": r}));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_items_map_to_template_messages() {
        let body = json!({"model": "m", "instructions": "be brief", "max_output_tokens": 9,
            "input": [
                {"role": "developer", "content": "use tools"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                {"type": "function_call", "call_id": "call_1", "name": "ls", "arguments": "{\"path\":\".\"}"},
                {"type": "function_call", "call_id": "call_2", "name": "pwd", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "a.rs"},
                {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "/"}]},
                {"role": "user", "content": "thanks"}],
            "tools": [{"type": "function", "name": "ls", "description": "list", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": "auto", "reasoning": {"effort": "none"}, "store": false, "foo": 1});
        let (chat, warnings) = chat_body(&body).unwrap();
        assert_eq!(warnings, ["unknown field `foo` in the request body was ignored"]);
        let m = chat["messages"].as_array().unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "be brief\n\nuse tools"}));
        assert_eq!(m[1], json!({"role": "user", "content": "list files"}));
        assert_eq!(m[2]["reasoning_content"], "hmm");
        assert_eq!(m[2]["content"], "ok");
        assert_eq!(m[2]["tool_calls"][0]["function"], json!({"name": "ls", "arguments": "{\"path\":\".\"}"}));
        assert_eq!(m[2]["tool_calls"][1]["id"], "call_2");
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "call_1", "content": "a.rs"}));
        assert_eq!(m[4], json!({"role": "tool", "tool_call_id": "call_2", "content": "/"}));
        assert_eq!(m[5], json!({"role": "user", "content": "thanks"}));
        assert_eq!(m.len(), 6);
        assert_eq!(chat["max_tokens"], 9);
        assert_eq!(chat["tools"][0]["function"]["name"], "ls");
        assert_eq!(chat["chat_template_kwargs"]["enable_thinking"], false);
        let (chat, _) = chat_body(&json!({"input": "hi"})).unwrap();
        assert_eq!(chat["messages"], json!([{"role": "user", "content": "hi"}]));
        // An empty input (a client's probe): one empty user turn after the instructions.
        let (chat, _) = chat_body(&json!({"input": [], "instructions": "be brief", "max_output_tokens": 1})).unwrap();
        assert_eq!(
            chat["messages"],
            json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": ""}])
        );
    }

    /// Hosted tools and tool groups (Codex CLI's `web_search`, `namespace`, `image_generation` beside
    /// its function tools) are skipped, each with a warning; the function tools are offered as
    /// sent, in order; a request of hosted tools only offers none.
    #[test]
    fn hosted_tools_are_skipped_with_a_warning() {
        let ns = json!({"type": "namespace", "name": "mcp", "description": "d",
                        "tools": [{"type": "function", "name": "inner", "parameters": {"type": "object"}}]});
        let body = json!({"input": "x", "tools": [
            {"type": "function", "name": "shell", "parameters": {"type": "object"}},
            {"type": "web_search", "external_web_access": false}, ns, {"type": "image_generation"},
            {"type": "function", "name": "update_plan"}]});
        let (chat, warnings) = chat_body(&body).unwrap();
        let names: Vec<&str> =
            chat["tools"].as_array().unwrap().iter().map(|t| t["function"]["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["shell", "update_plan"]);
        assert_eq!(warnings.len(), 3, "{warnings:?}");
        for (w, ty) in warnings.iter().zip(["web_search", "namespace", "image_generation"]) {
            assert!(w.contains(&format!("\"{ty}\"")) && w.contains("not offered"), "{w}");
        }
        let (chat, warnings) = chat_body(&json!({"input": "x", "tools": [{"type": "web_search_preview"}]})).unwrap();
        assert_eq!(chat["tools"], json!([]));
        assert_eq!(warnings.len(), 1);
    }

    #[test]
    fn refusals_are_clear() {
        let e = chat_body(&json!({"input": "x", "previous_response_id": "resp_1"})).unwrap_err();
        assert_eq!(e.code, "invalid_request");
        assert!(e.message.contains("stateless"), "{}", e.message);
        let e = chat_body(&json!({"input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]})).unwrap_err();
        assert_eq!(e.code, "unsupported_parameter");
        assert!(e.message.contains("\"custom\"") && e.message.contains("web_search"), "{}", e.message);
        assert_eq!(
            chat_body(&json!({"input": "x", "tools": [{"type": "local_shell"}]})).unwrap_err().code,
            "unsupported_parameter"
        );
        let e = chat_body(&json!({"input": "x", "tool_choice": {"type": "allowed_tools", "tools": []}})).unwrap_err();
        assert_eq!(e.code, "unsupported_parameter");
        let (chat, _) = chat_body(&json!({"input": "x", "tool_choice": "required"})).unwrap();
        assert_eq!(chat["tool_choice"], "required");
        let (chat, _) = chat_body(&json!({"input": "x", "tool_choice": {"type": "function", "name": "f"}})).unwrap();
        assert_eq!(chat["tool_choice"], json!({"type": "function", "function": {"name": "f"}}));
        let img = json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]});
        assert_eq!(chat_body(&img).unwrap_err().code, "unsupported_content");
        assert!(chat_body(&json!({"input": 5})).is_err());
        assert!(chat_body(&json!({})).is_err());
    }

    fn echo() -> Echo {
        Echo::new("resp_abc".into(), 1, "m", &json!({"input": "x"}))
    }

    fn chunk(delta: Value) -> Value {
        json!({"choices": [{"index": 0, "delta": delta}]})
    }

    #[test]
    fn stream_events_are_in_order_and_end_in_the_final_response() {
        let mut ev = Events::new(echo());
        let mut all = ev.start();
        all.extend(ev.chunk(&chunk(json!({"role": "assistant", "content": ""}))));
        all.extend(ev.chunk(&chunk(json!({"reasoning_content": "think"}))));
        all.extend(ev.chunk(&chunk(json!({"content": "Hel"}))));
        all.extend(ev.chunk(&chunk(json!({"content": "lo"}))));
        let call = json!({"index": 0, "id": "call_9", "type": "function", "function": {"name": "ls", "arguments": "{\"a\":1}"}});
        all.extend(ev.chunk(&chunk(json!({"tool_calls": [call]}))));
        let body = json!({"choices": [{"finish_reason": "tool_calls"}],
                          "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}});
        all.extend(ev.finish(&body));
        let types: Vec<&str> = all.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(
            types,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, (t, v)) in all.iter().enumerate() {
            assert_eq!(v["sequence_number"], i as u64, "{t}");
            assert_eq!(v["type"], t.as_str());
        }
        let done = &all.last().unwrap().1["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["usage"]["output_tokens"], 4);
        let out = done["output"].as_array().unwrap();
        assert_eq!(out[0]["content"][0]["text"], "think");
        assert_eq!(out[1]["content"][0]["text"], "Hello");
        assert_eq!(out[2]["call_id"], "call_9");
        assert_eq!(out[2]["arguments"], "{\"a\":1}");
        // The item ids of the deltas are those of the final output.
        assert_eq!(all[10].1["item_id"], out[1]["id"]);
        assert_eq!(all[16].1["item_id"], out[2]["id"]);
    }

    #[test]
    fn max_output_tokens_makes_it_incomplete() {
        let body = json!({"choices": [{"finish_reason": "length", "message": {"content": "ab", "tool_calls": []}}],
                          "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}});
        let r = response(&echo(), &body);
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(r["output"][0]["content"][0]["text"], "ab");
        let mut ev = Events::new(echo());
        ev.start();
        let last = ev.finish(&body).pop().unwrap();
        assert_eq!(last.0, "response.incomplete");
    }
}
