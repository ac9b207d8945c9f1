//! The Anthropic Messages API on top of the OpenAI-shaped front end: a `/v1/messages` body becomes
//! a chat body (messages as the chat template expects them, tools as OpenAI function tools), and
//! the chat result (or its stream chunks) becomes a message (or its event stream).

use serde_json::{json, Map, Value};

use crate::protocol::request::LineError;

/// Fields of a Messages body this server reads, and those it ignores because they do not change
/// the result (`metadata`, `service_tier`); others are warned about.
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
    "service_tier",
];

const TEXT_ONLY: &str = "this build serves text only";

fn invalid(m: impl Into<String>) -> LineError {
    LineError::invalid(m)
}

/// Text of `content` (a string or text blocks), for `system` and `tool_result` contents.
fn text_of(v: &Value, what: &str) -> Result<String, LineError> {
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::new();
            for b in blocks {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => parts.push(
                        b.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| invalid(format!("{what}: a text block needs `text`")))?,
                    ),
                    Some("image" | "document" | "search_result") => {
                        return Err(LineError::new("unsupported_content", format!("{what}: {TEXT_ONLY}")))
                    }
                    _ => return Err(invalid(format!("{what}: expected text blocks"))),
                }
            }
            Ok(parts.join("\n"))
        }
        _ => Err(invalid(format!("{what} must be a string or a list of text blocks"))),
    }
}

/// The content of one message as blocks (a string is one text block).
fn blocks(m: &Value, i: usize) -> Result<Vec<Value>, LineError> {
    match m.get("content") {
        Some(Value::String(s)) => Ok(vec![json!({"type": "text", "text": s})]),
        Some(Value::Array(a)) => Ok(a.clone()),
        _ => Err(invalid(format!("messages[{i}].content must be a string or a list of content blocks"))),
    }
}

/// Converts the Anthropic `messages` and `system` to chat-template messages: `tool_use` blocks
/// become the assistant's `tool_calls`, `thinking` blocks its `reasoning_content`, each
/// `tool_result` a `tool` message.
fn messages(body: &Map<String, Value>) -> Result<Vec<Value>, LineError> {
    let mut out = Vec::new();
    if let Some(sys) = body.get("system").filter(|v| !v.is_null()) {
        out.push(json!({"role": "system", "content": text_of(sys, "system")?}));
    }
    let msgs = body.get("messages").and_then(Value::as_array).ok_or_else(|| invalid("`messages` must be an array"))?;
    if msgs.is_empty() {
        return Err(invalid("`messages` is empty"));
    }
    for (i, m) in msgs.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let blocks = blocks(m, i)?;
        match role {
            Some("user") => {
                let mut text = Vec::new();
                for b in &blocks {
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => {
                            text.push(b.get("text").and_then(Value::as_str).unwrap_or_default().to_string())
                        }
                        Some("tool_result") => {
                            let id = b.get("tool_use_id").and_then(Value::as_str).ok_or_else(|| {
                                invalid(format!("messages[{i}]: a tool_result block needs `tool_use_id`"))
                            })?;
                            let content = text_of(
                                b.get("content").unwrap_or(&Value::Null),
                                &format!("messages[{i}].tool_result"),
                            )?;
                            out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                        }
                        Some("image" | "document" | "search_result") => {
                            return Err(LineError::new("unsupported_content", format!("messages[{i}]: {TEXT_ONLY}")))
                        }
                        other => {
                            return Err(invalid(format!("messages[{i}]: unsupported user content block {other:?}")))
                        }
                    }
                }
                if !text.is_empty() {
                    out.push(json!({"role": "user", "content": text.concat()}));
                }
            }
            Some("assistant") => {
                let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
                for b in &blocks {
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => text += b.get("text").and_then(Value::as_str).unwrap_or_default(),
                        Some("thinking") => reasoning += b.get("thinking").and_then(Value::as_str).unwrap_or_default(),
                        Some("redacted_thinking") => {}
                        Some("tool_use") => {
                            let name = b
                                .get("name")
                                .and_then(Value::as_str)
                                .ok_or_else(|| invalid(format!("messages[{i}]: a tool_use block needs `name`")))?;
                            let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                            calls.push(json!({"id": b.get("id").cloned().unwrap_or(Value::Null), "type": "function",
                                              "function": {"name": name, "arguments": input}}));
                        }
                        other => {
                            return Err(invalid(format!(
                                "messages[{i}]: unsupported assistant content block {other:?}"
                            )))
                        }
                    }
                }
                let mut m = json!({"role": "assistant", "content": text});
                if !reasoning.is_empty() {
                    m["reasoning_content"] = json!(reasoning);
                }
                if !calls.is_empty() {
                    m["tool_calls"] = json!(calls);
                }
                out.push(m);
            }
            _ => return Err(invalid(format!("messages[{i}]: `role` must be \"user\" or \"assistant\""))),
        }
    }
    Ok(out)
}

