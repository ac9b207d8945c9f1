//! Counters of the HTTP server, rendered as Prometheus text at `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds (seconds) of the time-to-first-token histogram's buckets.
const TTFT_BUCKETS: [f64; 12] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

#[derive(Default)]
struct Histogram {
    /// Observations at or under each bound (not cumulative here).
    counts: [u64; TTFT_BUCKETS.len()],
    over: u64,
    sum: f64,
}

#[derive(Default)]
pub struct Metrics {
    /// (endpoint, status) → responses.
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    running: AtomicI64,
    waiting: AtomicI64,
    ttft: Mutex<Histogram>,
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
        let s = ttft.as_secs_f64();
        let mut h = self.ttft.lock().unwrap_or_else(|e| e.into_inner());
        match TTFT_BUCKETS.iter().position(|&b| s <= b) {
            Some(i) => h.counts[i] += 1,
            None => h.over += 1,
        }
        h.sum += s;
    }
    pub fn generated(&self, tokens: u64) {
        self.generation_tokens.fetch_add(tokens, Ordering::Relaxed);
    }
    /// A request left the engine (finished, failed or cancelled), `running` if it had sampled.
    pub fn left(&self, running: bool) {
        let g = if running { &self.running } else { &self.waiting };
        g.fetch_sub(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition, with the engine's pool occupancy.
    pub fn render(&self, pool: crate::engine::PoolUsage) -> String {
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
        let pool_gauges = [
            ("ornith_pool_slots_used", "Recurrent-state slots held by sequences.", pool.slots_used),
            ("ornith_pool_slots_total", "Recurrent-state slots of the pool.", pool.slots_total),
            ("ornith_pool_kv_blocks_used", "K/V blocks held by sequences.", pool.blocks_used),
            ("ornith_pool_kv_blocks_total", "K/V blocks of the pool.", pool.blocks_total),
        ];
        for (name, help, v) in pool_gauges {
            gauge(&mut s, name, help, v as i64);
        }
        if let Some(rss) = resident_bytes() {
            gauge(&mut s, "process_resident_memory_bytes", "Resident memory of the server process.", rss as i64);
        }
        let h = self.ttft.lock().unwrap_or_else(|e| e.into_inner());
        s += "# HELP ornith_time_to_first_token_seconds Time from a request's arrival to its first token.\n";
        s += "# TYPE ornith_time_to_first_token_seconds histogram\n";
        let mut cum = 0;
        for (b, n) in TTFT_BUCKETS.iter().zip(h.counts) {
            cum += n;
            let _ = writeln!(s, "ornith_time_to_first_token_seconds_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += h.over;
        let _ = writeln!(s, "ornith_time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {cum}");
        let _ = writeln!(s, "ornith_time_to_first_token_seconds_sum {}", h.sum);
        let _ = writeln!(s, "ornith_time_to_first_token_seconds_count {cum}");
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
        let pool = crate::engine::PoolUsage { slots_used: 1, slots_total: 4, blocks_used: 3, blocks_total: 16 };
        let t = m.render(pool);
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
