//! `ornith serve`'s limits, faults and monitoring over the test doubles and a real HTTP client:
//! the bounded queue (`--max-queue`: 429 with `Retry-After` in each API's error shape, never for
//! count_tokens, models, health or metrics), the `/metrics` figures that come from the engine
//! thread (queue depth, inter-token latency, the prefix cache), load with faults, `--api-key`,
//! and Anthropic pings.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};

mod support;
use support::server::*;
use support::ScriptRunner;

/// A POST whose status, `Retry-After` header and JSON body come back.
async fn post_raw(s: &Server, path: &str, body: &Value) -> (u16, Option<String>, Value) {
    let r = s.client.post(format!("{}{path}", s.base)).body(body.to_string()).send().await.unwrap();
    let status = r.status().as_u16();
    let retry = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
    let text = r.text().await.unwrap();
    (status, retry, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_with_retry_after_then_drains() {
    // One slot and two places to wait: three generation requests in the server at most.
    let s = server_opts(8192, 1, Duration::from_millis(5), |o| o.max_queue = 2).await;
    assert_eq!(metric(&s.metrics().await, "ornith_requests_in_flight_limit"), 3.0);
    // Ten endless streams at once: exactly three get in, the rest are refused at once.
    let url = format!("{}/v1/chat/completions", s.base);
    let sends = (0..10).map(|_| s.client.post(&url).body(endless(true).to_string()).send());
    let responses = futures_util::future::join_all(sends).await;
    let (mut open, mut refused) = (Vec::new(), 0);
    for r in responses {
        let r = r.unwrap();
        match r.status().as_u16() {
            200 => open.push(r.bytes_stream()),
            429 => {
                assert_eq!(r.headers()["retry-after"], "1");
                let b: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
                assert_eq!(b["error"]["type"], "requests", "{b}");
                assert_eq!(b["error"]["code"], "rate_limit_exceeded", "{b}");
                refused += 1;
            }
            st => panic!("status {st}"),
        }
    }
    assert_eq!((open.len(), refused), (3, 7), "slots + --max-queue requests get in");
    // One runs, two wait in the engine for its slot. `running` counts a request once it has
    // sampled a token, so the first may still be in its prefill when the queue reads 2: wait for
    // both, then read them together.
    s.wait_for("ornith_queue_depth", 2.0).await;
    s.wait_for("ornith_requests_running", 1.0).await;
    let m = s.metrics().await;
    assert_eq!(metric(&m, "ornith_requests_in_flight"), 3.0);
    assert_eq!(metric(&m, "ornith_queue_depth"), 2.0);
    assert_eq!(metric(&m, "ornith_requests_running"), 1.0);
    // Every generation endpoint refuses in its own API's shape, with Retry-After.
    let chat = json!({"messages": user("SAY:ok"), "max_tokens": 2});
    let (st, retry, b) = post_raw(&s, "/v1/chat/completions", &chat).await;
    assert_eq!((st, retry.as_deref()), (429, Some("1")), "{b}");
    assert_eq!(b["error"]["code"], "rate_limit_exceeded");
    assert!(b["error"]["message"].as_str().unwrap().contains("--max-queue"), "{b}");
    let (st, retry, b) = post_raw(&s, "/v1/completions", &json!({"prompt": "SAY:ok", "max_tokens": 2})).await;
    assert_eq!((st, retry.as_deref(), &b["error"]["type"]), (429, Some("1"), &json!("requests")), "{b}");
    let msg = json!({"model": MODEL, "max_tokens": 2, "messages": user("SAY:ok")});
    let (st, retry, b) = post_raw(&s, "/v1/messages", &msg).await;
    assert_eq!((st, retry.as_deref()), (429, Some("1")), "{b}");
    assert_eq!(b["type"], "error");
    assert_eq!(b["error"]["type"], "rate_limit_error", "{b}");
    let streamed = json!({"model": MODEL, "max_tokens": 2, "stream": true, "messages": user("SAY:ok")});
    let (st, retry, b) = post_raw(&s, "/v1/messages", &streamed).await;
    assert_eq!((st, retry.as_deref(), &b["error"]["type"]), (429, Some("1"), &json!("rate_limit_error")));
    let resp = json!({"input": "SAY:ok", "max_output_tokens": 2, "stream": true});
    let (st, retry, b) = post_raw(&s, "/v1/responses", &resp).await;
    assert_eq!((st, retry.as_deref()), (429, Some("1")), "{b}");
    assert_eq!(b["error"]["code"], "rate_limit_exceeded", "{b}");
    // Bad requests are still told what is wrong with them.
    let (st, _, b) = post_raw(&s, "/v1/chat/completions", &json!({"messages": 3})).await;
    assert_eq!(st, 400, "{b}");
    // What is not generation is never refused.
    let (st, b) = s.post("/v1/messages/count_tokens", json!({"model": MODEL, "messages": user("hi")})).await;
    assert_eq!(st, 200, "{b}");
    assert!(b["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(s.get("/v1/models").await.0, 200);
    assert_eq!(s.get("/health").await.0, 200);
    // Drain: the clients go away, their places come back, requests are accepted again.
    drop(open);
    s.wait_for("ornith_requests_in_flight", 0.0).await;
    s.wait_for("ornith_queue_depth", 0.0).await;
    short_request_runs(&s).await;
    let (st, b) = s.post("/v1/messages", msg).await;
    assert_eq!(st, 200, "{b}");
    let m = s.metrics().await;
    let refused_chat = "ornith_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"429\"}";
    assert_eq!(metric(&m, refused_chat), 8.0);
    assert_eq!(metric(&m, "ornith_http_requests_total{endpoint=\"/v1/messages\",status=\"429\"}"), 2.0);
    assert_eq!(metric(&m, "ornith_requests_in_flight"), 0.0);
    assert_eq!(metric(&m, "ornith_requests_cancelled_total"), 3.0);
    let stats = s.stop().await;
    assert_eq!(stats.cancelled, 3, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_queue_zero_admits_only_what_the_slots_run() {
    let s = server_opts(8192, 2, Duration::from_millis(5), |o| o.max_queue = 0).await;
    let url = format!("{}/v1/chat/completions", s.base);
    let a = s.client.post(&url).body(endless(true).to_string()).send().await.unwrap();
    let b = s.client.post(&url).body(endless(true).to_string()).send().await.unwrap();
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    let (st, retry, body) = post_raw(&s, "/v1/chat/completions", &endless(false)).await;
    assert_eq!((st, retry.as_deref()), (429, Some("1")), "{body}");
    drop(a);
    s.wait_for("ornith_requests_in_flight", 1.0).await;
    short_request_runs(&s).await;
    drop(b);
    s.stop().await;
}

/// A request of `n` choices takes `n` places (they are `n` sequences), at most all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_take_n_places() {
    let s = server_opts(8192, 2, Duration::from_millis(5), |o| o.max_queue = 1).await;
    let url = format!("{}/v1/chat/completions", s.base);
    let mut two = endless(true);
    two["n"] = json!(2);
    let a = s.client.post(&url).body(two.to_string()).send().await.unwrap();
    assert_eq!(a.status().as_u16(), 200);
    s.wait_for("ornith_requests_in_flight", 2.0).await;
    let mut three = endless(false);
    three["n"] = json!(3);
    let (st, retry, body) = post_raw(&s, "/v1/chat/completions", &three).await;
    assert_eq!((st, retry.as_deref()), (429, Some("1")), "two choices free, three asked: {body}");
    drop(a);
    s.wait_for("ornith_requests_in_flight", 0.0).await;
    // More choices than the bound: all three places, and it runs.
    let (st, b) = s.post("/v1/chat/completions", json!({"messages": user("SAY:ok"), "n": 5})).await;
    assert_eq!((st, b["choices"].as_array().map(Vec::len)), (200, Some(5)), "{b}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inter_token_histogram_counts_every_gap() {
    // 50 ms steps: a gap is timed where the router handles the token, so a router thread
    // descheduled for most of a step would squeeze two gaps together; on a loaded 2-core machine
    // that takes a stall of ~50 ms, not ~20.
    let s = server(512, 2, Duration::from_millis(50)).await;
    let (st, b) = s.post("/v1/chat/completions", json!({"messages": user("SAY:hello"), "max_tokens": 5})).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["usage"]["completion_tokens"], 5);
    let m = s.metrics().await;
    // Five tokens, four gaps, each one 50 ms step (give or take the router's scheduling).
    assert_eq!(metric(&m, "ornith_inter_token_seconds_count"), 4.0);
    assert_eq!(metric(&m, "ornith_inter_token_seconds_bucket{le=\"+Inf\"}"), 4.0);
    assert!(metric(&m, "ornith_inter_token_seconds_sum") > 0.1, "{m:?}");
    assert_eq!(metric(&m, "ornith_inter_token_seconds_bucket{le=\"0.001\"}"), 0.0);
    assert_eq!(metric(&m, "ornith_time_to_first_token_seconds_count"), 1.0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_figures_reach_metrics() {
    let runner = ScriptRunner::new(8192, 1).with_snapshots(4);
    let s = server_on(runner, |_| {}).await;
    let m = s.metrics().await;
    assert_eq!(metric(&m, "ornith_prefix_cache_snapshots_capacity"), 4.0);
    assert_eq!(metric(&m, "ornith_prefix_cache_snapshots"), 0.0);
    assert_eq!(metric(&m, "ornith_prefix_cache_hits_total"), 0.0);
    // A prompt of two full chunks and a tail: cold the first time, from the cache the second.
    let long = format!("{} SAY:hi", "a".repeat(5000));
    let req = json!({"messages": user(&long), "max_tokens": 3});
    let (st, first) = s.post("/v1/chat/completions", req.clone()).await;
    assert_eq!(st, 200, "{first}");
    let m = s.metrics().await;
    assert_eq!(metric(&m, "ornith_prefix_cache_misses_total"), 1.0);
    assert_eq!(metric(&m, "ornith_prefix_cache_hits_total"), 0.0);
    assert_eq!(metric(&m, "ornith_prefix_cache_chunks"), 2.0);
    // Snapshots at both boundaries (`prefix::keeps_snapshot`: the last one and the one before).
    assert_eq!(metric(&m, "ornith_prefix_cache_snapshots"), 2.0);
    assert_eq!(metric(&m, "ornith_prefix_cache_snapshots_taken_total"), 2.0);
    let (st, second) = s.post("/v1/chat/completions", req).await;
    assert_eq!(st, 200, "{second}");
    assert_eq!(first["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"]);
    let m = s.metrics().await;
    assert_eq!(metric(&m, "ornith_prefix_cache_hits_total"), 1.0);
    assert_eq!(metric(&m, "ornith_prefix_cache_misses_total"), 1.0);
    assert_eq!(metric(&m, "ornith_prompt_tokens_cached_total"), 4096.0);
    assert_eq!(metric(&m, "ornith_prefix_cache_snapshots_evicted_total"), 0.0);
    assert_eq!(metric(&m, "ornith_prefix_cache_chunks_evicted_total"), 0.0);
    let stats = s.stop().await;
    assert_eq!((stats.cache.hits, stats.cache.misses), (1, 1), "{stats:?}");
}

// ------------------------------------------------------------------ load and faults

/// One client of the load test: what it sends and how it reads.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Client {
    /// A streamed chat request, read to the end; its text must come back exactly.
    Chat,
    /// A streamed Anthropic request, read to the end.
    Messages,
    /// Reads one chunk of an endless stream, then drops the connection.
    Disconnect,
    /// Reads its stream with a pause between chunks.
    Slow,
    Malformed,
    Oversized,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_64_streams_with_disconnects_bad_bodies_and_a_slow_reader() {
    let s = server(8192, 8, Duration::from_millis(1)).await;
    let pool = |text: &str| {
        let m = parse_metrics(text);
        ["ornith_pool_slots_used", "ornith_pool_kv_blocks_used", "ornith_requests_running", "ornith_requests_waiting"]
            .map(|k| metric(&m, k))
    };
    let rss = |text: &str| metric(&parse_metrics(text), "process_resident_memory_bytes");
    // Warm up once, then take the idle baseline.
    let (st, _) = s.post("/v1/chat/completions", json!({"messages": user("SAY:warm"), "max_tokens": 8})).await;
    assert_eq!(st, 200);
    let (_, idle) = s.get("/metrics").await;
    assert_eq!(pool(&idle), [0.0; 4], "{idle}");
    let (idle_rss, total_slots) = (rss(&idle), metric(&parse_metrics(&idle), "ornith_pool_slots_total"));
    assert_eq!(total_slots, 8.0);

    let kinds: Vec<Client> = (0..64)
        .map(|i| match i {
            5 | 14 | 23 | 32 | 41 | 52 | 61 => Client::Disconnect, // 7 of 64: ~10%
            20 | 50 => Client::Malformed,                          // with the oversized one, 3 of 64: ~5%
            40 => Client::Oversized,
            63 => Client::Slow,
            _ if i % 4 == 1 => Client::Messages,
            _ => Client::Chat,
        })
        .collect();
    let peak_rss = std::sync::Arc::new(std::sync::Mutex::new(idle_rss));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for (i, kind) in kinds.iter().copied().enumerate() {
        let (c, base) = (s.client.clone(), s.base.clone());
        tasks.push(tokio::spawn(async move {
            let text = format!("client {i} says hello to the server");
            let (path, body) = match kind {
                Client::Chat | Client::Slow => (
                    "/v1/chat/completions",
                    json!({"messages": user(&format!("SAY:{text}")), "stream": true,
                           "stream_options": {"include_usage": true}, "chat_template_kwargs": {"enable_thinking": false}})
                    .to_string(),
                ),
                Client::Messages => (
                    "/v1/messages",
                    json!({"max_tokens": 200, "messages": user(&format!("SAY:{text}")), "stream": true,
                           "thinking": {"type": "disabled"}})
                    .to_string(),
                ),
                Client::Disconnect => ("/v1/chat/completions", endless(true).to_string()),
                Client::Malformed => ("/v1/chat/completions", "{\"messages\": [".to_string()),
                Client::Oversized => ("/v1/chat/completions", format!("{{\"pad\": \"{}\"}}", "x".repeat(1 << 20))),
            };
            // The server closes an oversized body's connection unread: a client of its own.
            let c = if kind == Client::Oversized { reqwest::Client::new() } else { c };
            let r = c.post(format!("{base}{path}")).body(body).send().await.unwrap();
            let status = r.status().as_u16();
            match kind {
                Client::Malformed => {
                    assert_eq!(status, 400);
                    let e: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
                    assert_eq!(e["error"]["code"], "invalid_json", "{e}");
                    return;
                }
                Client::Oversized => {
                    assert_eq!(status, 413);
                    return;
                }
                _ => assert_eq!(status, 200, "client {i} ({kind:?})"),
            }
            let mut stream = r.bytes_stream();
            let mut all = String::new();
            while let Some(b) = stream.next().await {
                all += std::str::from_utf8(&b.unwrap()).unwrap();
                match kind {
                    Client::Disconnect => return, // drops the stream mid-way
                    Client::Slow => tokio::time::sleep(Duration::from_millis(20)).await,
                    _ => {}
                }
            }
            let events = sse_events(&all); // asserts complete events
            if kind == Client::Messages {
                assert_eq!(events.first().unwrap().0, "message_start");
                assert_eq!(events.last().unwrap().0, "message_stop");
                let text_out: String = events
                    .iter()
                    .filter(|(n, _)| n == "content_block_delta")
                    .map(|(_, d)| {
                        serde_json::from_str::<Value>(d).unwrap()["delta"]["text"].as_str().unwrap().to_string()
                    })
                    .collect();
                assert_eq!(text_out, text, "client {i}");
            } else {
                assert_eq!(events.last().unwrap().1, "[DONE]", "client {i}");
                let chunks: Vec<Value> =
                    events[..events.len() - 1].iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
                let text_out: String =
                    chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
                assert_eq!(text_out, text, "client {i}");
                assert_eq!(chunks.iter().filter(|c| !c["usage"].is_null()).count(), 1, "usage once");
            }
        }));
    }
    // Sample the server's memory while the clients run.
    let sampler = {
        let (c, url, peak) = (s.client.clone(), format!("{}/metrics", s.base), peak_rss.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(r) = c.get(&url).send().await {
                    if let Ok(t) = r.text().await {
                        let v = metric(&parse_metrics(&t), "process_resident_memory_bytes");
                        let mut p = peak.lock().unwrap();
                        *p = p.max(v);
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    for t in tasks {
        t.await.unwrap();
    }
    let elapsed = t.elapsed();
    sampler.abort();
    // The pools return to idle (the disconnected clients' sequences were cancelled).
    let t2 = Instant::now();
    let after = loop {
        let (_, text) = s.get("/metrics").await;
        if pool(&text) == [0.0; 4] || t2.elapsed() > Duration::from_secs(5) {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(pool(&after), [0.0; 4], "the pools must be idle again: {after}");
    let m = parse_metrics(&after);
    let n = |k: &str| m.iter().filter(|(key, _)| key.starts_with(k)).map(|(_, v)| v).sum::<f64>();
    let peak = *peak_rss.lock().unwrap();
    let after_rss = rss(&after);
    eprintln!(
        "load: 64 clients in {elapsed:?}; 7 disconnects, 3 bad bodies, 1 slow reader; RSS idle {:.1} MiB, peak {:.1} MiB, after {:.1} MiB",
        idle_rss / 1048576.0,
        peak / 1048576.0,
        after_rss / 1048576.0
    );
    assert_eq!(n("ornith_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\""), 2.0);
    assert_eq!(n("ornith_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"413\""), 1.0);
    assert_eq!(n("ornith_requests_cancelled_total"), 7.0, "every disconnect counted once");
    // Memory: back near the baseline (the test process's whole RSS, so other tests running at
    // the same time count too; a leak of the 64 streams' state would be far above this).
    assert!(after_rss < idle_rss + 64.0 * 1048576.0, "RSS idle {idle_rss}, after {after_rss}");
    assert!(elapsed < Duration::from_secs(60), "{elapsed:?}");
    let stats = s.stop().await;
    assert_eq!(stats.cancelled, 7, "every disconnect cancelled its sequence: {stats:?}");
    assert_eq!(stats.finished, 1 + 64 - 7 - 3, "{stats:?}");
    assert_eq!(stats.failed, 0);
}

// ------------------------------------------------------------------ --api-key

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_when_set() {
    let s = server_with_key(512, 2, Duration::ZERO, Some("s3cret")).await;
    let url = |p: &str| format!("{}{p}", s.base);
    let chat = json!({"messages": user("SAY:ok"), "max_tokens": 2}).to_string();
    // Without a key, or with a wrong one: 401 in each API's shape.
    let r = s.client.post(url("/v1/chat/completions")).body(chat.clone()).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let e: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(e["error"]["code"], "invalid_api_key", "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("no API key"), "{e}");
    let r = s.client.post(url("/v1/chat/completions")).bearer_auth("s3cre").body(chat.clone()).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let msg = json!({"max_tokens": 2, "messages": user("SAY:ok")}).to_string();
    let r = s.client.post(url("/v1/messages")).header("x-api-key", "nope").body(msg.clone()).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let e: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(e["error"]["type"], "authentication_error", "{e}");
    assert_eq!(s.client.get(url("/v1/models")).send().await.unwrap().status().as_u16(), 401);
    // With it (either header): through. /health needs none.
    let r = s.client.post(url("/v1/chat/completions")).bearer_auth("s3cret").body(chat).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let r = s.client.post(url("/v1/messages")).header("x-api-key", "s3cret").body(msg).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(s.client.get(url("/health")).send().await.unwrap().status().as_u16(), 200);
    let (st, text) = s.get("/metrics").await;
    assert_eq!(st, 401, "metrics need the key too: {text}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_stream_pings_while_the_engine_is_slow() {
    // Steps of 150 ms, pings after 40 ms of silence.
    let s = server_opts(512, 1, Duration::from_millis(150), |o| o.ping_interval = Duration::from_millis(40)).await;
    let body = json!({"max_tokens": 16, "stream": true, "messages": user("SAY:ab"), "thinking": {"type": "disabled"}});
    let (st, _, events) = s.stream("/v1/messages", body).await;
    assert_eq!(st, 200);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(names.last(), Some(&"message_stop"));
    let pings: Vec<&(String, String)> = events.iter().filter(|(n, _)| n == "ping").collect();
    assert!(pings.len() >= 3, "{names:?}");
    assert!(pings.iter().all(|(_, d)| d == r#"{"type":"ping"}"#), "{pings:?}");
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap()["delta"]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, "ab", "pings do not disturb the content");
    // The OpenAI stream of the same wait has no pings.
    let (_, _, events) = s.stream("/v1/chat/completions", json!({"messages": user("SAY:ab"), "stream": true})).await;
    assert!(events.iter().all(|(n, _)| n.is_empty()), "{events:?}");
    s.stop().await;
}
