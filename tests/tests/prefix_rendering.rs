//! What the prefix cache can reuse depends on the chat template rendering earlier turns the same
//! way in later requests. These tests pin down, in tokens, where Ornith's template (Qwen3.5's) keeps
//! a conversation's prefix and where it breaks it (README, "What breaks a prefix").

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ornith_runtime::chat::ChatTemplate;
use ornith_runtime::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

fn files() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ornith-prefix-render-{}", std::process::id()));
        xtask::tokenizer::write_tokenizer_files(&dir).expect("writing tokenizer files");
        dir
    })
}

fn template() -> &'static ChatTemplate {
    static T: OnceLock<ChatTemplate> = OnceLock::new();
    T.get_or_init(|| ChatTemplate::from_file(&files().join("chat_template.jinja")).expect("chat_template.jinja"))
}

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_file(&files().join("tokenizer.json")).expect("tokenizer.json"))
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}])
}

/// The prompt the server builds for `messages` (with the generation prompt), in tokens.
fn prompt(messages: &[Value], thinking: bool) -> (String, Vec<u32>) {
    let mut kwargs = Map::new();
    kwargs.insert("enable_thinking".into(), thinking.into());
    let text = template().render(&Value::Array(messages.to_vec()), Some(&tools()), true, &kwargs).unwrap();
    let ids = tokenizer().encode(&text).unwrap();
    (text, ids)
}

fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// An assistant turn as a client sends it back: reasoning (when thinking), a tool call.
fn assistant(k: usize, thinking: bool) -> Value {
    let mut m = json!({"role": "assistant", "content": "", "tool_calls": [{"id": format!("c{k}"), "type": "function",
        "function": {"name": "read_file", "arguments": format!("{{\"path\": \"src/m{k}.rs\"}}")}}]});
    if thinking {
        m["reasoning_content"] = json!(format!("The bug may be in module {k}; read it."));
    }
    m
}

fn tool(k: usize) -> Value {
    json!({"role": "tool", "tool_call_id": format!("c{k}"), "content": format!("pub fn m{k}() -> u32 {{ {k} }}\n")})
}

/// In an agent's tool loop every request's prompt begins with the previous request's whole
/// prompt, token for token, thinking on or off: only the new tokens need a prefill.
#[test]
fn a_tool_loop_extends_the_previous_prompt_token_for_token() {
    for thinking in [true, false] {
        let mut msgs = vec![
            json!({"role": "system", "content": "You are a coding agent."}),
            json!({"role": "user", "content": "Find the bug."}),
        ];
        let (mut text, mut ids) = prompt(&msgs, thinking);
        for k in 0..6 {
            msgs.push(assistant(k, thinking));
            msgs.push(tool(k));
            let (t2, i2) = prompt(&msgs, thinking);
            assert!(t2.starts_with(&text), "thinking {thinking}, turn {k}: the text prefix changed");
            assert_eq!(common(&ids, &i2), ids.len(), "thinking {thinking}, turn {k}: the token prefix changed");
            (text, ids) = (t2, i2);
        }
    }
}

/// A new user message re-renders the assistant messages since the previous user message without
/// their `<think>` block (the reasoning with thinking on, the empty block with it off): the
/// prompt's tokens stay the same exactly up to the first of those messages' header, and no
/// further.
#[test]
fn a_new_user_message_drops_earlier_think_blocks_and_breaks_the_prefix_there() {
    for thinking in [true, false] {
        let mut msgs = vec![
            json!({"role": "system", "content": "You are a coding agent."}),
            json!({"role": "user", "content": "Find the bug."}),
            assistant(0, thinking),
            tool(0),
            assistant(1, thinking),
            tool(1),
        ];
        let (text, ids) = prompt(&msgs, thinking);
        msgs.push(json!({"role": "user", "content": "Now add a test."}));
        let (t2, i2) = prompt(&msgs, thinking);
        let header = "<|im_start|>assistant\n";
        let first_assistant = text.find(header).expect("an assistant turn") + header.len();
        assert!(text[first_assistant..].starts_with("<think>\n"), "thinking {thinking}: a think block before");
        assert!(!t2[first_assistant..].starts_with("<think>"), "thinking {thinking}: none after a new user message");
        let kept = tokenizer().encode(&text[..first_assistant]).unwrap();
        assert_eq!(common(&ids, &i2), kept.len(), "thinking {thinking}: the prefix ends at the first assistant header");
    }
}
