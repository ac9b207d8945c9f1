//! The thread between the HTTP handlers and the engine thread: it owns the tokenizer and the chat
//! template, starts requests (render, tokenize, submit), turns the engine's tokens into chunks and
//! final bodies with [`Live`], and sends them to each request's channel.
//!
//! Every message (a new request, a cancel, an engine event) comes through one queue, so a
//! request is registered under its id before any event of it can be handled. A request whose
//! channel is closed (the client went away) is cancelled in the engine at once.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use crate::engine::{Engine, EngineClient, EngineStats, EngineThread, Event, EventKind};
use crate::protocol::live::{self, Limits, Live};
use crate::protocol::request::{LineError, Request};
use crate::protocol::{PromptRenderer, TextCodec};

use super::metrics::Metrics;
use super::queue::Place;

/// What a request's channel carries, in order: `Accepted` (or one `Done` with the refusal), then
/// `Chunks` (streamed requests), then `Done`.
#[derive(Debug)]
pub enum Out {
    /// Submitted to the engine with this many prompt tokens.
    Accepted { prompt_tokens: usize },
    /// Stream chunks (OpenAI `chat.completion.chunk` / `text_completion` objects).
    Chunks(Vec<Value>),
    /// The final body (OpenAI `chat.completion` / `text_completion`), or the error.
    Done(Result<Value, LineError>),
}

pub(crate) enum Msg {
    Start {
        id: u64,
        req: Request,
        started: Instant,
        tx: mpsc::UnboundedSender<Out>,
        place: Place,
    },
    Count {
        req: Request,
        reply: oneshot::Sender<Result<usize, LineError>>,
    },
    Cancel(u64),
    Event(Event),
    EngineGone,
    /// Every [`EngineRouter`] is gone: cancel what is open and stop.
    Closed,
}

/// Sends `Closed` when the last [`EngineRouter`] clone is dropped (the engine's sink holds a
/// sender too, so the queue alone would never close).
struct Closer(Sender<Msg>);
impl Drop for Closer {
    fn drop(&mut self) {
        let _ = self.0.send(Msg::Closed);
    }
}

/// Sends `EngineGone` when the engine thread drops its sink, however it ends.
struct GoneSignal(Sender<Msg>);
impl Drop for GoneSignal {
    fn drop(&mut self) {
        let _ = self.0.send(Msg::EngineGone);
    }
}

/// The handle the HTTP handlers hold.
#[derive(Clone)]
pub struct EngineRouter {
    tx: Sender<Msg>,
    client: EngineClient,
    /// Longest prompt + output.
    pub window: usize,
    _closer: Arc<Closer>,
}

impl EngineRouter {
    /// A fresh request id (the engine's: see [`EngineClient::reserve_id`]).
    pub fn reserve_id(&self) -> u64 {
        self.client.reserve_id()
    }

    /// Starts `req` under `id`, holding `place` until it ends; its results come on the returned
    /// channel. Dropping the [`CancelOnDrop`] guard before `Done` cancels it.
    pub fn start(&self, id: u64, req: Request, place: Place) -> (mpsc::UnboundedReceiver<Out>, CancelOnDrop) {
        let (tx, rx) = mpsc::unbounded_channel();
        let started = Instant::now();
        if self.tx.send(Msg::Start { id, req, started, tx, place }).is_err() {
            // The router is gone: the receiver sees a closed channel.
        }
        (rx, CancelOnDrop { tx: Some(self.tx.clone()), id })
    }

    /// The engine's pool occupancy.
    pub fn pool_usage(&self) -> crate::engine::PoolUsage {
        self.client.pool_usage()
    }

    /// The engine's pools, queue and prefix cache.
    pub fn gauges(&self) -> crate::engine::EngineGauges {
        self.client.gauges()
    }

    /// The prompt tokens `req` would have.
    pub async fn count(&self, req: Request) -> Result<usize, LineError> {
        let (reply, rx) = oneshot::channel();
        let _ = self.tx.send(Msg::Count { req, reply });
        rx.await.unwrap_or_else(|_| Err(engine_stopped()))
    }
}

