//! The HTTP tests' harness: `ornith serve`'s server in process on an ephemeral port over the
//! test doubles, a real HTTP client, and readers of event streams and Prometheus text.

use std::time::{Duration, Instant};

use ornith_runtime::engine::Engine;
use ornith_runtime::http::{self, ServerOptions};
use ornith_runtime::protocol::GenerationDefaults;
use serde_json::{json, Value};

use super::{ByteCodec, ChatMl, Gate, ScriptRunner, ENDOFTEXT, IM_END};

pub const MODEL: &str = "ornith-test";

pub struct Server {
    pub base: String,
    pub client: reqwest::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    threads: Option<http::router::Threads>,
}

/// A server over an engine of `slots` sequences of `ctx` tokens whose steps take `step`.
pub async fn server(ctx: usize, slots: usize, step: Duration) -> Server {
    server_with_key(ctx, slots, step, None).await
}

pub async fn server_with_key(ctx: usize, slots: usize, step: Duration, api_key: Option<&str>) -> Server {
    server_opts(ctx, slots, step, |o| o.api_key = api_key.map(str::to_string)).await
}

/// A server whose options `f` adjusts.
pub async fn server_opts(ctx: usize, slots: usize, step: Duration, f: impl FnOnce(&mut ServerOptions)) -> Server {
    let mut runner = ScriptRunner::new(ctx, slots);
    runner.step_time = step;
    server_on(runner, f).await
}

/// A server over `runner` whose options `f` adjusts.
pub async fn server_on(runner: ScriptRunner, f: impl FnOnce(&mut ServerOptions)) -> Server {
    server_with_codec(runner, Box::new(ByteCodec), f).await
}

impl Gate {
    /// Waits (up to 10 s) until `n` encodes wait at the gate.
    pub async fn until_waiting(&self, n: usize) {
        let t = Instant::now();
        while self.waiting.load(std::sync::atomic::Ordering::SeqCst) < n {
            assert!(t.elapsed() < Duration::from_secs(10), "no encode reached the gate");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A server over `runner` with its own codec, whose options `f` adjusts.
pub async fn server_with_codec(
    runner: ScriptRunner,
    codec: Box<dyn ornith_runtime::protocol::TextCodec + Send + Sync>,
    f: impl FnOnce(&mut ServerOptions),
) -> Server {
    let ctx = runner.ctx;
    let cfg = super::script_config(ctx);
    let engine = Engine::new(Box::new(runner), cfg).unwrap();
    let defaults = GenerationDefaults {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        eos_token_ids: vec![IM_END, ENDOFTEXT],
    };
    let mut opts = ServerOptions {
        model_name: MODEL.into(),
        defaults,
        run_id: 0xabc,
        quiet: true,
        max_body_bytes: 1 << 20,
        api_key: None,
        ping_interval: http::PING_INTERVAL,
        max_queue: http::queue::DEFAULT_MAX_QUEUE,
    };
    f(&mut opts);
    let (app, threads) = http::app(engine, codec, Box::new(ChatMl), opts).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(http::serve(listener, app, async {
        let _ = stopped.await;
    }));
    let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    Server { base, client, stop: Some(stop), task: Some(task), threads: Some(threads) }
}

impl Server {
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self.client.post(format!("{}{path}", self.base)).body(body.to_string()).send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
    }

    /// A streamed request: the status, the content type and the events (name, data) in order.
    pub async fn stream(&self, path: &str, body: Value) -> (u16, String, Vec<(String, String)>) {
        let r = self.client.post(format!("{}{path}", self.base)).body(body.to_string()).send().await.unwrap();
        let status = r.status().as_u16();
        let ctype = r.headers().get("content-type").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
        let text = r.text().await.unwrap();
        (status, ctype, sse_events(&text))
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = self.client.get(format!("{}{path}", self.base)).send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// The `/metrics` samples.
    pub async fn metrics(&self) -> Vec<(String, f64)> {
        let (st, text) = self.get("/metrics").await;
        assert_eq!(st, 200, "{text}");
        parse_metrics(&text)
    }

    /// Polls `/metrics` (up to 10 s) until `key` reads `want`: the engine thread publishes after
    /// each step, the router gives places back when it has handled a request's end.
    pub async fn wait_for(&self, key: &str, want: f64) {
        let t = Instant::now();
        loop {
            let v = metric(&self.metrics().await, key);
            if v == want {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "{key} stayed {v}, not {want}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the server; the engine's counters.
    pub async fn stop(mut self) -> ornith_runtime::engine::EngineStats {
        let _ = self.stop.take().unwrap().send(());
        self.task.take().unwrap().await.unwrap().unwrap();
        let threads = self.threads.take().unwrap();
        tokio::task::spawn_blocking(move || threads.join().unwrap()).await.unwrap()
    }
}

/// Splits an event stream into (event name or "", data) pairs; every event ends with a blank line.
pub fn sse_events(text: &str) -> Vec<(String, String)> {
    assert!(text.is_empty() || text.ends_with("\n\n"), "the stream must end with a complete event: {text:?}");
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (mut name, mut data) = (String::new(), String::new());
            for line in e.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_string();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = d.to_string();
                } else {
                    panic!("unexpected line {line:?} in the event stream");
                }
            }
            (name, data)
        })
        .collect()
}

pub fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// Every sample line of a Prometheus text exposition: (name with labels, value).
pub fn parse_metrics(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap_or_else(|| panic!("bad sample line {l:?}"));
            (k.to_string(), v.parse::<f64>().unwrap_or_else(|_| panic!("bad value in {l:?}")))
        })
        .collect()
}

pub fn metric(m: &[(String, f64)], key: &str) -> f64 {
    m.iter().find(|(k, _)| k == key).unwrap_or_else(|| panic!("no {key} in {m:?}")).1
}

/// A request that would run for minutes on the only slot: `x` forever (ignore_eos).
pub fn endless(stream: bool) -> Value {
    json!({"messages": user("SAY:"), "max_tokens": 4000, "ignore_eos": true, "stream": stream})
}

/// Runs a short request on a server of one slot; it can only finish if the slot is free.
pub async fn short_request_runs(s: &Server) {
    let t = Instant::now();
    let (st, b) = s.post("/v1/chat/completions", json!({"messages": user("SAY:ok"), "max_tokens": 5})).await;
    assert_eq!(st, 200, "{b}");
    assert!(t.elapsed() < Duration::from_secs(10), "the short request waited for the slot: {:?}", t.elapsed());
}
