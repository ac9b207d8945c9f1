//! Splits generated chat text into reasoning, content and tool calls, incrementally, so that the
//! streamed deltas concatenate to exactly the final message.
//!
//! * Reasoning: with thinking on, the prompt ends with `<think>\n`, so the output up to
//!   `</think>` is reasoning. With thinking off the output is content, unless it opens with
//!   `<think>` itself. An output that never closes `</think>` is all reasoning (cut by length).
//! * Whitespace at tag boundaries is dropped: newlines leading the reasoning, the content after
//!   `</think>` and text after a tool call; whitespace trailing the reasoning before `</think>` and
//!   the content before a tool call (the chat template writes `<think>\n…\n</think>\n\n` and
//!   `\n\n<tool_call>`). Elsewhere text is passed through unchanged. (vLLM's qwen3 reasoning
//!   parser leaves the `\n\n` at the start of the content; clients strip it anyway.)
//! * Tool calls (only when the request has tools): each `<tool_call>…</tool_call>` block holding a
//!   `<function=…>` becomes one call once its structural close has arrived (or at the end of
//!   output, for an unterminated block, as vLLM does); other text stays content.

use serde_json::Value;

use super::stop::partial_overlap;
use super::toolcall::{self, ToolCall, TOOL_CALL_START};

const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";

#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCall),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Thinking off: the output may still open with `<think>`.
    Start,
    Reasoning,
    Content,
    Tool,
}

pub struct Splitter {
    phase: Phase,
    buf: String,
    tools: Option<Value>,
    parse_tools: bool,
    /// Drop leading whitespace of what comes next (after a tag).
    lstrip: bool,
    /// Trailing whitespace of the current section, emitted only if more text follows.
    held_ws: String,
}

impl Splitter {
    /// `thinking`: the prompt left a `<think>` open. `tools`: the request's tools (schemas type
    /// the arguments); `parse_tools`: whether tool calls are extracted at all.
    pub fn new(thinking: bool, tools: Option<&Value>, parse_tools: bool) -> Self {
        Splitter {
            phase: if thinking { Phase::Reasoning } else { Phase::Start },
            buf: String::new(),
            tools: tools.cloned(),
            parse_tools,
            lstrip: thinking,
            held_ws: String::new(),
        }
    }

    pub fn feed(&mut self, text: &str, out: &mut Vec<Delta>) {
        self.buf.push_str(text);
        self.process(false, out);
    }

    /// End of output: everything still buffered is emitted.
    pub fn finish(&mut self, out: &mut Vec<Delta>) {
        self.process(true, out);
        if !self.held_ws.is_empty() {
            let ws = std::mem::take(&mut self.held_ws);
            out.push(match self.phase {
                Phase::Reasoning => Delta::Reasoning(ws),
                _ => Delta::Content(ws),
            });
        }
    }

    /// Emits `s` into the current section, holding back its trailing whitespace; `boundary`
    /// drops what is held (a tag follows).
    fn emit(&mut self, s: &str, boundary: bool, out: &mut Vec<Delta>) {
        let mut s = s;
        if self.lstrip {
            // Newlines only: leading spaces may be meaningful (indented code).
            s = s.trim_start_matches(['\n', '\r']);
            if !s.is_empty() {
                self.lstrip = false;
            }
        }
        let body = s.trim_end();
        if !body.is_empty() {
            let mut text = std::mem::take(&mut self.held_ws);
            text.push_str(body);
            out.push(match self.phase {
                Phase::Reasoning => Delta::Reasoning(text),
                _ => Delta::Content(text),
            });
        }
        self.held_ws.push_str(&s[body.len()..]);
        if boundary {
            self.held_ws.clear();
        }
    }

    fn process(&mut self, last: bool, out: &mut Vec<Delta>) {
        loop {
            match self.phase {
                Phase::Start => {
                    let t = self.buf.trim_start();
                    if let Some(rest) = t.strip_prefix(THINK_START) {
                        self.buf = rest.to_string();
                        self.phase = Phase::Reasoning;
                        self.lstrip = true;
                    } else if !last && THINK_START.starts_with(t) {
                        return; // could still become `<think>`
                    } else {
                        self.phase = Phase::Content;
                    }
                }
                Phase::Reasoning => {
                    if let Some(i) = self.buf.find(THINK_END) {
                        let head = self.buf[..i].to_string();
                        self.emit(&head, true, out);
                        self.buf.drain(..i + THINK_END.len());
                        self.phase = Phase::Content;
                        self.lstrip = true;
                        continue;
                    }
                    let keep = if last { 0 } else { partial_overlap(&self.buf, THINK_END) };
                    let head: String = self.buf.drain(..self.buf.len() - keep).collect();
                    self.emit(&head, false, out);
                    return;
                }
                Phase::Content => {
                    if self.parse_tools {
                        if let Some(i) = toolcall::find_call_start(&self.buf) {
                            let head: String = self.buf.drain(..i).collect();
                            // Whitespace before the block stays held: dropped only if it is a call.
                            self.emit(&head, false, out);
                            self.phase = Phase::Tool;
                            continue;
                        }
                    }
                    let keep = if last || !self.parse_tools { 0 } else { partial_overlap(&self.buf, TOOL_CALL_START) };
                    let head: String = self.buf.drain(..self.buf.len() - keep).collect();
                    self.emit(&head, false, out);
                    return;
                }
                Phase::Tool => {
                    // A block closed before any `<function=` is prose, not a call.
                    let inner = &self.buf[TOOL_CALL_START.len()..];
                    if let Some(close) = inner.find(toolcall::TOOL_CALL_END) {
                        if !inner[..close].contains(toolcall::FUNCTION_PREFIX) {
                            let n = TOOL_CALL_START.len() + close + toolcall::TOOL_CALL_END.len();
                            let block: String = self.buf.drain(..n).collect();
                            self.phase = Phase::Content;
                            self.emit(&block, false, out);
                            continue;
                        }
                    }
                    let end = toolcall::find_call_end(&self.buf);
                    if end.is_none() && !last {
                        return;
                    }
                    let end = end.unwrap_or(self.buf.len());
                    let block: String = self.buf.drain(..end).collect();
                    let inner = &block[TOOL_CALL_START.len()..];
                    let inner = inner.strip_suffix(toolcall::TOOL_CALL_END).unwrap_or(inner);
                    self.phase = Phase::Content;
                    match toolcall::parse_block(inner, self.tools.as_ref()) {
                        Some(call) => {
                            self.held_ws.clear();
                            out.push(Delta::ToolCall(call));
                            self.lstrip = true;
                        }
                        // Not a valid call: the literal text is content.
                        None => self.emit(&block, false, out),
                    }
                    if self.buf.is_empty() {
                        return;
                    }
                }
            }
        }
    }
}

