//! `ornith-bench`: batch-1 speed of the CUDA backend on the checkpoint this binary was compiled
//! for. For each prompt length: TTFT (prefill + first token), prefill tok/s, decode tok/s over
//! `--gen` tokens (warm) three ways — greedy, the checkpoint's default sampling
//! (generation_config.json) and top-p only (T 0.7, top-p 0.8), all sampled on the device from the
//! tokenizer's ids as the engine does — the bytes a decode step must read and the fraction of the
//! measured device copy bandwidth that implies, and per-kernel times of one decode step and of one prefill (CUDA
//! events). With `--batch 1,2,4,...`: for each batch size B, B sequences prefilled with
//! `--batch-prompt`-token prompts (different ones), then `--gen` timed decode steps over all B at
//! once (greedy, then the default sampling), with the aggregate and per-sequence decode tok/s
//! and the step time. JSON on stdout, tables on stderr.
use anyhow::{Context, Result};
use clap::Parser;
use cudarc::driver::sys::CUevent_flags;
use ornith_runtime::backend_cuda::decode_bytes::{decode_step_bytes, total, ByteGroup};
use ornith_runtime::backend_cuda::plan::MAX_DECODE_ROWS;
use ornith_runtime::backend_cuda::CudaBackend;
use ornith_runtime::cuda::profile::{summarize, KernelSummary};
use ornith_runtime::cuda::spark::{spark_kernels, spark_step, SparkKernel, SparkStep};
use ornith_runtime::cuda::{CudaContext, Pdl};
use ornith_runtime::engine::{PoolRequest, SamplingParams, PREFILL_CHUNK};
use ornith_runtime::graph::{Backend, Batch, RowSample, SeqRows, KV_BLOCK};
use ornith_runtime::weights::Checkpoint;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

mod compiled {
    ornith_macros::model!();
}

#[derive(Parser)]
#[command(name = "ornith-bench", about = "Batch-1 prefill/decode speed of the CUDA backend (JSON on stdout)")]
struct Args {
    /// Checkpoint directory (default: the one the binary was compiled for).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt lengths in tokens of the batch-1 runs, comma-separated (`--prompts` with no value:
    /// none, the batched runs only).
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "512,2048,8192,32768,131072")]
    prompts: Vec<usize>,
    /// Tokens generated (timed) after each prefill, per decode mode.
    #[arg(long, default_value_t = 128)]
    gen: usize,
    /// Skip prompt lengths once this many seconds have passed.
    #[arg(long, default_value_t = 1e9)]
    budget_s: f64,
    /// Batch sizes of the batched decode runs, comma-separated (none: batch 1 only).
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
    /// Prompt length of each sequence of a batched run.
    #[arg(long, default_value_t = 2048)]
    batch_prompt: usize,
    /// DGX Spark (GB10) bandwidth, GB/s, of the labelled Spark estimate (cuda::spark):
    /// 273 is the specification, 231-240 what it streams in practice.
    #[arg(long, default_value_t = 240.0)]
    spark_gb_s: f64,
    /// Programmatic dependent launch mode of the whole run (off, weights, all; default: the
    /// runtime's). The other modes are timed beside it (greedy, batch 1 and batched).
    #[arg(long)]
    pdl: Option<Pdl>,
    /// The binary's `--max-batch-tokens` (default its default): rows of one step. The batch-1
    /// prefill runs the prompt in steps of that many tokens (chunks of PREFILL_CHUNK, each MoE
    /// block over up to a step's rows at once), as the engine does.
    #[arg(long, default_value_t = 2048)]
    max_batch_tokens: usize,
}

/// One batched run: B sequences decoded together.
#[derive(Serialize)]
struct BatchRun {
    batch: usize,
    prompt_tokens: usize,
    /// Prefill of all B prompts, packed into steps as the engine packs them (seconds).
    prefill_s: f64,
    decode_steps: usize,
    /// Greedy: tokens of all sequences per second, one sequence's tokens per second, ms per step.
    decode_tok_s: f64,
    decode_tok_s_per_seq: f64,
    decode_step_ms: f64,
    /// The same steps with the checkpoint's default sampling (every row sampled in one launch).
    decode_default_sampling_tok_s: f64,
    decode_default_sampling_tok_s_per_seq: f64,
    decode_default_sampling_step_ms: f64,
    /// Greedy aggregate tok/s of the same steps in each other PDL mode (graphs captured in it).
    decode_tok_s_other_pdl: BTreeMap<&'static str, f64>,
    /// One more greedy step with every launch timed by events (eager), aggregated by kernel.
    kernels: Vec<KernelSummary>,
    /// Sum of those launches' times (us).
    kernel_us: f64,
    /// GPU time of one replayed greedy step of this batch (graph), and each kernel's share of it
    /// (`ablate`); 0 and empty if the ablation failed.
    decode_graph_us_per_step: f64,
    decode_graph_ablation: Vec<Ablation>,
    /// An estimate for a DGX Spark from the greedy step and the profile's bytes (which count
    /// every possibly active expert: an upper bound), not a measurement.
    spark_estimate: SparkStep,
}

