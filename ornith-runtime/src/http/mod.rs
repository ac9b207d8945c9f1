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
mod auth;
mod body;
pub mod metrics;
pub mod queue;
pub mod responses;
pub mod router;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

use self::metrics::{Metrics, QueueUsage};
use self::queue::Admission;
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
    /// When set, every endpoint but `/health` needs it as `Authorization: Bearer KEY` or
    /// `x-api-key: KEY` (401 otherwise).
    pub api_key: Option<String>,
    /// An Anthropic event stream that has sent nothing for this long sends a `ping` event (as
    /// Anthropic's API does), so that clients and proxies do not time out during a long prefill
    /// or a wait in the queue.
    pub ping_interval: Duration,
    /// Generation requests that may wait beyond the engine's sequence slots (`--max-queue`): at
    /// most slots + this many are in the server at once; more get 429 with `Retry-After`.
    pub max_queue: usize,
}

/// The default [`ServerOptions::ping_interval`].
pub const PING_INTERVAL: Duration = Duration::from_secs(10);

struct AppState {
    router: EngineRouter,
    opts: ServerOptions,
    metrics: Arc<Metrics>,
    admission: Arc<Admission>,
    created: u64,
}

/// The served paths, named once: the router's table, the handlers' request counts and the
/// body limit's endpoint names (`ornith_http_requests_total{endpoint=...}`) all read these.
mod paths {
    pub const CHAT: &str = "/v1/chat/completions";
    pub const COMPLETIONS: &str = "/v1/completions";
    pub const RESPONSES: &str = "/v1/responses";
    pub const MESSAGES: &str = "/v1/messages";
    pub const COUNT_TOKENS: &str = "/v1/messages/count_tokens";
    pub const MODELS: &str = "/v1/models";
    pub const HEALTH: &str = "/health";
    pub const METRICS: &str = "/metrics";
    /// Every served path (a request anywhere else is counted under "other").
    pub const ALL: [&str; 8] = [CHAT, COMPLETIONS, RESPONSES, MESSAGES, COUNT_TOKENS, MODELS, HEALTH, METRICS];
}

/// Which API's error shape a handler answers with.
#[derive(Clone, Copy, PartialEq)]
enum Api {
    OpenAi,
    Anthropic,
}

impl Api {
    /// The shape of errors answered before a handler runs (or where none matched): Anthropic's
    /// under `/v1/messages`, OpenAI's elsewhere.
    fn of_path(path: &str) -> Api {
        if path.starts_with(paths::MESSAGES) {
            Api::Anthropic
        } else {
            Api::OpenAi
        }
    }
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

    /// 429: every place for a generation request is taken (`--max-queue`).
    fn queue_full(limit: usize) -> Self {
        let msg = format!(
            "the server is at its limit of {limit} generation requests (running and queued, --max-queue); retry after {} s",
            queue::RETRY_AFTER_SECS
        );
        ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded", msg)
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
                let ty = match self.status {
                    // OpenAI's own 429s: `"type": "requests", "code": "rate_limit_exceeded"`.
                    StatusCode::TOO_MANY_REQUESTS => "requests",
                    s if s.is_server_error() => "server_error",
                    _ => "invalid_request_error",
                };
                json!({"error": {"message": self.message, "type": ty, "param": null, "code": self.code}})
            }
            Api::Anthropic => {
                let ty = match self.status {
                    StatusCode::NOT_FOUND => "not_found_error",
                    StatusCode::UNAUTHORIZED => "authentication_error",
                    StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
                    StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
                    s if s.is_server_error() => "api_error",
                    _ => "invalid_request_error",
                };
                json!({"type": "error", "error": {"type": ty, "message": self.message}})
            }
        }
    }

    fn response(&self, api: Api) -> Response {
        let mut r = json_response(self.status, &self.body(api));
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut().insert(header::RETRY_AFTER, queue::RETRY_AFTER_SECS.into());
        }
        r
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
    codec: Box<dyn TextCodec + Send + Sync>,
    renderer: Box<dyn PromptRenderer + Send + Sync>,
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
    let admission = Admission::new(router.pool_usage().slots_total.saturating_add(opts.max_queue));
    let state = Arc::new(AppState { router, opts, metrics, admission, created: now_unix() });
    let app = Router::new()
        .route(paths::CHAT, post(chat_completions))
        .route(paths::COMPLETIONS, post(completions))
        .route(paths::RESPONSES, post(responses_endpoint))
        .route(paths::MESSAGES, post(messages))
        .route(paths::COUNT_TOKENS, post(count_tokens))
        .route(paths::MODELS, get(models))
        .route(paths::HEALTH, get(health))
        .route(paths::METRICS, get(metrics_text))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), body::limit_body))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth::require_key))
        .layer(DefaultBodyLimit::disable())
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
    // The size limit is enforced before the handler (`body::limit_body`).
    let body = body.map_err(|r| ApiError::new(r.status(), "invalid_request", r.body_text()))?;
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

