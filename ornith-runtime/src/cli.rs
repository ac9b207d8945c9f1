//! Command line of the `ornith` binary. Every flag can also be set through an `ORNITH_*`
//! environment variable (the flag wins). Boolean variables accept 1/0, true/false, yes/no, on/off.

use std::path::PathBuf;

use clap::builder::BoolishValueParser;
use clap::{ArgAction, Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "ornith",
    version,
    about = "Ornith inference engine: JSONL requests on stdin, JSONL results on stdout (or `ornith serve`: HTTP)"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub args: Args,
}

#[derive(Debug, Clone, PartialEq, Eq, Subcommand)]
pub enum Command {
    /// Generate: one request per stdin line, one result line per request on stdout (default).
    Run,
    /// Count tokens: `{"text": …}` or `{"messages": …}` per line → `{"ids": […], "count": N}`.
    Tokenize,
    /// HTTP server: the OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) and
    /// Anthropic (`/v1/messages`) APIs on one engine shared by every connection.
    Serve(ServeArgs),
    /// Run a JSONL file into a JSONL file, resumably: a rerun after a crash, a kill or Ctrl-C
    /// skips the requests whose result is already in the output and appends the rest.
    Batch(BatchArgs),
}

#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct BatchArgs {
    /// Requests, one JSON object per line (the `ornith run` shapes).
    #[arg(long, env = "ORNITH_BATCH_INPUT", value_name = "FILE")]
    pub input: PathBuf,
    /// Results, one line per request, appended as each finishes; an earlier run's complete
    /// result lines are kept and their requests skipped.
    #[arg(long, env = "ORNITH_BATCH_OUTPUT", value_name = "FILE")]
    pub output: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on (default: this machine only).
    #[arg(long, env = "ORNITH_HOST", default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, env = "ORNITH_PORT", default_value_t = 8000)]
    pub port: u16,
    /// The model id of `/v1/models` and of responses; requests naming another model get 404
    /// (default: the checkpoint directory's name).
    #[arg(long, env = "ORNITH_SERVED_MODEL_NAME", value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Require this key on every request but `/health` (`Authorization: Bearer KEY` or
    /// `x-api-key: KEY`; 401 without it). Default: no key needed.
    #[arg(long, env = "ORNITH_API_KEY", value_name = "KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Generation requests that may wait beyond the engine's sequence slots (`--max-seqs`): with
    /// slots + N in the server, new ones get 429 with `Retry-After` (count_tokens, models,
    /// health and metrics are never refused). Bounds the memory queued requests hold.
    #[arg(long, env = "ORNITH_MAX_QUEUE", value_name = "N", default_value_t = crate::http::queue::DEFAULT_MAX_QUEUE)]
    pub max_queue: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// CUDA when a usable GPU is present, else CPU.
    Auto,
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json, *.safetensors, tokenizer.json, chat template).
    #[arg(long, env = "ORNITH_MODEL", global = true, value_name = "DIR")]
    pub model: Option<PathBuf>,
    #[arg(long, env = "ORNITH_BACKEND", value_enum, default_value_t = Backend::Auto, global = true)]
    pub backend: Backend,
    /// Longest sequence (prompt + output) of one request, in tokens (default: the model's
    /// window). The K/V pool always holds at least one such sequence.
    #[arg(long, env = "ORNITH_MAX_CONTEXT", global = true, value_name = "TOKENS")]
    pub max_context: Option<usize>,
    /// Memory for the K/V blocks shared by all sequences, e.g. `8GiB`, `512MiB`, `2000000000`
    /// (default: what the memory plan leaves after weights and recurrent states).
    #[arg(long, env = "ORNITH_KV_BUDGET", value_parser = parse_bytes, global = true, value_name = "BYTES")]
    pub kv_budget: Option<u64>,
    /// Memory for the prefix cache's recurrent-state snapshots (~63 MiB each at the 35B shapes),
    /// e.g. `4GiB`; `0` disables the prefix cache (default: up to 4 GiB as memory allows).
    /// Its K/V blocks live in the K/V pool's free blocks.
    #[arg(long, env = "ORNITH_PREFIX_CACHE_BYTES", value_parser = parse_bytes_or_zero, global = true, value_name = "BYTES")]
    pub prefix_cache_bytes: Option<u64>,
    /// Sequences generated at once: each holds one recurrent-state slot (~63 MiB at the 35B
    /// shapes) whatever its length (default on CUDA: as many as memory allows, up to 256 for
    /// `run` and `batch` and 64 for `serve`; on the CPU 4).
    #[arg(long, env = "ORNITH_MAX_SEQS", value_parser = clap::value_parser!(u64).range(1..=4096), global = true, value_name = "N")]
    pub max_seqs: Option<u64>,
    /// Prefill rows per forward step: beside one decode token of every running sequence (not
    /// counted), prefill chunks (of 2,048 tokens) up to this many rows, at least one per step.
    /// More rows prefill faster (the CUDA MoE runs up to 8,192 prefill rows at once, with fuller
    /// expert tiles) but hold running sequences longer per step. Default: 8,192 for `run` and `batch` on the CUDA
    /// backend (throughput), 2,048 for `serve` (a step is every stream's gap between tokens; 8,192
    /// on CUDA in a step where no sequence decodes, which holds no stream back) and on the CPU
    /// backend. Given, it bounds every step.
    #[arg(long, env = "ORNITH_MAX_BATCH_TOKENS", value_parser = clap::value_parser!(u64).range(1..=1048576), global = true, value_name = "TOKENS")]
    pub max_batch_tokens: Option<u64>,
    /// Write results in input order, holding finished ones back until those before them are
    /// written (default: each as it finishes; lines carry `custom_id`).
    #[arg(long, env = "ORNITH_ORDERED", global = true, action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub ordered: bool,
    /// No per-request log lines on stderr.
    #[arg(long, env = "ORNITH_QUIET", global = true, action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub quiet: bool,
    /// Longer input lines are skipped and answered with an error line (`serve`: larger request
    /// bodies are answered with 413).
    #[arg(long, env = "ORNITH_MAX_LINE_BYTES", default_value_t = 16 << 20, value_parser = clap::value_parser!(u64).range(1..), global = true, value_name = "BYTES")]
    pub max_line_bytes: u64,
}

