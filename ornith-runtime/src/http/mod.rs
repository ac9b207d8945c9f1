//! `ornith serve`: the OpenAI and Anthropic HTTP APIs on one engine shared by every connection.
//!
//! * `POST /v1/chat/completions`, `POST /v1/completions`: the JSONL front end's request parsing
//!   (`protocol::request`) and result building (`protocol::live`); `stream: true` answers with
//!   server-sent events `data: {chunk}` … `data: [DONE]`.
//! * `POST /v1/messages`, `POST /v1/messages/count_tokens`: the Anthropic Messages API, translated
//!   to and from the chat shapes (`anthropic`).
//! * `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text).
//!
//! A router thread (`router`) owns the tokenizer and chat template and talks to the engine
//! thread; handlers send it requests and read their results from a channel of their own. A client
//! that goes away (a dropped connection or event stream) cancels its sequence at once.

pub mod anthropic;
pub mod metrics;
pub mod router;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::Engine;
use crate::protocol::request::{self, LineError};
use crate::protocol::{GenerationDefaults, PromptRenderer, TextCodec};
use crate::sampling::mix64;

use self::metrics::Metrics;
use self::router::{CancelOnDrop, EngineRouter, Out, RouterConfig, Threads};

/// What the server needs besides the engine and the front end.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The model id clients must name (or leave out); `model` of every response.
    pub model_name: String,
    pub defaults: GenerationDefaults,
    /// Unique per run: goes into response ids and default seeds.
    pub run_id: u64,
    /// No per-request log lines on stderr.
    pub quiet: bool,
    /// Larger request bodies are refused (413).
    pub max_body_bytes: usize,
}

struct AppState {
    router: EngineRouter,
    opts: ServerOptions,
    metrics: Arc<Metrics>,
    created: u64,
}

/// Which API's error shape a handler answers with.
#[derive(Clone, Copy, PartialEq)]
enum Api {
    OpenAi,
    Anthropic,
}

/// An error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, code, message: message.into() }
    }

    /// The HTTP status of a front-end error code.
    fn from_line(e: LineError) -> Self {
        let status = match e.code {
            "engine_error" | "internal_error" => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::BAD_REQUEST,
        };
        ApiError { status, code: e.code, message: e.message }
    }

    fn body(&self, api: Api) -> Value {
        match api {
            Api::OpenAi => {
                let ty = if self.status.is_server_error() { "server_error" } else { "invalid_request_error" };
                json!({"error": {"message": self.message, "type": ty, "param": null, "code": self.code}})
            }
            Api::Anthropic => {
                let ty = match self.status {
                    StatusCode::NOT_FOUND => "not_found_error",
                    StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
                    s if s.is_server_error() => "api_error",
                    _ => "invalid_request_error",
                };
                json!({"type": "error", "error": {"type": ty, "message": self.message}})
            }
        }
    }

    fn response(&self, api: Api) -> Response {
        json_response(self.status, &self.body(api))
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Builds the app and starts the engine and router threads under it. The threads end once the
/// app (every clone of it) is dropped; [`Threads::join`] then returns the engine's counters.
pub fn app(
    engine: Engine,
    codec: Box<dyn TextCodec + Send>,
    renderer: Box<dyn PromptRenderer + Send>,
    opts: ServerOptions,
) -> anyhow::Result<(Router, Threads)> {
    let metrics = Arc::new(Metrics::default());
    let cfg = RouterConfig {
        model_name: opts.model_name.clone(),
        eos_ids: opts.defaults.eos_token_ids.clone(),
        run_id: opts.run_id,
        quiet: opts.quiet,
    };
    let (threads, router) = router::spawn(engine, codec, renderer, cfg, metrics.clone())?;
    let limit = opts.max_body_bytes;
    let state = Arc::new(AppState { router, opts, metrics, created: now_unix() });
    let app = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state);
    Ok((app, threads))
}

/// Serves `app` on `listener` until `shutdown` completes (then lets open requests finish).
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

type St = State<Arc<AppState>>;

/// The JSON object of a request body, and a model name that is ours.
fn json_body(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let body = body.map_err(|r| {
        let code = if r.status() == StatusCode::PAYLOAD_TOO_LARGE { "request_too_large" } else { "invalid_request" };
        let msg = if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            format!("the request body is larger than {} bytes (--max-line-bytes)", st.opts.max_body_bytes)
        } else {
            r.body_text()
        };
        ApiError::new(r.status(), code, msg)
    })?;
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", format!("malformed JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "the request body must be a JSON object",
        ));
    }
    match v.get("model") {
        None | Some(Value::Null) => {}
        Some(Value::String(m)) if *m == st.opts.model_name => {}
        Some(m) => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "model_not_found",
                format!("The model {m} does not exist; this server serves {:?}", st.opts.model_name),
            ))
        }
    }
    Ok(v)
}