#[derive(Serialize)]
struct Run {
    prompt_tokens: usize,
    ttft_s: f64,
    prefill_tok_s: f64,
    decode_tokens: usize,
    /// Greedy decode (argmax on the device).
    decode_tok_s: f64,
    /// The same number of steps with the checkpoint's default sampling (`sampling_default`).
    decode_default_sampling_tok_s: f64,
    /// And with top-p only (`sampling_top_p`).
    decode_top_p_tok_s: f64,
    /// The same decode steps with every launch issued eagerly (no CUDA graph), for comparison.
    decode_eager_tok_s: f64,
    /// The same greedy decode steps as graphs captured in each other PDL mode (`Report::pdl`).
    decode_tok_s_other_pdl: BTreeMap<&'static str, f64>,
    decode_ms_per_token: f64,
    bytes_per_decoded_token: u64,
    /// `bytes_per_decoded_token` by group (`backend_cuda::decode_bytes`).
    decode_bytes_by_group: Vec<ByteGroup>,
    achieved_gb_s: f64,
    fraction_of_ceiling: f64,
    decode_step_kernels: Vec<KernelSummary>,
    decode_step_kernel_us: f64,
    decode_step_launches: usize,
    /// GPU time of one replayed decode step (graph, no per-step host sync), for the ablation.
    decode_graph_us_per_step: f64,
    /// Each kernel's cost inside the graph: the step's time minus the time of a graph captured
    /// without that kernel's launches.
    decode_graph_ablation: Vec<Ablation>,
    /// One more prefill of the same prompt with every launch timed by events.
    prefill_kernels: Vec<KernelSummary>,
    prefill_kernel_us: f64,
    prefill_launches: usize,
    /// An estimate for a DGX Spark from this run's greedy step and bytes, not a measurement.
    spark_estimate: SparkStep,
    /// The same per kernel of the event-timed step.
    spark_kernels: Vec<SparkKernel>,
}

#[derive(Serialize)]
struct Report {
    device: String,
    /// The PDL mode of every figure but the `*_other_pdl` ones.
    pdl: &'static str,
    model: String,
    copy_bandwidth_gb_s: f64,
    load_s: f64,
    weight_bytes: u64,
    routed_expert_bytes: u64,
    kv_cache_bytes: u64,
    max_context: usize,
    /// `--max-batch-tokens`: the rows of a prefill step (the binary's flag of the same name).
    max_batch_tokens: usize,
    /// Candidate ids sampled (the tokenizer's vocabulary; the lm_head has more rows).
    sample_vocab: usize,
    sampling_default: String,
    sampling_top_p: String,
    memory_plan: ornith_runtime::backend_cuda::plan::MemoryPlan,
    runs: Vec<Run>,
    batch_runs: Vec<BatchRun>,
}

/// Samples row 0 of `l` (a batch-1 step).
fn sample1(
    b: &CudaBackend,
    l: &<CudaBackend as Backend>::Logits,
    n: usize,
    q: &SamplingParams,
    step: u64,
) -> Result<u32> {
    Ok(b.sample(l, n, &[RowSample { row: 0, params: *q, step, penalties: None, logprobs: None, mask: None }])?[0].id)
}

/// Timed decode runs of `--gen` steps at batch 1: greedy, default sampling, top-p, eager, and
/// greedy in each other PDL mode.
const BATCH1_RUNS: usize = 4 + Pdl::ALL.len() - 1;

/// Blocks one sequence of a batched run needs: the prompt, the timed decode runs (greedy,
/// default sampling, greedy in each other PDL mode) and the first token.
fn batch_seq_blocks(prompt: usize, gen: usize) -> usize {
    (prompt + (1 + Pdl::ALL.len()) * gen + 2 + Pdl::ALL.len()).div_ceil(KV_BLOCK)
}

