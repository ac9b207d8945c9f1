//! The serve loop: JSONL requests in, exactly one result line per input line out.
//!
//! Result line (OpenAI Batch output shape):
//! `{"id": "batch_req_…", "custom_id": …, "response": {"status_code": 200, "request_id": …,
//! "body": {…}}, "error": null}`, or on failure `{"id", "custom_id", "response": null,
//! "error": {"code", "message", "line"}}`. `custom_id` is the request's `custom_id` (or `id` for
//! bare bodies), else `line-<n>`. With `"stream": true` the result line is preceded by chunk
//! lines (`object` `chat.completion.chunk` or `text_completion`, plus `custom_id`), which the
//! deltas of concatenate to the final message.
//!
//! Many requests run at once: a reader thread reads ahead (at most `max_in_flight` requests between
//! their line and their result, a request of `n` choices counting `n`), the main thread parses each
//! line and hands its request to one of [`PREPARE_THREADS`] preparation threads, which render and
//! tokenize the prompt; the main thread submits each prepared request to the engine thread as it
//! comes back, and turns the engine's tokens into chunk and result lines as they come — so a long
//! prompt being encoded holds up neither the other requests' output nor a short prompt read after
//! it.
//! Results are written as each request finishes (each line carries `custom_id`), or with
//! `ordered` in input order; chunk lines of different requests interleave.
//!
//! Policies (vLLM's where it has one; the window and length ones are in `live`):
//! * Duplicate `custom_id` (explicit ids only) → error `duplicate_custom_id` for the later line
//!   (the OpenAI Batch API refuses such files; results keyed by id would be ambiguous).
//! * A panic while handling a line is caught and answered with `internal_error`; a failed engine
//!   step answers every request it carried with `engine_error`; an engine that stopped answers
//!   every request still open, and every later line, with `internal_error`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, BufRead, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::engine::{Engine, EngineStats, EngineThread, Event, EventKind};
use crate::sampling::mix64;

use super::lines::{LineReader, RawLine};
use super::live::{prepare, settle, Limits, Live, Prepared, Progress as ChoiceProgress, PREPARE_THREADS};
use super::request::{self, LineError, Request};
use super::structured::Grammars;
use super::{GenerationDefaults, PromptRenderer, TextCodec};

#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// `model` field of responses.
    pub model_name: String,
    /// Write results in input order (buffering finished ones) instead of completion order.
    pub ordered: bool,
    /// Longer lines are skipped and answered with `line_too_long`.
    pub max_line_bytes: usize,
    pub defaults: GenerationDefaults,
    /// Unique per run: goes into response ids and default seeds.
    pub run_id: u64,
    /// No per-request log lines on stderr.
    pub quiet: bool,
    /// Requests read ahead and not yet answered, at most (bounds memory on huge files); a request
    /// of `n` choices counts `n`.
    pub max_in_flight: usize,
}

impl ServeOptions {
    pub fn new(model_name: impl Into<String>, defaults: GenerationDefaults) -> Self {
        ServeOptions {
            model_name: model_name.into(),
            ordered: false,
            max_line_bytes: 16 << 20,
            defaults,
            run_id: fresh_run_id(),
            quiet: false,
            max_in_flight: 1024,
        }
    }
}

/// A run id from the clock and the process id (distinct across runs; not cryptographic).
pub fn fresh_run_id() -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    mix64(nanos ^ ((std::process::id() as u64) << 32))
}

#[derive(Debug, Default, Clone, PartialEq)]
pub struct ServeStats {
    pub lines: u64,
    pub ok: u64,
    pub errors: u64,
    /// `ornith batch`: lines skipped because the output already had their result.
    pub skipped: u64,
    /// Stopped by a signal: requests that had begun generating, answered `cancelled`.
    pub cancelled: u64,
    /// Stopped by a signal: lines read or queued but not begun, left without a result line.
    pub not_run: u64,
    /// The signal number that stopped the run (None: it ran to the end of the input).
    pub stopped_by: Option<i32>,
    /// Tokens sampled for the requests answered.
    pub generated: u64,
    /// The engine's counters.
    pub engine: EngineStats,
}