/// Parses a chat (or completion) body with the JSONL front end's rules; logs its warnings.
fn parse_request(st: &AppState, id: u64, url: &str, body: Value) -> Result<request::Request, ApiError> {
    let line = json!({"url": url, "body": body});
    let seed = mix64(st.opts.run_id ^ mix64(id));
    let req = request::parse(&line, &st.opts.defaults, seed).map_err(ApiError::from_line)?;
    if !st.opts.quiet {
        for w in &req.warnings {
            eprintln!("[ornith] request {id}: warning: {w}");
        }
    }
    Ok(req)
}

/// Starts `req` and waits for the engine to accept it: the prompt's token count, the request's
/// channel and its cancel guard.
async fn start(
    st: &AppState,
    id: u64,
    req: request::Request,
) -> Result<(usize, UnboundedReceiver<Out>, CancelOnDrop), ApiError> {
    let (mut rx, mut guard) = st.router.start(id, req);
    match rx.recv().await {
        Some(Out::Accepted { prompt_tokens }) => Ok((prompt_tokens, rx, guard)),
        Some(Out::Done(Err(e))) => {
            guard.done();
            Err(ApiError::from_line(e))
        }
        _ => {
            guard.done();
            Err(ApiError::from_line(router::engine_stopped()))
        }
    }
}

/// Waits for the final body of a request that does not stream.
async fn finish(mut rx: UnboundedReceiver<Out>, mut guard: CancelOnDrop) -> Result<Value, ApiError> {
    loop {
        match rx.recv().await {
            Some(Out::Done(res)) => {
                guard.done();
                return res.map_err(ApiError::from_line);
            }
            Some(_) => {}
            None => {
                guard.done();
                return Err(ApiError::from_line(router::engine_stopped()));
            }
        }
    }
}

fn sse(body: Body) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .expect("a valid response")
}

/// Records the response's status under `endpoint` and answers errors in `api`'s shape.
fn respond(st: &AppState, endpoint: &'static str, api: Api, r: Result<Response, ApiError>) -> Response {
    let resp = r.unwrap_or_else(|e| {
        if !st.opts.quiet && e.status.is_server_error() {
            eprintln!("[ornith] {endpoint}: {}: {}", e.code, e.message);
        }
        e.response(api)
    });
    st.metrics.request(endpoint, resp.status().as_u16());
    resp
}

async fn chat_completions(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    let r = openai(&st, "/v1/chat/completions", body).await;
    respond(&st, "/v1/chat/completions", Api::OpenAi, r)
}

async fn completions(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    let r = openai(&st, "/v1/completions", body).await;
    respond(&st, "/v1/completions", Api::OpenAi, r)
}

async fn openai(st: &AppState, url: &'static str, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = json_body(st, body)?;
    let include_usage = body.pointer("/stream_options/include_usage") == Some(&Value::Bool(true));
    let id = st.router.reserve_id();
    let req = parse_request(st, id, url, body)?;
    let stream = req.stream;
    let (_, rx, guard) = start(st, id, req).await?;
    if !stream {
        return Ok(json_response(StatusCode::OK, &finish(rx, guard).await?));
    }
    let chat = url == "/v1/chat/completions";
    let s = futures_util::stream::unfold(Some((rx, guard)), move |state| async move {
        let (mut rx, mut guard) = state?;
        let data = |v: &Value| format!("data: {v}\n\n");
        let text = match rx.recv().await {
            Some(Out::Chunks(cs)) => {
                let text: String = cs.iter().map(data).collect();
                return Some((Ok::<_, Infallible>(Bytes::from(text)), Some((rx, guard))));
            }
            Some(Out::Accepted { .. }) => return Some((Ok(Bytes::new()), Some((rx, guard)))),
            Some(Out::Done(Ok(body))) => {
                let mut text = String::new();
                if include_usage {
                    let object = if chat { "chat.completion.chunk" } else { "text_completion" };
                    text += &data(&json!({"id": body["id"], "object": object, "created": body["created"],
                        "model": body["model"], "choices": [], "usage": body["usage"]}));
                }
                text
            }
            Some(Out::Done(Err(e))) => data(&ApiError::from_line(e).body(Api::OpenAi)),
            None => data(&ApiError::from_line(router::engine_stopped()).body(Api::OpenAi)),
        };
        guard.done();
        Some((Ok(Bytes::from(text + "data: [DONE]\n\n")), None))
    });
    Ok(sse(Body::from_stream(s)))
}

