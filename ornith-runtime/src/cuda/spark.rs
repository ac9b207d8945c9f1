//! A DGX Spark (GB10) estimate of a decode step measured on another GPU — an estimate, labelled
//! as such wherever it is printed (`ornith-bench`), never a measurement.
//!
//! The model. A decode step here took `step_us` (one replayed graph) and reads `bytes`. Split it
//! into the time its bytes take at this GPU's copy bandwidth and the rest (launch gaps, latency
//! chains, reductions, the small kernels that move almost nothing):
//!
//! ```text
//! stream_here = bytes / bw_here          fixed = max(0, step_us − stream_here)
//! spark_ceiling_us = bytes / bw_spark    (bytes only: no decode step is faster)
//! spark_est_us     = bytes / bw_spark + fixed
//! ```
//!
//! `spark_est_us` carries the fixed part over unchanged. That is pessimistic where a kernel that is
//! latency-bound here becomes bandwidth-bound at a twentieth of the bandwidth (its latency then
//! hides under the streaming) and optimistic where the GB10's 48 SMs (132 on an H200) or its
//! LPDDR5x latency make the fixed part longer; the two bracket what a Spark can do with this code:
//! the ceiling above, the estimate below (usually). Per kernel the same split is applied to the
//! event-timed profile (whose brackets add a few µs per launch to the fixed part).
//!
//! The bandwidth: 273 GB/s is the GB10's specification; 231–240 GB/s is what others measure it
//! streaming (docs/DESIGN.md, "The DGX Spark estimate's bandwidth", with the sources);
//! `ornith-bench --spark-gb-s` defaults to 240.
use super::profile::KernelSummary;

/// A step's Spark estimate (see the module doc).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct SparkStep {
    pub bandwidth_gb_s: f64,
    /// The bytes the step reads.
    pub bytes: u64,
    /// `bytes / bw_spark`: the step at the Spark's bandwidth, nothing else.
    pub ceiling_us: f64,
    /// The part of the measured step that its bytes do not explain here.
    pub fixed_us: f64,
    /// `ceiling_us + fixed_us`.
    pub estimate_us: f64,
    /// Tokens per second the estimate and the ceiling give (`tokens` decoded per step).
    pub estimate_tok_s: f64,
    pub ceiling_tok_s: f64,
}

/// The estimate for a step of `step_us` measured here that reads `bytes` and decodes `tokens`.
pub fn spark_step(bytes: u64, step_us: f64, tokens: usize, here_gb_s: f64, spark_gb_s: f64) -> SparkStep {
    assert!(here_gb_s > 0.0 && spark_gb_s > 0.0, "bandwidths must be positive");
    let b = bytes as f64;
    let fixed_us = (step_us - b / (here_gb_s * 1e3)).max(0.0);
    let ceiling_us = b / (spark_gb_s * 1e3);
    let estimate_us = ceiling_us + fixed_us;
    let per_s = |us: f64| if us > 0.0 { tokens as f64 * 1e6 / us } else { 0.0 };
    SparkStep {
        bandwidth_gb_s: spark_gb_s,
        bytes,
        ceiling_us,
        fixed_us,
        estimate_us,
        estimate_tok_s: per_s(estimate_us),
        ceiling_tok_s: per_s(ceiling_us),
    }
}

/// One kernel of an event-timed step, projected the same way.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SparkKernel {
    pub kernel: &'static str,
    pub launches: usize,
    pub bytes: u64,
    /// Measured here (event brackets), per launch.
    pub here_us_per_launch: f64,
    /// Its bytes at the Spark's bandwidth, all launches.
    pub spark_stream_us: f64,
    /// Plus the part of its measured time its bytes do not explain here.
    pub spark_estimate_us: f64,
}

/// The per-kernel table of an event-timed step.
pub fn spark_kernels(kernels: &[KernelSummary], here_gb_s: f64, spark_gb_s: f64) -> Vec<SparkKernel> {
    kernels
        .iter()
        .map(|k| {
            let s = spark_step(k.bytes, k.total_us, k.launches, here_gb_s, spark_gb_s);
            SparkKernel {
                kernel: k.kernel,
                launches: k.launches,
                bytes: k.bytes,
                here_us_per_launch: k.total_us / k.launches.max(1) as f64,
                spark_stream_us: s.ceiling_us,
                spark_estimate_us: s.estimate_us,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spark_step_splits_bytes_and_fixed_time() {
        // 4.664 GB in 3.45 ms here at 4,260 GB/s: 1,094.9 µs of streaming, 2,355.1 µs fixed; at
        // 240 GB/s the bytes alone take 19,433.4 µs.
        let s = spark_step(4_664_024_192, 3450.0, 1, 4260.0, 240.0);
        assert!((s.ceiling_us - 19_433.43).abs() < 0.01, "{s:?}");
        assert!((s.fixed_us - (3450.0 - 1094.84)).abs() < 0.01, "{s:?}");
        assert!((s.estimate_us - (s.ceiling_us + s.fixed_us)).abs() < 1e-9);
        assert_eq!(s.bytes, 4_664_024_192);
        assert!((s.ceiling_tok_s - 51.458).abs() < 0.001, "{s:?}");
        assert!((s.estimate_tok_s - 45.896).abs() < 0.001, "{s:?}");
        // A step faster than its bytes here (impossible, but the inputs are measured) has no
        // fixed part; 8 tokens per step multiply the rates.
        let t = spark_step(4_260_000_000, 500.0, 8, 4260.0, 240.0);
        assert_eq!(t.fixed_us, 0.0);
        assert!((t.estimate_tok_s - 8.0 * 1e6 / t.ceiling_us).abs() < 1e-9);
    }

    #[test]
    fn spark_kernels_keep_the_order_and_split_each_kernel() {
        let ks = [
            KernelSummary { kernel: "gemv_bf16", launches: 2, total_us: 100.0, bytes: 213_000_000, gb_per_s: 0.0 },
            KernelSummary { kernel: "rmsnorm_residual", launches: 4, total_us: 12.0, bytes: 0, gb_per_s: 0.0 },
        ];
        let t = spark_kernels(&ks, 4260.0, 240.0);
        assert_eq!(t.iter().map(|k| k.kernel).collect::<Vec<_>>(), ["gemv_bf16", "rmsnorm_residual"]);
        assert!((t[0].here_us_per_launch - 50.0).abs() < 1e-9);
        assert!((t[0].spark_stream_us - 887.5).abs() < 1e-9);
        assert!((t[0].spark_estimate_us - (887.5 + 50.0)).abs() < 1e-9);
        assert_eq!(t[1].spark_stream_us, 0.0);
        assert!((t[1].spark_estimate_us - 12.0).abs() < 1e-9);
    }
}
