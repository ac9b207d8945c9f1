//! An engine on a thread of its own, the one thread that touches the backend. Front ends hold an
//! [`EngineClient`] (cloneable, `Send`): `submit` and `cancel` are messages; events come back
//! through the sink given at spawn.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::core::{Engine, EngineStats, Event, EventKind, GenRequest};
use super::prefix::CacheStats;

enum Cmd {
    Submit(u64, Box<GenRequest>),
    Cancel(u64),
}

/// The engine's pool, queue and prefix-cache figures, as the engine thread last published them
/// (after every command and every step).
#[derive(Debug, Default)]
struct Gauges {
    free_slots: AtomicUsize,
    total_slots: AtomicUsize,
    free_blocks: AtomicUsize,
    total_blocks: AtomicUsize,
    waiting: AtomicUsize,
    chunks: AtomicUsize,
    snapshots: AtomicUsize,
    snapshots_total: AtomicUsize,
    hits: AtomicU64,
    misses: AtomicU64,
    cached_tokens: AtomicU64,
    snapshots_taken: AtomicU64,
    snapshots_evicted: AtomicU64,
    chunks_evicted: AtomicU64,
}

impl Gauges {
    fn publish(&self, engine: &Engine) {
        let (fs, ts, fb, tb) = engine.pool_usage();
        self.free_slots.store(fs, Ordering::Relaxed);
        self.total_slots.store(ts, Ordering::Relaxed);
        self.free_blocks.store(fb, Ordering::Relaxed);
        self.total_blocks.store(tb, Ordering::Relaxed);
        self.waiting.store(engine.waiting(), Ordering::Relaxed);
        let (chunks, snaps, snaps_total) = engine.cache_usage();
        self.chunks.store(chunks, Ordering::Relaxed);
        self.snapshots.store(snaps, Ordering::Relaxed);
        self.snapshots_total.store(snaps_total, Ordering::Relaxed);
        let c = engine.cache_stats();
        self.hits.store(c.hits, Ordering::Relaxed);
        self.misses.store(c.misses, Ordering::Relaxed);
        self.cached_tokens.store(c.cached_tokens, Ordering::Relaxed);
        self.snapshots_taken.store(c.snapshots_taken, Ordering::Relaxed);
        self.snapshots_evicted.store(c.snapshots_evicted, Ordering::Relaxed);
        self.chunks_evicted.store(c.chunks_evicted, Ordering::Relaxed);
    }
}

/// Pool occupancy: recurrent-state slots and K/V blocks held by sequences, of the totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolUsage {
    pub slots_used: usize,
    pub slots_total: usize,
    pub blocks_used: usize,
    pub blocks_total: usize,
}

/// What the engine thread publishes for monitoring (`/metrics`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineGauges {
    pub pool: PoolUsage,
    /// Requests queued in the engine, not yet admitted (waiting for a slot or K/V blocks).
    pub waiting: usize,
    /// Prefix-cache chunks held (each [`PREFILL_CHUNK`](super::PREFILL_CHUNK) tokens of K/V).
    pub cache_chunks: usize,
    /// Recurrent-state snapshots held, and how many the cache has room for.
    pub snapshots: usize,
    pub snapshots_total: usize,
    /// The prefix cache's counters since the engine started.
    pub cache: CacheStats,
}

/// A handle to submit to and cancel on an [`EngineThread`].
#[derive(Clone)]
pub struct EngineClient {
    tx: Sender<Cmd>,
    next: Arc<AtomicU64>,
    gauges: Arc<Gauges>,
}

