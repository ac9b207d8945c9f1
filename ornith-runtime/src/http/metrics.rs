//! Counters of the HTTP server, rendered as Prometheus text at `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::engine::EngineGauges;

/// Upper bounds (seconds) of the time-to-first-token histogram's buckets.
const TTFT_BUCKETS: [f64; 12] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Upper bounds (seconds) of the inter-token histogram's buckets (one engine step each: a few ms
/// to tens of ms on the GPU, longer while long prefills share the steps).
const ITL_BUCKETS: [f64; 13] = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5];

/// A Prometheus histogram over `N` fixed bucket bounds.
struct Histogram<const N: usize> {
    bounds: &'static [f64; N],
    /// Observations at or under each bound and over the previous one (not cumulative here).
    counts: [u64; N],
    over: u64,
    sum: f64,
}

impl<const N: usize> Histogram<N> {
    const fn new(bounds: &'static [f64; N]) -> Self {
        Histogram { bounds, counts: [0; N], over: 0, sum: 0.0 }
    }
    fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        match self.bounds.iter().position(|&b| s <= b) {
            Some(i) => self.counts[i] += 1,
            None => self.over += 1,
        }
        self.sum += s;
    }
    fn render(&self, s: &mut String, name: &str, help: &str) {
        let _ = write!(s, "# HELP {name} {help}\n# TYPE {name} histogram\n");
        let mut cum = 0;
        for (b, n) in self.bounds.iter().zip(self.counts) {
            cum += n;
            let _ = writeln!(s, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += self.over;
        let _ = writeln!(s, "{name}_bucket{{le=\"+Inf\"}} {cum}");
        let _ = writeln!(s, "{name}_sum {}", self.sum);
        let _ = writeln!(s, "{name}_count {cum}");
    }
}

/// The admission queue's figures at render time: generation requests holding a place in the
/// server (see [`super::queue`]) and the most that may.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueUsage {
    pub in_flight: usize,
    pub limit: usize,
}

pub struct Metrics {
    /// (endpoint, status) → responses.
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    cancelled: AtomicU64,
    running: AtomicI64,
    waiting: AtomicI64,
    ttft: Mutex<Histogram<{ TTFT_BUCKETS.len() }>>,
    itl: Mutex<Histogram<{ ITL_BUCKETS.len() }>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            running: AtomicI64::new(0),
            waiting: AtomicI64::new(0),
            ttft: Mutex::new(Histogram::new(&TTFT_BUCKETS)),
            itl: Mutex::new(Histogram::new(&ITL_BUCKETS)),
        }
    }
}