/// [`parse_bytes`], or `0`.
pub fn parse_bytes_or_zero(s: &str) -> Result<u64, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    parse_bytes(s)
}

/// A byte count with an optional unit: `K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB` are powers of
/// 1024, `KB`/`MB`/`GB`/`TB` powers of 1000; a fraction is allowed (`1.5GiB`).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num.parse().map_err(|_| format!("{s:?} is not a byte count (e.g. 8GiB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        u => return Err(format!("unknown unit {u:?} in {s:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")),
    };
    let v = x * mult;
    if !v.is_finite() || v < 1.0 || v > u64::MAX as f64 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(v as u64)
}

/// Prefill rows per step of the throughput front ends (`run`, `batch`) on the CUDA backend:
/// four prefill chunks, the most the CUDA MoE takes as one segment
/// (`backend_cuda::plan::MAX_MOE_ROWS`, held equal at compile time there).
pub const THROUGHPUT_STEP_ROWS: usize = 4 * crate::engine::PREFILL_CHUNK;
/// Prefill rows per step of `serve` and of the CPU backend: one prefill chunk.
pub const LATENCY_STEP_ROWS: usize = crate::engine::PREFILL_CHUNK;

/// `--max-batch-tokens` where given; otherwise [`THROUGHPUT_STEP_ROWS`] for a throughput front end
/// on the CUDA backend and [`LATENCY_STEP_ROWS`] elsewhere.
pub fn step_rows(max_batch_tokens: Option<u64>, throughput: bool, cuda: bool) -> usize {
    match max_batch_tokens {
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None if throughput && cuda => THROUGHPUT_STEP_ROWS,
        None => LATENCY_STEP_ROWS,
    }
}

/// Prefill rows of a step in which no sequence decodes: the throughput front ends' step whatever
/// the front end — `--max-batch-tokens` where given (it bounds every step), otherwise
/// [`THROUGHPUT_STEP_ROWS`] on the CUDA backend and [`LATENCY_STEP_ROWS`] on the CPU. Such a step
/// holds no running sequence back, and 8,192-row steps brought a 32,768-token prompt's first token
/// in 1.33 s against 1.46 s in 2,048-row steps (H100, docs/DESIGN.md).
pub fn idle_step_rows(max_batch_tokens: Option<u64>, cuda: bool) -> usize {
    step_rows(max_batch_tokens, true, cuda)
}

/// Sequences at once the CUDA backend's plan chooses for the throughput front ends (`run`,
/// `batch`) when `--max-seqs` is not given — as many as fit, up to this (the most a decode step
/// takes, `backend_cuda::plan::MAX_DECODE_ROWS`, held equal at compile time there): from 64
/// sequences on a decode step reads nearly every routed expert, so more sequences share the same
/// weight bytes.
pub const THROUGHPUT_SEQS: usize = 256;
/// The same for `serve`, where a step is every stream's gap between tokens.
pub const LATENCY_SEQS: usize = 64;