impl EngineClient {
    /// Queues `req`; returns the id its events carry. A refused request gets one
    /// `EventKind::Error` event with the refusal's code.
    pub fn submit(&self, req: GenRequest) -> u64 {
        let id = self.reserve_id();
        self.submit_as(id, req);
        id
    }
    /// An id for a later [`submit_as`](Self::submit_as): a front end that routes events to
    /// per-request channels registers the channel under it before any event can arrive.
    pub fn reserve_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }
    /// Queues `req` under an id from [`reserve_id`](Self::reserve_id) (used once).
    pub fn submit_as(&self, id: u64, req: GenRequest) {
        // A send fails only when the engine thread is gone; its sink has then been dropped
        // and the front end sees that.
        let _ = self.tx.send(Cmd::Submit(id, Box::new(req)));
    }
    /// Ends a sequence now (no event follows) and frees its memory.
    pub fn cancel(&self, id: u64) {
        let _ = self.tx.send(Cmd::Cancel(id));
    }
    /// The pools' occupancy after the engine's last command or step.
    pub fn pool_usage(&self) -> PoolUsage {
        let g = &self.gauges;
        let (fs, ts) = (g.free_slots.load(Ordering::Relaxed), g.total_slots.load(Ordering::Relaxed));
        let (fb, tb) = (g.free_blocks.load(Ordering::Relaxed), g.total_blocks.load(Ordering::Relaxed));
        PoolUsage { slots_used: ts - fs.min(ts), slots_total: ts, blocks_used: tb - fb.min(tb), blocks_total: tb }
    }
    /// The pools, the engine's queue and the prefix cache after the engine's last command or step.
    pub fn gauges(&self) -> EngineGauges {
        let g = &self.gauges;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EngineGauges {
            pool: self.pool_usage(),
            waiting: g.waiting.load(Ordering::Relaxed),
            cache_chunks: g.chunks.load(Ordering::Relaxed),
            snapshots: g.snapshots.load(Ordering::Relaxed),
            snapshots_total: g.snapshots_total.load(Ordering::Relaxed),
            cache: CacheStats {
                hits: l(&g.hits),
                misses: l(&g.misses),
                cached_tokens: l(&g.cached_tokens),
                snapshots_taken: l(&g.snapshots_taken),
                snapshots_evicted: l(&g.snapshots_evicted),
                chunks_evicted: l(&g.chunks_evicted),
            },
        }
    }
}

pub struct EngineThread {
    join: JoinHandle<EngineStats>,
}

impl EngineThread {
    /// Runs `engine` until every client is dropped and no work is left, or `sink` returns false.
    pub fn spawn(
        mut engine: Engine,
        mut sink: impl FnMut(Event) -> bool + Send + 'static,
    ) -> (EngineThread, EngineClient) {
        let (tx, rx): (Sender<Cmd>, Receiver<Cmd>) = channel();
        let published = Arc::new(Gauges::default());
        published.publish(&engine);
        let gauges = published.clone();
        let join = std::thread::Builder::new()
            .name("ornith-engine".into())
            .spawn(move || {
                let mut open = true;
                let handle = |engine: &mut Engine, c: Cmd, sink: &mut dyn FnMut(Event) -> bool| -> bool {
                    match c {
                        Cmd::Submit(id, req) => match engine.submit(id, *req) {
                            Ok(()) => true,
                            Err(e) => sink(Event { id, kind: EventKind::Error { code: e.code, message: e.message } }),
                        },
                        Cmd::Cancel(id) => {
                            engine.cancel(id);
                            true
                        }
                    }
                };
                loop {
                    while open {
                        match rx.try_recv() {
                            Ok(c) => {
                                if !handle(&mut engine, c, &mut sink) {
                                    return engine.stats();
                                }
                            }
                            Err(std::sync::mpsc::TryRecvError::Empty) => break,
                            Err(std::sync::mpsc::TryRecvError::Disconnected) => open = false,
                        }
                    }
                    gauges.publish(&engine);
                    if !engine.has_work() {
                        if !open {
                            return engine.stats();
                        }
                        match rx.recv() {
                            Ok(c) => {
                                if !handle(&mut engine, c, &mut sink) {
                                    return engine.stats();
                                }
                            }
                            Err(_) => open = false,
                        }
                        continue;
                    }
                    let events = engine.step();
                    // Published before the events go out: a client that sees its request end
                    // sees the pools without it.
                    gauges.publish(&engine);
                    for e in events {
                        if !sink(e) {
                            return engine.stats();
                        }
                    }
                }
            })
            .expect("spawning the engine thread");
        (EngineThread { join }, EngineClient { tx, next: Arc::new(AtomicU64::new(1)), gauges: published })
    }

    /// Waits for the thread (after every client was dropped); its counters.
    pub fn join(self) -> anyhow::Result<EngineStats> {
        self.join.join().map_err(|_| anyhow::anyhow!("the engine thread panicked"))
    }
}