/// The chat-completions body of a Messages body (`counting`: a `count_tokens` body, which has no
/// `max_tokens`), with a warning per field this server does not know.
pub fn chat_body(body: &Value, counting: bool) -> Result<(Value, Vec<String>), LineError> {
    let b = body.as_object().ok_or_else(|| invalid("the request body must be a JSON object"))?;
    let mut warnings = Vec::new();
    for k in b.keys() {
        if !FIELDS.contains(&k.as_str()) {
            warnings.push(format!("unknown field `{k}` in the request body was ignored"));
        }
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages(b)?));
    if !counting {
        match b.get("max_tokens") {
            Some(Value::Number(n)) => {
                chat.insert("max_tokens".into(), Value::Number(n.clone()));
            }
            _ => return Err(invalid("`max_tokens` is required (an integer)")),
        }
    }
    for k in ["temperature", "top_p", "top_k", "stream"] {
        if let Some(v) = b.get(k) {
            chat.insert(k.into(), v.clone());
        }
    }
    if let Some(s) = b.get("stop_sequences").filter(|v| !v.is_null()) {
        chat.insert("stop".into(), s.clone());
    }
    if let Some(tools) = b.get("tools").filter(|v| !v.is_null()) {
        let arr = tools.as_array().ok_or_else(|| invalid("`tools` must be an array"))?;
        let mut out = Vec::new();
        for t in arr {
            if let Some(ty) = t.get("type").and_then(Value::as_str).filter(|&ty| ty != "custom") {
                return Err(LineError::new(
                    "unsupported_parameter",
                    format!("tool type {ty:?} is not supported by this build (only custom tools with `input_schema`)"),
                ));
            }
            let name = t.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
            let name = name.ok_or_else(|| invalid("each tool needs a `name`"))?;
            let mut f = json!({"name": name, "parameters": t.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object"}))});
            if let Some(d) = t.get("description") {
                f["description"] = d.clone();
            }
            out.push(json!({"type": "function", "function": f}));
        }
        chat.insert("tools".into(), Value::Array(out));
    }
    if let Some(tc) = b.get("tool_choice").filter(|v| !v.is_null()) {
        match tc.get("type").and_then(Value::as_str) {
            Some("auto") => {
                chat.insert("tool_choice".into(), json!("auto"));
            }
            Some("none") => {
                chat.insert("tool_choice".into(), json!("none"));
            }
            // A forced call: any tool, or the named one (the chat request checks the name).
            Some("any") => {
                chat.insert("tool_choice".into(), json!("required"));
            }
            Some("tool") => {
                let name = tc
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid("`tool_choice` of type tool needs a `name`"))?;
                chat.insert("tool_choice".into(), json!({"type": "function", "function": {"name": name}}));
            }
            _ => {
                return Err(LineError::new(
                    "unsupported_parameter",
                    "`tool_choice` must be of type auto, any, tool or none",
                ))
            }
        }
    }
    if let Some(th) = b.get("thinking").filter(|v| !v.is_null()) {
        let on = match th.get("type").and_then(Value::as_str) {
            Some("enabled" | "adaptive") => true,
            Some("disabled") => false,
            _ => return Err(invalid("`thinking.type` must be \"enabled\" or \"disabled\"")),
        };
        chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": on}));
        // The budget is kept: once the reasoning reaches it the model is made to answer.
        if let (true, Some(n)) = (on, th.get("budget_tokens").filter(|v| !v.is_null())) {
            let n = n.as_u64().ok_or_else(|| invalid("`thinking.budget_tokens` must be a non-negative integer"))?;
            chat.insert("thinking_budget".into(), json!(n));
        }
    }
    Ok((Value::Object(chat), warnings))
}