/// Takes a place for `req` (429 when there is none), starts it and waits for the engine to
/// accept it: the prompt's token count, the request's channel and its cancel guard.
async fn start(
    st: &AppState,
    id: u64,
    req: request::Request,
) -> Result<(usize, UnboundedReceiver<Out>, CancelOnDrop), ApiError> {
    let place = st.admission.try_enter(req.n).ok_or_else(|| ApiError::queue_full(st.admission.limit()))?;
    let (mut rx, mut guard) = st.router.start(id, req, place);
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
    let r = openai(&st, paths::CHAT, body).await;
    respond(&st, paths::CHAT, Api::OpenAi, r)
}

async fn completions(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    let r = openai(&st, paths::COMPLETIONS, body).await;
    respond(&st, paths::COMPLETIONS, Api::OpenAi, r)
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
    let chat = url == paths::CHAT;
    let data = |v: &Value| format!("data: {v}\n\n");
    Ok(event_stream(rx, guard, String::new(), None, move |out| {
        let text = match out {
            Ok(chunk) => return data(chunk),
            Err(Ok(body)) if include_usage => {
                let object = if chat { "chat.completion.chunk" } else { "text_completion" };
                data(&json!({"id": body["id"], "object": object, "created": body["created"],
                    "model": body["model"], "choices": [], "usage": body["usage"]}))
            }
            Err(Ok(_)) => String::new(),
            Err(Err(e)) => data(&ApiError::from_line(e.clone()).body(Api::OpenAi)),
        };
        text + "data: [DONE]\n\n"
    }))
}

async fn messages(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    let r = anthropic_messages(&st, body).await;
    respond(&st, paths::MESSAGES, Api::Anthropic, r)
}

fn anthropic_request(st: &AppState, id: u64, body: Value, counting: bool) -> Result<request::Request, ApiError> {
    let (chat, warnings) = anthropic::chat_body(&body, counting).map_err(ApiError::from_line)?;
    if !st.opts.quiet {
        for w in &warnings {
            eprintln!("[ornith] request {id}: warning: {w}");
        }
    }
    parse_request(st, id, paths::CHAT, chat)
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
    let mut events = anthropic::Events::new(&st.opts.model_name);
    let msg_id = anthropic::message_id(&format!("{:016x}{id:08x}", st.opts.run_id));
    let first = events.start(&msg_id, prompt_tokens);
    let text = |evs: Vec<anthropic::Event>| -> String {
        evs.iter().map(|(name, v)| format!("event: {name}\ndata: {v}\n\n")).collect()
    };
    let first = text(vec![first]);
    let ping = Some((st.opts.ping_interval, text(vec![("ping", json!({"type": "ping"}))])));
    Ok(event_stream(rx, guard, first, ping, move |out| match out {
        Ok(chunk) => text(events.chunk(chunk)),
        Err(Ok(body)) => text(events.finish(body)),
        Err(Err(e)) => text(vec![("error", ApiError::from_line(e.clone()).body(Api::Anthropic))]),
    }))
}

/// What an event stream turns into text: a chunk (`Ok`), or the end: the final body or the error.
type StreamItem<'a> = Result<&'a Value, Result<&'a Value, &'a LineError>>;

