//! `ornith tokenize`: JSONL in, token counts out, for users who budget their context.
//!
//! Input per line: `{"text": "…"}` (encoded as is) or a chat request `{"messages": […],
//! "tools"?, "chat_template_kwargs"?, "add_generation_prompt"? (default true)}` (rendered with the
//! chat template first, exactly as `serve` does). Output per line: `{"ids": […], "count": N}`
//! (plus `custom_id` when the input has one), or `{"error": {"code", "message", "line"}}`.

use std::io::{BufRead, Write};

use serde_json::{json, Value};

use super::lines::{LineReader, RawLine};
use super::request::{self, LineError};
use super::{PromptRenderer, TextCodec};

fn ids_for(v: &Value, codec: &dyn TextCodec, renderer: &dyn PromptRenderer) -> Result<Vec<u32>, LineError> {
    let obj = v.as_object().ok_or_else(|| LineError::new("invalid_request", "a line must be a JSON object"))?;
    let tok = LineError::tokenizer;
    if let Some(t) = obj.get("text") {
        let t = t.as_str().ok_or_else(|| LineError::new("invalid_request", "`text` must be a string"))?;
        return codec.encode(t).map_err(tok);
    }
    let Some(messages) = obj.get("messages") else {
        return Err(LineError::new("invalid_request", "expected {\"text\": …} or {\"messages\": …}"));
    };
    let messages = request::normalize_messages(messages)?;
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => None,
        Some(t @ Value::Array(_)) => Some(t),
        Some(_) => return Err(LineError::new("invalid_request", "`tools` must be an array")),
    };
    let kwargs = request::template_kwargs(obj.get("chat_template_kwargs").filter(|v| !v.is_null()))?;
    let add = match obj.get("add_generation_prompt") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(LineError::new("invalid_request", "`add_generation_prompt` must be true or false")),
    };
    let text = renderer
        .render(&messages, tools, add, &kwargs)
        .map_err(|e| LineError::new("invalid_request", format!("{e:#}")))?;
    codec.encode(&text).map_err(tok)
}

/// Runs the tokenize loop; one output line per input line.
pub fn tokenize<R: BufRead, W: Write>(
    reader: R,
    mut writer: W,
    codec: &dyn TextCodec,
    renderer: &dyn PromptRenderer,
    max_line_bytes: usize,
) -> anyhow::Result<u64> {
    let mut lines = LineReader::new(reader, max_line_bytes);
    let mut n = 0u64;
    while let Some(raw) = lines.next_line()? {
        n += 1;
        let (custom_id, res) = match raw {
            RawLine::TooLong { len, .. } => (
                None,
                Err(LineError::new(
                    "line_too_long",
                    format!("the line has {len} bytes, over the limit of {max_line_bytes}"),
                )),
            ),
            RawLine::Bytes(b) => match std::str::from_utf8(&b) {
                Err(_) => (None, Err(LineError::new("invalid_utf8", "the line is not valid UTF-8"))),
                Ok(t) => match serde_json::from_str::<Value>(t) {
                    Err(e) => (
                        request::scan_custom_id(t),
                        Err(LineError::new("invalid_json", format!("malformed JSON: {e}"))),
                    ),
                    Ok(v) => (request::custom_id_of(&v), ids_for(&v, codec, renderer)),
                },
            },
        };
        let mut out = match res {
            Ok(ids) => json!({"ids": ids, "count": ids.len()}),
            Err(e) => json!({"error": {"code": e.code, "message": e.message, "line": n}}),
        };
        if let Some(id) = custom_id {
            out.as_object_mut().unwrap().insert("custom_id".into(), Value::String(id));
        }
        writeln!(writer, "{out}")?;
        writer.flush()?;
    }
    Ok(n)
}