/// `toolu_…` for an OpenAI `call_…` id.
fn tool_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.strip_prefix("call_").unwrap_or(call_id))
}

/// `msg_…` for a `chatcmpl-…` id.
pub fn message_id(chat_id: &str) -> String {
    format!("msg_{}", chat_id.strip_prefix("chatcmpl-").unwrap_or(chat_id).replace('-', ""))
}

/// (`stop_reason`, `stop_sequence`) of a chat result.
fn stop_of(body: &Value) -> (&'static str, Value) {
    let choice = &body["choices"][0];
    match choice["finish_reason"].as_str() {
        Some("tool_calls") => ("tool_use", Value::Null),
        Some("length") => ("max_tokens", Value::Null),
        _ => match &choice["stop_reason"] {
            Value::String(s) => ("stop_sequence", json!(s)),
            _ => ("end_turn", Value::Null),
        },
    }
}

fn tool_input(args: &Value) -> Value {
    args.as_str().and_then(|a| serde_json::from_str(a).ok()).unwrap_or_else(|| json!({}))
}

/// The Messages response of a (non-streamed) chat result.
pub fn message(body: &Value) -> Value {
    let m = &body["choices"][0]["message"];
    let mut content = Vec::new();
    if let Some(r) = m["reasoning_content"].as_str().filter(|r| !r.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
    }
    if let Some(t) = m["content"].as_str().filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": t}));
    }
    for c in m["tool_calls"].as_array().into_iter().flatten() {
        content.push(json!({"type": "tool_use", "id": tool_id(c["id"].as_str().unwrap_or_default()),
                            "name": c["function"]["name"], "input": tool_input(&c["function"]["arguments"])}));
    }
    let (stop_reason, stop_sequence) = stop_of(body);
    json!({
        "id": message_id(body["id"].as_str().unwrap_or_default()), "type": "message", "role": "assistant",
        "model": body["model"], "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": usage(&body["usage"]),
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Block {
    Text,
    Thinking,
}

/// Turns the chat stream of one request into Messages stream events (name, data).
pub struct Events {
    model: String,
    /// The open text or thinking block, and its index.
    open: Option<(Block, usize)>,
    next: usize,
}

pub type Event = (&'static str, Value);

impl Events {
    pub fn new(model: &str) -> Self {
        Events { model: model.to_string(), open: None, next: 0 }
    }

    /// `message_start`, once the request is accepted.
    pub fn start(&self, id: &str, prompt_tokens: usize) -> Event {
        (
            "message_start",
            json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}),
        )
    }

    fn close(&mut self, out: &mut Vec<Event>) {
        if let Some((_, i)) = self.open.take() {
            out.push(("content_block_stop", json!({"type": "content_block_stop", "index": i})));
        }
    }

    fn text(&mut self, kind: Block, s: &str, out: &mut Vec<Event>) {
        if s.is_empty() {
            return;
        }
        if self.open.map(|(k, _)| k) != Some(kind) {
            self.close(out);
            let i = self.next;
            self.next += 1;
            self.open = Some((kind, i));
            let block = match kind {
                Block::Text => json!({"type": "text", "text": ""}),
                Block::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            };
            out.push((
                "content_block_start",
                json!({"type": "content_block_start", "index": i, "content_block": block}),
            ));
        }
        let i = self.open.map_or(0, |(_, i)| i);
        let delta = match kind {
            Block::Text => json!({"type": "text_delta", "text": s}),
            Block::Thinking => json!({"type": "thinking_delta", "thinking": s}),
        };
        out.push(("content_block_delta", json!({"type": "content_block_delta", "index": i, "delta": delta})));
    }

    /// The events of one `chat.completion.chunk`.
    pub fn chunk(&mut self, chunk: &Value) -> Vec<Event> {
        let mut out = Vec::new();
        let d = &chunk["choices"][0]["delta"];
        if let Some(r) = d["reasoning_content"].as_str() {
            self.text(Block::Thinking, r, &mut out);
        }
        if let Some(t) = d["content"].as_str() {
            self.text(Block::Text, t, &mut out);
        }
        for c in d["tool_calls"].as_array().into_iter().flatten() {
            self.close(&mut out);
            let i = self.next;
            self.next += 1;
            let block = json!({"type": "tool_use", "id": tool_id(c["id"].as_str().unwrap_or_default()),
                               "name": c["function"]["name"], "input": {}});
            out.push((
                "content_block_start",
                json!({"type": "content_block_start", "index": i, "content_block": block}),
            ));
            let args = c["function"]["arguments"].as_str().unwrap_or("{}");
            out.push((
                "content_block_delta",
                json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": args}}),
            ));
            out.push(("content_block_stop", json!({"type": "content_block_stop", "index": i})));
        }
        out
    }

    /// `message_delta` and `message_stop` for the final chat body.
    pub fn finish(&mut self, body: &Value) -> Vec<Event> {
        let mut out = Vec::new();
        self.close(&mut out);
        let (stop_reason, stop_sequence) = stop_of(body);
        out.push((
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                   "usage": usage(&body["usage"])}),
        ));
        out.push(("message_stop", json!({"type": "message_stop"})));
        out
    }
}

