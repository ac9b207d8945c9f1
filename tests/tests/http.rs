//! `ornith serve`'s HTTP server in process on an ephemeral port, over the test doubles (a
//! byte-level codec, a ChatML renderer, a runner that replays the text after `SAY:`), driven by a
//! real HTTP client. Limits, faults and monitoring: `http_limits.rs`; the harness: `support/server.rs`.

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Value};

mod support;
use support::server::*;
use support::{Gate, GatedCodec, HOLD};

const NO_THINK: &str = "chat_template_kwargs";

fn schema() -> Value {
    json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}})
}

fn tool_spec() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": schema()}}])
}

/// Two tool calls after a thought, in the model's XML format.
const TWO_CALLS: &str = "SAY:Checking.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_non_streamed() {
    let s = server(512, 2, Duration::ZERO).await;
    let (st, b) = s
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": user("SAY:Hello, world!"), NO_THINK: {"enable_thinking": false}}),
        )
        .await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["object"], "chat.completion");
    assert_eq!(b["model"], MODEL);
    assert_eq!(b["choices"][0]["message"]["content"], "Hello, world!");
    assert_eq!(b["choices"][0]["finish_reason"], "stop");
    assert_eq!(b["usage"]["completion_tokens"], 14, "13 bytes and <|im_end|>");
    assert!(b.get("custom_id").is_none());
    // Without `model` too.
    let (st, b) = s.post("/v1/chat/completions", json!({"messages": user("SAY:ok"), "max_tokens": 1})).await;
    assert_eq!((st, b["choices"][0]["finish_reason"].as_str()), (200, Some("length")), "{b}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_streamed_with_usage() {
    let s = server(512, 2, Duration::ZERO).await;
    let body = json!({"model": MODEL, "messages": user("SAY:Hello, wörld!"), NO_THINK: {"enable_thinking": false},
                      "stream": true, "stream_options": {"include_usage": true}});
    let (st, ctype, events) = s.stream("/v1/chat/completions", body).await;
    assert_eq!(st, 200);
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    assert_eq!(events.last().unwrap().1, "[DONE]", "[DONE] is last");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c.get("custom_id").is_none()));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, "Hello, wörld!");
    let with_usage: Vec<&Value> = chunks.iter().filter(|c| c.get("usage").is_some_and(|u| !u.is_null())).collect();
    assert_eq!(with_usage.len(), 1, "usage comes once");
    assert_eq!(with_usage[0]["choices"], json!([]));
    assert_eq!(with_usage[0]["usage"]["completion_tokens"], 15);
    assert!(std::ptr::eq(with_usage[0], chunks.last().unwrap()), "the usage chunk is the last one");
    let fin = &chunks[chunks.len() - 2]["choices"][0];
    assert_eq!(fin["finish_reason"], "stop");
    // Without include_usage: no usage chunk.
    let body = json!({"messages": user("SAY:hi"), "stream": true});
    let (_, _, events) = s.stream("/v1/chat/completions", body).await;
    assert!(events.iter().all(|(_, d)| !d.contains("\"usage\"")));
    s.stop().await;
}