/// The server-sent events of a streamed request: `first`, then what `render` makes of each
/// chunk and of the end; with `ping` = (interval, event), that event whenever nothing else was
/// sent for the interval. Dropping the stream (the client went away) cancels the request.
fn event_stream<F>(
    rx: UnboundedReceiver<Out>,
    guard: CancelOnDrop,
    first: String,
    ping: Option<(Duration, String)>,
    render: F,
) -> Response
where
    F: FnMut(StreamItem<'_>) -> String + Send + 'static,
{
    struct State<F> {
        rx: UnboundedReceiver<Out>,
        guard: CancelOnDrop,
        render: F,
        first: Option<String>,
        ping: Option<(Duration, String)>,
    }
    let state = State { rx, guard, render, first: Some(first), ping };
    let s = futures_util::stream::unfold(Some(state), |state| async move {
        let mut st = state?;
        if let Some(f) = st.first.take() {
            return Some((Ok::<_, Infallible>(Bytes::from(f)), Some(st)));
        }
        let out = match &st.ping {
            None => st.rx.recv().await,
            Some((every, event)) => match tokio::time::timeout(*every, st.rx.recv()).await {
                Ok(out) => out,
                Err(_) => {
                    let ping = Bytes::from(event.clone());
                    return Some((Ok(ping), Some(st)));
                }
            },
        };
        let (text, end) = match out {
            Some(Out::Chunks(cs)) => (cs.iter().map(|c| (st.render)(Ok(c))).collect::<String>(), false),
            Some(Out::Accepted { .. }) => (String::new(), false),
            Some(Out::Done(Ok(body))) => ((st.render)(Err(Ok(&body))), true),
            Some(Out::Done(Err(e))) => ((st.render)(Err(Err(&e))), true),
            None => ((st.render)(Err(Err(&router::engine_stopped()))), true),
        };
        if end {
            st.guard.done();
            return Some((Ok(Bytes::from(text)), None));
        }
        Some((Ok(Bytes::from(text)), Some(st)))
    });
    sse(Body::from_stream(s))
}

async fn responses_endpoint(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    let r = openai_responses(&st, body).await;
    respond(&st, paths::RESPONSES, Api::OpenAi, r)
}

async fn openai_responses(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = json_body(st, body)?;
    let id = st.router.reserve_id();
    let (chat, warnings) = responses::chat_body(&body).map_err(ApiError::from_line)?;
    if !st.opts.quiet {
        for w in &warnings {
            eprintln!("[ornith] request {id}: warning: {w}");
        }
    }
    let req = parse_request(st, id, paths::CHAT, chat)?;
    let stream = req.stream;
    let resp_id = format!("resp_{:016x}{id:08x}", st.opts.run_id);
    let echo = responses::Echo::new(resp_id, now_unix(), &st.opts.model_name, &body);
    let (_, rx, guard) = start(st, id, req).await?;
    if !stream {
        return Ok(json_response(StatusCode::OK, &responses::response(&echo, &finish(rx, guard).await?)));
    }
    let mut events = responses::Events::new(echo);
    let text = |evs: Vec<responses::Event>| -> String {
        evs.iter().map(|(name, v)| format!("event: {name}\ndata: {v}\n\n")).collect()
    };
    let first = text(events.start());
    Ok(event_stream(rx, guard, first, None, move |out| match out {
        Ok(chunk) => text(events.chunk(chunk)),
        Err(Ok(body)) => text(events.finish(body)),
        Err(Err(e)) => text(events.failed(e.code, &e.message)),
    }))
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
    respond(&st, paths::COUNT_TOKENS, Api::Anthropic, r)
}

async fn models(State(st): St) -> Response {
    let w = st.router.window;
    let m = json!({"id": st.opts.model_name, "object": "model", "created": st.created, "owned_by": "ornith",
                   "max_model_len": w, "context_length": w});
    respond(&st, paths::MODELS, Api::OpenAi, Ok(json_response(StatusCode::OK, &json!({"object": "list", "data": [m]}))))
}

async fn health(State(st): St) -> Response {
    respond(&st, paths::HEALTH, Api::OpenAi, Ok(json_response(StatusCode::OK, &json!({"status": "ok"}))))
}

async fn metrics_text(State(st): St) -> Response {
    let queue = QueueUsage { in_flight: st.admission.held(), limit: st.admission.limit() };
    let text = st.metrics.render(&st.router.gauges(), queue);
    let r = (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response();
    respond(&st, paths::METRICS, Api::OpenAi, Ok(r))
}

async fn not_found(State(st): St, uri: axum::http::Uri) -> Response {
    let e = ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no endpoint {}", uri.path()));
    let api = Api::of_path(uri.path());
    respond(&st, "other", api, Err(e))
}
