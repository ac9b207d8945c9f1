//! Per-launch timing with CUDA events (each launch bracketed by two events on the stream,
//! [`super::CudaContext::profile_begin`]). Used
//! by `ornith-bench` on one eager decode step; the brackets serialise nothing that the stream did
//! not already serialise, but each adds a few µs of host overhead, so only kernel times are read.
use anyhow::Result;
use cudarc::driver::CudaEvent;

pub(crate) struct Launch {
    pub name: &'static str,
    pub bytes: u64,
    pub start: CudaEvent,
    pub end: CudaEvent,
}

/// One timed launch.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelTime {
    pub kernel: &'static str,
    pub us: f64,
    pub bytes: u64,
}

/// Launches aggregated by kernel name, in first-launch order.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelSummary {
    pub kernel: &'static str,
    pub launches: usize,
    pub total_us: f64,
    pub bytes: u64,
    pub gb_per_s: f64,
}

pub(crate) fn collect(launches: Vec<Launch>) -> Result<Vec<KernelTime>> {
    let mut out = Vec::with_capacity(launches.len());
    for l in launches {
        let ms = l.start.elapsed_ms(&l.end)?;
        out.push(KernelTime { kernel: l.name, us: ms as f64 * 1e3, bytes: l.bytes });
    }
    Ok(out)
}

pub fn summarize(times: &[KernelTime]) -> Vec<KernelSummary> {
    let mut v: Vec<KernelSummary> = Vec::new();
    for t in times {
        match v.iter_mut().find(|s| s.kernel == t.kernel) {
            Some(s) => {
                s.launches += 1;
                s.total_us += t.us;
                s.bytes += t.bytes;
            }
            None => {
                v.push(KernelSummary { kernel: t.kernel, launches: 1, total_us: t.us, bytes: t.bytes, gb_per_s: 0.0 })
            }
        }
    }
    for s in &mut v {
        s.gb_per_s = if s.total_us > 0.0 { s.bytes as f64 / (s.total_us * 1e-6) / 1e9 } else { 0.0 };
    }
    v
}
