//! The thread between the HTTP handlers and the engine thread: it starts requests (submits them
//! to the engine), turns the engine's tokens into chunks and final bodies with [`Live`], and
//! sends them to each request's channel. A request's prompt (the chat template's rendering and
//! its tokens) is made first on one of [`PREPARE_THREADS`] preparation threads, so that encoding
//! a long conversation holds up neither the tokens of the requests already streaming nor the
//! start of a short request that arrives meanwhile (requests whose preparations overlap are
//! submitted as they finish, otherwise in arrival order).
//!
//! Every message (a new request, its prepared prompt, a cancel, an engine event) comes through
//! one queue, so a request is registered under its id before any event of it can be handled. A
//! request whose channel is closed (the client went away) is cancelled in the engine at once; one
//! cancelled while its prompt is being prepared is dropped when the prompt comes back.

use std::collections::{HashMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use crate::engine::{Engine, EngineClient, EngineStats, EngineThread, Event, EventKind};
use crate::protocol::live::{self, Limits, Live, Prepared, Progress};
use crate::protocol::request::{LineError, Request};
use crate::protocol::structured::Grammars;
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
    /// The prompt of request `id`, from a preparation thread.
    Prepared {
        id: u64,
        req: Request,
        started: Instant,
        tx: mpsc::UnboundedSender<Out>,
        place: Place,
        prompt: Result<Prepared, LineError>,
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

pub use crate::protocol::live::PREPARE_THREADS;

/// The router thread, the preparation threads and the engine thread under them.
pub struct Threads {
    router: JoinHandle<()>,
    prepare: Vec<JoinHandle<()>>,
    engine: EngineThread,
}

impl Threads {
    /// Waits for the threads (once every [`EngineRouter`] is dropped); the engine's counters.
    pub fn join(self) -> anyhow::Result<EngineStats> {
        self.router.join().map_err(|_| anyhow::anyhow!("the router thread panicked"))?;
        for p in self.prepare {
            p.join().map_err(|_| anyhow::anyhow!("a prompt preparation thread panicked"))?;
        }
        self.engine.join()
    }
}

/// Work for the preparation threads.
enum Job {
    /// Make the prompt of a request to start; the result goes back to the router as `Prepared`.
    Start { id: u64, req: Request, started: Instant, tx: mpsc::UnboundedSender<Out>, place: Place },
    /// Count a request's prompt tokens and reply at once.
    Count { req: Request, reply: oneshot::Sender<Result<usize, LineError>> },
}

/// Starts the engine thread, the router thread and the preparation threads.
pub fn spawn(
    engine: Engine,
    codec: Box<dyn TextCodec + Send + Sync>,
    renderer: Box<dyn PromptRenderer + Send + Sync>,
    cfg: RouterConfig,
    metrics: Arc<Metrics>,
) -> anyhow::Result<(Threads, EngineRouter)> {
    let window = engine.max_context();
    let limits = Limits { window, vocab: codec.vocab_size(), eos: cfg.eos_ids.first().copied() };
    let grammars = Arc::new(Grammars::new());
    let codec: Arc<dyn TextCodec + Send + Sync> = Arc::from(codec);
    let (tx, rx) = channel::<Msg>();
    let (jobs, job_rx) = channel::<Job>();
    let gone = GoneSignal(tx.clone());
    let (engine, client) = EngineThread::spawn(engine, move |e| gone.0.send(Msg::Event(e)).is_ok());
    let router_client = client.clone();
    let router_codec = codec.clone();
    let router = std::thread::Builder::new().name("ornith-router".into()).spawn(move || {
        route(rx, jobs, router_client, router_codec.as_ref(), &cfg, limits, &metrics);
    })?;
    let job_rx = Arc::new(std::sync::Mutex::new(job_rx));
    let renderer: Arc<dyn PromptRenderer + Send + Sync> = Arc::from(renderer);
    let mut prepare = Vec::with_capacity(PREPARE_THREADS);
    for i in 0..PREPARE_THREADS {
        let (jobs, back, codec, renderer) = (job_rx.clone(), tx.clone(), codec.clone(), renderer.clone());
        let grammars = grammars.clone();
        prepare.push(std::thread::Builder::new().name(format!("ornith-prompts-{i}")).spawn(move || {
            prepare_prompts(&jobs, back, codec.as_ref(), renderer.as_ref(), limits, &grammars);
        })?);
    }
    let closer = Arc::new(Closer(tx.clone()));
    Ok((Threads { router, prepare, engine }, EngineRouter { tx, client, window, _closer: closer }))
}

/// A preparation thread: renders and tokenizes the prompts of the jobs it takes from the shared
/// queue (a panic in the template or the tokenizer becomes that request's error). Ends when the
/// router does.
fn prepare_prompts(
    jobs: &std::sync::Mutex<Receiver<Job>>,
    back: Sender<Msg>,
    codec: &dyn TextCodec,
    renderer: &dyn PromptRenderer,
    limits: Limits,
    grammars: &Grammars,
) {
    let make = |req: &Request| {
        catch_unwind(AssertUnwindSafe(|| live::prepare(req, codec, renderer, &limits, grammars)))
            .unwrap_or_else(|_| Err(panicked()))
    };
    let count = |req: &Request| {
        catch_unwind(AssertUnwindSafe(|| live::prompt_tokens(req, codec, renderer, &limits)))
            .unwrap_or_else(|_| Err(panicked()))
    };
    loop {
        // The lock is held only while waiting for the next job, never while preparing one.
        let Ok(job) = jobs.lock().unwrap_or_else(|e| e.into_inner()).recv() else { break };
        match job {
            Job::Start { id, req, started, tx, place } => {
                let prompt = make(&req);
                if back.send(Msg::Prepared { id, req, started, tx, place, prompt }).is_err() {
                    break; // the router is gone
                }
            }
            Job::Count { req, reply } => {
                let _ = reply.send(count(&req).map(|(p, _)| p.len()));
            }
        }
    }
}

struct Open<'a> {
    live: Live<'a>,
    /// The engine ids of its choices' sequences (the first is the request's id).
    ids: Vec<u64>,
    tx: mpsc::UnboundedSender<Out>,
    started: Instant,
    /// When each choice's last token came (inter-token latency).
    last_token: Vec<Instant>,
    /// Given back when the request leaves `open`, before its `Done` is sent: a client that has
    /// seen its request end finds the place free.
    place: Place,
}

fn route(
    rx: Receiver<Msg>,
    jobs: Sender<Job>,
    client: EngineClient,
    codec: &dyn TextCodec,
    cfg: &RouterConfig,
    limits: Limits,
    metrics: &Metrics,
) {
    // Requests by id, and the (request, choice) of each engine id.
    let mut open: HashMap<u64, Open<'_>> = HashMap::new();
    let mut owner: HashMap<u64, (u64, usize)> = HashMap::new();
    // Requests whose prompts are being prepared, and those of them cancelled meanwhile.
    let mut preparing: HashSet<u64> = HashSet::new();
    let mut cancelled: HashSet<u64> = HashSet::new();
    let mut engine_alive = true;
    while let Ok(msg) = rx.recv() {
        match msg {
            Msg::Closed => break,
            Msg::Count { req, reply } => {
                if let Err(std::sync::mpsc::SendError(Job::Count { reply, .. })) = jobs.send(Job::Count { req, reply })
                {
                    let _ = reply.send(Err(engine_stopped()));
                }
            }
            Msg::Start { id, req, started, tx, place } => {
                if !engine_alive {
                    let _ = tx.send(Out::Done(Err(engine_stopped())));
                    continue;
                }
                match jobs.send(Job::Start { id, req, started, tx, place }) {
                    Ok(()) => {
                        preparing.insert(id);
                    }
                    Err(std::sync::mpsc::SendError(job)) => {
                        if let Job::Start { tx, .. } = job {
                            let _ = tx.send(Out::Done(Err(engine_stopped())));
                        }
                    }
                }
            }
            Msg::Prepared { id, req, started, tx, place, prompt } => {
                preparing.remove(&id);
                if cancelled.remove(&id) {
                    continue; // the client went away while its prompt was made
                }
                if !engine_alive {
                    let _ = tx.send(Out::Done(Err(engine_stopped())));
                    continue;
                }
                let begun = prompt.and_then(|prompt| {
                    catch_unwind(AssertUnwindSafe(|| {
                        Live::begin(
                            req,
                            prompt,
                            id,
                            None,
                            codec,
                            &limits,
                            &cfg.eos_ids,
                            &cfg.model_name,
                            cfg.run_id,
                            started,
                        )
                    }))
                    .unwrap_or_else(|_| Err(panicked()))
                });
                match begun {
                    Ok((gens, mut live)) => {
                        let prompt_tokens = live.prompt_len();
                        let chunks = live.take_chunks();
                        if tx.send(Out::Accepted { prompt_tokens }).is_err() {
                            metrics.client_left(); // the client left already (its cancel comes next)
                            continue;
                        }
                        if !chunks.is_empty() {
                            let _ = tx.send(Out::Chunks(chunks));
                        }
                        metrics.submitted(prompt_tokens);
                        let mut ids = Vec::with_capacity(gens.len());
                        for (choice, g) in gens.into_iter().enumerate() {
                            let eid = if choice == 0 { id } else { client.reserve_id() };
                            owner.insert(eid, (id, choice));
                            client.submit_as(eid, g);
                            ids.push(eid);
                        }
                        let last_token = vec![started; ids.len()];
                        open.insert(id, Open { live, ids, tx, started, last_token, place });
                    }
                    Err(e) => {
                        let _ = tx.send(Out::Done(Err(e)));
                    }
                }
            }
            Msg::Cancel(id) => {
                if preparing.contains(&id) {
                    if cancelled.insert(id) {
                        metrics.client_left();
                    }
                } else if let Some(o) = open.remove(&id) {
                    metrics.client_left();
                    for eid in &o.ids {
                        client.cancel(*eid);
                        owner.remove(eid);
                    }
                    metrics.left(o.live.generated() > 0);
                    if !cfg.quiet {
                        eprintln!("[ornith] request {id}: cancelled (the client went away)");
                    }
                }
            }
            Msg::Event(e) => {
                let Some(&(rid, choice)) = owner.get(&e.id) else { continue };
                let Some(o) = open.get_mut(&rid) else { continue };
                let progress = match e.kind {
                    EventKind::Token(t) => {
                        let now = Instant::now();
                        if o.live.generated() == 0 {
                            metrics.first_token(now - o.started);
                        } else if o.live.generated_by(choice) > 0 {
                            metrics.inter_token(now - o.last_token[choice]);
                        }
                        o.last_token[choice] = now;
                        metrics.generated(1);
                        catch_unwind(AssertUnwindSafe(|| o.live.on_token(choice, t)))
                            .unwrap_or_else(|_| Err(panicked()))
                    }
                    EventKind::Finished(_) => catch_unwind(AssertUnwindSafe(|| o.live.on_finished(choice)))
                        .unwrap_or_else(|_| Err(panicked())),
                    EventKind::Admitted { cached_tokens } => {
                        o.live.on_admitted(choice, cached_tokens);
                        if choice == 0 {
                            metrics.cached(cached_tokens);
                        }
                        Ok(Progress::Running)
                    }
                    EventKind::Logprobs(lp) => {
                        o.live.on_logprobs(choice, lp);
                        Ok(Progress::Running)
                    }
                    EventKind::Error { code, message } => Err(LineError::from_engine(code, message)),
                };
                let done = live::settle(progress, || {
                    client.cancel(e.id);
                    owner.remove(&e.id);
                });
                let chunks = o.live.take_chunks();
                let mut gone = !chunks.is_empty() && o.tx.send(Out::Chunks(chunks)).is_err();
                if let Some(res) = done {
                    let mut o = open.remove(&rid).expect("present above");
                    for eid in &o.ids {
                        client.cancel(*eid); // a no-op when the engine already ended it
                        owner.remove(eid);
                    }
                    metrics.left(o.live.generated() > 0);
                    let res = res.and_then(|()| {
                        catch_unwind(AssertUnwindSafe(|| o.live.body())).unwrap_or_else(|_| Err(panicked()))
                    });
                    let chunks = o.live.take_chunks();
                    if !chunks.is_empty() {
                        let _ = o.tx.send(Out::Chunks(chunks));
                    }
                    if !cfg.quiet {
                        log_result(rid, &res);
                    }
                    drop(o.place);
                    let _ = o.tx.send(Out::Done(res));
                    continue;
                }
                gone = gone || o.tx.is_closed();
                if gone {
                    // The client went away between two tokens.
                    metrics.client_left();
                    let o = open.remove(&rid).expect("present above");
                    for eid in &o.ids {
                        client.cancel(*eid);
                        owner.remove(eid);
                    }
                    metrics.left(o.live.generated() > 0);
                    if !cfg.quiet {
                        eprintln!("[ornith] request {rid}: cancelled (the client went away)");
                    }
                }
            }
            Msg::EngineGone => {
                engine_alive = false;
                owner.clear();
                for (_, o) in open.drain() {
                    metrics.left(o.live.generated() > 0);
                    drop(o.place);
                    let _ = o.tx.send(Out::Done(Err(engine_stopped())));
                }
            }
        }
    }
    for eid in open.values().flat_map(|o| &o.ids) {
        client.cancel(*eid);
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