impl Metrics {
    /// A response with `status` was sent for `endpoint` (for streams: their status line).
    pub fn request(&self, endpoint: &'static str, status: u16) {
        *self.requests.lock().unwrap_or_else(|e| e.into_inner()).entry((endpoint, status)).or_default() += 1;
    }
    /// A request went to the engine with this many prompt tokens; it waits for its first token.
    pub fn submitted(&self, prompt_tokens: usize) {
        self.prompt_tokens.fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.waiting.fetch_add(1, Ordering::Relaxed);
    }
    /// A request was admitted with this many prompt tokens from the prefix cache.
    pub fn cached(&self, tokens: usize) {
        self.cached_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
    }
    /// A request sampled its first token `ttft` after it arrived: it is now running.
    pub fn first_token(&self, ttft: Duration) {
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        self.running.fetch_add(1, Ordering::Relaxed);
        self.ttft.lock().unwrap_or_else(|e| e.into_inner()).observe(ttft);
    }
    /// A request sampled a token `gap` after its previous one.
    pub fn inter_token(&self, gap: Duration) {
        self.itl.lock().unwrap_or_else(|e| e.into_inner()).observe(gap);
    }
    pub fn generated(&self, tokens: u64) {
        self.generation_tokens.fetch_add(tokens, Ordering::Relaxed);
    }
    /// A request's client went away before the request ended (while its prompt was being
    /// prepared, or once it was in the engine); it is cancelled.
    pub fn client_left(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
    }
    /// A request left the engine (finished, failed or cancelled), `running` if it had sampled.
    pub fn left(&self, running: bool) {
        let g = if running { &self.running } else { &self.waiting };
        g.fetch_sub(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition, with what the engine thread published and the admission
    /// queue's occupancy.
    pub fn render(&self, engine: &EngineGauges, queue: QueueUsage) -> String {
        let pool = engine.pool;
        let mut s = String::new();
        s += "# HELP ornith_http_requests_total HTTP responses by endpoint and status code.\n";
        s += "# TYPE ornith_http_requests_total counter\n";
        for ((ep, st), n) in self.requests.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(s, "ornith_http_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}");
        }
        let counter = |s: &mut String, name: &str, help: &str, v: u64| {
            let _ = write!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}\n");
        };
        let gauge = |s: &mut String, name: &str, help: &str, v: i64| {
            let _ = write!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}\n");
        };
        counter(
            &mut s,
            "ornith_prompt_tokens_total",
            "Prompt tokens of the requests submitted to the engine.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut s,
            "ornith_prompt_tokens_cached_total",
            "Prompt tokens served from the prefix cache (not prefilled).",
            self.cached_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut s,
            "ornith_generation_tokens_total",
            "Tokens sampled.",
            self.generation_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut s,
            "ornith_requests_cancelled_total",
            "Generation requests cancelled because their client went away before they ended.",
            self.cancelled.load(Ordering::Relaxed),
        );
        gauge(
            &mut s,
            "ornith_requests_running",
            "Requests in the engine that have sampled a token.",
            self.running.load(Ordering::Relaxed),
        );
        gauge(
            &mut s,
            "ornith_requests_waiting",
            "Requests in the engine without a token yet (queued, or in prefill).",
            self.waiting.load(Ordering::Relaxed),
        );
        gauge(
            &mut s,
            "ornith_queue_depth",
            "Requests queued in the engine, not yet admitted (waiting for a sequence slot or K/V blocks).",
            engine.waiting as i64,
        );
        gauge(
            &mut s,
            "ornith_requests_in_flight",
            "Generation requests in the server (queued or running; n choices count n); at ornith_requests_in_flight_limit new ones get 429.",
            queue.in_flight as i64,
        );
        gauge(
            &mut s,
            "ornith_requests_in_flight_limit",
            "The most generation requests in the server at once: the engine's sequence slots plus --max-queue.",
            queue.limit as i64,
        );
        let pool_gauges = [
            ("ornith_pool_slots_used", "Recurrent-state slots held by sequences.", pool.slots_used),
            ("ornith_pool_slots_total", "Recurrent-state slots of the pool.", pool.slots_total),
            ("ornith_pool_kv_blocks_used", "K/V blocks held by sequences.", pool.blocks_used),
            ("ornith_pool_kv_blocks_total", "K/V blocks of the pool.", pool.blocks_total),
            (
                "ornith_prefix_cache_chunks",
                "Prompt chunks (2048 tokens of K/V each) the prefix cache holds.",
                engine.cache_chunks,
            ),
            ("ornith_prefix_cache_snapshots", "Recurrent-state snapshots the prefix cache holds.", engine.snapshots),
            (
                "ornith_prefix_cache_snapshots_capacity",
                "Recurrent-state snapshots the prefix cache has room for (0: no prefix cache).",
                engine.snapshots_total,
            ),
        ];
        for (name, help, v) in pool_gauges {
            gauge(&mut s, name, help, v as i64);
        }
        let c = &engine.cache;
        let cache_counters = [
            ("ornith_prefix_cache_hits_total", "Admissions that resumed from a prefix-cache snapshot.", c.hits),
            (
                "ornith_prefix_cache_misses_total",
                "Admissions of prompts longer than one chunk that found no snapshot.",
                c.misses,
            ),
            ("ornith_prefix_cache_snapshots_taken_total", "Recurrent-state snapshots taken.", c.snapshots_taken),
            (
                "ornith_prefix_cache_snapshots_evicted_total",
                "Recurrent-state snapshots evicted to make room.",
                c.snapshots_evicted,
            ),
            ("ornith_prefix_cache_chunks_evicted_total", "Prompt chunks evicted to make room.", c.chunks_evicted),
        ];
        for (name, help, v) in cache_counters {
            counter(&mut s, name, help, v);
        }
        if let Some(rss) = resident_bytes() {
            gauge(&mut s, "process_resident_memory_bytes", "Resident memory of the server process.", rss as i64);
        }
        self.ttft.lock().unwrap_or_else(|e| e.into_inner()).render(
            &mut s,
            "ornith_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
        );
        self.itl.lock().unwrap_or_else(|e| e.into_inner()).render(
            &mut s,
            "ornith_inter_token_seconds",
            "Time between two consecutive tokens of a request.",
        );
        s
    }
}

