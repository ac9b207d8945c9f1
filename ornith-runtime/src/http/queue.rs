//! The bound on generation requests in the server (`--max-queue`).
//!
//! A generation request takes a [`Place`] before anything of it is queued anywhere (the router's
//! queue, the engine's); it holds it through the engine's queue and its run, and gives it back
//! when it ends (finished, failed, or cancelled because its client went away). At most `limit`
//! places exist: the engine's sequence slots plus `--max-queue` waiting. A request that finds
//! none is refused at once with 429 and `Retry-After`, so memory held for queued requests (their
//! parsed bodies and prompt tokens) is bounded by the limit whatever the clients send.
//! `count_tokens`, `/v1/models`, `/health` and `/metrics` take no place and are never refused.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The default `--max-queue`: requests that may wait beyond those running. Each holds its parsed
/// body and prompt tokens (usually tens to hundreds of KB for a coding agent's prompt, at most
/// about `--max-line-bytes`).
pub const DEFAULT_MAX_QUEUE: usize = 256;

/// What a refused client is told to wait before retrying (`Retry-After`, seconds).
pub const RETRY_AFTER_SECS: u64 = 1;

/// Places for generation requests.
#[derive(Debug)]
pub struct Admission {
    held: AtomicUsize,
    limit: usize,
}

impl Admission {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Admission { held: AtomicUsize::new(0), limit })
    }

    /// A place, or None when all `limit` are held.
    pub fn try_enter(self: &Arc<Self>) -> Option<Place> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.limit).then_some(n + 1))
            .ok()
            .map(|_| Place(self.clone()))
    }

    /// Places held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
    pub fn limit(&self) -> usize {
        self.limit
    }
}

/// One request's place; given back when dropped.
#[derive(Debug)]
pub struct Place(Arc<Admission>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_bounded_and_come_back() {
        let a = Admission::new(2);
        let p1 = a.try_enter().unwrap();
        let p2 = a.try_enter().unwrap();
        assert!(a.try_enter().is_none(), "a third place of two");
        assert_eq!(a.held(), 2);
        drop(p1);
        let p3 = a.try_enter().expect("a place came back");
        drop((p2, p3));
        assert_eq!(a.held(), 0);
        assert!(Admission::new(0).try_enter().is_none());
    }
}