/// What `ornith batch` adds to the serve loop (see `protocol::batch`).
#[derive(Debug, Default)]
pub struct BatchControl {
    /// Result lines the output already holds, by `custom_id` (`line-N` for a line without one):
    /// that many input lines with the id are skipped (a later duplicate still gets its
    /// `duplicate_custom_id` line).
    pub done: HashMap<String, u32>,
    /// Set to a signal number (SIGINT 2, SIGTERM 15) to stop: no further line is admitted,
    /// requests that have begun generating are cancelled and answered `cancelled`, the others
    /// get no line (a resume runs them).
    pub stop: Arc<AtomicI32>,
    /// Write only result lines (no stream chunks, whatever a request's `stream`).
    pub results_only: bool,
    /// Input lines in all, for the progress line on stderr (None: no progress line).
    pub total_lines: Option<u64>,
}

/// How often the serve loop looks at [`BatchControl::stop`] when no message comes.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Writes lines, in completion order or (ordered) in input order.
struct Emitter<W: Write> {
    w: W,
    ordered: bool,
    /// Drop chunk lines (`ornith batch`).
    results_only: bool,
    /// Next input line (1-based) whose lines may be written in ordered mode.
    next: u64,
    /// Ordered mode: lines of later requests, and whether their result line is in.
    pending: BTreeMap<u64, (Vec<String>, bool)>,
}

impl<W: Write> Emitter<W> {
    fn write_line(&mut self, s: &str) -> io::Result<()> {
        self.w.write_all(s.as_bytes())?;
        self.w.write_all(b"\n")
    }

    /// A chunk line of request `line`.
    fn chunk(&mut self, line: u64, s: String) -> io::Result<()> {
        if self.results_only {
            return Ok(());
        }
        if !self.ordered || line == self.next {
            self.write_line(&s)?;
            return self.w.flush();
        }
        self.pending.entry(line).or_default().0.push(s);
        Ok(())
    }

    /// The result line of request `line`.
    fn result(&mut self, line: u64, s: String) -> io::Result<()> {
        if !self.ordered {
            self.write_line(&s)?;
            return self.w.flush();
        }
        let e = self.pending.entry(line).or_default();
        e.0.push(s);
        e.1 = true;
        // Write every consecutive request from `next` on; an unfinished one writes its chunks
        // so far and stops the walk.
        while let Some(entry) = self.pending.get_mut(&self.next) {
            let lines = std::mem::take(&mut entry.0);
            let done = entry.1;
            for l in &lines {
                self.write_line(l)?;
            }
            if !done {
                break;
            }
            self.pending.remove(&self.next);
            self.next += 1;
        }
        self.w.flush()
    }
}

fn error_line(opts: &ServeOptions, line: u64, custom_id: Option<&str>, e: &LineError) -> String {
    json!({
        "id": format!("batch_req_{:016x}_{line}", opts.run_id),
        "custom_id": custom_id.map_or_else(|| format!("line-{line}"), str::to_string),
        "response": null,
        "error": {"code": e.code, "message": e.message, "line": line},
    })
    .to_string()
}

/// Read-ahead credits: the reader takes one per line, each answered line gives one back. A
/// request of `n` choices holds `n` (it is `n` sequences in the engine, each with its prompt):
/// [`Credits::charge`] takes the others, into debt if need be, so reading pauses until enough
/// sequences have ended.
struct Credits {
    state: Mutex<(i64, bool)>,
    cv: Condvar,
}

impl Credits {
    /// Waits for a credit; false once `stop` was called.
    fn take(&self) -> bool {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while g.0 <= 0 && !g.1 {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        if g.1 {
            return false;
        }
        g.0 -= 1;
        true
    }
    fn give(&self) {
        self.give_n(1);
    }
    fn give_n(&self, n: usize) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).0 += n as i64;
        self.cv.notify_one();
    }
    /// Takes `n` more credits without waiting (the balance may go below zero).
    fn charge(&self, n: usize) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).0 -= n as i64;
    }
    fn stop(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.cv.notify_all();
    }
}

enum Msg {
    Line(io::Result<Option<RawLine>>),
    /// A request's prompt, made by a preparation thread.
    Prepared {
        job: Box<Job>,
        prompt: Result<Prepared, LineError>,
    },
    Event(Event),
    /// The engine thread ended (its event sink was dropped).
    EngineGone,
}