/// B sequences (slots 0..B, blocks `s·per ..` of `pools`), each with its own prompt, prefilled as
/// the engine fills steps: chunk by chunk of PREFILL_CHUNK, as many sequences' chunks per step
/// as `max_batch_tokens` rows hold (at least one); then `gen` decode steps over all of them
/// greedy and `gen` with `sampling` (seed + sequence), each step sampling every row in one call.
#[allow(clippy::too_many_arguments)]
fn batch_run(
    b: &CudaBackend,
    model: &compiled::Model<CudaBackend>,
    pools: &mut compiled::Pools<CudaBackend>,
    bsz: usize,
    prompt_len: usize,
    gen: usize,
    n_vocab: usize,
    sampling: &SamplingParams,
    (here_gb_s, spark_gb_s): (f64, f64),
    max_batch_tokens: usize,
) -> Result<BatchRun> {
    let d = compiled::DIMS;
    let per = batch_seq_blocks(prompt_len, gen);
    let blocks = |s: usize| ((s * per) as u32..((s + 1) * per) as u32).collect::<Vec<u32>>();
    let greedy = SamplingParams::greedy();
    let t0 = Instant::now();
    let mut toks = Vec::with_capacity(bsz);
    // A different prompt per sequence: the same generator, rotated ids.
    let base = prompt(prompt_len, d.vocab_size);
    let ids: Vec<Vec<u32>> =
        (0..bsz).map(|s| base.iter().map(|&t| (t + 7919 * s as u32) % d.vocab_size as u32).collect()).collect();
    for s in 0..bsz {
        pools.clear_slot(b, s)?;
    }
    let seqs: Vec<usize> = (0..bsz).collect();
    for c0 in (0..prompt_len).step_by(PREFILL_CHUNK) {
        let len = PREFILL_CHUNK.min(prompt_len - c0);
        let last = c0 + len == prompt_len;
        for group in seqs.chunks((max_batch_tokens / len).max(1)) {
            let batch = Batch {
                ids: group.iter().flat_map(|&s| ids[s][c0..c0 + len].iter().copied()).collect(),
                seqs: group.iter().map(|&s| SeqRows { slot: s, pos: c0, len, blocks: blocks(s) }).collect(),
                all_rows: false,
            };
            let l = model.forward(b, pools, &batch, &mut |_, _| {})?;
            if last {
                let rows: Vec<RowSample> = (0..group.len())
                    .map(|row| RowSample { row, params: greedy, step: 0, penalties: None, logprobs: None, mask: None })
                    .collect();
                toks.extend(b.sample(&l, n_vocab, &rows)?.into_iter().map(|s| s.id));
            }
        }
    }
    b.context().synchronize()?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut pos = prompt_len;
    // One decode step of all B sequences, row s sampled with `q` (seed + s) at stream step `step`.
    let mut one = |q: &SamplingParams, step: u64, toks: &mut Vec<u32>, pos: &mut usize| -> Result<()> {
        let seqs = (0..bsz).map(|s| SeqRows { slot: s, pos: *pos, len: 1, blocks: blocks(s) }).collect();
        let batch = Batch { ids: toks.clone(), seqs, all_rows: false };
        let l = model.forward(b, pools, &batch, &mut |_, _| {})?;
        let rows: Vec<RowSample> = (0..bsz)
            .map(|s| RowSample {
                row: s,
                params: SamplingParams { seed: q.seed + s as u64, ..*q },
                step,
                penalties: None,
                logprobs: None,
                mask: None,
            })
            .collect();
        *toks = b.sample(&l, n_vocab, &rows)?.into_iter().map(|s| s.id).collect();
        *pos += 1;
        Ok(())
    };
    // One untimed step captures this batch size's graph (the blocks hold it: see batch_seq_blocks).
    one(&greedy, 1, &mut toks, &mut pos)?;
    let mut timed = |q: &SamplingParams, capture: bool| -> Result<f64> {
        if capture {
            one(&greedy, 1, &mut toks, &mut pos)?;
        }
        let t = Instant::now();
        for i in 0..gen {
            one(q, i as u64 + 2, &mut toks, &mut pos)?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    let tg = timed(&greedy, false)?;
    let ts = timed(sampling, false)?;
    // Greedy again in each other PDL mode (its graph captured at an untimed first step).
    let mode = b.context().pdl();
    let mut other = BTreeMap::new();
    for m in Pdl::ALL.into_iter().filter(|&m| m != mode) {
        b.context().set_pdl(m);
        other.insert(m.name(), bsz as f64 * gen as f64 / timed(&greedy, true)?);
    }
    b.context().set_pdl(mode);
    // One more greedy step with every launch timed (after the timed runs; eager while profiled).
    b.profile_begin();
    one(&greedy, gen as u64 + 2, &mut toks, &mut pos)?;
    let times = b.profile_end()?;
    let kernel_us: f64 = times.iter().map(|t| t.us).sum();
    let kernels = summarize(&times);
    // In-graph cost per kernel of this batch size's step (as at batch 1; the same tokens and
    // positions every replay: the state it leaves is garbage, and these slots are cleared before
    // their next use).
    let fixed = Batch {
        ids: toks.clone(),
        seqs: (0..bsz).map(|s| SeqRows { slot: s, pos, len: 1, blocks: blocks(s) }).collect(),
        all_rows: false,
    };
    let step = || model.forward(b, pools, &fixed, &mut |_, _| {}).map(drop);
    let (graph_us, ablation) = ablate(b, step, &kernels, &format!("batch {bsz}"));
    let (g, bs) = (gen as f64, bsz as f64);
    let step_bytes = kernels.iter().map(|k| k.bytes).sum();
    let spark_estimate = spark_step(step_bytes, tg * 1e6 / g, bsz, here_gb_s, spark_gb_s);
    Ok(BatchRun {
        batch: bsz,
        prompt_tokens: prompt_len,
        prefill_s,
        decode_steps: gen,
        decode_tok_s: bs * g / tg,
        decode_tok_s_per_seq: g / tg,
        decode_step_ms: tg * 1e3 / g,
        decode_default_sampling_tok_s: bs * g / ts,
        decode_default_sampling_tok_s_per_seq: g / ts,
        decode_default_sampling_step_ms: ts * 1e3 / g,
        decode_tok_s_other_pdl: other,
        kernels,
        kernel_us,
        decode_graph_us_per_step: graph_us,
        decode_graph_ablation: ablation,
        spark_estimate,
    })
}

/// The labelled DGX Spark estimate of the batch-1 runs (and per kernel at the last prompt), on stderr.
fn print_spark(runs: &[Run], spark_gb_s: f64) {
    eprintln!(
        "\nDGX Spark ESTIMATE at {spark_gb_s} GB/s, batch 1 (not a measurement; cuda::spark):\n{:>8} {:>13} {:>14} {:>10} {:>11}",
        "prompt", "ceiling t/s", "estimate t/s", "fixed us", "stream us"
    );
    for r in runs {
        let e = &r.spark_estimate;
        eprintln!(
            "{:>8} {:>13.1} {:>14.1} {:>10.0} {:>11.0}",
            r.prompt_tokens, e.ceiling_tok_s, e.estimate_tok_s, e.fixed_us, e.ceiling_us
        );
    }
    if let Some(r) = runs.last() {
        eprintln!("per kernel at prompt {} (event-timed step):", r.prompt_tokens);
        eprintln!(
            "{:>22} {:>8} {:>10} {:>12} {:>14} {:>15}",
            "kernel", "launches", "MB", "us/launch", "spark stream", "spark estimate"
        );
        for k in &r.spark_kernels {
            eprintln!(
                "{:>22} {:>8} {:>10.2} {:>12.1} {:>14.0} {:>15.0}",
                k.kernel,
                k.launches,
                k.bytes as f64 / 1e6,
                k.here_us_per_launch,
                k.spark_stream_us,
                k.spark_estimate_us
            );
        }
    }
}

/// The byte count of one decode step (the "% of ceiling" denominator) by group, on stderr.
fn print_decode_bytes(groups: &[ByteGroup], position: usize) {
    eprintln!("ornith-bench: bytes one decode step reads at position {position}:");
    for g in groups {
        eprintln!("{:>28} {:>10.2} MB", g.group, g.bytes as f64 / 1e6);
    }
    eprintln!("{:>28} {:>10.2} MB", "total", total(groups) as f64 / 1e6);
}

/// Device-to-device copy bandwidth (bytes read + written per second), median of 10 copies of 2 GiB.
fn copy_bandwidth(cx: &CudaContext) -> Result<f64> {
    let n = 2usize << 30;
    let src = cx.stream().alloc_zeros::<u8>(n)?;
    let mut dst = cx.stream().alloc_zeros::<u8>(n)?;
    let mut v = Vec::new();
    for i in 0..13 {
        let a = cx.driver().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let b = cx.driver().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        a.record(cx.stream())?;
        cx.stream().memcpy_dtod(&src, &mut dst)?;
        b.record(cx.stream())?;
        let ms = a.elapsed_ms(&b)? as f64;
        if i >= 3 {
            v.push(2.0 * n as f64 / (ms * 1e-3));
        }
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v[v.len() / 2])
}

fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// One kernel's share of a captured decode step (see [`ablate`]).
#[derive(Serialize)]
struct Ablation {
    kernel: &'static str,
    launches: usize,
    in_graph_us: f64,
}

/// Steps timed per ablated graph (after one step that captures it).
const ABLATION_STEPS: usize = 24;
/// Positions the ablation may use: the full graph plus up to 24 kernels, each `ABLATION_STEPS + 1`,
/// and the whole graph's one replay as a profiler range.
const ABLATION_ROOM: usize = 25 * (ABLATION_STEPS + 1) + 1;

/// In-graph cost of each kernel of the decode step. Event brackets (the per-kernel table) stop the
/// GPU between launches and inflate small kernels; here the step is captured once as the engine
/// runs it, and replayed `ABLATION_STEPS` times whole and, for each kernel, as the same graph
/// edited without that kernel's nodes (`CudaBackend::set_ablated_kernel`), with one
/// synchronisation at the end of each. A kernel's in-graph cost is the difference. The edited
/// graphs leave garbage behind (the state is reset by the caller afterwards); a fixed token is
/// fed, so no garbage logits reach the host. Each edited graph must have lost exactly the
/// kernel's launches of the profiled step, or the ablation fails; a kernel the graph does not
/// launch (the greedy argmax after the step) has no in-graph cost and is left out.
/// `step` runs one decode step (batch 1: `decode_step` of a fixed token; a batch: `forward` of the
/// same tokens at the same positions each time). A measurement aid: a failure is reported (`at`
/// names the run), the ablation cleared and `(0, [])` returned, so the run's other figures stay.
fn ablate(
    b: &CudaBackend,
    step: impl FnMut() -> Result<()>,
    kernels: &[KernelSummary],
    at: &str,
) -> (f64, Vec<Ablation>) {
    ablate_or_fail(b, step, kernels).unwrap_or_else(|e| {
        b.set_ablated_kernel(None);
        eprintln!("ornith-bench: in-graph ablation at {at} failed: {e:#}");
        (0.0, Vec::new())
    })
}

/// [`ablate`], its failure returned.
fn ablate_or_fail(
    b: &CudaBackend,
    mut step: impl FnMut() -> Result<()>,
    kernels: &[KernelSummary],
) -> Result<(f64, Vec<Ablation>)> {
    let mut time = |ablated: Option<&'static str>| -> Result<f64> {
        b.set_ablated_kernel(ablated);
        step()?; // captures the graph (once), edits it (once per kernel)
        b.context().synchronize()?;
        let t = Instant::now();
        for _ in 0..ABLATION_STEPS {
            step()?;
        }
        b.context().synchronize()?;
        let us = t.elapsed().as_secs_f64() * 1e6 / ABLATION_STEPS as f64;
        if ablated.is_none() {
            // One more replay of the whole step as a profiler range: under `ncu
            // --profile-from-start off` (tests/gpu/profile.sh) one captured step of each run.
            b.context().profiler_range(&mut step)?;
        }
        Ok(us)
    };
    let whole = time(None)?;
    let mut out = Vec::new();
    for k in kernels.iter().take(24) {
        let without = time(Some(k.kernel))?; // on an error the caller clears the ablation
        let removed = b.ablated_nodes();
        if removed == Some(0) {
            continue; // runs outside the graph
        }
        anyhow::ensure!(
            removed == Some(k.launches),
            "ablating {}: {removed:?} graph nodes removed, the profiled step launched it {} times",
            k.kernel,
            k.launches
        );
        out.push(Ablation { kernel: k.kernel, launches: k.launches, in_graph_us: whole - without });
    }
    b.set_ablated_kernel(None);
    Ok((whole, out))
}

/// The in-graph cost table of an ablation, its rows in the order given (stderr).
fn print_ablation<'a>(rows: impl Iterator<Item = &'a Ablation>, step_us: f64) {
    eprintln!("{:>22} {:>8} {:>10} {:>8}", "kernel", "launches", "us/step", "share");
    for a in rows {
        eprintln!(
            "{:>22} {:>8} {:>10.1} {:>7.1}%",
            a.kernel,
            a.launches,
            a.in_graph_us,
            100.0 * a.in_graph_us / step_us
        );
    }
}