/// The CUDA plan's sequence cap when `--max-seqs` is not given (the CPU plan keeps its own).
pub fn default_seqs(throughput: bool) -> usize {
    if throughput {
        THROUGHPUT_SEQS
    } else {
        LATENCY_SEQS
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_flags_and_subcommands() {
        let c = Cli::try_parse_from(["ornith"]).unwrap();
        assert_eq!(c.command, None);
        assert_eq!(c.args.max_line_bytes, 16 << 20);
        assert_eq!(c.args.backend, Backend::Auto);
        let c = Cli::try_parse_from([
            "ornith",
            "tokenize",
            "--model",
            "/m",
            "--backend",
            "cpu",
            "--kv-budget",
            "2GiB",
            "--ordered",
        ])
        .unwrap();
        assert_eq!(c.command, Some(Command::Tokenize));
        assert_eq!(c.args.model, Some(PathBuf::from("/m")));
        assert_eq!(c.args.kv_budget, Some(2 << 30));
        assert!(c.args.ordered);
        assert!(Cli::try_parse_from(["ornith", "--max-line-bytes", "0"]).is_err());
        assert_eq!(Cli::try_parse_from(["ornith", "run"]).unwrap().command, Some(Command::Run));
        let c = Cli::try_parse_from(["ornith", "serve", "--port", "9000", "--served-model-name", "m"]).unwrap();
        let want = ServeArgs {
            host: "127.0.0.1".into(),
            port: 9000,
            served_model_name: Some("m".into()),
            api_key: None,
            max_queue: crate::http::queue::DEFAULT_MAX_QUEUE,
        };
        assert_eq!(c.command, Some(Command::Serve(want)));
        let c = Cli::try_parse_from(["ornith", "serve", "--max-queue", "0"]).unwrap();
        assert!(matches!(c.command, Some(Command::Serve(ServeArgs { max_queue: 0, .. }))));
        assert!(Cli::try_parse_from(["ornith", "serve", "--port", "70000"]).is_err());
        let c = Cli::try_parse_from(["ornith", "batch", "--input", "in.jsonl", "--output", "out.jsonl", "--quiet"])
            .unwrap();
        let want = BatchArgs { input: "in.jsonl".into(), output: "out.jsonl".into() };
        assert_eq!(c.command, Some(Command::Batch(want)));
        assert!(c.args.quiet);
        assert!(Cli::try_parse_from(["ornith", "batch", "--input", "in.jsonl"]).is_err(), "--output is required");
        assert!(Cli::try_parse_from(["ornith", "--backend", "tpu"]).is_err());
    }

    #[test]
    fn step_rows_default_by_front_end_and_backend() {
        let c = Cli::try_parse_from(["ornith"]).unwrap();
        assert_eq!(c.args.max_batch_tokens, None);
        assert_eq!((THROUGHPUT_STEP_ROWS, LATENCY_STEP_ROWS), (8192, 2048));
        // run / batch on CUDA; serve on CUDA; anything on the CPU.
        assert_eq!(step_rows(None, true, true), 8192);
        assert_eq!(step_rows(None, false, true), 2048);
        assert_eq!(step_rows(None, true, false), 2048);
        assert_eq!(step_rows(None, false, false), 2048);
        // The flag wins everywhere.
        let c = Cli::try_parse_from(["ornith", "serve", "--max-batch-tokens", "4096"]).unwrap();
        assert_eq!(c.args.max_batch_tokens, Some(4096));
        for (throughput, cuda) in [(true, true), (false, true), (true, false), (false, false)] {
            assert_eq!(step_rows(Some(4096), throughput, cuda), 4096);
            assert_eq!(idle_step_rows(Some(4096), cuda), 4096);
        }
        // A step with no decode row: 8,192 on CUDA for every front end, 2,048 on the CPU; never
        // below the front end's own step.
        assert_eq!((idle_step_rows(None, true), idle_step_rows(None, false)), (8192, 2048));
        for (throughput, cuda) in [(true, true), (false, true), (true, false), (false, false)] {
            assert!(idle_step_rows(None, cuda) >= step_rows(None, throughput, cuda));
        }
        assert!(Cli::try_parse_from(["ornith", "--max-batch-tokens", "0"]).is_err());
    }

    #[test]
    fn sequence_cap_by_front_end() {
        assert_eq!((default_seqs(true), default_seqs(false)), (256, 64));
        assert_eq!(Cli::try_parse_from(["ornith", "run"]).unwrap().args.max_seqs, None);
        assert_eq!(Cli::try_parse_from(["ornith", "--max-seqs", "8"]).unwrap().args.max_seqs, Some(8));
    }

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("8GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes("1.5 G"), Ok(3 << 29));
        assert_eq!(parse_bytes("500MB"), Ok(500_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
        assert!(parse_bytes("0").is_err());
    }
}
