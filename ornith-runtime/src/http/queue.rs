//! The bound on generation requests in the server (`--max-queue`).
//!
//! A generation request takes a [`Place`] before anything of it is queued anywhere (the router's
//! queue, the engine's) — one per sequence it will run (`n` choices: `n` places, at most the limit,
//! so that every request can be admitted) —; it holds it through the engine's queue and its run,
//! and gives it back when it ends (finished, failed, or cancelled because its client went away). At
//! most `limit` places exist: the engine's sequence slots plus `--max-queue` waiting. A request
//! that finds none is refused at once with 429 and `Retry-After`, so memory held for queued
//! requests (their parsed bodies and prompt tokens) is bounded by the limit whatever the clients
//! send.
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

    /// The places of a request of `seqs` sequences (`seqs` clamped to 1..=limit), or None when
    /// fewer are free.
    pub fn try_enter(self: &Arc<Self>, seqs: usize) -> Option<Place> {
        let k = seqs.clamp(1, self.limit.max(1));
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n + k <= self.limit).then_some(n + k))
            .ok()
            .map(|_| Place(self.clone(), k))
    }

    /// Places held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
    pub fn limit(&self) -> usize {
        self.limit
    }
}

/// One request's places; given back when dropped.
#[derive(Debug)]
pub struct Place(Arc<Admission>, usize);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.held.fetch_sub(self.1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_bounded_and_come_back() {
        let a = Admission::new(2);
        let p1 = a.try_enter(1).unwrap();
        let p2 = a.try_enter(1).unwrap();
        assert!(a.try_enter(1).is_none(), "a third place of two");
        assert_eq!(a.held(), 2);
        drop(p1);
        assert!(a.try_enter(2).is_none(), "two places with one free");
        let p3 = a.try_enter(1).expect("a place came back");
        drop((p2, p3));
        assert_eq!(a.held(), 0);
        // n choices take n places, at most all of them.
        let p4 = a.try_enter(5).expect("clamped to the limit");
        assert_eq!(a.held(), 2);
        drop(p4);
        assert_eq!(a.held(), 0);
        assert!(Admission::new(0).try_enter(1).is_none());
    }
}