/// Sends `EngineGone` when the engine thread drops its sink, however it ends.
struct GoneSignal(Sender<Msg>);
impl Drop for GoneSignal {
    fn drop(&mut self) {
        let _ = self.0.send(Msg::EngineGone);
    }
}

/// A parsed request whose prompt a preparation thread makes.
struct Job {
    line: u64,
    custom_id: Option<String>,
    req: Request,
    /// When its line was read (the TTFT's start).
    started: Instant,
}

/// A preparation thread: renders and tokenizes the prompts of the jobs it takes from the shared
/// queue (a panic in the template or the tokenizer becomes that request's error) and sends them
/// back to the main thread. Ends when the queue's sender is dropped or the main thread is gone.
fn prepare_prompts(
    jobs: &Mutex<std::sync::mpsc::Receiver<Job>>,
    back: Sender<Msg>,
    codec: &dyn TextCodec,
    renderer: &dyn PromptRenderer,
    limits: Limits,
    grammars: &Grammars,
) {
    loop {
        // The lock is held only while waiting for the next job, never while preparing one.
        let Ok(job) = jobs.lock().unwrap_or_else(|e| e.into_inner()).recv() else { break };
        let prompt = catch_unwind(AssertUnwindSafe(|| prepare(&job.req, codec, renderer, &limits, grammars)))
            .unwrap_or_else(|_| Err(panicked()));
        if back.send(Msg::Prepared { job: Box::new(job), prompt }).is_err() {
            break;
        }
    }
}

/// A submitted request.
struct Open<'a> {
    line: u64,
    custom_id: Option<String>,
    live: Live<'a>,
    /// The engine ids of its choices' sequences.
    ids: Vec<u64>,
}

/// Runs every request of `reader` through `engine`, writing JSONL to `writer`. Returns an error
/// only when reading the input or writing the output fails.
pub fn serve<R: BufRead + Send + 'static, W: Write>(
    reader: R,
    writer: W,
    engine: Engine,
    codec: &(dyn TextCodec + Sync),
    renderer: &(dyn PromptRenderer + Sync),
    opts: &ServeOptions,
) -> anyhow::Result<ServeStats> {
    serve_with(reader, writer, engine, codec, renderer, opts, BatchControl::default())
}