async fn messages(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    let r = anthropic_messages(&st, body).await;
    respond(&st, "/v1/messages", Api::Anthropic, r)
}

fn anthropic_request(st: &AppState, id: u64, body: Value, counting: bool) -> Result<request::Request, ApiError> {
    let (chat, warnings) = anthropic::chat_body(&body, counting).map_err(ApiError::from_line)?;
    if !st.opts.quiet {
        for w in &warnings {
            eprintln!("[ornith] request {id}: warning: {w}");
        }
    }
    parse_request(st, id, "/v1/chat/completions", chat)
}

async fn anthropic_messages(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = json_body(st, body)?;
    let id = st.router.reserve_id();
    let req = anthropic_request(st, id, body, false)?;
    let stream = req.stream;
    let (prompt_tokens, rx, guard) = start(st, id, req).await?;
    if !stream {
        return Ok(json_response(StatusCode::OK, &anthropic::message(&finish(rx, guard).await?)));
    }
    let events = anthropic::Events::new(&st.opts.model_name);
    let msg_id = anthropic::message_id(&format!("{:016x}{id:08x}", st.opts.run_id));
    let first = events.start(&msg_id, prompt_tokens);
    let s = futures_util::stream::unfold(Some((rx, guard, events, Some(first))), move |state| async move {
        let (mut rx, mut guard, mut events, first) = state?;
        let data = |evs: Vec<anthropic::Event>| -> String {
            evs.iter().map(|(name, v)| format!("event: {name}\ndata: {v}\n\n")).collect()
        };
        if let Some(f) = first {
            return Some((Ok::<_, Infallible>(Bytes::from(data(vec![f]))), Some((rx, guard, events, None))));
        }
        let text = match rx.recv().await {
            Some(Out::Chunks(cs)) => {
                let text: String = cs.iter().map(|c| data(events.chunk(c))).collect();
                return Some((Ok(Bytes::from(text)), Some((rx, guard, events, None))));
            }
            Some(Out::Accepted { .. }) => return Some((Ok(Bytes::new()), Some((rx, guard, events, None)))),
            Some(Out::Done(Ok(body))) => data(events.finish(&body)),
            Some(Out::Done(Err(e))) => data(vec![("error", ApiError::from_line(e).body(Api::Anthropic))]),
            None => data(vec![("error", ApiError::from_line(router::engine_stopped()).body(Api::Anthropic))]),
        };
        guard.done();
        Some((Ok(Bytes::from(text)), None))
    });
    Ok(sse(Body::from_stream(s)))
}

async fn count_tokens(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let body = json_body(&st, body)?;
        let id = st.router.reserve_id();
        let req = anthropic_request(&st, id, body, true)?;
        let n = st.router.count(req).await.map_err(ApiError::from_line)?;
        Ok(json_response(StatusCode::OK, &json!({"input_tokens": n})))
    }
    .await;
    respond(&st, "/v1/messages/count_tokens", Api::Anthropic, r)
}

async fn models(State(st): St) -> Response {
    let w = st.router.window;
    let m = json!({"id": st.opts.model_name, "object": "model", "created": st.created, "owned_by": "ornith",
                   "max_model_len": w, "context_length": w});
    respond(&st, "/v1/models", Api::OpenAi, Ok(json_response(StatusCode::OK, &json!({"object": "list", "data": [m]}))))
}

async fn health(State(st): St) -> Response {
    respond(&st, "/health", Api::OpenAi, Ok(json_response(StatusCode::OK, &json!({"status": "ok"}))))
}

async fn metrics_text(State(st): St) -> Response {
    let text = st.metrics.render();
    let r = (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response();
    respond(&st, "/metrics", Api::OpenAi, Ok(r))
}

async fn not_found(State(st): St, uri: axum::http::Uri) -> Response {
    let e = ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no endpoint {}", uri.path()));
    let api = if uri.path().starts_with("/v1/messages") { Api::Anthropic } else { Api::OpenAi };
    respond(&st, "other", api, Err(e))
}
