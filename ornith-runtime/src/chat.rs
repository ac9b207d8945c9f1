//! Chat template rendering (`chat_template.jinja`) with minijinja, set up to render like
//! transformers' `apply_chat_template(tokenize=False)`:
//! * environment: `trim_blocks` and `lstrip_blocks` on, trailing newline of the template dropped,
//!   loop controls on (transformers' jinja2 environment);
//! * Python string/dict methods (`startswith`, `split`, `rstrip`, `items`, …) via
//!   minijinja-contrib `pycompat`;
//! * `tojson` = Python `json.dumps(x, ensure_ascii=False)`: separators `", "` and `": "`, keys in
//!   insertion order, non-ASCII kept (transformers overrides jinja's HTML-escaping `tojson`);
//! * printing and `|string` follow Python `str()`: `True`, `False`, `None` (minijinja 3 already
//!   displays values this way; the formatter and filter pin it);
//! * `trim` strips Python's whitespace set (Rust's plus U+001C…U+001F);
//! * `raise_exception(msg)` fails the render with `msg`.
//!
//! OpenAI clients send tool-call `arguments` as a JSON string; the template iterates them as a
//! mapping (`arguments|items`). transformers' own server (`transformers serve`) parses such strings
//! with `json.loads` before rendering, and so do we (plain `apply_chat_template` would fail on a
//! string with "Can only get item pairs from a mapping").
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;

const TEMPLATE_NAME: &str = "chat_template.jinja";

pub struct ChatTemplate {
    env: Environment<'static>,
}

/// Python's `str.isspace()` set: Unicode White_Space plus the four information separators.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python `str()` of a template value: `True`/`False`/`None` for booleans and none.
fn py_str(v: &Value) -> String {
    match v.kind() {
        minijinja::value::ValueKind::Bool => if v.is_true() { "True" } else { "False" }.to_string(),
        minijinja::value::ValueKind::None => "None".to_string(),
        minijinja::value::ValueKind::Undefined => String::new(),
        _ => v.to_string(),
    }
}

/// serde_json formatter writing Python `json.dumps` default separators (`", "`, `": "`).
struct PyJsonFormatter;

impl serde_json::ser::Formatter for PyJsonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// `json.dumps(value, ensure_ascii=False)`.
pub fn py_json_dumps<T: Serialize>(value: &T) -> Result<String> {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PyJsonFormatter);
    value.serialize(&mut ser)?;
    Ok(String::from_utf8(out)?)
}

fn tojson_filter(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    // transformers' tojson accepts ensure_ascii/indent/separators/sort_keys; only the defaults
    // (the form this template uses) are implemented.
    kwargs.assert_all_used()?;
    py_json_dumps(&value).map(Value::from).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn build_env(source: String) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| anyhow!("minijinja syntax config: {e}"))?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        // No autoescaping (transformers renders plain text); Python str() for scalars.
        out.write_str(&py_str(value)).map_err(Error::from)
    });
    env.add_filter("tojson", tojson_filter);
    env.add_filter("string", |v: Value| py_str(&v));
    env.add_filter("trim", |s: String| s.trim_matches(is_py_space).to_string());
    env.add_function("raise_exception", raise_exception);
    env.add_template_owned(TEMPLATE_NAME, source).map_err(|e| anyhow!("chat template does not parse: {e:#}"))?;
    Ok(env)
}

/// Parses tool-call `arguments` given as JSON strings (OpenAI form) into mappings, as
/// `transformers serve` does before rendering.
fn normalise_messages(messages: &serde_json::Value) -> Result<serde_json::Value> {
    let mut messages = messages.clone();
    let Some(list) = messages.as_array_mut() else {
        bail!("messages must be an array");
    };
    for (i, m) in list.iter_mut().enumerate() {
        let Some(calls) = m.get_mut("tool_calls").and_then(|c| c.as_array_mut()) else {
            continue;
        };
        for (j, call) in calls.iter_mut().enumerate() {
            let func = if call.get("function").is_some_and(|f| f.is_object()) { &mut call["function"] } else { call };
            if let Some(serde_json::Value::String(s)) = func.get("arguments") {
                let parsed: serde_json::Value = serde_json::from_str(s)
                    .with_context(|| format!("message {i}, tool call {j}: arguments is not valid JSON"))?;
                func["arguments"] = parsed;
            }
        }
    }
    Ok(messages)
}

impl ChatTemplate {
    pub fn from_file(path: &Path) -> Result<Self> {
        let source = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::from_source(source).with_context(|| format!("loading {}", path.display()))
    }

    pub fn from_source(source: String) -> Result<Self> {
        Ok(Self { env: build_env(source)? })
    }

    /// messages: OpenAI-style array; tools: optional OpenAI tools array; kwargs: chat_template_kwargs (e.g. enable_thinking).
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let messages = normalise_messages(messages)?;
        // Context as transformers builds it: the kwargs first, then the fixed names on top.
        let mut ctx = serde_json::Map::new();
        for (k, v) in kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), messages);
        ctx.insert("tools".into(), tools.cloned().unwrap_or(serde_json::Value::Null));
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        let tmpl = self.env.get_template(TEMPLATE_NAME).expect("template added at construction");
        tmpl.render(Value::from(minijinja::value::Serde(&ctx))).map_err(template_error)
    }
}

/// A `raise_exception` message comes back as just the message; other failures keep minijinja's
/// description (with the template line).
fn template_error(e: Error) -> anyhow::Error {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = cur {
        if let Some(me) = err.downcast_ref::<Error>() {
            if me.kind() == ErrorKind::InvalidOperation {
                if let Some(d) = me.detail() {
                    return anyhow!("chat template: {d}");
                }
            }
        }
        cur = err.source();
    }
    anyhow!("chat template rendering failed: {e:#}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_dumps_matches_python() {
        let v = json!({"b": 1, "a": [true, null, 1.5, "é\n\"x\""], "c": {}});
        assert_eq!(py_json_dumps(&v).unwrap(), r#"{"b": 1, "a": [true, null, 1.5, "é\n\"x\""], "c": {}}"#);
    }

    #[test]
    fn python_str_and_trim() {
        let t = ChatTemplate::from_source("{{ a }}|{{ b|string }}|{{ c }}|{{ d|trim }}|".into()).unwrap();
        let tmpl = t.env.get_template(TEMPLATE_NAME).unwrap();
        let out = tmpl.render(minijinja::context! { a => true, b => false, c => (), d => "\u{1f} x \n" }).unwrap();
        assert_eq!(out, "True|False|None|x|");
    }

    #[test]
    fn raise_exception_message_is_the_error() {
        let t = ChatTemplate::from_source("{{ raise_exception('nope: ' ~ messages|length) }}".into()).unwrap();
        let e = t.render(&json!([]), None, false, &Default::default()).unwrap_err();
        assert_eq!(e.to_string(), "chat template: nope: 0");
    }
}