/// [`serve`] with `ornith batch`'s skipping, stopping and progress.
pub fn serve_with<R: BufRead + Send + 'static, W: Write>(
    reader: R,
    writer: W,
    engine: Engine,
    codec: &(dyn TextCodec + Sync),
    renderer: &(dyn PromptRenderer + Sync),
    opts: &ServeOptions,
    mut ctl: BatchControl,
) -> anyhow::Result<ServeStats> {
    let eos = opts.defaults.eos_token_ids.first().copied();
    let limits = Limits { window: engine.max_context(), vocab: codec.vocab_size(), eos };
    let grammars = Grammars::new();
    let (tx, rx) = channel::<Msg>();
    let credits =
        Arc::new(Credits { state: Mutex::new((opts.max_in_flight.max(1) as i64, false)), cv: Condvar::new() });
    {
        let (tx, credits, max) = (tx.clone(), credits.clone(), opts.max_line_bytes);
        std::thread::Builder::new().name("ornith-reader".into()).spawn(move || {
            let mut lines = LineReader::new(reader, max);
            while credits.take() {
                let r = lines.next_line();
                let end = !matches!(r, Ok(Some(_)));
                if tx.send(Msg::Line(r)).is_err() || end {
                    break;
                }
            }
        })?;
    }
    let back = tx.clone();
    let gone = GoneSignal(tx);
    let (thread, client) = EngineThread::spawn(engine, move |e| gone.0.send(Msg::Event(e)).is_ok());
    let mut out =
        Emitter { w: writer, ordered: opts.ordered, results_only: ctl.results_only, next: 1, pending: BTreeMap::new() };
    let progress = ctl.total_lines.filter(|_| !opts.quiet).map(|total| Progress { total, last: Instant::now() });
    let mut st = Run { opts, stats: ServeStats::default(), credits: &credits, progress };
    let mut seen: HashSet<String> = HashSet::new();
    // Submitted requests by line, and the (line, choice) of each engine id.
    let mut open: HashMap<u64, Open<'_>> = HashMap::new();
    let mut owner: HashMap<u64, (u64, usize)> = HashMap::new();
    let (mut line_no, mut eof, mut engine_alive) = (0u64, false, true);
    // Lines handed to the preparation threads and not yet back.
    let mut preparing = 0u64;
    let (jobs, job_rx) = channel::<Job>();
    let job_rx = Mutex::new(job_rx);
    let r = std::thread::scope(|scope| -> anyhow::Result<()> {
        let jobs = jobs; // moved in: dropped when the closure returns
        for i in 0..PREPARE_THREADS {
            let (job_rx, back, grammars) = (&job_rx, back.clone(), &grammars);
            std::thread::Builder::new()
                .name(format!("ornith-prompts-{i}"))
                .spawn_scoped(scope, move || prepare_prompts(job_rx, back, codec, renderer, limits, grammars))?;
        }
        drop(back);
        // `jobs` is dropped when this closure returns, so the preparation threads end before the
        // scope joins them.
        while !(eof && open.is_empty() && preparing == 0) {
            let signal = ctl.stop.load(Ordering::Relaxed);
            if signal != 0 {
                // Lines still being prepared were read but not begun: no line (a resume runs them).
                st.stats.not_run += preparing;
                st.stop(&mut out, &client, &mut open, signal)?;
                break;
            }
            let msg = match rx.recv_timeout(STOP_POLL) {
                Ok(m) => m,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
            };
            match msg {
                Msg::Line(Err(e)) => return Err(e.into()),
                Msg::Line(Ok(None)) => eof = true,
                Msg::Line(Ok(Some(raw))) => {
                    line_no += 1;
                    st.stats.lines += 1;
                    // Set by `parse_line` as soon as it is known, so that it survives a panic.
                    let mut cid: Option<String> = None;
                    let started = Instant::now();
                    let parsed = catch_unwind(AssertUnwindSafe(|| parse_line(raw, line_no, opts, &mut seen, &mut cid)))
                        .unwrap_or_else(|_| Err(panicked()));
                    // `ornith batch`: the output already has this line's result.
                    let key = cid.clone().unwrap_or_else(|| format!("line-{line_no}"));
                    if let Some(n) = ctl.done.get_mut(&key).filter(|n| **n > 0) {
                        *n -= 1;
                        st.stats.skipped += 1;
                        credits.give();
                        st.tick();
                        continue;
                    }
                    if let (Ok(req), false) = (&parsed, opts.quiet) {
                        for w in &req.warnings {
                            eprintln!("[ornith] line {line_no}: warning: {w}");
                        }
                    }
                    let req = match parsed {
                        Ok(r) => r,
                        Err(e) => {
                            st.answer(&mut out, line_no, cid.as_deref(), Err(e), 0)?;
                            continue;
                        }
                    };
                    if !engine_alive {
                        st.answer(&mut out, line_no, cid.as_deref(), Err(engine_stopped()), 0)?;
                        continue;
                    }
                    jobs.send(Job { line: line_no, custom_id: cid, req, started })
                        .map_err(|_| anyhow::anyhow!("the prompt preparation threads stopped"))?;
                    preparing += 1;
                }
                Msg::Prepared { job, prompt } => {
                    preparing -= 1;
                    let Job { line, custom_id: cid, req, started } = *job;
                    if !engine_alive {
                        st.answer(&mut out, line, cid.as_deref(), Err(engine_stopped()), 0)?;
                        continue;
                    }
                    let eos = &opts.defaults.eos_token_ids;
                    let begun = prompt.and_then(|prompt| {
                        catch_unwind(AssertUnwindSafe(|| {
                            let chunk_id = cid.clone().unwrap_or_else(|| format!("line-{line}"));
                            let (name, run_id) = (&opts.model_name, opts.run_id);
                            Live::begin(req, prompt, line, Some(&chunk_id), codec, &limits, eos, name, run_id, started)
                        }))
                        .unwrap_or_else(|_| Err(panicked()))
                    });
                    match begun {
                        Ok((gens, mut live)) => {
                            for c in live.take_chunks() {
                                out.chunk(line, c.to_string())?;
                            }
                            let ids: Vec<u64> = gens.into_iter().map(|g| client.submit(g)).collect();
                            for (choice, &id) in ids.iter().enumerate() {
                                owner.insert(id, (line, choice));
                            }
                            credits.charge(ids.len() - 1);
                            open.insert(line, Open { line, custom_id: cid, live, ids });
                        }
                        Err(e) => st.answer(&mut out, line, cid.as_deref(), Err(e), 0)?,
                    }
                }
                Msg::Event(e) => {
                    let Some(&(line, choice)) = owner.get(&e.id) else { continue };
                    let Some(o) = open.get_mut(&line) else { continue };
                    let progress = match e.kind {
                        EventKind::Token(t) => catch_unwind(AssertUnwindSafe(|| o.live.on_token(choice, t)))
                            .unwrap_or_else(|_| Err(panicked())),
                        // The engine ends a sequence on the same token the front end does; a
                        // finish the front end has not seen still ends the choice.
                        EventKind::Finished(_) => catch_unwind(AssertUnwindSafe(|| o.live.on_finished(choice)))
                            .unwrap_or_else(|_| Err(panicked())),
                        EventKind::Admitted { cached_tokens } => {
                            o.live.on_admitted(choice, cached_tokens);
                            Ok(ChoiceProgress::Running)
                        }
                        EventKind::Logprobs(lp) => {
                            o.live.on_logprobs(choice, lp);
                            Ok(ChoiceProgress::Running)
                        }
                        EventKind::Error { code, message } => Err(LineError::from_engine(code, message)),
                    };
                    for c in o.live.take_chunks() {
                        out.chunk(o.line, c.to_string())?;
                    }
                    let done = settle(progress, || {
                        client.cancel(e.id);
                        owner.remove(&e.id);
                    });
                    if let Some(res) = done {
                        let mut o = open.remove(&line).expect("present above");
                        credits.give_n(o.ids.len() - 1);
                        for id in &o.ids {
                            client.cancel(*id); // a no-op when the engine already ended it
                            owner.remove(id);
                        }
                        let res = res.and_then(|()| {
                            catch_unwind(AssertUnwindSafe(|| o.live.body())).unwrap_or_else(|_| Err(panicked()))
                        });
                        for c in o.live.take_chunks() {
                            out.chunk(o.line, c.to_string())?;
                        }
                        let n = o.live.generated();
                        st.answer(&mut out, o.line, o.custom_id.as_deref(), res, n)?;
                    }
                }
                Msg::EngineGone => {
                    engine_alive = false;
                    owner.clear();
                    let mut left: Vec<(u64, Open)> = open.drain().collect();
                    left.sort_by_key(|(_, o)| o.line);
                    for (_, o) in left {
                        credits.give_n(o.ids.len() - 1);
                        st.answer(&mut out, o.line, o.custom_id.as_deref(), Err(engine_stopped()), 0)?;
                    }
                }
            }
        }
        Ok(())
    });
    credits.stop();
    for id in open.values().flat_map(|o| &o.ids) {
        client.cancel(*id);
    }
    drop(client);
    r?;
    let st_progress = st.progress.take();
    let mut stats = st.stats;
    stats.engine = thread.join()?;
    if let Some(p) = &st_progress {
        p.print(&stats);
    }
    if !opts.quiet {
        let e = &stats.engine;
        eprintln!(
            "[ornith] done: {} lines, {} ok, {} errors; {} tokens generated; {} steps ({} decode rows, {} prefill rows), at most {} sequences at once",
            stats.lines, stats.ok, stats.errors, stats.generated, e.steps, e.decode_rows, e.prefill_rows, e.peak_running
        );
        let c = &e.cache;
        eprintln!(
            "[ornith] prefix cache: {} hits, {} misses, {} prompt tokens served from it; {} snapshots taken, {} evicted; {} chunks evicted",
            c.hits, c.misses, c.cached_tokens, c.snapshots_taken, c.snapshots_evicted, c.chunks_evicted
        );
    }
    Ok(stats)
}