/// Reasoning, content and tool calls gathered from deltas.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Message {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

impl Message {
    pub fn add(&mut self, d: &Delta) {
        match d {
            Delta::Reasoning(s) => self.reasoning.push_str(s),
            Delta::Content(s) => self.content.push_str(s),
            Delta::ToolCall(c) => self.tool_calls.push(c.clone()),
        }
    }
}

/// Splits a whole output at once (the non-streaming path uses the same machine).
pub fn split_all(text: &str, thinking: bool, tools: Option<&Value>, parse_tools: bool) -> Message {
    let mut s = Splitter::new(thinking, tools, parse_tools);
    let mut out = Vec::new();
    s.feed(text, &mut out);
    s.finish(&mut out);
    let mut m = Message::default();
    out.iter().for_each(|d| m.add(d));
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "Let me look.\nThe file is big.\n</think>\n\nI'll read it.\n\n<tool_call>\n<function=read>\n<parameter=path>\na.rs\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=read>\n<parameter=path>\nb.rs\n</parameter>\n</function>\n</tool_call>";

    fn by_pieces(text: &str, piece: usize, thinking: bool, tools: bool) -> Message {
        let mut s = Splitter::new(thinking, None, tools);
        let mut out = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for c in chars.chunks(piece) {
            s.feed(&c.iter().collect::<String>(), &mut out);
        }
        s.finish(&mut out);
        let mut m = Message::default();
        out.iter().for_each(|d| m.add(d));
        m
    }

    #[test]
    fn reasoning_content_and_calls() {
        let m = split_all(OUT, true, None, true);
        assert_eq!(m.reasoning, "Let me look.\nThe file is big.");
        assert_eq!(m.content, "I'll read it.");
        assert_eq!(m.tool_calls.len(), 2);
        assert_eq!(m.tool_calls[1].arguments, r#"{"path":"b.rs"}"#);
        // Any chunking gives the same result.
        for piece in [1, 2, 3, 5, 8, 13] {
            assert_eq!(by_pieces(OUT, piece, true, true), m, "piece {piece}");
        }
    }

    #[test]
    fn leading_spaces_of_content_are_kept() {
        let m = split_all("r</think>\n\n    indented()\n", true, None, false);
        assert_eq!(m.content, "    indented()\n");
        assert_eq!(by_pieces("r</think>\n\n    indented()\n", 1, true, false), m);
    }

    #[test]
    fn without_tools_the_xml_is_content() {
        let m = split_all(OUT, true, None, false);
        assert!(m.tool_calls.is_empty());
        assert!(m.content.starts_with("I'll read it.\n\n<tool_call>"));
        assert_eq!(by_pieces(OUT, 1, true, false), m);
    }

    #[test]
    fn thinking_off_and_self_opened_think() {
        let m = split_all("Hello there.\n", false, None, false);
        assert_eq!((m.reasoning.as_str(), m.content.as_str()), ("", "Hello there.\n"));
        let m = split_all("<think>\nhmm\n</think>\n\nHi", false, None, false);
        assert_eq!((m.reasoning.as_str(), m.content.as_str()), ("hmm", "Hi"));
        assert_eq!(by_pieces("<think>\nhmm\n</think>\n\nHi", 1, false, false), m);
        // "<th" at the end of a short output is content.
        assert_eq!(split_all("<th", false, None, false).content, "<th");
    }

    #[test]
    fn unclosed_reasoning_and_unclosed_call() {
        let m = split_all("thinking forever\nand", true, None, true);
        assert_eq!((m.reasoning.as_str(), m.content.as_str()), ("thinking forever\nand", ""));
        let m = split_all("x</think>ok <tool_call>\n<function=f>\n<parameter=a>\n1", true, None, true);
        assert_eq!(m.content, "ok");
        assert_eq!(m.tool_calls, vec![ToolCall { name: "f".into(), arguments: r#"{"a":"1"}"#.into() }]);
        // A bare <tool_call> without a function stays content.
        let m = split_all("a <tool_call>junk</tool_call> b", false, None, true);
        assert_eq!(m.content, "a <tool_call>junk</tool_call> b");
        assert!(m.tool_calls.is_empty());
        assert_eq!(by_pieces("a <tool_call>junk</tool_call> b", 1, false, true), m);
    }
}
