//! The runtime chat template against transformers' renderings
//! (tests/generators/chat_template_goldens.py).
use std::path::Path;

use ornith_runtime::chat::ChatTemplate;
use serde_json::{json, Value};

fn template() -> ChatTemplate {
    // One dir per call: the tests of this binary run in parallel threads.
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ornith-chat-test-{}-{n}", std::process::id()));
    xtask::tokenizer::write_tokenizer_files(&dir).expect("writing tokenizer files");
    let t = ChatTemplate::from_file(&dir.join("chat_template.jinja")).expect("loading chat_template.jinja");
    let _ = std::fs::remove_dir_all(&dir);
    t
}

fn golden() -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/chat_template.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["cases"].as_array().unwrap().clone()
}

fn render(t: &ChatTemplate, c: &Value) -> anyhow::Result<String> {
    let tools = if c["tools"].is_null() { None } else { Some(&c["tools"]) };
    t.render(&c["messages"], tools, c["add_generation_prompt"].as_bool().unwrap(), c["kwargs"].as_object().unwrap())
}

#[test]
fn renders_like_transformers() {
    let t = template();
    let cases: Vec<Value> = golden().into_iter().filter(|c| c.get("expected").is_some()).collect();
    assert!(cases.len() >= 12);
    for c in &cases {
        let got = render(&t, c).unwrap_or_else(|e| panic!("case {}: {e:#}", c["name"]));
        assert_eq!(got, c["expected"].as_str().unwrap(), "case {}", c["name"]);
    }
}

#[test]
fn template_errors_carry_the_template_message() {
    let t = template();
    let cases: Vec<Value> = golden().into_iter().filter(|c| c.get("error").is_some()).collect();
    assert!(cases.len() >= 4);
    for c in &cases {
        let err = render(&t, c).expect_err(c["name"].as_str().unwrap()).to_string();
        match c["error_source"].as_str().unwrap() {
            "template" => {
                assert_eq!(err, format!("chat template: {}", c["error"].as_str().unwrap()), "case {}", c["name"])
            }
            // transformers refuses an empty conversation itself; the template's own check fires here.
            _ => assert_eq!(err, "chat template: No messages provided.", "case {}", c["name"]),
        }
    }
}

#[test]
fn bad_inputs_are_errors() {
    let t = template();
    let none = serde_json::Map::new();
    let bad_args = json!([{"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}]);
    let e = t.render(&bad_args, None, false, &none).unwrap_err();
    assert!(format!("{e:#}").contains("arguments is not valid JSON"), "{e:#}");
    assert!(t.render(&json!({"role": "user"}), None, false, &none).is_err());
    assert!(ChatTemplate::from_source("{% if %}".into()).is_err());
    assert!(ChatTemplate::from_file(Path::new("/nonexistent/chat_template.jinja")).is_err());
}

#[test]
fn thinking_switch() {
    let t = template();
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let mut kw = serde_json::Map::new();
    assert_eq!(
        t.render(&msgs, None, true, &kw).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    );
    kw.insert("enable_thinking".into(), json!(false));
    assert_eq!(
        t.render(&msgs, None, true, &kw).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
}