fn panicked() -> LineError {
    LineError::new("internal_error", "the engine panicked on this request; see stderr")
}

fn engine_stopped() -> LineError {
    LineError::new("internal_error", "the engine thread stopped; see stderr")
}

/// `ornith batch`'s progress line on stderr (at most one a second, and one at the end).
struct Progress {
    total: u64,
    last: Instant,
}

impl Progress {
    fn print(&self, s: &ServeStats) {
        let done = s.ok + s.errors + s.skipped;
        eprintln!(
            "[ornith] batch: {done}/{} lines answered ({} from an earlier run, {} errors)",
            self.total, s.skipped, s.errors
        );
    }
}

/// What answering a line needs.
struct Run<'o> {
    opts: &'o ServeOptions,
    stats: ServeStats,
    credits: &'o Credits,
    progress: Option<Progress>,
}

impl Run<'_> {
    /// Prints the progress line if a second has passed since the last one.
    fn tick(&mut self) {
        if let Some(p) = &mut self.progress {
            if p.last.elapsed() >= Duration::from_secs(1) {
                p.last = Instant::now();
                p.print(&self.stats);
            }
        }
    }

    /// Stops on `signal`: cancels every open request in the engine; those that have begun
    /// generating are answered `cancelled`, the others (queued, in prefill) get no line.
    fn stop<W: Write>(
        &mut self,
        out: &mut Emitter<W>,
        client: &crate::engine::EngineClient,
        open: &mut HashMap<u64, Open<'_>>,
        signal: i32,
    ) -> io::Result<()> {
        self.stats.stopped_by = Some(signal);
        self.credits.stop();
        let mut left: Vec<(u64, Open)> = open.drain().collect();
        left.sort_by_key(|(_, o)| o.line);
        for (_, o) in left {
            for id in &o.ids {
                client.cancel(*id);
            }
            if o.live.generated() == 0 {
                self.stats.not_run += 1;
                continue;
            }
            self.stats.cancelled += 1;
            let msg = format!(
                "stopped by signal {signal} after {} tokens; the request was cancelled (rerun `ornith batch` to resume)",
                o.live.generated()
            );
            self.answer(out, o.line, o.custom_id.as_deref(), Err(LineError::new("cancelled", msg)), 0)?;
        }
        out.w.flush()
    }

    /// Writes the result line of `line` and gives its read-ahead credit back.
    fn answer<W: Write>(
        &mut self,
        out: &mut Emitter<W>,
        line: u64,
        custom_id: Option<&str>,
        res: Result<Value, LineError>,
        generated: u64,
    ) -> io::Result<()> {
        let opts = self.opts;
        let text = match res {
            Ok(body) => {
                self.stats.ok += 1;
                self.stats.generated += generated;
                if !opts.quiet {
                    log_result(line, custom_id, &body);
                }
                json!({
                    "id": format!("batch_req_{:016x}_{line}", opts.run_id),
                    "custom_id": custom_id.map_or_else(|| format!("line-{line}"), str::to_string),
                    "response": {"status_code": 200, "request_id": format!("req_{:016x}_{line}", opts.run_id), "body": body},
                    "error": null,
                })
                .to_string()
            }
            Err(e) => {
                self.stats.errors += 1;
                if !opts.quiet {
                    eprintln!("[ornith] line {line}: {}: {}", e.code, e.message);
                }
                error_line(opts, line, custom_id, &e)
            }
        };
        self.credits.give();
        out.result(line, text)?;
        self.tick();
        Ok(())
    }
}

