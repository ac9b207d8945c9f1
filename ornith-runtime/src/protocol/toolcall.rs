//! Tool calls in the Qwen3.5 / qwen3_coder XML format:
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=ARG>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//! Values are typed with the tool's JSON schema as vLLM's `qwen3_coder` parser does: strings stay
//! strings, integers / numbers / booleans / objects / arrays are parsed, `null`/`None` become null
//! for nullable or non-string parameters, and a value that does not parse as its declared type
//! stays a string (booleans other than `true` degrade to `false`, as in vLLM).
//!
//! Differences from vLLM, on purpose or for size: a `</parameter>` is structural when followed
//! (after whitespace) by `<parameter=`, `</function>`, `</tool_call>` or the end of the block, but
//! nested literal `<parameter=` blocks inside a value are not depth-tracked; Python-literal values
//! (`{'a': 1}`) of container parameters are not converted (vLLM uses `ast.literal_eval`) and stay
//! strings.

use serde_json::{Map, Value};

pub const TOOL_CALL_START: &str = "<tool_call>";
pub const TOOL_CALL_END: &str = "</tool_call>";
pub const FUNCTION_PREFIX: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAM_PREFIX: &str = "<parameter=";
const PARAM_END: &str = "</parameter>";

/// One parsed call, in OpenAI terms.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// A JSON object, serialised (OpenAI `function.arguments` is a string).
    pub arguments: String,
}