/// Cancels its request when dropped, unless [`done`](Self::done) was called.
pub struct CancelOnDrop {
    tx: Option<Sender<Msg>>,
    id: u64,
}

impl CancelOnDrop {
    /// The request ended: nothing to cancel.
    pub fn done(&mut self) {
        self.tx = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Msg::Cancel(self.id));
        }
    }
}

pub(crate) fn engine_stopped() -> LineError {
    LineError::new("internal_error", "the engine thread stopped; see the server's log")
}

fn panicked() -> LineError {
    LineError::new("internal_error", "the engine panicked on this request; see the server's log")
}

/// What the router needs besides the engine.
pub struct RouterConfig {
    pub model_name: String,
    pub eos_ids: Vec<u32>,
    pub run_id: u64,
    pub quiet: bool,
}

/// The router thread and the engine thread under it.
pub struct Threads {
    router: JoinHandle<()>,
    engine: EngineThread,
}

impl Threads {
    /// Waits for both threads (once every [`EngineRouter`] is dropped); the engine's counters.
    pub fn join(self) -> anyhow::Result<EngineStats> {
        self.router.join().map_err(|_| anyhow::anyhow!("the router thread panicked"))?;
        self.engine.join()
    }
}

/// Starts the engine thread and the router thread.
pub fn spawn(
    engine: Engine,
    codec: Box<dyn TextCodec + Send>,
    renderer: Box<dyn PromptRenderer + Send>,
    cfg: RouterConfig,
    metrics: Arc<Metrics>,
) -> anyhow::Result<(Threads, EngineRouter)> {
    let window = engine.max_context();
    let (tx, rx) = channel::<Msg>();
    let gone = GoneSignal(tx.clone());
    let (engine, client) = EngineThread::spawn(engine, move |e| gone.0.send(Msg::Event(e)).is_ok());
    let router_client = client.clone();
    let router = std::thread::Builder::new().name("ornith-router".into()).spawn(move || {
        route(rx, router_client, codec.as_ref(), renderer.as_ref(), &cfg, window, &metrics);
    })?;
    let closer = Arc::new(Closer(tx.clone()));
    Ok((Threads { router, engine }, EngineRouter { tx, client, window, _closer: closer }))
}

struct Open<'a> {
    live: Live<'a>,
    tx: mpsc::UnboundedSender<Out>,
    started: Instant,
    /// When its last token came (inter-token latency).
    last_token: Instant,
    /// Given back when the request leaves `open`, before its `Done` is sent: a client that has
    /// seen its request end finds the place free.
    place: Place,
}

