//! An engine on a thread of its own, the one thread that touches the backend. Front ends hold an
//! [`EngineClient`] (cloneable, `Send`): `submit` and `cancel` are messages; events come back
//! through the sink given at spawn.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::core::{Engine, EngineStats, Event, EventKind, GenRequest};

enum Cmd {
    Submit(u64, GenRequest),
    Cancel(u64),
}

/// A handle to submit to and cancel on an [`EngineThread`].
#[derive(Clone)]
pub struct EngineClient {
    tx: Sender<Cmd>,
    next: Arc<AtomicU64>,
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
        let _ = self.tx.send(Cmd::Submit(id, req));
    }
    /// Ends a sequence now (no event follows) and frees its memory.
    pub fn cancel(&self, id: u64) {
        let _ = self.tx.send(Cmd::Cancel(id));
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
        let join = std::thread::Builder::new()
            .name("ornith-engine".into())
            .spawn(move || {
                let mut open = true;
                let handle = |engine: &mut Engine, c: Cmd, sink: &mut dyn FnMut(Event) -> bool| -> bool {
                    match c {
                        Cmd::Submit(id, req) => match engine.submit(id, req) {
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
                    for e in engine.step() {
                        if !sink(e) {
                            return engine.stats();
                        }
                    }
                }
            })
            .expect("spawning the engine thread");
        (EngineThread { join }, EngineClient { tx, next: Arc::new(AtomicU64::new(1)) })
    }

    /// Waits for the thread (after every client was dropped); its counters.
    pub fn join(self) -> anyhow::Result<EngineStats> {
        self.join.join().map_err(|_| anyhow::anyhow!("the engine thread panicked"))
    }
}