/// Index of the next structural `<parameter=` at or after `from` (at the start or after `\n`).
fn next_param_start(text: &str, mut from: usize) -> Option<usize> {
    while let Some(i) = text.get(from..).and_then(|t| t.find(PARAM_PREFIX)) {
        let at = from + i;
        if at == 0 || text.as_bytes()[at - 1] == b'\n' {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// End of a parameter value: the first `</parameter>` followed by a structural delimiter, by the
/// beginning of one that the output's end cut off (`</func` when `max_tokens` ran out), or by
/// the end of the text.
fn param_value_end(value: &str) -> Option<usize> {
    const DELIMITERS: [&str; 3] = [PARAM_PREFIX, FUNCTION_END, TOOL_CALL_END];
    let mut from = 0;
    while let Some(i) = value[from..].find(PARAM_END) {
        let at = from + i;
        let rest = value[at + PARAM_END.len()..].trim_start();
        if DELIMITERS.iter().any(|d| rest.starts_with(d) || d.starts_with(rest)) {
            return Some(at);
        }
        from = at + PARAM_END.len();
    }
    None
}

/// A function name must look like an identifier (vLLM rejects template debris such as
/// `{{ name }}` so clients never see phantom calls).
fn valid_name(name: &str) -> bool {
    !name.is_empty() && !name.chars().any(|c| "{}<>\"' \t\n\r".contains(c))
}

/// `properties` of the tool named `name` in an OpenAI `tools` array.
fn tool_properties<'a>(tools: Option<&'a Value>, name: &str) -> Option<&'a Map<String, Value>> {
    tools?.as_array()?.iter().find_map(|t| {
        let f = t.get("function").unwrap_or(t);
        if f.get("name")?.as_str()? == name {
            f.get("parameters")?.get("properties")?.as_object()
        } else {
            None
        }
    })
}

/// The declared type of a parameter schema (lowercase) and whether null is admitted.
fn schema_type(schema: &Value) -> (String, bool) {
    let norm = |v: &Value| match v {
        Value::String(s) => s.trim().to_lowercase(),
        other => other.to_string().to_lowercase(),
    };
    if let Some(t) = schema.get("type") {
        if let Value::Array(opts) = t {
            let nullable = opts.iter().any(|o| norm(o) == "null");
            let first = opts.iter().map(norm).find(|o| o != "null").unwrap_or_else(|| "string".into());
            return (first, nullable);
        }
        let t = norm(t);
        let nullable = t == "null";
        return (t, nullable);
    }
    if let Some(Value::Array(opts)) = schema.get("anyOf") {
        let mut nullable = false;
        let mut picked: Option<String> = None;
        for o in opts {
            if let Some(t) = o.get("type") {
                let t = norm(t);
                if t == "null" {
                    nullable = true;
                } else if picked.is_none() {
                    picked = Some(t);
                }
            }
        }
        return (picked.unwrap_or_else(|| "string".into()), nullable);
    }
    ("string".into(), false)
}

/// Converts the raw text of a parameter to JSON according to its schema.
pub fn convert_value(raw: &str, schema: Option<&Value>) -> Value {
    let Some(schema) = schema else { return Value::String(raw.to_string()) };
    let (ty, nullable) = schema_type(schema);
    let lower = raw.to_lowercase();
    let is_null_word = lower == "null" || lower == "none";
    if nullable && is_null_word {
        return Value::Null;
    }
    if ["string", "str", "text", "varchar", "char", "enum"].contains(&ty.as_str()) {
        return Value::String(raw.to_string());
    }
    if is_null_word {
        return Value::Null;
    }
    let trimmed = raw.trim();
    if ["int", "uint", "long", "short", "unsigned"].iter().any(|p| ty.starts_with(p)) {
        if let Ok(i) = trimmed.parse::<i64>() {
            return Value::from(i);
        }
        if let Ok(u) = trimmed.parse::<u64>() {
            return Value::from(u);
        }
        return Value::String(raw.to_string());
    }
    if ty.starts_with("num") || ty.starts_with("float") {
        if let Ok(f) = trimmed.parse::<f64>() {
            if f.is_finite() {
                // Whole numbers become integers (vLLM: `f if f - int(f) != 0 else int(f)`).
                if f.fract() == 0.0 && f.abs() < 9.0e15 {
                    return Value::from(f as i64);
                }
                if let Some(n) = serde_json::Number::from_f64(f) {
                    return Value::Number(n);
                }
            }
        }
        return Value::String(raw.to_string());
    }
    if ["boolean", "bool", "binary"].contains(&ty.as_str()) {
        return Value::Bool(lower.trim() == "true");
    }
    let container =
        ["object", "array", "arr"].contains(&ty.as_str()) || ty.starts_with("dict") || ty.starts_with("list");
    match serde_json::from_str::<Value>(trimmed) {
        Ok(Value::String(inner)) if container => {
            // A JSON-encoded document inside a string: decode once more if that parses.
            serde_json::from_str::<Value>(&inner).unwrap_or(Value::String(inner))
        }
        Ok(v) => v,
        Err(_) => Value::String(raw.to_string()),
    }
}

/// Parses the inside of one `<tool_call>` block (the text after `<tool_call>`, up to
/// `</tool_call>` or the end of the output). `None` when it holds no valid `<function=NAME>`.
pub fn parse_block(block: &str, tools: Option<&Value>) -> Option<ToolCall> {
    let f = block.find(FUNCTION_PREFIX)?;
    let after = &block[f + FUNCTION_PREFIX.len()..];
    let name_end = after.find('>')?;
    let name = after[..name_end].trim();
    if !valid_name(name) {
        return None;
    }
    let props = tool_properties(tools, name);
    let mut body = &after[name_end + 1..];
    // The body ends at the last structural `</function>` (values may contain the literal text).
    if let Some(fe) = body.rfind(FUNCTION_END) {
        if body[fe + FUNCTION_END.len()..].trim().is_empty() {
            body = &body[..fe];
        }
    }
    let mut args = Map::new();
    let mut pos = 0;
    while let Some(ps) = next_param_start(body, pos) {
        let name_start = ps + PARAM_PREFIX.len();
        let Some(ne) = body[name_start..].find('>') else { break };
        let pname = body[name_start..name_start + ne].trim().to_string();
        let value_start = name_start + ne + 1;
        let value_text = &body[value_start..];
        let (mut value, next) = match param_value_end(value_text) {
            Some(e) => (&value_text[..e], value_start + e + PARAM_END.len()),
            // Missing `</parameter>`: the next structural `<parameter=` or the end closes it.
            None => match next_param_start(value_text, 1) {
                Some(n) => (&value_text[..n], value_start + n),
                None => (value_text, body.len()),
            },
        };
        if let Some(v) = value.strip_prefix('\n') {
            value = v;
        }
        if let Some(v) = value.strip_suffix('\n') {
            value = v;
        }
        let schema = props.and_then(|p| p.get(&pname));
        args.insert(pname, convert_value(value, schema));
        pos = next;
    }
    Some(ToolCall { name: name.to_string(), arguments: Value::Object(args).to_string() })
}

/// Start of the first `<tool_call>` in `text` that is followed by `<function=` before its
/// `</tool_call>` (a bare `<tool_call>` in prose is not a call) — or, when the block is still
/// open, any `<tool_call>` (more text may complete it).
pub fn find_call_start(text: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = text[from..].find(TOOL_CALL_START) {
        let at = from + i;
        let inner = &text[at + TOOL_CALL_START.len()..];
        match inner.find(TOOL_CALL_END) {
            Some(close) if !inner[..close].contains(FUNCTION_PREFIX) => {
                from = at + TOOL_CALL_START.len() + close + TOOL_CALL_END.len();
            }
            _ => return Some(at),
        }
    }
    None
}

/// End (exclusive, past `</tool_call>`) of the block that starts at offset 0 of `text`, when its
/// structural close has arrived: a `</tool_call>` preceded (after whitespace) by `</function>`.
pub fn find_call_end(text: &str) -> Option<usize> {
    let mut from = TOOL_CALL_START.len();
    while let Some(i) = text.get(from..)?.find(TOOL_CALL_END) {
        let at = from + i;
        if text[..at].trim_end().ends_with(FUNCTION_END) {
            return Some(at + TOOL_CALL_END.len());
        }
        from = at + TOOL_CALL_END.len();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Value {
        json!([{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "line": {"type": "integer"}, "ratio": {"type": "number"},
            "dry": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "count": {"type": ["integer", "null"]}
        }}}}])
    }

    #[test]
    fn types_values_by_schema() {
        let block = "\n<function=edit>\n<parameter=path>\nsrc/a.rs\n</parameter>\n<parameter=line>\n42\n</parameter>\n\
<parameter=ratio>\n2.5\n</parameter>\n<parameter=dry>\nTrue\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n\
<parameter=tags>\n[\"x\"]\n</parameter>\n<parameter=note>\nNone\n</parameter>\n<parameter=count>\nnull\n</parameter>\n\
<parameter=extra>\n7\n</parameter>\n</function>\n";
        let t = tools();
        let c = parse_block(block, Some(&t)).unwrap();
        assert_eq!(c.name, "edit");
        let a: Value = serde_json::from_str(&c.arguments).unwrap();
        assert_eq!(
            a,
            json!({"path": "src/a.rs", "line": 42, "ratio": 2.5, "dry": true, "opts": {"a": [1, 2]},
                   "tags": ["x"], "note": null, "count": null, "extra": "7"})
        );
        // Key order follows the output.
        assert!(c.arguments.starts_with("{\"path\""));
    }

    #[test]
    fn strings_stay_strings_and_bad_numbers_degrade() {
        let t = tools();
        let c = parse_block("<function=edit>\n<parameter=path>\n123\n</parameter>\n<parameter=line>\nten\n</parameter>\n<parameter=ratio>\n3.0\n</parameter>\n</function>", Some(&t)).unwrap();
        let a: Value = serde_json::from_str(&c.arguments).unwrap();
        assert_eq!(a, json!({"path": "123", "line": "ten", "ratio": 3}));
    }

    #[test]
    fn multiline_values_literal_tags_and_missing_close() {
        let block = "<function=write>\n<parameter=code>\nfn a() {}\n</parameter> not yet\nlast line\n</parameter>\n<parameter=mode>\nfast\n</function>";
        let c = parse_block(block, None).unwrap();
        let a: Value = serde_json::from_str(&c.arguments).unwrap();
        assert_eq!(a, json!({"code": "fn a() {}\n</parameter> not yet\nlast line", "mode": "fast"}));
        assert!(parse_block("<function={{ name }}>\n</function>", None).is_none());
        assert!(parse_block("no function here", None).is_none());
        let c = parse_block("<function=noargs>\n</function>", None).unwrap();
        assert_eq!(c.arguments, "{}");
    }

    /// An output cut off by `max_tokens` inside the closing tags keeps the values it completed:
    /// a `</parameter>` followed by the start of `</function>` (or of the next `<parameter=`) at
    /// the very end closes its value; the cut tag is not part of it.
    #[test]
    fn a_block_cut_inside_its_closing_tags_keeps_clean_values() {
        let t = tools();
        for cut in ["</func", "</", "<", "<param", "</function", "\n</tool_"] {
            let block = format!(
                "\n<function=edit>\n<parameter=path>\nsrc/a.rs\n</parameter>\n<parameter=line>\n1\n</parameter>\n{cut}"
            );
            let c = parse_block(&block, Some(&t)).unwrap();
            let a: Value = serde_json::from_str(&c.arguments).unwrap();
            assert_eq!(a, json!({"path": "src/a.rs", "line": 1}), "cut at {cut:?}");
        }
        // A literal `</parameter>` inside a value, followed by ordinary text, is still content.
        let c = parse_block("<function=edit>\n<parameter=path>\na</parameter>b\n</parameter>\n</fu", None).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&c.arguments).unwrap(), json!({"path": "a</parameter>b"}));
    }

    #[test]
    fn call_boundaries() {
        let text = "see <tool_call></tool_call> then <tool_call>\n<function=f>\n</function>\n</tool_call>";
        let s = find_call_start(text).unwrap();
        assert_eq!(&text[s..s + 11], "<tool_call>");
        assert!(s > 20);
        let e = find_call_end(&text[s..]).unwrap();
        assert_eq!(s + e, text.len());
        assert_eq!(find_call_end("<tool_call>\n<function=f>\n"), None);
        // Unclosed start counts (more may come).
        assert_eq!(find_call_start("a <tool_call>\n<func"), Some(2));
    }
}