/// The process's resident memory (`VmRSS` of `/proc/self/status`; None where there is none).
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.trim_start_matches("VmRSS:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_gauges_balance() {
        let m = Metrics::default();
        m.request("/v1/models", 200);
        m.submitted(10);
        m.first_token(Duration::from_millis(30));
        m.submitted(5);
        m.first_token(Duration::from_secs(100));
        m.left(true);
        m.submitted(1);
        m.left(false);
        m.inter_token(Duration::from_millis(4));
        m.inter_token(Duration::from_millis(4));
        m.inter_token(Duration::from_secs(3));
        let pool = crate::engine::PoolUsage { slots_used: 1, slots_total: 4, blocks_used: 3, blocks_total: 16 };
        let cache = crate::engine::CacheStats { hits: 2, misses: 5, snapshots_taken: 7, ..Default::default() };
        let g = EngineGauges { pool, waiting: 3, cache_chunks: 9, snapshots: 6, snapshots_total: 64, cache };
        let t = m.render(&g, QueueUsage { in_flight: 5, limit: 260 });
        assert!(t.contains("ornith_queue_depth 3\n") && t.contains("ornith_requests_in_flight 5\n"), "{t}");
        assert!(t.contains("ornith_requests_in_flight_limit 260\n"), "{t}");
        assert!(t.contains("ornith_prefix_cache_hits_total 2\n") && t.contains("ornith_prefix_cache_misses_total 5\n"));
        assert!(
            t.contains("ornith_prefix_cache_snapshots 6\n")
                && t.contains("ornith_prefix_cache_snapshots_capacity 64\n")
        );
        assert!(
            t.contains("ornith_prefix_cache_chunks 9\n") && t.contains("ornith_prefix_cache_snapshots_taken_total 7\n")
        );
        assert!(t.contains("# TYPE ornith_inter_token_seconds histogram\n"), "{t}");
        assert!(t.contains("ornith_inter_token_seconds_bucket{le=\"0.0025\"} 0\n"), "{t}");
        assert!(t.contains("ornith_inter_token_seconds_bucket{le=\"0.005\"} 2\n"), "{t}");
        assert!(t.contains("ornith_inter_token_seconds_bucket{le=\"2.5\"} 2\n"), "{t}");
        assert!(t.contains("ornith_inter_token_seconds_bucket{le=\"+Inf\"} 3\n"), "{t}");
        assert!(
            t.contains("ornith_inter_token_seconds_count 3\n") && t.contains("ornith_inter_token_seconds_sum 3.00")
        );
        assert!(t.contains("ornith_pool_slots_used 1\n") && t.contains("ornith_pool_kv_blocks_total 16\n"), "{t}");
        assert!(resident_bytes().is_some_and(|b| b > 1 << 20), "Linux has VmRSS");
        assert!(t.contains("process_resident_memory_bytes "), "{t}");
        assert!(t.contains("ornith_requests_running 1\n") && t.contains("ornith_requests_waiting 0\n"), "{t}");
        assert!(t.contains("ornith_http_requests_total{endpoint=\"/v1/models\",status=\"200\"} 1\n"), "{t}");
        assert!(t.contains("ornith_prompt_tokens_total 16\n"));
        assert!(t.contains("ornith_time_to_first_token_seconds_bucket{le=\"0.025\"} 0\n"));
        assert!(t.contains("ornith_time_to_first_token_seconds_bucket{le=\"0.05\"} 1\n"));
        assert!(t.contains("ornith_time_to_first_token_seconds_bucket{le=\"60\"} 1\n"));
        assert!(t.contains("ornith_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2\n"));
        assert!(t.contains("ornith_time_to_first_token_seconds_count 2\n"));
    }
}