fn log_result(line: u64, custom_id: Option<&str>, body: &Value) {
    let u = &body["usage"];
    // One output token has no decode step to time (`decode_tok_s` is null).
    let decode = match body["decode_tok_s"].as_f64() {
        Some(r) => format!("decode {r} tok/s"),
        None => "no decode step".to_string(),
    };
    eprintln!(
        "[ornith] line {line}{}: {}+{} tokens, {}, ttft {} ms, {decode}",
        custom_id.map(|c| format!(" ({c})")).unwrap_or_default(),
        u["prompt_tokens"],
        u["completion_tokens"],
        body["choices"][0]["finish_reason"].as_str().unwrap_or("?"),
        body["ttft_ms"],
    );
}

/// Parses one line into a request. Sets `cid` as soon as the custom_id is known.
fn parse_line(
    raw: RawLine,
    line: u64,
    opts: &ServeOptions,
    seen: &mut HashSet<String>,
    cid: &mut Option<String>,
) -> Result<Request, LineError> {
    let bytes = match raw {
        RawLine::Bytes(b) => b,
        RawLine::TooLong { len, head } => {
            *cid = request::scan_custom_id(&String::from_utf8_lossy(&head));
            let msg = format!(
                "the line has {len} bytes, over the limit of {} (--max-line-bytes); it was skipped",
                opts.max_line_bytes
            );
            return Err(LineError::new("line_too_long", msg));
        }
    };
    let text = match std::str::from_utf8(&bytes) {
        Ok(t) => t,
        Err(e) => {
            *cid = request::scan_custom_id(&String::from_utf8_lossy(&bytes));
            let msg = format!("the line is not valid UTF-8 (byte {})", e.valid_up_to());
            return Err(LineError::new("invalid_utf8", msg));
        }
    };
    if text.trim().is_empty() {
        return Err(LineError::new("empty_line", "blank line; expected a JSON request"));
    }
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            *cid = request::scan_custom_id(text);
            return Err(LineError::new("invalid_json", format!("malformed JSON: {e}")));
        }
    };
    *cid = request::custom_id_of(&value);
    if let Some(id) = cid.as_ref() {
        if !seen.insert(id.clone()) {
            let msg = format!("custom_id {id:?} was already used by an earlier line; ids must be unique");
            return Err(LineError::new("duplicate_custom_id", msg));
        }
    }
    let seed = mix64(opts.run_id ^ mix64(line));
    request::parse(&value, &opts.defaults, seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(e: &Emitter<Vec<u8>>) -> Vec<String> {
        String::from_utf8(e.w.clone()).unwrap().lines().map(str::to_string).collect()
    }

    #[test]
    fn a_request_of_n_choices_holds_n_read_ahead_credits() {
        let c = Arc::new(Credits { state: Mutex::new((2, false)), cv: Condvar::new() });
        assert!(c.take() && c.take());
        c.charge(3); // a line of 4 choices: 3 more than its line's credit
        c.give_n(3); // ... which ends: the balance is back to 0
        let (c2, (tx, rx)) = (c.clone(), std::sync::mpsc::channel());
        let reader = std::thread::spawn(move || tx.send(c2.take()).unwrap());
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "read past the bound");
        c.give();
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(true));
        reader.join().unwrap();
        c.stop();
        assert!(!c.take(), "a stopped reader takes nothing");
    }

    #[test]
    fn ordered_emitter_buffers_out_of_order_completions() {
        let mut e = Emitter { w: Vec::new(), ordered: true, results_only: false, next: 1, pending: BTreeMap::new() };
        // Request 2 streams and finishes before request 1.
        e.chunk(2, "2a".into()).unwrap();
        e.result(2, "2r".into()).unwrap();
        assert!(lines(&e).is_empty());
        e.chunk(1, "1a".into()).unwrap();
        assert_eq!(lines(&e), ["1a"]);
        // Request 3 is half streamed when 1 finishes: 1, then 2, then 3's chunk so far.
        e.chunk(3, "3a".into()).unwrap();
        e.result(1, "1r".into()).unwrap();
        assert_eq!(lines(&e), ["1a", "1r", "2a", "2r", "3a"]);
        e.chunk(3, "3b".into()).unwrap();
        e.result(3, "3r".into()).unwrap();
        assert_eq!(lines(&e), ["1a", "1r", "2a", "2r", "3a", "3b", "3r"]);
        assert!(e.pending.is_empty());
    }

    #[test]
    fn unordered_emitter_writes_at_once() {
        let mut e = Emitter { w: Vec::new(), ordered: false, results_only: false, next: 1, pending: BTreeMap::new() };
        e.result(2, "2r".into()).unwrap();
        e.result(1, "1r".into()).unwrap();
        assert_eq!(lines(&e), ["2r", "1r"]);
    }
}