fn route(
    rx: Receiver<Msg>,
    client: EngineClient,
    codec: &dyn TextCodec,
    renderer: &dyn PromptRenderer,
    cfg: &RouterConfig,
    window: usize,
    metrics: &Metrics,
) {
    let limits = Limits { window, vocab: codec.vocab_size() };
    let mut open: HashMap<u64, Open<'_>> = HashMap::new();
    let mut engine_alive = true;
    while let Ok(msg) = rx.recv() {
        match msg {
            Msg::Closed => break,
            Msg::Count { req, reply } => {
                let r = catch_unwind(AssertUnwindSafe(|| live::prompt_tokens(&req, codec, renderer, &limits)))
                    .unwrap_or_else(|_| Err(panicked()));
                let _ = reply.send(r.map(|(p, _)| p.len()));
            }
            Msg::Start { id, req, started, tx, place } => {
                if !engine_alive {
                    let _ = tx.send(Out::Done(Err(engine_stopped())));
                    continue;
                }
                let begun = catch_unwind(AssertUnwindSafe(|| {
                    Live::start(
                        req,
                        id,
                        None,
                        codec,
                        renderer,
                        &limits,
                        &cfg.eos_ids,
                        &cfg.model_name,
                        cfg.run_id,
                        started,
                    )
                }))
                .unwrap_or_else(|_| Err(panicked()));
                match begun {
                    Ok((gen, mut live)) => {
                        let prompt_tokens = live.prompt_len();
                        let chunks = live.take_chunks();
                        if tx.send(Out::Accepted { prompt_tokens }).is_err() {
                            continue; // the client left already
                        }
                        if !chunks.is_empty() {
                            let _ = tx.send(Out::Chunks(chunks));
                        }
                        metrics.submitted(prompt_tokens);
                        client.submit_as(id, gen);
                        open.insert(id, Open { live, tx, started, last_token: started, place });
                    }
                    Err(e) => {
                        let _ = tx.send(Out::Done(Err(e)));
                    }
                }
            }
            Msg::Cancel(id) => {
                if let Some(o) = open.remove(&id) {
                    client.cancel(id);
                    metrics.left(o.live.generated() > 0);
                    if !cfg.quiet {
                        eprintln!("[ornith] request {id}: cancelled (the client went away)");
                    }
                }
            }
            Msg::Event(e) => {
                let Some(o) = open.get_mut(&e.id) else { continue };
                let done: Option<Result<(), LineError>> = match e.kind {
                    EventKind::Token(t) => {
                        let now = Instant::now();
                        if o.live.generated() == 0 {
                            metrics.first_token(now - o.started);
                        } else {
                            metrics.inter_token(now - o.last_token);
                        }
                        o.last_token = now;
                        metrics.generated(1);
                        match catch_unwind(AssertUnwindSafe(|| o.live.on_token(t))).unwrap_or_else(|_| Err(panicked()))
                        {
                            Ok(true) => Some(Ok(())),
                            Ok(false) => None,
                            Err(e) => Some(Err(e)),
                        }
                    }
                    EventKind::Finished(_) => Some(Ok(())),
                    EventKind::Admitted { cached_tokens } => {
                        o.live.on_admitted(cached_tokens);
                        metrics.cached(cached_tokens);
                        None
                    }
                    EventKind::Error { code, message } => Some(Err(LineError::from_engine(code, message))),
                };
                let chunks = o.live.take_chunks();
                let mut gone = !chunks.is_empty() && o.tx.send(Out::Chunks(chunks)).is_err();
                if let Some(res) = done {
                    let mut o = open.remove(&e.id).expect("present above");
                    client.cancel(e.id); // a no-op when the engine already ended it
                    metrics.left(o.live.generated() > 0);
                    let res = res.and_then(|()| {
                        catch_unwind(AssertUnwindSafe(|| o.live.body())).unwrap_or_else(|_| Err(panicked()))
                    });
                    let chunks = o.live.take_chunks();
                    if !chunks.is_empty() {
                        let _ = o.tx.send(Out::Chunks(chunks));
                    }
                    if !cfg.quiet {
                        log_result(e.id, &res);
                    }
                    drop(o.place);
                    let _ = o.tx.send(Out::Done(res));
                    continue;
                }
                gone = gone || o.tx.is_closed();
                if gone {
                    // The client went away between two tokens.
                    let o = open.remove(&e.id).expect("present above");
                    client.cancel(e.id);
                    metrics.left(o.live.generated() > 0);
                    if !cfg.quiet {
                        eprintln!("[ornith] request {}: cancelled (the client went away)", e.id);
                    }
                }
            }
            Msg::EngineGone => {
                engine_alive = false;
                for (_, o) in open.drain() {
                    metrics.left(o.live.generated() > 0);
                    drop(o.place);
                    let _ = o.tx.send(Out::Done(Err(engine_stopped())));
                }
            }
        }
    }
    for id in open.keys() {
        client.cancel(*id);
    }
}

fn log_result(id: u64, res: &Result<Value, LineError>) {
    match res {
        Ok(body) => {
            let u = &body["usage"];
            eprintln!(
                "[ornith] request {id}: {}+{} tokens, {}, ttft {} ms",
                u["prompt_tokens"],
                u["completion_tokens"],
                body["choices"][0]["finish_reason"].as_str().unwrap_or("?"),
                body["ttft_ms"],
            );
        }
        Err(e) => eprintln!("[ornith] request {id}: {}: {}", e.code, e.message),
    }
}