/// Anthropic's usage of an OpenAI-shaped one: `input_tokens` counts the prompt tokens not read
/// from the cache, `cache_read_input_tokens` those that were (their sum is the prompt).
fn usage(u: &Value) -> Value {
    let prompt = u["prompt_tokens"].as_u64().unwrap_or(0);
    let cached = u.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64).unwrap_or(0);
    json!({"input_tokens": prompt - cached.min(prompt), "cache_read_input_tokens": cached,
           "cache_creation_input_tokens": 0, "output_tokens": u["completion_tokens"]})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_blocks_map_to_template_messages() {
        let body = json!({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                {"role": "user", "content": "list files"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "ok"},
                    {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "."}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.rs"}]},
                    {"type": "text", "text": "thanks"}]}],
            "tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"}, "stop_sequences": ["END"], "foo": 1});
        let (chat, warnings) = chat_body(&body, false).unwrap();
        assert_eq!(warnings.len(), 1);
        assert_eq!(chat["messages"][0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(chat["messages"][2]["reasoning_content"], "hmm");
        assert_eq!(chat["messages"][2]["tool_calls"][0]["function"], json!({"name": "ls", "arguments": {"path": "."}}));
        assert_eq!(chat["messages"][3], json!({"role": "tool", "tool_call_id": "toolu_1", "content": "a.rs"}));
        assert_eq!(chat["messages"][4], json!({"role": "user", "content": "thanks"}));
        assert_eq!(chat["tools"][0]["function"]["parameters"], json!({"type": "object"}));
        assert_eq!(chat["chat_template_kwargs"]["enable_thinking"], false);
        assert_eq!(chat["stop"], json!(["END"]));
        assert!(chat_body(&json!({"messages": [{"role": "user", "content": "x"}]}), false).is_err());
        assert!(chat_body(&json!({"messages": [{"role": "user", "content": "x"}]}), true).is_ok());
        let img =
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]});
        assert_eq!(chat_body(&img, false).unwrap_err().code, "unsupported_content");
        // Forced calls map to the chat forms; an unknown type is refused.
        let with =
            |tc: Value| json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tool_choice": tc});
        assert_eq!(chat_body(&with(json!({"type": "any"})), false).unwrap().0["tool_choice"], "required");
        assert_eq!(
            chat_body(&with(json!({"type": "tool", "name": "ls"})), false).unwrap().0["tool_choice"],
            json!({"type": "function", "function": {"name": "ls"}})
        );
        assert_eq!(chat_body(&with(json!({"type": "tool"})), false).unwrap_err().code, "invalid_request");
        assert_eq!(chat_body(&with(json!({"type": "some"})), false).unwrap_err().code, "unsupported_parameter");
        // A thinking budget is kept (thinking on); a budget with thinking off means nothing.
        let think =
            |th: Value| json!({"max_tokens": 9000, "messages": [{"role": "user", "content": "x"}], "thinking": th});
        let (chat, _) = chat_body(&think(json!({"type": "enabled", "budget_tokens": 4096})), false).unwrap();
        assert_eq!(chat["thinking_budget"], 4096);
        let (chat, _) = chat_body(&think(json!({"type": "disabled", "budget_tokens": 4096})), false).unwrap();
        assert!(chat.get("thinking_budget").is_none());
        let e = chat_body(&think(json!({"type": "enabled", "budget_tokens": -5})), false).unwrap_err();
        assert_eq!(e.code, "invalid_request");
    }
}