/// `n` over HTTP: each choice its own sequence seeded `seed + i` (the scripted model says its
/// seed's last digit), three choices on a server of two sequences at once; streamed chunks
/// carry each choice's index; tool calls are parsed per choice, their ids distinct.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_streamed_and_not() {
    let s = server(1024, 2, Duration::ZERO).await;
    let body = json!({"messages": user("SAY:c$S"), NO_THINK: {"enable_thinking": false}, "n": 3, "seed": 40,
                      "stream": true, "stream_options": {"include_usage": true}});
    let (st, _, events) = s.stream("/v1/chat/completions", body).await;
    assert_eq!(st, 200);
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
    let mut text = vec![String::new(); 3];
    let mut roles = [0; 3];
    let mut finish = vec![Value::Null; 3];
    for c in &chunks[..chunks.len() - 1] {
        let ch = &c["choices"][0];
        let i = ch["index"].as_u64().unwrap() as usize;
        roles[i] += (ch["delta"]["role"] == "assistant") as usize;
        text[i] += ch["delta"]["content"].as_str().unwrap_or("");
        if !ch["finish_reason"].is_null() {
            finish[i] = ch["finish_reason"].clone();
        }
    }
    assert_eq!(text, ["c0", "c1", "c2"]);
    assert_eq!(roles, [1, 1, 1], "one role chunk per choice");
    assert_eq!(finish, [json!("stop"), json!("stop"), json!("stop")]);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 9);

    let calls = TWO_CALLS.replace("Paris", "Paris$S");
    let (st, b) = s
        .post("/v1/chat/completions", json!({"messages": user(&calls), "tools": tool_spec(), "n": 2, "seed": 5}))
        .await;
    assert_eq!(st, 200, "{b}");
    let choices = b["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    let mut ids = std::collections::HashSet::new();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["finish_reason"], "tool_calls");
        let tc = c["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(tc.len(), 2);
        let args: Value = serde_json::from_str(tc[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args["city"], format!("Paris{}", 5 + i));
        for t in tc {
            assert!(ids.insert(t["id"].as_str().unwrap().to_string()), "tool-call ids repeat: {b}");
        }
    }
    let (st, b) = s.post("/v1/chat/completions", json!({"messages": user("SAY:x"), "n": 129})).await;
    assert_eq!((st, b["error"]["code"].as_str()), (400, Some("invalid_request")), "{b}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_tool_calls_and_reasoning() {
    let s = server(1024, 2, Duration::ZERO).await;
    let body = json!({"messages": user(TWO_CALLS), "tools": tool_spec(), "stream": true});
    let (st, _, events) = s.stream("/v1/chat/completions", body).await;
    assert_eq!(st, 200);
    let chunks: Vec<Value> =
        events.iter().filter(|(_, d)| d != "[DONE]").map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
    let reasoning: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str()).collect();
    assert_eq!(reasoning.trim(), "Checking.");
    let calls: Vec<&Value> =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
    assert_eq!(calls.len(), 2, "{calls:?}");
    for (i, c) in calls.iter().enumerate() {
        assert_eq!(c["index"], i, "a distinct index per call");
        assert!(c["id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(c["type"], "function");
        assert_eq!(c["function"]["name"], "get_weather");
    }
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "days": 3}));
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
    // Non-streamed: the same calls in the message.
    let (st, b) = s.post("/v1/chat/completions", json!({"messages": user(TWO_CALLS), "tools": tool_spec()})).await;
    assert_eq!(st, 200);
    let m = &b["choices"][0]["message"];
    assert_eq!(m["tool_calls"].as_array().unwrap().len(), 2);
    assert_eq!(m["reasoning_content"].as_str().unwrap().trim(), "Checking.");
    assert_eq!(b["choices"][0]["finish_reason"], "tool_calls");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_models_health() {
    let s = server(512, 2, Duration::ZERO).await;
    let (st, b) = s.post("/v1/completions", json!({"model": MODEL, "prompt": "SAY:abcdef", "max_tokens": 3})).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["object"], "text_completion");
    assert_eq!(b["choices"][0]["text"], "abc");
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    let body =
        json!({"prompt": "SAY:abcdef", "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}});
    let (st, _, events) = s.stream("/v1/completions", body).await;
    assert_eq!(st, 200);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, "abcd");
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 4);

    let (st, text) = s.get("/v1/models").await;
    assert_eq!(st, 200);
    let m: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(m["data"][0]["max_model_len"], 512);
    let (st, _) = s.get("/health").await;
    assert_eq!(st, 200);
    let (st, text) = s.get("/v1/nothing").await;
    assert_eq!(st, 404, "{text}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_have_each_apis_shape_and_status() {
    let s = server(256, 2, Duration::ZERO).await;
    let (st, b) = s.post("/v1/chat/completions", json!({"model": "gpt-4", "messages": user("hi")})).await;
    assert_eq!(st, 404);
    assert_eq!(b["error"]["code"], "model_not_found");
    assert!(b["error"]["message"].as_str().unwrap().contains("gpt-4"));
    let (st, b) = s.post("/v1/messages", json!({"model": "claude", "max_tokens": 5, "messages": user("hi")})).await;
    assert_eq!(st, 404);
    assert_eq!(b["type"], "error");
    assert_eq!(b["error"]["type"], "not_found_error");
    // Context length: the output does not fit, and a prompt that fills the window.
    let (st, b) = s.post("/v1/chat/completions", json!({"messages": user("hi"), "max_tokens": 1000})).await;
    assert_eq!((st, b["error"]["code"].as_str()), (400, Some("context_length_exceeded")), "{b}");
    let long = "z".repeat(300);
    let (st, b) = s.post("/v1/completions", json!({"prompt": long})).await;
    assert_eq!((st, b["error"]["code"].as_str()), (400, Some("context_length_exceeded")), "{b}");
    let (st, b) = s.post("/v1/messages", json!({"max_tokens": 1000, "messages": user("hi")})).await;
    assert_eq!((st, b["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{b}");
    assert!(b["error"]["message"].as_str().unwrap().contains("context length"), "{b}");
    // A streamed request refused up front gets a plain error, not an event stream.
    let (st, b) =
        s.post("/v1/chat/completions", json!({"messages": user("hi"), "max_tokens": 1000, "stream": true})).await;
    assert_eq!((st, b["error"]["code"].as_str()), (400, Some("context_length_exceeded")));
    // Invalid bodies.
    let r = s.client.post(format!("{}/v1/chat/completions", s.base)).body("{not json").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let (st, b) = s.post("/v1/chat/completions", json!({"messages": user("hi"), "temperature": -1})).await;
    assert_eq!((st, b["error"]["type"].as_str()), (400, Some("invalid_request_error")));
    // Over the 1 MiB limit, just and by far (a client of its own each: the server closes those
    // connections): the body is read to its end before the 413, so a client still sending gets
    // the answer, not a broken pipe (the 32 MiB body got one in 2 of 3 tries while the server
    // answered unread).
    for (size, api) in
        [((1 << 20) + 1024, "/v1/chat/completions"), (32 << 20, "/v1/chat/completions"), (32 << 20, "/v1/messages")]
    {
        let r = reqwest::Client::new().post(format!("{}{api}", s.base)).body("a".repeat(size)).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 413, "{size} bytes to {api}");
        let b: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
        // OpenAI's shape carries it as the error's code, Anthropic's as its type.
        let code = if api == "/v1/messages" { &b["error"]["type"] } else { &b["error"]["code"] };
        assert_eq!(code, "request_too_large", "{b}");
    }
    // A client that asks to continue is answered before it sends the body.
    let addr = s.base.trim_start_matches("http://").to_string();
    let answer = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut tcp = std::net::TcpStream::connect(addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                    Content-Length: 104857600\r\nExpect: 100-continue\r\n\r\n";
        tcp.write_all(head.as_bytes()).unwrap();
        let mut answer = vec![0u8; 4096];
        let n = tcp.read(&mut answer).expect("no answer before the body");
        String::from_utf8_lossy(&answer[..n]).into_owned()
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    // A failing engine step: 500 in each shape.
    let (st, b) = s.post("/v1/chat/completions", json!({"messages": user("SAY:FAIL")})).await;
    assert_eq!((st, b["error"]["code"].as_str()), (500, Some("engine_error")), "{b}");
    let (st, b) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": user("SAY:FAIL")})).await;
    assert_eq!((st, b["error"]["type"].as_str()), (500, Some("api_error")), "{b}");
    // Once streaming, an engine failure is an error event closing the stream.
    let (st, _, events) = s.stream("/v1/chat/completions", json!({"messages": user("SAY:FAIL"), "stream": true})).await;
    assert_eq!(st, 200);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let err: Value = serde_json::from_str(&events[events.len() - 2].1).unwrap();
    assert_eq!(err["error"]["code"], "engine_error", "{events:?}");
    let body = json!({"max_tokens": 5, "stream": true, "messages": user("SAY:FAIL")});
    let (st, _, events) = s.stream("/v1/messages", body).await;
    assert_eq!(st, 200);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["message_start", "error"]);
    let err: Value = serde_json::from_str(&events[1].1).unwrap();
    assert_eq!(err["error"]["type"], "api_error");
    // The Responses API: 500 in the OpenAI shape, and once streaming `response.failed` last.
    let (st, b) = s.post("/v1/responses", json!({"input": "SAY:FAIL"})).await;
    assert_eq!((st, b["error"]["code"].as_str()), (500, Some("engine_error")), "{b}");
    let (st, _, events) = s.stream("/v1/responses", json!({"input": "SAY:FAIL", "stream": true})).await;
    assert_eq!(st, 200);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["response.created", "response.in_progress", "response.failed"]);
    let failed: Value = serde_json::from_str(&events[2].1).unwrap();
    assert_eq!(failed["response"]["status"], "failed");
    assert_eq!(failed["response"]["error"]["code"], "engine_error", "{failed}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_non_streamed() {
    let s = server(1024, 2, Duration::ZERO).await;
    let body = json!({"model": MODEL, "max_tokens": 100, "system": "be brief",
                      "messages": user("SAY:Let me look.</think>\n\nHere it is.")});
    let (st, b) = s.post("/v1/messages", body).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["type"], "message");
    assert_eq!(b["role"], "assistant");
    assert!(b["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(b["content"][0]["type"], "thinking");
    assert_eq!(b["content"][0]["thinking"].as_str().unwrap().trim(), "Let me look.");
    assert_eq!(b["content"][1], json!({"type": "text", "text": "Here it is."}));
    assert_eq!(b["stop_reason"], "end_turn");
    assert!(b["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert!(b["usage"]["output_tokens"].as_u64().unwrap() > 0);
    // Tools: a tool_use block with its input; then the history with tool_use / tool_result.
    let tools = json!([{"name": "get_weather", "description": "Weather", "input_schema": schema()}]);
    let (st, b) = s.post("/v1/messages", json!({"max_tokens": 300, "tools": tools, "messages": user(TWO_CALLS)})).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["stop_reason"], "tool_use");
    let uses: Vec<&Value> = b["content"].as_array().unwrap().iter().filter(|c| c["type"] == "tool_use").collect();
    assert_eq!(uses.len(), 2);
    assert!(uses[0]["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(uses[0]["input"], json!({"city": "Paris", "days": 3}));
    let history = json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0]["id"], "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0]["id"], "content": "sunny"},
                                     {"type": "text", "text": "SAY:Sunny."}]}]);
    let (st, b) = s
        .post(
            "/v1/messages",
            json!({"max_tokens": 50, "tools": tools, "messages": history, "thinking": {"type": "disabled"}}),
        )
        .await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["content"], json!([{"type": "text", "text": "Sunny."}]));
    // max_tokens and stop sequences.
    let (_, b) = s.post("/v1/messages", json!({"max_tokens": 2, "messages": user("SAY:abcdef")})).await;
    assert_eq!(b["stop_reason"], "max_tokens");
    let body = json!({"max_tokens": 50, "stop_sequences": ["cd"], "thinking": {"type": "disabled"}, "messages": user("SAY:abcdef")});
    let (_, b) = s.post("/v1/messages", body).await;
    assert_eq!((b["stop_reason"].as_str(), b["stop_sequence"].as_str()), (Some("stop_sequence"), Some("cd")), "{b}");
    assert_eq!(b["content"][0]["text"], "ab");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_streamed_event_sequence() {
    let s = server(1024, 2, Duration::ZERO).await;
    let tools = json!([{"name": "get_weather", "input_schema": schema()}]);
    let script = TWO_CALLS.replace("</think>\n\n", "</think>\n\nOn it.\n");
    let body = json!({"model": MODEL, "max_tokens": 300, "stream": true, "tools": tools, "messages": user(&script)});
    let (st, ctype, events) = s.stream("/v1/messages", body).await;
    assert_eq!(st, 200);
    assert!(ctype.starts_with("text/event-stream"));
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let data: Vec<Value> = events.iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
    for (n, d) in names.iter().zip(&data) {
        assert_eq!(d["type"], *n, "each event's data names its type");
    }
    assert_eq!(names[0], "message_start");
    assert_eq!(data[0]["message"]["usage"]["output_tokens"], 0);
    assert!(data[0]["message"]["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"]);
    let delta = &data[names.len() - 2];
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    assert!(delta["usage"]["output_tokens"].as_u64().unwrap() > 0);
    // Blocks: start, deltas, stop; indexes 0, 1, …; thinking, text, tool_use, tool_use.
    let mut kinds = Vec::new();
    let mut open: Option<u64> = None;
    let (mut thinking, mut text, mut json_parts) = (String::new(), String::new(), Vec::new());
    for (n, d) in names.iter().zip(&data).skip(1).take(names.len() - 3) {
        match *n {
            "content_block_start" => {
                assert!(open.is_none(), "a block starts while another is open");
                assert_eq!(d["index"], kinds.len());
                open = d["index"].as_u64();
                kinds.push(d["content_block"]["type"].as_str().unwrap().to_string());
                if kinds.last().unwrap() == "tool_use" {
                    assert_eq!(d["content_block"]["name"], "get_weather");
                    assert!(d["content_block"]["id"].as_str().unwrap().starts_with("toolu_"));
                    json_parts.push(String::new());
                }
            }
            "content_block_delta" => {
                assert_eq!(d["index"].as_u64(), open);
                match d["delta"]["type"].as_str().unwrap() {
                    "thinking_delta" => thinking += d["delta"]["thinking"].as_str().unwrap(),
                    "text_delta" => text += d["delta"]["text"].as_str().unwrap(),
                    "input_json_delta" => {
                        json_parts.last_mut().unwrap().push_str(d["delta"]["partial_json"].as_str().unwrap())
                    }
                    t => panic!("delta type {t}"),
                }
            }
            "content_block_stop" => {
                assert_eq!(d["index"].as_u64(), open);
                open = None;
            }
            other => panic!("unexpected event {other}"),
        }
    }
    assert!(open.is_none());
    assert_eq!(kinds, ["thinking", "text", "tool_use", "tool_use"]);
    assert_eq!(thinking.trim(), "Checking.");
    assert_eq!(text.trim(), "On it.");
    let inputs: Vec<Value> = json_parts.iter().map(|p| serde_json::from_str(p).unwrap()).collect();
    assert_eq!(inputs, [json!({"city": "Paris", "days": 3}), json!({"city": "Oslo"})]);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_tokens_matches_the_prompt() {
    let s = server(512, 2, Duration::ZERO).await;
    let msgs = json!({"model": MODEL, "system": "sys", "messages": user("SAY:hi")});
    let (st, c) = s.post("/v1/messages/count_tokens", msgs.clone()).await;
    assert_eq!(st, 200, "{c}");
    let mut body = msgs;
    body["max_tokens"] = json!(5);
    let (_, b) = s.post("/v1/messages", body).await;
    assert_eq!(c, json!({"input_tokens": b["usage"]["input_tokens"]}));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_text_parses_and_counts() {
    let s = server(512, 2, Duration::ZERO).await;
    let (st, _) = s.post("/v1/chat/completions", json!({"messages": user("SAY:hello"), "max_tokens": 3})).await;
    assert_eq!(st, 200);
    let (st, _) = s.post("/v1/chat/completions", json!({"model": "other", "messages": user("hi")})).await;
    assert_eq!(st, 404);
    let (st, text) = s.get("/metrics").await;
    assert_eq!(st, 200);
    let m = parse_metrics(&text);
    assert_eq!(metric(&m, "ornith_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}"), 1.0);
    assert_eq!(metric(&m, "ornith_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"404\"}"), 1.0);
    assert!(metric(&m, "ornith_prompt_tokens_total") > 0.0);
    assert_eq!(metric(&m, "ornith_generation_tokens_total"), 3.0);
    assert_eq!(metric(&m, "ornith_requests_running"), 0.0);
    assert_eq!(metric(&m, "ornith_requests_waiting"), 0.0);
    assert_eq!(metric(&m, "ornith_time_to_first_token_seconds_count"), 1.0);
    assert_eq!(metric(&m, "ornith_time_to_first_token_seconds_bucket{le=\"+Inf\"}"), 1.0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_its_slot() {
    // 4000 steps of 5 ms: 20 s if the sequence were not cancelled.
    let s = server(8192, 1, Duration::from_millis(5)).await;
    // A dropped event stream.
    let r =
        s.client.post(format!("{}/v1/chat/completions", s.base)).body(endless(true).to_string()).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut body = r.bytes_stream();
    let mut seen = 0;
    while seen < 3 {
        seen += body.next().await.unwrap().unwrap().len().min(1);
    }
    drop(body);
    short_request_runs(&s).await;
    // An aborted request that does not stream.
    let c = s.client.clone();
    let url = format!("{}/v1/chat/completions", s.base);
    let pending = tokio::spawn(async move { c.post(url).body(endless(false).to_string()).send().await });
    s.wait_for("ornith_requests_running", 1.0).await;
    pending.abort();
    let _ = pending.await;
    short_request_runs(&s).await;
    // Nothing left in the engine (published after the engine's next step); both counted.
    s.wait_for("ornith_requests_running", 0.0).await;
    s.wait_for("ornith_requests_waiting", 0.0).await;
    assert_eq!(metric(&s.metrics().await, "ornith_requests_cancelled_total"), 2.0);
    let stats = s.stop().await;
    assert_eq!(stats.cancelled, 2, "{stats:?}");
    assert_eq!(stats.finished, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_concurrent_streams_interleave() {
    // Both prompts wait at the gate until both are being prepared, so that the two requests reach
    // the engine together however the test's threads are scheduled; 10 ms steps give the streams
    // ~240 ms side by side. (The script is what follows `SAY:`, so the marker before it is not
    // said.)
    let gate = std::sync::Arc::new(Gate::default());
    let mut runner = support::ScriptRunner::new(512, 2);
    runner.step_time = Duration::from_millis(10);
    let s = server_with_codec(runner, Box::new(GatedCodec(gate.clone())), |_| {}).await;
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (who, text) in [("a", "one two three four five"), ("b", "six seven eight nine ten")] {
        let (c, url, log) = (s.client.clone(), format!("{}/v1/chat/completions", s.base), log.clone());
        let body = json!({"messages": user(&format!("{HOLD} SAY:{text}")), "stream": true,
                          NO_THINK: {"enable_thinking": false}});
        tasks.push(tokio::spawn(async move {
            let r = c.post(url).body(body.to_string()).send().await.unwrap();
            let mut all = String::new();
            let mut stream = r.bytes_stream();
            while let Some(b) = stream.next().await {
                let b = b.unwrap();
                log.lock().unwrap().push(who);
                all += std::str::from_utf8(&b).unwrap();
            }
            let content: String = sse_events(&all)
                .iter()
                .filter(|(_, d)| d != "[DONE]")
                .filter_map(|(_, d)| {
                    serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"]["content"]
                        .as_str()
                        .map(str::to_string)
                })
                .collect();
            assert_eq!(content, text);
        }));
    }
    gate.until_waiting(2).await;
    gate.open();
    for t in tasks {
        t.await.unwrap();
    }
    let log = log.lock().unwrap().clone();
    let switches = log.windows(2).filter(|w| w[0] != w[1]).count();
    assert!(switches >= 4, "the two streams did not interleave: {log:?}");
    let stats = s.stop().await;
    assert_eq!(stats.peak_running, 2);
}

/// The content of a streamed chat completion's events.
fn streamed_content(events: &[(String, String)]) -> String {
    events
        .iter()
        .filter(|(_, d)| d != "[DONE]")
        .filter_map(|(_, d)| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"]["content"].as_str().map(str::to_string)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_being_prepared_holds_up_no_other_request() {
    // A coding agent's 200K-token conversation takes a while to render and encode; meanwhile the
    // other clients' requests start and stream. Request B's encoding waits at the gate until A,
    // sent after it, has streamed to its end.
    let gate = std::sync::Arc::new(Gate::default());
    let mut runner = support::ScriptRunner::new(512, 2);
    runner.step_time = Duration::from_millis(3);
    let s = server_with_codec(runner, Box::new(GatedCodec(gate.clone())), |_| {}).await;
    let (c, url) = (s.client.clone(), format!("{}/v1/chat/completions", s.base));
    let b = tokio::spawn(async move {
        let body = json!({"messages": user(&format!("SAY:held {HOLD}")), NO_THINK: {"enable_thinking": false}});
        let r = c.post(url).body(body.to_string()).send().await.unwrap();
        let status = r.status().as_u16();
        (status, serde_json::from_str::<Value>(&r.text().await.unwrap()).unwrap())
    });
    gate.until_waiting(1).await;
    let a = json!({"messages": user("SAY:one two three"), "stream": true, NO_THINK: {"enable_thinking": false}});
    let (status, _, events) = tokio::time::timeout(Duration::from_secs(20), s.stream("/v1/chat/completions", a))
        .await
        .expect("request A waited for B's prompt");
    assert_eq!((status, streamed_content(&events).as_str()), (200, "one two three"));
    assert!(!b.is_finished(), "B finished before its prompt was made");
    gate.open();
    let (status, body) = b.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], format!("held {HOLD}"));
    let stats = s.stop().await;
    assert_eq!((stats.finished, stats.cancelled), (2, 0), "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_cancelled_while_its_prompt_is_prepared_never_starts() {
    // The client goes away while its prompt is encoded: the router drops the prompt when it
    // comes back, the engine never sees the request, and its place is then free for the next
    // one. The place is held until the prompt comes back (the work of preparing it is still
    // going on, and `--max-queue` bounds that work too), so the next request waits for the
    // router to give it back. Each step waits on what the server reports (the cancellation
    // counted, the place back), not on sleeps that a loaded machine may outrun.
    let gate = std::sync::Arc::new(Gate::default());
    let runner = support::ScriptRunner::new(512, 1);
    let s = server_with_codec(runner, Box::new(GatedCodec(gate.clone())), |o| o.max_queue = 0).await;
    let (c, url) = (s.client.clone(), format!("{}/v1/chat/completions", s.base));
    let pending = tokio::spawn(async move {
        let body = json!({"messages": user(&format!("SAY:{HOLD}")), "max_tokens": 4000, "ignore_eos": true});
        c.post(url).body(body.to_string()).send().await
    });
    gate.until_waiting(1).await;
    pending.abort();
    let _ = pending.await;
    s.wait_for("ornith_requests_cancelled_total", 1.0).await; // the router saw the client go
    assert_eq!(metric(&s.metrics().await, "ornith_requests_in_flight"), 1.0, "the place went before the prompt");
    gate.open();
    s.wait_for("ornith_requests_in_flight", 0.0).await;
    short_request_runs(&s).await;
    let stats = s.stop().await;
    assert_eq!((stats.finished, stats.cancelled), (1, 0), "the cancelled request reached the engine: {stats:?}");
}

// ------------------------------------------------------------------ /v1/responses (Responses API)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_non_streamed_and_refusals() {
    let s = server(1024, 2, Duration::ZERO).await;
    let body = json!({"model": MODEL, "instructions": "be brief", "input": "SAY:Hello, world!",
                      "reasoning": {"effort": "none"}});
    let (st, r) = s.post("/v1/responses", body).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["object"], "response");
    assert!(r["id"].as_str().unwrap().starts_with("resp_"), "{r}");
    assert_eq!((r["status"].as_str(), r["model"].as_str()), (Some("completed"), Some(MODEL)));
    assert_eq!(r["instructions"], "be brief");
    let out = r["output"].as_array().unwrap();
    assert_eq!(out.len(), 1, "{r}");
    assert_eq!(out[0]["type"], "message");
    assert_eq!(out[0]["role"], "assistant");
    assert_eq!(
        out[0]["content"][0],
        json!({"type": "output_text", "text": "Hello, world!", "annotations": [], "logprobs": []})
    );
    assert_eq!(r["usage"]["output_tokens"], 14, "13 bytes and <|im_end|>");
    let u = &r["usage"];
    assert_eq!(u["total_tokens"].as_u64(), Some(u["input_tokens"].as_u64().unwrap() + 14));
    // Tool calls after a thought: reasoning and function_call items; message items with
    // function_call / function_call_output history are accepted.
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": schema()}]);
    let input = json!([
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Rome\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "user", "content": TWO_CALLS}]);
    let (st, r) = s.post("/v1/responses", json!({"input": input, "tools": tools})).await;
    assert_eq!(st, 200, "{r}");
    let types: Vec<&str> = r["output"].as_array().unwrap().iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["reasoning", "function_call", "function_call"], "{r}");
    assert_eq!(r["output"][0]["content"][0]["text"].as_str().unwrap().trim(), "Checking.");
    let call = &r["output"][1];
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["name"], "get_weather");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "days": 3}));
    // `text.format` json_schema: the output text is the JSON (structured output), the format
    // echoed back.
    let format = json!({"type": "json_schema", "name": "r", "strict": true, "schema": {"type": "object",
        "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}});
    let (st, r) = s
        .post("/v1/responses", json!({"input": "SAY:ok?", "reasoning": {"effort": "none"}, "text": {"format": format}}))
        .await;
    assert_eq!(st, 200, "{r}");
    let text = r["output"][0]["content"][0]["text"].as_str().unwrap();
    assert!(serde_json::from_str::<Value>(text).unwrap()["ok"].is_boolean(), "{text}");
    assert_eq!(r["text"]["format"], format);
    // With tools beside it (Codex's `--output-schema`), the answer may still be calls.
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": schema()}]);
    let (st, r) =
        s.post("/v1/responses", json!({"input": TWO_CALLS, "tools": tools, "text": {"format": format}})).await;
    assert_eq!(st, 200, "{r}");
    let types: Vec<&str> = r["output"].as_array().unwrap().iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["reasoning", "function_call", "function_call"], "{r}");
    let (st, e) = s.post("/v1/responses", json!({"input": "x", "text": {"format": {"type": "yaml"}}})).await;
    assert_eq!((st, e["error"]["code"].as_str()), (400, Some("unsupported_parameter")), "{e}");
    // max_output_tokens ends it: incomplete.
    let (st, r) = s.post("/v1/responses", json!({"input": "SAY:abcdef", "max_output_tokens": 2})).await;
    assert_eq!(st, 200);
    assert_eq!(
        (r["status"].as_str(), r["incomplete_details"]["reason"].as_str()),
        (Some("incomplete"), Some("max_output_tokens"))
    );
    // Stateless: previous_response_id is refused, saying so.
    let (st, e) = s.post("/v1/responses", json!({"input": "x", "previous_response_id": "resp_1"})).await;
    assert_eq!(st, 400);
    assert_eq!(e["error"]["code"], "invalid_request");
    assert!(e["error"]["message"].as_str().unwrap().contains("stores no responses"), "{e}");
    let (st, e) =
        s.post("/v1/responses", json!({"input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]})).await;
    assert_eq!((st, e["error"]["code"].as_str()), (400, Some("unsupported_parameter")), "{e}");
    // Tools the server cannot run and tool groups are not offered (a warning in the log): the
    // request runs on (Codex CLI sends web_search and namespace beside its function tools).
    let hosted = json!([{"type": "web_search"}, {"type": "namespace", "name": "g", "description": "", "tools": []}]);
    let (st, r) = s.post("/v1/responses", json!({"input": "SAY:ok", "tools": hosted})).await;
    assert_eq!((st, r["status"].as_str()), (200, Some("completed")), "{r}");
    // A probe with empty input (Codex CLI's) is answered.
    let (st, r) = s.post("/v1/responses", json!({"input": [], "max_output_tokens": 1})).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["object"], "response", "{r}");
    let (st, _) = s.post("/v1/responses", json!({"input": "x", "model": "other"})).await;
    assert_eq!(st, 404);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_streamed_event_sequence() {
    let s = server(1024, 2, Duration::ZERO).await;
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": schema()}]);
    let input =
        format!("{}\nDone.", TWO_CALLS.replace("SAY:Checking.\n</think>\n\n", "SAY:Checking.\n</think>\n\nOn it.\n"));
    let (st, ctype, events) = s.stream("/v1/responses", json!({"input": input, "tools": tools, "stream": true})).await;
    assert_eq!(st, 200);
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    assert!(events.iter().all(|(n, _)| n != "[DONE]" && !n.is_empty()), "every event is named, no [DONE]");
    let evs: Vec<Value> = events.iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
    for (i, ((name, _), e)) in events.iter().zip(&evs).enumerate() {
        assert_eq!(e["type"], name.as_str(), "the event line names the data's type");
        assert_eq!(e["sequence_number"], i as u64);
    }
    assert_eq!(evs[0]["type"], "response.created");
    assert_eq!(evs[0]["response"]["status"], "in_progress");
    assert_eq!(evs[1]["type"], "response.in_progress");
    let last = evs.last().unwrap();
    assert_eq!(last["type"], "response.completed");
    // Rebuild the output from the deltas; it must equal the final response's output.
    let mut items: Vec<Value> = Vec::new();
    let mut open: Option<usize> = None;
    for e in &evs[2..evs.len() - 1] {
        let idx = e["output_index"].as_u64().unwrap() as usize;
        match e["type"].as_str().unwrap() {
            "response.output_item.added" => {
                assert!(open.is_none(), "one item at a time");
                assert_eq!(idx, items.len());
                items.push(e["item"].clone());
                open = Some(idx);
            }
            "response.content_part.added" | "response.content_part.done" => assert_eq!(Some(idx), open),
            "response.reasoning_text.delta" | "response.output_text.delta" => {
                assert_eq!(Some(idx), open);
                assert_eq!(e["item_id"], items[idx]["id"]);
                let t = items[idx]["text"].as_str().unwrap_or("").to_string() + e["delta"].as_str().unwrap();
                items[idx]["text"] = json!(t);
            }
            "response.reasoning_text.done" | "response.output_text.done" => {
                assert_eq!(e["text"], items[idx]["text"]);
            }
            "response.function_call_arguments.delta" => {
                assert_eq!(items[idx]["arguments"], "");
                items[idx]["args"] = e["delta"].clone();
            }
            "response.function_call_arguments.done" => assert_eq!(e["arguments"], items[idx]["args"]),
            "response.output_item.done" => {
                assert_eq!(Some(idx), open);
                assert_eq!(e["item"]["id"], items[idx]["id"]);
                assert_eq!(e["item"]["status"], "completed");
                open = None;
            }
            t => panic!("unexpected event {t}"),
        }
    }
    assert!(open.is_none());
    let out = last["response"]["output"].as_array().unwrap();
    let kinds: Vec<&str> = out.iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["reasoning", "message", "function_call", "function_call", "message"]);
    assert_eq!(out[0]["content"][0]["text"], items[0]["text"]);
    assert_eq!(out[0]["content"][0]["text"].as_str().unwrap().trim(), "Checking.");
    assert_eq!(out[1]["content"][0]["text"].as_str().unwrap().trim(), "On it.");
    let args: Vec<Value> =
        out[2..4].iter().map(|c| serde_json::from_str(c["arguments"].as_str().unwrap()).unwrap()).collect();
    assert_eq!(args, [json!({"city": "Paris", "days": 3}), json!({"city": "Oslo"})]);
    assert_eq!(out[2]["arguments"], items[2]["args"]);
    assert_ne!(out[2]["call_id"], out[3]["call_id"]);
    assert!(last["response"]["usage"]["output_tokens"].as_u64().unwrap() > 10);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_suffix_without_fim_tokens_is_a_clear_400() {
    let s = server(512, 2, Duration::ZERO).await;
    let (st, e) = s.post("/v1/completions", json!({"prompt": "def f(", "suffix": "):\n", "max_tokens": 3})).await;
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["code"], "unsupported_parameter");
    assert!(e["error"]["message"].as_str().unwrap().contains("<|fim_prefix|>"), "{e}");
    s.stop().await;
}

// ------------------------------------------------------------------ the official Python SDKs

/// The pinned `openai` and `anthropic` SDKs (tests/requirements-sdk.txt, installed by .ci/run)
/// run tests/sdk/sdk_clients.py against this server. Missing SDKs fail the test, saying how to
/// install them, unless ORNITH_SKIP_SDK_TESTS=1 (local development only; see docs/TESTING.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_python_sdks_against_the_server() {
    let s = server(4096, 4, Duration::ZERO).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/sdk/sdk_clients.py");
    let base = s.base.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3").args([script, &base, MODEL]).output()
    })
    .await
    .unwrap();
    let missing = |why: String| {
        if std::env::var("ORNITH_SKIP_SDK_TESTS").as_deref() == Ok("1") {
            eprintln!("skipped (ORNITH_SKIP_SDK_TESTS=1): {why}");
        } else {
            panic!(
                "{why}\nthe official SDK tests need python3 and the pinned SDKs: pip install -r tests/requirements-sdk.txt \
                 (ORNITH_SKIP_SDK_TESTS=1 skips them for local development)"
            );
        }
    };
    match out {
        Err(e) => missing(format!("python3 could not be started: {e}")),
        Ok(o) if o.status.code() == Some(3) => missing(String::from_utf8_lossy(&o.stderr).into_owned()),
        Ok(o) => {
            let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
            assert!(o.status.success(), "the SDK checks failed ({:?}):\n{stdout}\n{stderr}", o.status);
            assert!(stdout.contains("every check passed"), "{stdout}");
            eprintln!("{stdout}");
        }
    }
    s.stop().await;
}