/// The prefill of `ids` as the engine runs one sequence: steps of as many whole chunks of
/// PREFILL_CHUNK as `max_batch_tokens` holds (at least one), the last step ending at the
/// prompt's end; the last step's logits.
fn prefill_steps(
    b: &CudaBackend,
    model: &compiled::Model<CudaBackend>,
    st: &mut compiled::State<CudaBackend>,
    ids: &[u32],
    max_batch_tokens: usize,
) -> Result<<CudaBackend as Backend>::Logits> {
    let step = (max_batch_tokens / PREFILL_CHUNK).max(1) * PREFILL_CHUNK;
    let mut chunks = ids.chunks(step).peekable();
    loop {
        let c = chunks.next().context("prefill of no tokens")?;
        let l = model.prefill(b, st, c, false, &mut |_, _| {})?;
        if chunks.peek().is_none() {
            return Ok(l);
        }
    }
}

/// Wall-clock seconds of `steps` decode steps, each sampled with `q` over ids `0..n_vocab` as the
/// engine does (the request's sampled-token count feeds the random stream); `tok` is fed in and
/// holds the last sampled token afterwards.
fn decode_timed(
    b: &CudaBackend,
    model: &compiled::Model<CudaBackend>,
    st: &mut compiled::State<CudaBackend>,
    q: &SamplingParams,
    n_vocab: usize,
    steps: usize,
    tok: &mut u32,
) -> Result<f64> {
    let t = Instant::now();
    for i in 0..steps {
        *tok = sample1(b, &model.decode_step(b, st, *tok)?, n_vocab, q, i as u64 + 1)?;
    }
    Ok(t.elapsed().as_secs_f64())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("ornith-bench: error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    let dir = args.model.clone().unwrap_or_else(|| PathBuf::from(compiled::MODEL_DIR));
    let ck = Checkpoint::open(&dir, compiled::FINGERPRINT)?;
    let d = compiled::DIMS;
    let max_prompt = args.prompts.iter().copied().max().unwrap_or(512);
    // Room for the graph-decoded tokens (greedy, default sampling, top-p, greedy in each other PDL
    // mode), as many eager ones, the profiled step and the ablation's steps.
    let batch_ctx = if args.batch.is_empty() { 0 } else { batch_seq_blocks(args.batch_prompt, args.gen) * KV_BLOCK };
    let ctx = (max_prompt + BATCH1_RUNS * args.gen + 16 + ABLATION_ROOM).max(batch_ctx).min(d.max_position_embeddings);
    let n_vocab = ornith_runtime::tokenizer::Tokenizer::from_file(&dir.join("tokenizer.json"))?.vocab_size();
    anyhow::ensure!(n_vocab <= d.vocab_size, "the tokenizer has {n_vocab} ids, the lm_head {} rows", d.vocab_size);
    let gd = ornith_runtime::protocol::GenerationDefaults::from_model_dir(&dir)?;
    let default_sampling =
        SamplingParams { temperature: gd.temperature, top_k: gd.top_k, top_p: gd.top_p, min_p: gd.min_p, seed: 7 };
    let top_p_only = SamplingParams { temperature: 0.7, top_k: 0, top_p: 0.8, min_p: 0.0, seed: 8 };
    let describe = |q: &SamplingParams| {
        format!("temperature {}, top_k {}, top_p {}, min_p {}", q.temperature, q.top_k, q.top_p, q.min_p)
    };
    eprintln!(
        "ornith-bench: sampling {n_vocab} ids; default sampling: {}; top-p row: {}",
        describe(&default_sampling),
        describe(&top_p_only)
    );
    let cx = CudaContext::with_notes(0, |m| eprintln!("ornith-bench: {m}"))?;
    if let Some(m) = args.pdl {
        cx.set_pdl(m);
    }
    let mode = cx.pdl();
    eprintln!("ornith-bench: programmatic dependent launch: {} (the other modes timed beside it)", mode.name());
    let device = cx.device_name().to_string();
    let bw = copy_bandwidth(&cx)?;
    eprintln!("ornith-bench: {device}: device copy bandwidth {:.0} GB/s (read + write)", bw / 1e9);
    let t0 = Instant::now();
    // Pools: one slot of `ctx` tokens (the batch-1 runs) beside `bmax` slots of the batched runs.
    let bmax = args.batch.iter().copied().max().unwrap_or(0);
    let per = batch_seq_blocks(args.batch_prompt, args.gen);
    let seq_blocks = ctx.div_ceil(KV_BLOCK);
    anyhow::ensure!(
        bmax < MAX_DECODE_ROWS,
        "--batch {bmax}: at most {} (one more state slot holds the batch-1 runs' sequence)",
        MAX_DECODE_ROWS - 1
    );
    let req = PoolRequest {
        max_seqs: Some(bmax.max(1) + 1),
        default_seqs: bmax.max(1) + 1,
        kv_budget: Some(compiled::KV_BYTES_PER_TOKEN * KV_BLOCK as u64 * (seq_blocks + bmax * per) as u64),
        max_context: ctx,
        prefix_cache: Some(0),
        max_batch_tokens: args.max_batch_tokens,
    };
    let (b, cap) = CudaBackend::new(cx, &ck, &d, &req, false)?;
    let model = compiled::Model::load(&b, &ck).with_context(|| format!("loading {}", dir.display()))?;
    let mut st = compiled::Model::new_state(&b, ctx)?;
    let mut batch_pools = if bmax > 0 {
        anyhow::ensure!(cap.blocks >= seq_blocks + bmax * per, "the K/V pool holds {} blocks", cap.blocks);
        Some(compiled::Model::new_pools(&b, bmax, bmax * per)?)
    } else {
        None
    };
    b.context().synchronize()?;
    let load_s = t0.elapsed().as_secs_f64();
    let plan = *b.plan();

    // Stored bytes of the routed experts (the report's field); what a decode step reads is
    // `decode_step_bytes`.
    let expert_bytes: u64 =
        ck.spec.tensors.iter().filter(|(n, _)| n.contains(".mlp.experts.")).map(|(_, t)| t.nbytes()).sum();

    let greedy = SamplingParams::greedy();
    // Warm-up: module JIT, allocator pools, clocks.
    {
        st.reset(&b)?;
        let l = model.prefill(&b, &mut st, &prompt(64, d.vocab_size), false, &mut |_, _| {})?;
        let mut t = sample1(&b, &l, n_vocab, &greedy, 0)?;
        for i in 0..16 {
            t = sample1(&b, &model.decode_step(&b, &mut st, t)?, n_vocab, &greedy, i + 1)?;
        }
    }
    let started = Instant::now();
    let mut runs = Vec::new();
    for &p in &args.prompts {
        if p + BATCH1_RUNS * args.gen + 2 + ABLATION_ROOM > ctx {
            eprintln!("ornith-bench: skipping prompt {p}: exceeds the context {ctx}");
            continue;
        }
        if started.elapsed().as_secs_f64() > args.budget_s {
            eprintln!("ornith-bench: skipping prompt {p}: time budget of {}s spent", args.budget_s);
            continue;
        }
        let ids = prompt(p, d.vocab_size);
        st.reset(&b)?;
        let t0 = Instant::now();
        let l = prefill_steps(&b, &model, &mut st, &ids, args.max_batch_tokens)?;
        let mut tok = sample1(&b, &l, n_vocab, &greedy, 0)?;
        let ttft = t0.elapsed().as_secs_f64();
        let dec = decode_timed(&b, &model, &mut st, &greedy, n_vocab, args.gen, &mut tok)?;
        // The same number of steps with sampling: the checkpoint's default, then top-p only.
        let dec_default = decode_timed(&b, &model, &mut st, &default_sampling, n_vocab, args.gen, &mut tok)?;
        let dec_top_p = decode_timed(&b, &model, &mut st, &top_p_only, n_vocab, args.gen, &mut tok)?;
        // The same number of steps again with eager launches (the graph's gain).
        b.set_decode_graph(false);
        let dec_eager = decode_timed(&b, &model, &mut st, &greedy, n_vocab, args.gen, &mut tok)?;
        b.set_decode_graph(true);
        // And again as graphs captured in each other programmatic dependent launch mode.
        let mut other_pdl = BTreeMap::new();
        for m in Pdl::ALL.into_iter().filter(|&m| m != mode) {
            b.context().set_pdl(m);
            let t = decode_timed(&b, &model, &mut st, &greedy, n_vocab, args.gen, &mut tok)?;
            other_pdl.insert(m.name(), args.gen as f64 / t);
        }
        b.context().set_pdl(mode);
        // One more step with every launch timed by events.
        b.profile_begin();
        let l = model.decode_step(&b, &mut st, tok)?;
        let _ = sample1(&b, &l, n_vocab, &greedy, 0)?;
        let times = b.profile_end()?;
        let kernels = summarize(&times);
        let kernel_us: f64 = times.iter().map(|t| t.us).sum();
        let step = || model.decode_step(&b, &mut st, 0).map(drop);
        let (graph_us, ablation) = ablate(&b, step, &kernels, &format!("prompt {p}"));
        // One more prefill with every launch timed (after the timed runs, so it cannot slow them).
        st.reset(&b)?;
        b.profile_begin();
        // A profiler range too (tests/gpu/profile.sh): the prefill's launches under ncu.
        let _ = b.context().profiler_range(|| prefill_steps(&b, &model, &mut st, &ids, args.max_batch_tokens))?;
        let ptimes = b.profile_end()?;
        let avg_pos = p + args.gen / 2;
        let groups = decode_step_bytes(&ck.spec, avg_pos);
        let bytes = total(&groups);
        if runs.is_empty() {
            print_decode_bytes(&groups, avg_pos);
        }
        let tok_s = args.gen as f64 / dec;
        let achieved = bytes as f64 * tok_s;
        let spark_kernels = spark_kernels(&kernels, bw / 1e9, args.spark_gb_s);
        let spark_estimate = spark_step(bytes, dec * 1e6 / args.gen as f64, 1, bw / 1e9, args.spark_gb_s);
        runs.push(Run {
            prompt_tokens: p,
            ttft_s: ttft,
            prefill_tok_s: p as f64 / ttft,
            decode_tokens: args.gen,
            decode_tok_s: tok_s,
            decode_default_sampling_tok_s: args.gen as f64 / dec_default,
            decode_top_p_tok_s: args.gen as f64 / dec_top_p,
            decode_eager_tok_s: args.gen as f64 / dec_eager,
            decode_tok_s_other_pdl: other_pdl,
            decode_ms_per_token: dec * 1e3 / args.gen as f64,
            bytes_per_decoded_token: bytes,
            decode_bytes_by_group: groups,
            achieved_gb_s: achieved / 1e9,
            fraction_of_ceiling: achieved / bw,
            decode_step_kernels: kernels,
            decode_step_kernel_us: kernel_us,
            decode_step_launches: times.len(),
            decode_graph_us_per_step: graph_us,
            decode_graph_ablation: ablation,
            prefill_kernels: summarize(&ptimes),
            prefill_kernel_us: ptimes.iter().map(|t| t.us).sum(),
            prefill_launches: ptimes.len(),
            spark_estimate,
            spark_kernels,
        });
    }

    // Greedy tok/s in the other PDL modes, one column each ("pdl:MODE").
    let others: Vec<&'static str> = Pdl::ALL.into_iter().filter(|&m| m != mode).map(Pdl::name).collect();
    let other_head: String = others.iter().map(|m| format!(" {:>12}", format!("pdl:{m} t/s"))).collect();
    eprintln!(
        "\n(greedy, default and top-p with PDL {}; eager: no graph)\n{:>8} {:>9} {:>11} {:>10} {:>10} {:>10}{} {:>10} {:>9} {:>11} {:>9} {:>8}",
        mode.name(),
        "prompt",
        "TTFT s",
        "prefill t/s",
        "greedy t/s",
        "default t/s",
        "top-p t/s",
        other_head,
        "eager t/s",
        "ms/tok",
        "MB/token",
        "GB/s",
        "% ceil"
    );
    for r in &runs {
        let other: String = others.iter().map(|m| format!(" {:>12.1}", r.decode_tok_s_other_pdl[m])).collect();
        eprintln!(
            "{:>8} {:>9.3} {:>11.0} {:>10.1} {:>10.1} {:>10.1}{} {:>10.1} {:>9.2} {:>11.1} {:>9.0} {:>7.1}%",
            r.prompt_tokens,
            r.ttft_s,
            r.prefill_tok_s,
            r.decode_tok_s,
            r.decode_default_sampling_tok_s,
            r.decode_top_p_tok_s,
            other,
            r.decode_eager_tok_s,
            r.decode_ms_per_token,
            r.bytes_per_decoded_token as f64 / 1e6,
            r.achieved_gb_s,
            100.0 * r.fraction_of_ceiling
        );
    }
    if let Some(r) = runs.last() {
        eprintln!(
            "\none decode step at prompt {} ({} launches, {:.0} us of kernel time):",
            r.prompt_tokens, r.decode_step_launches, r.decode_step_kernel_us
        );
        eprintln!("{:>22} {:>8} {:>10} {:>10} {:>8}", "kernel", "launches", "total us", "MB", "GB/s");
        for k in &r.decode_step_kernels {
            eprintln!(
                "{:>22} {:>8} {:>10.1} {:>10.2} {:>8.0}",
                k.kernel,
                k.launches,
                k.total_us,
                k.bytes as f64 / 1e6,
                k.gb_per_s
            );
        }
    }
    if let Some(r) = runs.last() {
        eprintln!(
            "\nin-graph cost per kernel at prompt {} (step {:.0} us as replayed; each: step minus a graph captured without it):",
            r.prompt_tokens, r.decode_graph_us_per_step
        );
        print_ablation(r.decode_graph_ablation.iter(), r.decode_graph_us_per_step);
    }
    if let Some(r) = runs.last() {
        eprintln!(
            "\nprefill of {} tokens ({} launches, {:.0} us of kernel time):",
            r.prompt_tokens, r.prefill_launches, r.prefill_kernel_us
        );
        eprintln!("{:>22} {:>8} {:>10} {:>10} {:>8}", "kernel", "launches", "total us", "MB", "GB/s");
        for k in &r.prefill_kernels {
            eprintln!(
                "{:>22} {:>8} {:>10.1} {:>10.2} {:>8.0}",
                k.kernel,
                k.launches,
                k.total_us,
                k.bytes as f64 / 1e6,
                k.gb_per_s
            );
        }
    }
    print_spark(&runs, args.spark_gb_s);
    let mut batch_runs = Vec::new();
    if let Some(pools) = batch_pools.as_mut() {
        for &bsz in &args.batch {
            anyhow::ensure!(bsz >= 1, "--batch sizes must be at least 1");
            let bws = (bw / 1e9, args.spark_gb_s);
            let r = batch_run(
                &b,
                &model,
                pools,
                bsz,
                args.batch_prompt,
                args.gen,
                n_vocab,
                &default_sampling,
                bws,
                args.max_batch_tokens,
            )?;
            batch_runs.push(r);
        }
        eprintln!(
            "\nbatched decode, {}-token prompts, {} steps per mode (PDL {}):\n{:>6} {:>10} {:>11} {:>11} {:>9} {:>12} {:>12} {:>9}{}",
            args.batch_prompt,
            args.gen,
            mode.name(),
            "batch",
            "prefill s",
            "greedy t/s",
            "per seq",
            "ms/step",
            "default t/s",
            "per seq",
            "ms/step",
            other_head
        );
        for r in &batch_runs {
            let other: String = others.iter().map(|m| format!(" {:>12.1}", r.decode_tok_s_other_pdl[m])).collect();
            eprintln!(
                "{:>6} {:>10.2} {:>11.1} {:>11.1} {:>9.2} {:>12.1} {:>12.1} {:>9.2}{}",
                r.batch,
                r.prefill_s,
                r.decode_tok_s,
                r.decode_tok_s_per_seq,
                r.decode_step_ms,
                r.decode_default_sampling_tok_s,
                r.decode_default_sampling_tok_s_per_seq,
                r.decode_default_sampling_step_ms,
                other
            );
        }
        eprintln!(
            "\nDGX Spark ESTIMATE of the batched steps at {} GB/s (not a measurement; cuda::spark; bytes as the profile counts them):\n{:>6} {:>10} {:>13} {:>14} {:>10}",
            args.spark_gb_s, "batch", "MB/step", "ceiling t/s", "estimate t/s", "fixed us"
        );
        for r in &batch_runs {
            let e = &r.spark_estimate;
            let mb = e.bytes as f64 / 1e6;
            eprintln!(
                "{:>6} {:>10.0} {:>13.1} {:>14.1} {:>10.0}",
                r.batch, mb, e.ceiling_tok_s, e.estimate_tok_s, e.fixed_us
            );
        }
        for r in &batch_runs {
            let mut ks: Vec<&KernelSummary> = r.kernels.iter().collect();
            ks.sort_by(|a, b| b.total_us.total_cmp(&a.total_us));
            eprintln!("\nbatch {} profiled step: {:.0} us of kernel time; by kernel:", r.batch, r.kernel_us);
            eprintln!(
                "{:>22} {:>8} {:>10} {:>8} {:>10} {:>8}",
                "kernel", "launches", "total us", "share", "MB", "GB/s"
            );
            for k in ks.iter().take(12) {
                eprintln!(
                    "{:>22} {:>8} {:>10.1} {:>7.1}% {:>10.2} {:>8.0}",
                    k.kernel,
                    k.launches,
                    k.total_us,
                    100.0 * k.total_us / r.kernel_us.max(1e-9),
                    k.bytes as f64 / 1e6,
                    k.gb_per_s
                );
            }
            if !r.decode_graph_ablation.is_empty() {
                eprintln!(
                    "batch {} in-graph cost per kernel (step {:.0} us as replayed; each: step minus a graph captured without it):",
                    r.batch, r.decode_graph_us_per_step
                );
                let mut a: Vec<&Ablation> = r.decode_graph_ablation.iter().collect();
                a.sort_by(|x, y| y.in_graph_us.total_cmp(&x.in_graph_us));
                print_ablation(a.into_iter(), r.decode_graph_us_per_step);
            }
        }
    }
    let report = Report {
        device,
        pdl: mode.name(),
        model: dir.display().to_string(),
        copy_bandwidth_gb_s: bw / 1e9,
        load_s,
        weight_bytes: plan.weights,
        routed_expert_bytes: expert_bytes,
        kv_cache_bytes: plan.kv_cache,
        max_context: ctx,
        max_batch_tokens: args.max_batch_tokens,
        sample_vocab: n_vocab,
        sampling_default: describe(&default_sampling),
        sampling_top_p: describe(&top_p_only),
        memory_plan: plan,
        runs,
        batch_runs,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
