//! Model-level CUDA backend tests, `#[ignore]`d (CI has no GPU). The graph is compiled for the
//! spec at `ORNITH_SPEC` (one spec per build); the checkpoint is `ORNITH_TEST_MODEL` (default: the
//! spec's own directory). See docs/TESTING.md for the exact build and run commands.
//!
//! * `cuda_matches_cpu` — build for the **shallow** preset (real widths, all 256 experts):
//!   100-token prefill (all rows) and 64 teacher-forced greedy decode steps, CUDA against the
//!   CPU reference, the tolerances computed from the CPU's own noise and capped by constants.
//! * `cuda_matches_cpu_at_length` — shallow: the same at `ORNITH_LONG` tokens (default 16,421),
//!   prefilled in the engine's pieces, each piece's last row and 16 decode steps.
//! * `cuda_ops_vs_cpu` — shallow: every layer op, prefill and one-token decode, from the same CPU
//!   input on both backends, each within a stated bound (row 0 of prefill bit-exact).
//! * `cuda_decode_graph_matches_eager` — the captured decode graph against eager launches.
//! * `decode_graph_ablation` — the bench's in-graph ablation: each edited clone of the decode
//!   graph lacks exactly one kernel's launches; the captured graph is left as it was.
//! * `batch_invariance` — shallow: sequences decoded together (1, 2, 3, 8, 13 at once, and next
//!   to a prefill chunk) give each sequence the bits it gets alone; graphs equal eager launches
//!   at every batch size.
//! * `cuda_penalties_match_cpu_sampling` — shallow: penalties on the device logits, then the
//!   device sampler, against the CPU edit and sampler on the same logits.
//! * `cuda_decode_1000_steps_finite` — build for the **full** preset: 1,000 greedy decode steps.
#![cfg(feature = "cuda")]

use ornith_runtime::backend_cpu::CpuBackend;
use ornith_runtime::backend_cuda::CudaBackend;
use ornith_runtime::cuda::{CudaContext, Pdl};
use ornith_runtime::engine::{PoolRequest, PREFILL_CHUNK};
use ornith_runtime::graph::{Backend, Batch, SeqRows, KV_BLOCK};
use ornith_runtime::weights::Checkpoint;
use std::path::PathBuf;

mod compiled {
    ornith_macros::model!();
}

fn model_dir() -> PathBuf {
    std::env::var_os("ORNITH_TEST_MODEL").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(compiled::MODEL_DIR))
}

/// Deterministic prompt ids spread over the vocabulary (an LCG; no tokenizer needed).
fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Indices of the `k` largest values (any order).
fn top_indices(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    let k = k.min(v.len());
    idx.select_nth_unstable_by(k - 1, |&a, &b| v[b].total_cmp(&v[a]));
    idx.truncate(k);
    idx
}

fn argmax(v: &[f32]) -> usize {
    let mut b = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[b] {
            b = i;
        }
    }
    b
}

/// Relative L2 distance and the largest absolute difference.
fn dist(a: &[f32], b: &[f32]) -> (f64, f64) {
    let (mut num, mut den, mut mx) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = (x as f64 - y as f64).abs();
        num += d * d;
        den += (y as f64) * (y as f64);
        mx = mx.max(d);
    }
    ((num / den.max(1e-300)).sqrt(), mx)
}

/// A CUDA backend planned for `seqs` sequences of up to `ctx` tokens (K/V pool: what is free).
fn cuda_backend_for(ck: &Checkpoint, ctx: usize, seqs: usize) -> CudaBackend {
    let cx = CudaContext::new(0).expect("this test needs a CUDA device");
    let req = PoolRequest {
        max_seqs: Some(seqs),
        default_seqs: seqs,
        kv_budget: None,
        max_context: ctx,
        prefix_cache: Some(0),
        max_batch_tokens: PREFILL_CHUNK,
    };
    CudaBackend::new(cx, ck, &compiled::DIMS, &req, false).expect("CUDA backend").0
}

fn cuda_backend(ck: &Checkpoint, ctx: usize) -> CudaBackend {
    cuda_backend_for(ck, ctx, 2)
}

/// Tolerance floor. Both backends round to bf16 at the same points and quantise activations to
/// E4M3 the same way (each op agrees to ~1e-3 relative L2 with row 0 bit-exact: `cuda_ops_vs_cpu`,
/// except prefill attention at ~1e-2: the flash kernel rounds P to bf16, see docs/TESTING.md);
/// they differ in fp32 summation order (GEMM vs GEMV, chunked vs recurrent delta rule). A summation-order difference
/// changes a bf16 rounding (2^-9 relative) near a rounding boundary, and sometimes an E4M3 code
/// (2^-4 relative) of the next FP8 Linear's input, and each flip propagates through the later
/// layers — so the end-to-end gap is set by the model's own sensitivity, which the test measures:
/// the CPU backend run two legitimate ways (one chunked prefill, and token by token through the
/// recurrent decode path) differs by `cpu_gap`. CUDA must be within twice that (and never need
/// less than 2^-7, a few bf16 ulps), and produce the same greedy tokens except ties within the
/// model's own noise (the decode loop of `cuda_matches_cpu` states the criterion).
const REL_L2: f64 = 1.0 / 128.0;

/// Cap of the self-computed logits tolerance `max(REL_L2, 2 · cpu_gap)`. `cpu_gap` is a CPU-only
/// figure of a fixed checkpoint and prompt, recorded as 7.42e-2 on every H200 run that printed it
/// (docs/TESTING.md and TESTING-2026-11.md, 2026-11-30: 9daff8d, e44ea40, fb31681, d5bc3c4; tolerance 1.48e-1). The cap
/// is 1.6e-1, 8% above that tolerance: if the CPU backend's two orderings drifted further apart
/// (a regression in the reference itself), the tolerance would widen with them, so the test fails
/// instead of accepting a larger CUDA gap. CUDA's own recorded worst: prefill 8.97e-2, decode
/// 1.14e-1.
const REL_L2_CAP: f64 = 0.16;

/// Cap of the self-computed tie threshold `2 · cpu_top` (the CPU orderings' largest difference at
/// each prefill row's 8 largest logits). Recorded: cpu_top 0.156, threshold 0.3125 (d5bc3c4,
/// 2026-11-30, H200; the CPU figure is deterministic); the ties CUDA showed had CPU gaps 0–0.109.
/// Cap 0.35, 12% above the recorded threshold.
const TIE_CAP: f64 = 0.35;

/// The same cap for the NVFP4A16 export of the checkpoint (other weights: E2M1 codes under E4M3
/// group scales, BF16 activations), whose CPU figure is its own: cpu_top 0.2031, threshold 0.4062
/// (2026-12-02, H200, the shallow preset's NVFP4A16 synth). Cap 0.45, 11% above.
const TIE_CAP_NVFP4: f64 = 0.45;

/// The tie cap of the checkpoint under test (by its quantisation format).
fn tie_cap(ck: &Checkpoint) -> f64 {
    match ck.spec.quant.as_ref().map(|q| q.format.as_str()) {
        Some("nvfp4-pack-quantized") => TIE_CAP_NVFP4,
        _ => TIE_CAP,
    }
}

/// Most decode steps (of 64) whose greedy token may differ as a tie. Recorded: 7 (e44ea40) and 6
/// (fb31681, a1bd676, d5bc3c4); twice the worst is allowed, more means CUDA's logits moved
/// towards the CPU's runners-up far more often than the model's noise explains.
const MAX_TIES: usize = 14;

/// One backend's side of a comparison: the backend, the model on it and a sequence's state.
struct Side<'a, B: Backend> {
    b: &'a B,
    m: &'a compiled::Model<B>,
    st: &'a mut compiled::State<B>,
}

impl<B: Backend> Side<'_, B> {
    /// The logits after one decode step of `tok`.
    fn step(&mut self, tok: u32) -> Vec<f32> {
        self.b.logits_to_host(&self.m.decode_step(self.b, self.st, tok).unwrap()).unwrap()
    }
}

/// What [`teacher_forced`] saw: the steps' worst relative L2, the greedy differences accepted as
/// ties (step, how far below its own maximum the CPU ranks CUDA's token) and the CPU's tokens.
struct Forced {
    worst: f64,
    ties: Vec<(usize, f64)>,
    tokens: Vec<usize>,
}

/// `steps` greedy decode steps on both backends, teacher-forced on the CPU's token, from the
/// logits each produced last (`g_last`, `c_last`): at every step CUDA's greedy token is the CPU's
/// or a tie (the CPU ranks it at most `tie` below its own), and once both have consumed the
/// CPU's token CUDA's logits are finite and within relative L2 `tol` of the CPU's.
fn teacher_forced(
    gpu: &mut Side<CudaBackend>,
    cpu: &mut Side<CpuBackend>,
    (mut g_last, mut c_last): (Vec<f32>, Vec<f32>),
    steps: usize,
    tol: f64,
    tie: f64,
) -> Forced {
    let mut f = Forced { worst: 0.0, ties: Vec::new(), tokens: Vec::new() };
    for step in 0..steps {
        let (gt, ct) = (argmax(&g_last), argmax(&c_last));
        if gt != ct {
            let short = (c_last[ct] - c_last[gt]) as f64;
            assert!(short <= tie, "greedy token differs at decode step {step}: CUDA {gt}, CPU {ct}; the CPU ranks CUDA's token {short:.4} below its own, beyond the tie threshold {tie:.4}");
            f.ties.push((step, short));
        }
        f.tokens.push(ct);
        g_last = gpu.step(ct as u32);
        c_last = cpu.step(ct as u32);
        assert!(g_last.iter().all(|v| v.is_finite()), "decode step {step}: non-finite CUDA logits");
        let (rel, mx) = dist(&g_last, &c_last);
        f.worst = f.worst.max(rel);
        assert!(rel <= tol, "decode step {step}: relative L2 {rel:.2e} (max |d| {mx:.3e}) > {tol:.2e}");
    }
    f
}

#[test]
#[ignore]
fn cuda_matches_cpu() {
    let dir = model_dir();
    let ck = Checkpoint::open(&dir, compiled::FINGERPRINT).expect("checkpoint");
    let d = compiled::DIMS;
    let ctx = 256;
    let gpu = cuda_backend(&ck, ctx);
    let gm = compiled::Model::load(&gpu, &ck).expect("CUDA load");
    let mut gs = compiled::Model::new_state(&gpu, ctx).unwrap();
    let cpu = CpuBackend::new();
    let cm = compiled::Model::load(&cpu, &ck).expect("CPU load");
    let mut cs = compiled::Model::new_state(&cpu, ctx).unwrap();

    let ids = prompt(100, d.vocab_size);
    let gl = gpu.logits_to_host(&gm.prefill(&gpu, &mut gs, &ids, true, &mut |_, _| {}).unwrap()).unwrap();
    let cl = cpu.logits_to_host(&cm.prefill(&cpu, &mut cs, &ids, true, &mut |_, _| {}).unwrap()).unwrap();
    assert_eq!(gl.len(), cl.len());
    // The model's own sensitivity: the CPU backend token by token (recurrent delta rule).
    let mut cs2 = compiled::Model::new_state(&cpu, ctx).unwrap();
    let (mut cpu_gap, mut cpu_abs, mut cpu_top) = (0f64, 0f64, 0f64);
    for r in 0..ids.len() {
        let l = if r == 0 {
            cpu.logits_to_host(&cm.prefill(&cpu, &mut cs2, &ids[..1], false, &mut |_, _| {}).unwrap()).unwrap()
        } else {
            cpu.logits_to_host(&cm.decode_step(&cpu, &mut cs2, ids[r]).unwrap()).unwrap()
        };
        let row = &cl[r * d.vocab_size..(r + 1) * d.vocab_size];
        let (rel, mx) = dist(&l, row);
        cpu_gap = cpu_gap.max(rel);
        cpu_abs = cpu_abs.max(mx);
        // The noise where greedy decisions are made: at the row's 8 largest logits.
        for i in top_indices(row, 8) {
            cpu_top = cpu_top.max((l[i] - row[i]).abs() as f64);
        }
    }
    let tol = REL_L2.max(2.0 * cpu_gap);
    eprintln!("CPU chunked vs CPU token-by-token: worst relative L2 {cpu_gap:.3e}, largest |d| {cpu_abs:.4} (at the 8 largest logits of a row: {cpu_top:.4}); tolerance {tol:.3e} (cap {REL_L2_CAP:.2e})");
    assert!(
        tol <= REL_L2_CAP,
        "the tolerance computed from the CPU's own orderings, {tol:.3e}, exceeds its cap {REL_L2_CAP:.2e} (recorded 1.48e-1): the CPU reference's sensitivity grew"
    );
    let mut worst = 0f64;
    for r in 0..ids.len() {
        let row = r * d.vocab_size..(r + 1) * d.vocab_size;
        assert!(gl[row.clone()].iter().all(|v| v.is_finite()), "prefill row {r}: non-finite CUDA logits");
        let (rel, mx) = dist(&gl[row.clone()], &cl[row.clone()]);
        worst = worst.max(rel);
        assert!(rel <= tol, "prefill row {r}: relative L2 {rel:.2e} (max |d| {mx:.3e}) > {tol:.2e}");
    }
    eprintln!("prefill: 100 rows, worst relative L2 {worst:.3e}");

    // Decode, 64 greedy steps, teacher-forced: both backends consume the CPU's greedy token, so
    // every step compares the same sequence (after a disagreement, free-running sequences would
    // no longer be comparable). Logits must stay within `tol` at every step, and the greedy
    // tokens must be identical at every step where the decision is not a tie within the model's
    // own noise where decisions are made: the largest absolute difference, between the CPU's two
    // orderings over the prefill rows, of the logits of each row's 8 most likely tokens
    // (`cpu_top`). On this random-weight checkpoint the top-2 margin is sometimes a single bf16
    // ulp (see `cpu_orderings_greedy_agreement`), where the CPU's own two orderings already pick
    // different tokens; a CUDA token whose CPU logit is more than 2·cpu_top below the CPU's
    // maximum fails.
    let tie = 2.0 * cpu_top;
    let cap = tie_cap(&ck);
    assert!(
        tie <= cap,
        "the tie threshold computed from the CPU's own orderings, {tie:.4}, exceeds its cap {cap} (recorded 0.3125 FP8, 0.4062 NVFP4A16)"
    );
    let last = |v: &[f32]| v[v.len() - d.vocab_size..].to_vec();
    let f = teacher_forced(
        &mut Side { b: &gpu, m: &gm, st: &mut gs },
        &mut Side { b: &cpu, m: &cm, st: &mut cs },
        (last(&gl), last(&cl)),
        64,
        tol,
        tie,
    );
    let ties = f.ties;
    eprintln!(
        "decode: 64 teacher-forced greedy steps, worst relative L2 {:.3e}; {} of 64 tokens identical, ties within {tie:.4} at (step, gap) {ties:?}; tokens {:?}",
        f.worst,
        64 - ties.len(),
        f.tokens
    );
    assert!(ties.len() <= MAX_TIES, "{} of 64 greedy tokens differ as ties, more than {MAX_TIES}", ties.len());
}

/// Caps of `cuda_matches_cpu_at_length`'s self-computed figures at its default length on the FP8
/// shallow preset (CPU-only figures of a fixed checkpoint and prompt): recorded tolerance 1.067e-1
/// (the CPU's two piece cuts 5.337e-2 apart) and tie threshold 0.1875 (H100, 2026-12-06, 38b476d;
/// CUDA's worst row 5.31e-2, one exact tie in 16 steps); each cap 12% above. Other lengths and the
/// NVFP4A16 export (not yet recorded at length) take `cuda_matches_cpu`'s caps.
const LONG_DEFAULT: usize = 16_421;
const LONG_REL_L2_CAP: f64 = 0.12;
const LONG_TIE_CAP: f64 = 0.21;

/// `cuda_matches_cpu` at length: a prompt of `ORNITH_LONG` tokens (default 16,421: 256 GDN
/// chunks and a partial one) prefilled in the engine's [`PREFILL_CHUNK`] pieces on both backends
/// — flash attention over up to 16K cached keys, the GDN and conv states carried through every
/// piece — then 16 teacher-forced decode steps (split decode attention at that length). Compared:
/// each piece's last row and every step. The model's own noise at that length comes from a second
/// CPU run whose pieces are cut at a different place (1,000 tokens into each, so every GDN chunk
/// boundary after the first moves: another fp32 summation order of the same math); CUDA must be
/// within twice it; both self-computed figures capped (`LONG_REL_L2_CAP`, `LONG_TIE_CAP`). More than
/// four pieces' worth of tokens: over two, the CPU's noise at the two cuts (1.88e-2, 2.19e-2) left
/// the tolerance below CUDA's distance at row 2,047 (4.93e-2, the same figure as in every longer
/// run; H100, forty-sixth session); the fourth piece's last row (8,191: 4.44e-2) brings the figure
/// that covers it.
#[test]
#[ignore]
fn cuda_matches_cpu_at_length() {
    let n: usize = std::env::var("ORNITH_LONG")
        .ok()
        .map(|v| v.parse().expect("ORNITH_LONG: a token count"))
        .unwrap_or(LONG_DEFAULT);
    assert!(
        n > 4 * PREFILL_CHUNK,
        "ORNITH_LONG {n}: at least {} tokens (the tolerance comes from the CPU's noise at the pieces' \
         last rows; over two pieces it undershot the model's own sensitivity at row 2,047 — H100, \
         shallow FP8, ORNITH_LONG 4,097: CUDA vs CPU 4.93e-2 there against 2 x 2.19e-2 — and the \
         figure that covers it came at row 8,191)",
        4 * PREFILL_CHUNK + 1
    );
    const STEPS: usize = 16;
    let dir = model_dir();
    let ck = Checkpoint::open(&dir, compiled::FINGERPRINT).expect("checkpoint");
    let d = compiled::DIMS;
    let ctx = (n + STEPS).next_multiple_of(KV_BLOCK);
    let gpu = cuda_backend(&ck, ctx);
    let gm = compiled::Model::load(&gpu, &ck).expect("CUDA load");
    let cpu = CpuBackend::new();
    let cm = compiled::Model::load(&cpu, &ck).expect("CPU load");
    let (mut gs, mut cs, mut cs2) = (
        compiled::Model::new_state(&gpu, ctx).unwrap(),
        compiled::Model::new_state(&cpu, ctx).unwrap(),
        compiled::Model::new_state(&cpu, ctx).unwrap(),
    );
    let ids = prompt(n, d.vocab_size);
    let t0 = std::time::Instant::now();
    let (mut rows, mut cpu_gap, mut cpu_top) = (Vec::new(), 0f64, 0f64);
    let (mut g_last, mut c_last) = (Vec::new(), Vec::new());
    for start in (0..n).step_by(PREFILL_CHUNK) {
        let end = (start + PREFILL_CHUNK).min(n);
        let g =
            gpu.logits_to_host(&gm.prefill(&gpu, &mut gs, &ids[start..end], false, &mut |_, _| {}).unwrap()).unwrap();
        let c =
            cpu.logits_to_host(&cm.prefill(&cpu, &mut cs, &ids[start..end], false, &mut |_, _| {}).unwrap()).unwrap();
        // The second CPU run's cut: 1,000 tokens into the piece, or before its last token; a
        // one-token piece (ORNITH_LONG = 1 mod 2,048) has no cut and goes in whole.
        let cut = (start + 1000).min(end - 1);
        if cut > start {
            cm.prefill(&cpu, &mut cs2, &ids[start..cut], false, &mut |_, _| {}).unwrap();
        }
        let c2 =
            cpu.logits_to_host(&cm.prefill(&cpu, &mut cs2, &ids[cut..end], false, &mut |_, _| {}).unwrap()).unwrap();
        assert!(g.iter().all(|v| v.is_finite()), "row {}: non-finite CUDA logits", end - 1);
        let ((rel, mx), own) = (dist(&g, &c), dist(&c2, &c).0);
        cpu_gap = cpu_gap.max(own);
        for i in top_indices(&c, 8) {
            cpu_top = cpu_top.max((c2[i] - c[i]).abs() as f64);
        }
        rows.push((end - 1, rel, mx));
        eprintln!(
            "  to {end}: {:.1} s; row {}: CUDA vs CPU {rel:.3e} (max |d| {mx:.3e}), CPU at two cuts {own:.3e}",
            t0.elapsed().as_secs_f64(),
            end - 1
        );
        (g_last, c_last) = (g, c);
    }
    eprintln!(
        "{n}-token prefill in pieces of {PREFILL_CHUNK} on both backends (and the CPU again): {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let tol = REL_L2.max(2.0 * cpu_gap);
    let tie = 2.0 * cpu_top;
    eprintln!("CPU at two piece cuts: worst relative L2 {cpu_gap:.3e}, at the 8 largest logits {cpu_top:.4}; tolerance {tol:.3e}, tie threshold {tie:.4}");
    let recorded = n == LONG_DEFAULT && tie_cap(&ck) == TIE_CAP;
    let (tol_cap, tie_max) = if recorded { (LONG_REL_L2_CAP, LONG_TIE_CAP) } else { (REL_L2_CAP, tie_cap(&ck)) };
    assert!(
        tol <= tol_cap,
        "the tolerance computed from the CPU's two piece cuts, {tol:.3e}, exceeds its cap {tol_cap:.2e}"
    );
    assert!(tie <= tie_max, "the tie threshold from the CPU's two piece cuts, {tie:.4}, exceeds its cap {tie_max}");
    for &(row, rel, mx) in &rows {
        assert!(rel <= tol, "prefill row {row}: relative L2 {rel:.2e} (max |d| {mx:.3e}) > {tol:.2e}");
    }

    // Teacher-forced on the CPU's greedy tokens, as cuda_matches_cpu, from the last prompt row.
    let f = teacher_forced(
        &mut Side { b: &gpu, m: &gm, st: &mut gs },
        &mut Side { b: &cpu, m: &cm, st: &mut cs },
        (g_last, c_last),
        STEPS,
        tol,
        tie,
    );
    let ties = f.ties;
    eprintln!(
        "decode: {STEPS} teacher-forced steps from position {n}, worst relative L2 {:.3e}, ties {ties:?}; {:.1} s in all",
        f.worst,
        t0.elapsed().as_secs_f64()
    );
    assert!(ties.len() <= STEPS / 4, "{} of {STEPS} greedy tokens differ as ties", ties.len());
}

/// The captured decode graph replays exactly the eager launches: the same prompt and 48 greedy
/// steps run eagerly and through the graph (captured at the first step, replayed at the rest,
/// across a state reset and in a second state) give bit-identical logits — in every programmatic
/// dependent launch mode (off, the weights-first decode products only, every launch): a missing
/// `griddepcontrol.wait`, or a read before it of anything but weights, would show up as a
/// difference from plain stream order, in the prefill as well as in decode.
#[test]
#[ignore]
fn cuda_decode_graph_matches_eager() {
    use ornith_runtime::cuda::{Pdl, DEFAULT_PDL};
    let ck = Checkpoint::open(&model_dir(), compiled::FINGERPRINT).expect("checkpoint");
    let d = compiled::DIMS;
    let ctx = 512;
    let gpu = cuda_backend(&ck, ctx);
    let m = compiled::Model::load(&gpu, &ck).expect("CUDA load");
    let ids = prompt(40, d.vocab_size);
    // (graph?, PDL mode) -> the prefill's logits, then 48 greedy decode steps' logits.
    let run = |st: &mut compiled::State<CudaBackend>, graph: bool, pdl: Pdl| -> (Vec<Vec<f32>>, f64) {
        gpu.set_decode_graph(graph);
        gpu.context().set_pdl(pdl);
        st.reset(&gpu).unwrap();
        let mut l = gpu.logits_to_host(&m.prefill(&gpu, st, &ids, false, &mut |_, _| {}).unwrap()).unwrap();
        let mut out = vec![l.clone()];
        let t0 = std::time::Instant::now();
        for _ in 0..48 {
            let t = argmax(&l) as u32;
            l = gpu.logits_to_host(&m.decode_step(&gpu, st, t).unwrap()).unwrap();
            out.push(l.clone());
        }
        (out, t0.elapsed().as_secs_f64() / 48.0)
    };
    let mut st = compiled::Model::new_state(&gpu, ctx).unwrap();
    // The reference: plain stream order, every launch issued eagerly.
    let (plain, _) = run(&mut st, false, Pdl::Off);
    let mut times = Vec::new();
    for mode in Pdl::ALL {
        for graph in [false, true] {
            let (got, t) = run(&mut st, graph, mode);
            for (step, l) in plain.iter().enumerate() {
                assert!(l.iter().all(|v| v.is_finite()), "step {step}: non-finite logits");
                assert!(got[step] == *l, "step {step}: graph {graph}, PDL {mode:?} differs from plain stream order");
            }
            times.push(format!("{} {}: {:.1}", if graph { "graph" } else { "eager" }, mode.name(), t * 1e6));
        }
    }
    let (again, _) = run(&mut st, true, DEFAULT_PDL);
    let mut st2 = compiled::Model::new_state(&gpu, ctx).unwrap();
    let (other, _) = run(&mut st2, true, DEFAULT_PDL);
    for (step, l) in plain.iter().enumerate() {
        assert!(again[step] == *l, "step {step}: replay after a state reset differs");
        assert!(other[step] == *l, "step {step}: a second state's graph differs");
    }
    gpu.context().set_pdl(DEFAULT_PDL);
    eprintln!(
        "decode graph: prefill + 48 steps bit-identical across eager/graph x PDL off/weights/all (also after reset and in a second state); us/step with a logits download per step: {}",
        times.join(", ")
    );
}

/// The bench's in-graph ablation edits a clone of the captured decode graph: for every kernel
/// of the step, the edited graph has lost exactly that kernel's launches of an eagerly profiled
/// step (counted by the event profile) and replays; afterwards the captured graph itself is
/// untouched: a fresh run replays it to the logits of eager launches, bit for bit.
#[test]
#[ignore]
fn decode_graph_ablation() {
    use ornith_runtime::cuda::profile::summarize;
    let ck = Checkpoint::open(&model_dir(), compiled::FINGERPRINT).expect("checkpoint");
    let d = compiled::DIMS;
    let ctx = 512;
    let gpu = cuda_backend(&ck, ctx);
    let m = compiled::Model::load(&gpu, &ck).expect("CUDA load");
    let ids = prompt(40, d.vocab_size);
    let mut st = compiled::Model::new_state(&gpu, ctx).unwrap();
    // Prefill + 8 greedy steps' logits (graph or eager).
    let run = |st: &mut compiled::State<CudaBackend>, graph: bool| -> Vec<Vec<f32>> {
        gpu.set_decode_graph(graph);
        st.reset(&gpu).unwrap();
        let mut l = gpu.logits_to_host(&m.prefill(&gpu, st, &ids, false, &mut |_, _| {}).unwrap()).unwrap();
        let mut out = vec![l.clone()];
        for _ in 0..8 {
            l = gpu.logits_to_host(&m.decode_step(&gpu, st, argmax(&l) as u32).unwrap()).unwrap();
            out.push(l.clone());
        }
        out
    };
    let eager = run(&mut st, false);
    let graph = run(&mut st, true);
    assert!(graph == eager, "the decode graph differs from eager launches");
    gpu.profile_begin();
    m.decode_step(&gpu, &mut st, 0).unwrap();
    let kernels = summarize(&gpu.profile_end().unwrap());
    assert!(kernels.len() > 5, "the profiled step launched {} kernels", kernels.len());
    for k in &kernels {
        gpu.set_ablated_kernel(Some(k.kernel));
        m.decode_step(&gpu, &mut st, 0).unwrap();
        gpu.context().synchronize().unwrap();
        assert_eq!(gpu.ablated_nodes(), Some(k.launches), "ablating {}: nodes removed vs launches", k.kernel);
    }
    gpu.set_ablated_kernel(None);
    assert_eq!(gpu.ablated_nodes(), None);
    let after = run(&mut st, true);
    assert!(after == eager, "the captured graph replays differently after the ablations");
    eprintln!(
        "decode graph ablation: {} kernels, each edited graph lost exactly its launches; the captured graph unchanged",
        kernels.len()
    );
}

/// Sequences in the batch-invariance test: the most one decode step takes (`MAX_DECODE_ROWS`,
/// what `run` and `batch` hold at once by default).
const INV_SEQS: usize = ornith_runtime::backend_cuda::plan::MAX_DECODE_ROWS;
/// Distinct prompt lengths in the batch-invariance test (20 + 12·(i mod INV_LENS) tokens).
const INV_LENS: usize = 41;
/// Decode steps per sequence in the batch-invariance test.
const INV_STEPS: usize = 6;

/// Batch invariance on the CUDA backend: a sequence's logits do not depend on which other
/// sequences share its steps. Sequence i (prompt of 20 + 12·(i mod 41) tokens, its own tokens,
/// so the first 41 sit at different positions; state slot 255 - i, so slots are not the row order;
/// blocks interleaved across the pool in reverse, so block tables are neither contiguous nor
/// ordered) is first run alone: prefill, then `INV_STEPS` greedy decode steps, recording its
/// logits and tokens. Then N = 1, 2, 3, 8, 9, 13, 33, 40, 65, 128, 256 sequences are run together
/// — each prefilled alone (the engine's chunks do not depend on the batch), then the same
/// decode steps as one batch of N rows fed the recorded tokens — through CUDA graphs and eagerly, in every programmatic-dependent-launch mode
/// (`Pdl`: the default, off, every launch; 9 is the first group of the wide products, of the
/// staged lm_head and of two shared-expert passes; 33 and 40 take every dense product through the
/// staged build, its K slices meeting in global memory; 65 to 256 are the `run` / `batch`
/// default's larger steps): every row's logits must equal the sequence's alone logits (default
/// mode) bit for bit. Last, a mixed step: three decode rows and
/// the whole prompts of sequences 39 and 40 as prefill chunks in the same batch (their MoE blocks
/// run as one: `moe_segments`), then a decode step of all five.
#[test]
#[ignore]
fn batch_invariance() {
    let ck = Checkpoint::open(&model_dir(), compiled::FINGERPRINT).expect("checkpoint");
    let d = compiled::DIMS;
    let ctx = 1024;
    let n_seq = INV_SEQS;
    let gpu = cuda_backend_for(&ck, ctx, n_seq);
    let m = compiled::Model::load(&gpu, &ck).expect("CUDA load");
    let per = ctx.div_ceil(KV_BLOCK);
    let total_blocks = n_seq * per;
    let mut pools = compiled::Model::new_pools(&gpu, n_seq, total_blocks).unwrap();
    let slot = |i: usize| n_seq - 1 - i;
    let blocks = |i: usize| (0..per).map(|j| (total_blocks - 1 - (j * n_seq + i)) as u32).collect::<Vec<u32>>();
    let prompts: Vec<Vec<u32>> = (0..n_seq)
        .map(|i| {
            let len = 20 + 12 * (i % INV_LENS);
            prompt(len + i, d.vocab_size).into_iter().skip(i).collect()
        })
        .collect();
    let host = |l: &<CudaBackend as Backend>::Logits| gpu.logits_to_host(l).unwrap();
    let vocab = d.vocab_size;
    let seq = |i: usize, pos: usize, len: usize| SeqRows { slot: slot(i), pos, len, blocks: blocks(i) };
    // Prefill sequence i alone (into its slot and blocks); its last row's logits.
    let prefill = |pools: &mut compiled::Pools<CudaBackend>, i: usize| -> Vec<f32> {
        pools.clear_slot(&gpu, slot(i)).unwrap();
        let b = Batch { ids: prompts[i].clone(), seqs: vec![seq(i, 0, prompts[i].len())], all_rows: false };
        host(&m.forward(&gpu, pools, &b, &mut |_, _| {}).unwrap())
    };
    // One decode step of sequences `idx` (fed `toks`, at `pos`): each row's logits.
    let decode =
        |pools: &mut compiled::Pools<CudaBackend>, idx: &[usize], toks: &[u32], pos: &[usize]| -> Vec<Vec<f32>> {
            let b = Batch {
                ids: toks.to_vec(),
                seqs: idx.iter().zip(pos).map(|(&i, &p)| seq(i, p, 1)).collect(),
                all_rows: false,
            };
            host(&m.forward(&gpu, pools, &b, &mut |_, _| {}).unwrap()).chunks(vocab).map(|r| r.to_vec()).collect()
        };
    // Alone: logits after the prefill and after each decode step; the tokens fed.
    gpu.set_decode_graph(true);
    let mut alone: Vec<Vec<Vec<f32>>> = Vec::new();
    let mut fed: Vec<Vec<u32>> = Vec::new();
    for (i, pr) in prompts.iter().enumerate() {
        let mut l = vec![prefill(&mut pools, i)];
        let mut t = Vec::new();
        for k in 0..INV_STEPS {
            t.push(argmax(&l[k]) as u32);
            let r = decode(&mut pools, &[i], &t[k..], &[pr.len() + k]);
            l.push(r.into_iter().next().unwrap());
        }
        assert!(l.iter().flatten().all(|v| v.is_finite()), "sequence {i}: non-finite logits");
        alone.push(l);
        fed.push(t);
    }
    for (n, pdl) in [1usize, 2, 3, 8, 9, 13, 33, 40, 65, 128, INV_SEQS]
        .into_iter()
        .flat_map(|n| [Pdl::Weights, Pdl::Off, Pdl::All].map(|pdl| (n, pdl)))
    {
        gpu.context().set_pdl(pdl);
        for graph in [true, false] {
            gpu.set_decode_graph(graph);
            let idx: Vec<usize> = (0..n).collect();
            for &i in &idx {
                assert!(prefill(&mut pools, i) == alone[i][0], "N {n}: prefill of sequence {i} differs");
            }
            for k in 0..INV_STEPS {
                let toks: Vec<u32> = idx.iter().map(|&i| fed[i][k]).collect();
                let pos: Vec<usize> = idx.iter().map(|&i| prompts[i].len() + k).collect();
                let rows = decode(&mut pools, &idx, &toks, &pos);
                for (&i, row) in idx.iter().zip(&rows) {
                    assert!(
                        *row == alone[i][k + 1],
                        "N {n} (graph {graph}, PDL {}): sequence {i} step {k} differs from the sequence alone",
                        pdl.name()
                    );
                }
            }
        }
        eprintln!(
            "batch invariance: {n} sequences x {INV_STEPS} steps bit-identical to each alone (graph and eager, PDL {})",
            pdl.name()
        );
    }
    gpu.context().set_pdl(ornith_runtime::cuda::DEFAULT_PDL);
    // Mixed: decode rows of sequences 0..3 (their first step) and the whole prompts of sequences
    // 39 and 40 as prefill chunks (488 + 500 rows: one MoE segment); then one decode step of all five.
    gpu.set_decode_graph(true);
    let pre = [39, 40];
    for i in 0..3 {
        prefill(&mut pools, i);
    }
    let mut ids: Vec<u32> = (0..3).map(|i| fed[i][0]).collect();
    let mut seqs: Vec<SeqRows> = (0..3).map(|i| seq(i, prompts[i].len(), 1)).collect();
    for p in pre {
        pools.clear_slot(&gpu, slot(p)).unwrap();
        ids.extend_from_slice(&prompts[p]);
        seqs.push(seq(p, 0, prompts[p].len()));
    }
    let mixed = Batch { ids, seqs, all_rows: false };
    let rows: Vec<Vec<f32>> =
        host(&m.forward(&gpu, &mut pools, &mixed, &mut |_, _| {}).unwrap()).chunks(vocab).map(|r| r.to_vec()).collect();
    for i in 0..3 {
        assert!(rows[i] == alone[i][1], "mixed batch: decode row of sequence {i} differs");
    }
    for (j, p) in pre.into_iter().enumerate() {
        assert!(rows[3 + j] == alone[p][0], "mixed batch: sequence {p}'s prefill logits differ from its prefill alone");
    }
    let idx = [0usize, 1, 2, pre[0], pre[1]];
    let toks: Vec<u32> = [fed[0][1], fed[1][1], fed[2][1], fed[pre[0]][0], fed[pre[1]][0]].to_vec();
    let pos: Vec<usize> = idx.iter().map(|&i| prompts[i].len() + usize::from(i < 3)).collect();
    let rows = decode(&mut pools, &idx, &toks, &pos);
    for (j, &i) in idx.iter().enumerate() {
        let want = if i < 3 { &alone[i][2] } else { &alone[i][1] };
        assert!(rows[j] == *want, "after the mixed batch: sequence {i} differs");
    }
    eprintln!("batch invariance: mixed decode + two-prefill step and the step after it bit-identical");
}

// Bounds of `cuda_ops_vs_cpu`: relative L2 distance of one op's output delta (`h_out - h_in`),
// CUDA against CPU from the same CPU input (the shallow preset, the 100-token LCG prompt of this
// file). Each is the largest figure recorded for that op on the H200 (docs/TESTING.md and TESTING-2026-11.md, runs of
// 2026-11-30 at 9daff8d, e0abe05 and fb31681: the prefill kernels wired in) times a margin of
// about 3: the ops are deterministic (fixed checkpoint, prompt and kernels), so a figure moves
// only when a kernel's summation order changes, while a real defect (a wrong row, scale, expert,
// position or cast point) moves it to O(1e-1..1).

/// Prefill GDN mixers (BF16 Linears on the shallow preset + chunked delta rule): recorded 1.1e-3,
/// 1.6e-3, 1.3e-3 (layers 0, 1, 2; 9daff8d, e0abe05, fb31681). 5e-3 = 3.1x the largest.
const OP_GDN_PREFILL: f64 = 5e-3;
/// Prefill MoE blocks (grouped FP8 GEMMs) per layer 0..3: recorded 2.3e-5, 1.7e-4, 2.5e-3,
/// 1.0e-3 (9daff8d; e0abe05 and fb31681 give the same range 2.3e-5..2.5e-3). The figures differ by
/// 100x between layers (how many E4M3 activation codes sit near a rounding boundary), so each
/// layer has its own bound, about 4x its figure.
const OP_MOE_PREFILL: [f64; 4] = [1e-4, 7e-4, 1e-2, 4e-3];
/// Prefill attention (flash kernel; it rounds the softmax probabilities to bf16 for P·V, the CPU
/// keeps them in fp32): recorded 1.19e-2 (e0abe05, fb31681; 1.2e-2 at 9daff8d). 4e-2 = 3.4x.
const OP_ATTN_PREFILL: f64 = 4e-2;
/// Logits of all 100 rows (final norm + BF16 lm_head GEMM): recorded 8.7e-5 (9daff8d, e0abe05,
/// fb31681; 8.6e-5 at 0b9802b). 3e-4 = 3.4x.
const OP_LOGITS: f64 = 3e-4;

// One-token decode ops (position 100, after each backend's own prefill of the op above, so the
// state a decode op reads differs between the backends by that op's prefill noise). NOT measured
// yet — unmeasured bounds, to be checked against the first H200 run's `OP` lines. Principle: the
// decode kernels have the same cast points as the CPU reference and differ from it only in fp32
// summation order (GEMV vs the CPU's dot products, split-K attention with an fp32 combine, the
// recurrent delta rule on both sides), the same mechanism as the prefill figures above; so each
// decode op is held to the bound of its prefill counterpart, except where one row makes the
// figure coarser:
/// GDN decode (BF16 GEMVs, recurrent rule on both backends): the prefill bound 5e-3. Order-only
/// differences flip at most one bf16 rounding per element (2^-9 relative each), so even a flip at
/// every element of one stage would stay near 2^-8 = 3.9e-3 — below the bound; a defect is O(1).
const OP_GDN_DECODE: f64 = 5e-3;
/// MoE and attention decode (FP8 Linears): one row of 2048 is a small sample of E4M3 code flips
/// (one flip moves a code by a 2^-4 step), so the per-row figure can sit well above the 100-row
/// prefill figures (up to 2.5e-3). 2e-2 allows about (2e-2 / 2^-4)^2 = 10% of one row's codes to
/// flip by one step — far beyond what summation order does (the prefill figures imply well under
/// 1%) and far below what a wrong expert, scale or cache position gives (O(1)). The decode
/// attention kernel keeps P to 16 significant bits (P·V as two bf16 mma, P = bf16(P) +
/// bf16(P - bf16(P))), so the flash kernel's 1.2e-2 (bf16 P) does not apply.
const OP_FP8_DECODE: f64 = 2e-2;
/// Decode logits (final norm + BF16 lm_head GEMV of one row): the prefill logits bound, 3e-4.
const OP_LOGITS_DECODE: f64 = 3e-4;

/// Op-by-op comparison. Prefill: each layer op (mixer, MoE) of layers 0..3 on the 100-token prompt
/// runs on both backends from the same (CPU) input, and the relative L2 distance of the op's
/// output delta (`h_out - h_in`, so a mismatch is located without propagation) must be within
/// the op's `OP_*` bound; row 0 (the first token) must be bit-exact in every op (recorded so on
/// every run since 9daff8d); logits of all rows within `OP_LOGITS`. Decode: then one more token
/// (position 100) goes through the decode ops of every layer the same way, each backend using the
/// state its own prefill op left, with the `OP_*_DECODE` bounds (unmeasured: see above). Every
/// figure is printed as an `OP` line.
#[test]
#[ignore]
fn cuda_ops_vs_cpu() {
    let ck = Checkpoint::open(&model_dir(), compiled::FINGERPRINT).expect("checkpoint");
    let d = compiled::DIMS;
    let ctx = 256;
    let gpu = cuda_backend(&ck, ctx);
    let gm = compiled::Model::load(&gpu, &ck).expect("CUDA load");
    let mut gs = compiled::Model::new_state(&gpu, ctx).unwrap();
    let cpu = CpuBackend::new();
    let cm = compiled::Model::load(&cpu, &ck).expect("CPU load");
    let mut cs = compiled::Model::new_state(&cpu, ctx).unwrap();
    let all = prompt(101, d.vocab_size);
    let (ids, next) = (&all[..100], all[100]);
    // The state's blocks in order (what `Model::prefill` uses).
    let table = |blocks: usize| (0..blocks as u32).collect::<Vec<u32>>();
    let pre = Batch::single(ids, 0, 0, table(gs.pools.blocks), false);
    let pre_all = Batch { all_rows: true, ..pre.clone() };
    let dec = Batch::single(&[next], 0, ids.len(), table(gs.pools.blocks), false);
    let mut hc = cpu.embed(&d, &cm.embed_tokens, &pre).unwrap();
    let he = gpu.embed(&d, &gm.embed_tokens, &pre).unwrap();
    assert_eq!(gpu.act_to_host(&he).unwrap(), cpu.act_to_host(&hc).unwrap(), "embedding");
    let mut failures: Vec<String> = Vec::new();
    // Prints the op's figures and returns its failures; `row0`: row 0 of the output must be bit-exact.
    let report = |name: &str, bound: f64, row0: bool, hin: &[f32], c: &[f32], g: &[f32]| -> Vec<String> {
        let dc: Vec<f32> = c.iter().zip(hin).map(|(a, b)| a - b).collect();
        let dg: Vec<f32> = g.iter().zip(hin).map(|(a, b)| a - b).collect();
        assert!(dg.iter().all(|v| v.is_finite()), "{name}: non-finite");
        let (rel, mx) = dist(&dg, &dc);
        let (r0, _) = dist(&dg[..d.hidden_size], &dc[..d.hidden_size]);
        let rms = (dc.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dc.len() as f64).sqrt();
        eprintln!(
            "OP {name:<18} rel L2 {rel:.3e} (bound {bound:.1e})  row0 {r0:.3e}  max|d| {mx:.3e}  rms(cpu delta) {rms:.3e}"
        );
        let mut f = Vec::new();
        if rel > bound {
            f.push(format!("{name}: relative L2 {rel:.3e} > {bound:.1e}"));
        }
        if row0 && g[..d.hidden_size] != c[..d.hidden_size] {
            f.push(format!("{name}: row 0 not bit-exact (relative L2 {r0:.3e})"));
        }
        f
    };
    // Layer `$layer`'s mixer (`$call`) over `$batch`, then its MoE.
    macro_rules! op {
        ($name:expr, $call:ident, $layer:ident, $batch:expr, $bound:expr, $moe_bound:expr, $row0:expr) => {{
            let hin = cpu.act_to_host(&hc).unwrap();
            let mut hg = gpu.act_from_host(&hin).unwrap();
            cpu.$call(&d, &cm.$layer.input_layernorm, &cm.$layer.mixer, &mut cs.pools.$layer, $batch, &mut hc).unwrap();
            gpu.$call(&d, &gm.$layer.input_layernorm, &gm.$layer.mixer, &mut gs.pools.$layer, $batch, &mut hg).unwrap();
            failures.extend(report(
                $name,
                $bound,
                $row0,
                &hin,
                &cpu.act_to_host(&hc).unwrap(),
                &gpu.act_to_host(&hg).unwrap(),
            ));
            let hin = cpu.act_to_host(&hc).unwrap();
            let mut hg = gpu.act_from_host(&hin).unwrap();
            cpu.sparse_moe(&d, &cm.$layer.post_attention_layernorm, &cm.$layer.mlp, $batch, &mut hc).unwrap();
            gpu.sparse_moe(&d, &gm.$layer.post_attention_layernorm, &gm.$layer.mlp, $batch, &mut hg).unwrap();
            failures.extend(report(
                concat!($name, " moe"),
                $moe_bound,
                $row0,
                &hin,
                &cpu.act_to_host(&hc).unwrap(),
                &gpu.act_to_host(&hg).unwrap(),
            ));
        }};
    }
    // Prefill: row 0 bit-exact.
    op!("layer0 gdn", gated_deltanet, layer_0, &pre, OP_GDN_PREFILL, OP_MOE_PREFILL[0], true);
    op!("layer1 gdn", gated_deltanet, layer_1, &pre, OP_GDN_PREFILL, OP_MOE_PREFILL[1], true);
    op!("layer2 gdn", gated_deltanet, layer_2, &pre, OP_GDN_PREFILL, OP_MOE_PREFILL[2], true);
    op!("layer3 attn", attention, layer_3, &pre, OP_ATTN_PREFILL, OP_MOE_PREFILL[3], true);
    let hin = cpu.act_to_host(&hc).unwrap();
    let hg = gpu.act_from_host(&hin).unwrap();
    let lc = cpu.logits_to_host(&cpu.logits(&d, &cm.norm, &cm.lm_head, &pre_all, &hc).unwrap()).unwrap();
    let lg = gpu.logits_to_host(&gpu.logits(&d, &gm.norm, &gm.lm_head, &pre_all, &hg).unwrap()).unwrap();
    assert!(lg.iter().all(|v| v.is_finite()), "logits: non-finite");
    let (rel, mx) = dist(&lg, &lc);
    eprintln!("OP logits            rel L2 {rel:.3e} (bound {OP_LOGITS:.1e})  max|d| {mx:.3e}");
    if rel > OP_LOGITS {
        failures.push(format!("logits: relative L2 {rel:.3e} > {OP_LOGITS:.1e}"));
    }

    // Decode: token `next` at position 100 through every layer's decode ops, one row.
    hc = cpu.embed(&d, &cm.embed_tokens, &dec).unwrap();
    op!("decode layer0 gdn", gated_deltanet, layer_0, &dec, OP_GDN_DECODE, OP_FP8_DECODE, false);
    op!("decode layer1 gdn", gated_deltanet, layer_1, &dec, OP_GDN_DECODE, OP_FP8_DECODE, false);
    op!("decode layer2 gdn", gated_deltanet, layer_2, &dec, OP_GDN_DECODE, OP_FP8_DECODE, false);
    op!("decode layer3 attn", attention, layer_3, &dec, OP_FP8_DECODE, OP_FP8_DECODE, false);
    let hin = cpu.act_to_host(&hc).unwrap();
    let hg = gpu.act_from_host(&hin).unwrap();
    let lc = cpu.logits_to_host(&cpu.logits(&d, &cm.norm, &cm.lm_head, &dec, &hc).unwrap()).unwrap();
    let lg = gpu.logits_to_host(&gpu.logits(&d, &gm.norm, &gm.lm_head, &dec, &hg).unwrap()).unwrap();
    assert!(lg.iter().all(|v| v.is_finite()), "decode logits: non-finite");
    let (rel, mx) = dist(&lg, &lc);
    eprintln!("OP decode logits     rel L2 {rel:.3e} (bound {OP_LOGITS_DECODE:.1e})  max|d| {mx:.3e}");
    if rel > OP_LOGITS_DECODE {
        failures.push(format!("decode logits: relative L2 {rel:.3e} > {OP_LOGITS_DECODE:.1e}"));
    }
    assert!(
        failures.is_empty(),
        "ops outside their bounds (every figure is on the OP lines above):\n{}",
        failures.join("\n")
    );
}

#[test]
#[ignore]
fn cuda_decode_1000_steps_finite() {
    let dir = model_dir();
    let ck = Checkpoint::open(&dir, compiled::FINGERPRINT).expect("checkpoint");
    let d = compiled::DIMS;
    let ctx = 2048;
    let gpu = cuda_backend(&ck, ctx);
    let m = compiled::Model::load(&gpu, &ck).expect("CUDA load");
    let mut st = compiled::Model::new_state(&gpu, ctx).unwrap();
    let ids = prompt(16, d.vocab_size);
    let mut l = gpu.logits_to_host(&m.prefill(&gpu, &mut st, &ids, false, &mut |_, _| {}).unwrap()).unwrap();
    let started = std::time::Instant::now();
    let mut distinct = std::collections::BTreeSet::new();
    for step in 0..1000 {
        assert!(l.iter().all(|v| v.is_finite()), "decode step {step}: non-finite logits");
        let t = argmax(&l) as u32;
        distinct.insert(t);
        l = gpu.logits_to_host(&m.decode_step(&gpu, &mut st, t).unwrap()).unwrap();
    }
    assert!(l.iter().all(|v| v.is_finite()));
    assert_eq!(st.pos, 16 + 1000);
    eprintln!(
        "1000 decode steps: all logits finite, {} distinct tokens, {:.1?} (with a 0.5 MB logits download per step)",
        distinct.len(),
        started.elapsed()
    );
}

/// The model's own sensitivity, CPU only: the CPU backend run two legitimate ways — one chunked
/// prefill, and token by token through the recurrent decode path — then 16 greedy steps from each
/// state. Prints where the greedy tokens first differ (diagnostic for `cuda_matches_cpu`).
#[test]
#[ignore]
fn cpu_orderings_greedy_agreement() {
    let ck = Checkpoint::open(&model_dir(), compiled::FINGERPRINT).expect("checkpoint");
    let d = compiled::DIMS;
    let cpu = CpuBackend::new();
    let m = compiled::Model::load(&cpu, &ck).expect("CPU load");
    let ids = prompt(100, d.vocab_size);
    let mut a = compiled::Model::new_state(&cpu, 256).unwrap();
    let mut la = cpu.logits_to_host(&m.prefill(&cpu, &mut a, &ids, false, &mut |_, _| {}).unwrap()).unwrap();
    let mut b = compiled::Model::new_state(&cpu, 256).unwrap();
    let mut lb = cpu.logits_to_host(&m.prefill(&cpu, &mut b, &ids[..1], false, &mut |_, _| {}).unwrap()).unwrap();
    for &t in &ids[1..] {
        lb = cpu.logits_to_host(&m.decode_step(&cpu, &mut b, t).unwrap()).unwrap();
    }
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for _ in 0..16 {
        let (x, y) = (argmax(&la), argmax(&lb));
        let mut top: Vec<f32> = la.clone();
        top.sort_by(|p, q| q.partial_cmp(p).unwrap());
        eprintln!(
            "chunked {x} (top-2 margin {:.4}) token-by-token {y}; rel L2 {:.3e}",
            top[0] - top[1],
            dist(&la, &lb).0
        );
        ta.push(x);
        tb.push(y);
        la = cpu.logits_to_host(&m.decode_step(&cpu, &mut a, x as u32).unwrap()).unwrap();
        lb = cpu.logits_to_host(&m.decode_step(&cpu, &mut b, y as u32).unwrap()).unwrap();
    }
    eprintln!("greedy chunked {ta:?}\ngreedy token-by-token {tb:?}");
}

/// The prefix cache's identity on the device: a prompt resumed after two cached chunks (their
/// K/V blocks shared through the block table, the recurrent state copied from a snapshot row by
/// `copy_slot`) gives the logits of a cold prefill of the same prompt bit for bit, and so do 8
/// greedy decode steps after it (graph replays). The cold prefill runs one chunk per step; the
/// same prompt as ONE step (its three chunks' MoE blocks as one segment of 4,296 rows, the
/// backend planned for steps of 3 chunks) gives the same logits too.
#[test]
#[ignore]
fn prefix_cache_resume_matches_cold() {
    use ornith_runtime::engine::{Capacity, PREFILL_CHUNK as C};
    let ck = Checkpoint::open(&model_dir(), compiled::FINGERPRINT).expect("checkpoint");
    let d = compiled::DIMS;
    let ctx = 3 * C;
    let per = ctx / KV_BLOCK;
    let gdn_layers = compiled::LAYER_KINDS.iter().filter(|k| **k == model_spec::LayerKind::LinearAttention).count();
    let (conv, ssm) = d.gdn_state_elems();
    let snapshot_bytes = (gdn_layers * (conv * 2 + ssm * 4)) as u64;
    let cx = CudaContext::new(0).expect("this test needs a CUDA device");
    let req = PoolRequest {
        max_seqs: Some(4),
        default_seqs: 4,
        kv_budget: None,
        max_context: ctx,
        prefix_cache: Some(snapshot_bytes),
        max_batch_tokens: 3 * C,
    };
    let (gpu, cap) = CudaBackend::new(cx, &ck, &d, &req, false).expect("CUDA backend");
    assert_eq!(cap.snapshots, 1, "the plan holds the one snapshot asked for");
    let m = compiled::Model::load(&gpu, &ck).expect("CUDA load");
    let mut pools =
        compiled::Model::new_pools_for(&gpu, &Capacity { slots: 4, blocks: 4 * per, snapshots: 1 }).unwrap();
    let snap_row = 4;
    let table = |s: usize| -> Vec<u32> { (0..per as u32).map(|j| j + (s * per) as u32).collect() };
    let run = |pools: &mut compiled::Pools<CudaBackend>, slot: usize, blocks: Vec<u32>, ids: &[u32], pos: usize| {
        let b = Batch::single(ids, slot, pos, blocks, false);
        gpu.logits_to_host(&m.forward(&gpu, pools, &b, &mut |_, _| {}).unwrap()).unwrap()
    };
    gpu.set_decode_graph(true);
    let base = prompt(2 * C + 300, d.vocab_size);
    pools.clear_slot(&gpu, 0).unwrap();
    for c in 0..2 {
        run(&mut pools, 0, table(0), &base[c * C..(c + 1) * C], c * C);
    }
    pools.copy_slot(&gpu, 0, snap_row).unwrap();
    let mut q = base[..2 * C].to_vec();
    q.extend(prompt(2 * C + 500, d.vocab_size).into_iter().skip(2 * C + 300));
    pools.clear_slot(&gpu, 1).unwrap();
    run(&mut pools, 1, table(1), &q[..C], 0);
    run(&mut pools, 1, table(1), &q[C..2 * C], C);
    let mut cold = vec![run(&mut pools, 1, table(1), &q[2 * C..], 2 * C)];
    pools.clear_slot(&gpu, 3).unwrap();
    let one_step = run(&mut pools, 3, table(3), &q, 0);
    let diff = cold[0].iter().zip(&one_step).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
    assert_eq!(diff, 0, "the prompt as one step: {diff} logits differ from its prefill chunk by chunk");
    pools.copy_slot(&gpu, snap_row, 2).unwrap();
    let shared: Vec<u32> = table(0)[..2 * C / KV_BLOCK].iter().chain(&table(2)[2 * C / KV_BLOCK..]).copied().collect();
    let mut warm = vec![run(&mut pools, 2, shared.clone(), &q[2 * C..], 2 * C)];
    for k in 0..8 {
        let t = argmax(&cold[k]) as u32;
        cold.push(run(&mut pools, 1, table(1), &[t], q.len() + k));
        warm.push(run(&mut pools, 2, shared.clone(), &[t], q.len() + k));
    }
    for (k, (a, b)) in cold.iter().zip(&warm).enumerate() {
        assert!(a.iter().all(|v| v.is_finite()), "step {k}: non-finite logits");
        let diff = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(diff, 0, "step {k} (0 = the resumed prefill): {diff} logits differ from the cold run");
    }
    eprintln!(
        "prefix cache on the device: resumed prefill + 8 decode steps bit-identical to the cold run; the prompt as \
         one step (one MoE segment of {} rows) too",
        q.len()
    );
}

/// Penalties through the CUDA backend's `sample` (`apply_penalties` on the device logits, then
/// the device argmax or draw) against the CPU path on the same logits: the row downloaded first,
/// penalised by `sampling::apply_penalties` and sampled by `sampling::sample`. Greedy and
/// sampled, each with a presence, frequency and repetition penalty over a prompt and a made-up
/// output history that holds the unpenalised greedy pick 20 times (so the greedy pick moves).
/// The row's log-probabilities (asked for beside) are those of the unpenalised row; a masked row
/// (structured output) draws what the CPU draws from the penalised, masked row.
#[test]
#[ignore]
fn cuda_penalties_match_cpu_sampling() {
    use ornith_runtime::engine::{Penalties, SamplingParams};
    use ornith_runtime::graph::RowSample;
    use ornith_runtime::sampling::{apply_penalties, bf16_bits, sample, PenaltyState};
    let ck = Checkpoint::open(&model_dir(), compiled::FINGERPRINT).expect("checkpoint");
    let d = compiled::DIMS;
    let gpu = cuda_backend(&ck, 256);
    let m = compiled::Model::load(&gpu, &ck).expect("CUDA load");
    let n = d.vocab_size;
    let ids = prompt(48, n);
    let sampled = SamplingParams { temperature: 1.0, top_k: 20, top_p: 0.95, min_p: 0.0, seed: 3 };
    for (params, pen) in [
        (SamplingParams::greedy(), Penalties { presence: 1.5, frequency: 0.5, repetition: 1.3 }),
        (sampled, Penalties { presence: 1.5, frequency: 0.5, repetition: 1.3 }),
        (sampled, Penalties { presence: -2.0, frequency: -1.0, repetition: 0.7 }),
    ] {
        let mut st = compiled::Model::new_state(&gpu, 256).unwrap();
        let logits = m.prefill(&gpu, &mut st, &ids, false, &mut |_, _| {}).unwrap();
        let host = bf16_bits(&gpu.logits_to_host(&logits).unwrap()[..n]);
        let mut seen = PenaltyState::new(pen, &ids);
        let top = ornith_runtime::sampling::argmax(&host).unwrap();
        for t in [7, (top + 1) % n as u32].into_iter().chain([top; 20]) {
            seen.add_output(t);
        }
        let mut want = host.clone();
        apply_penalties(&mut want, &seen);
        // Log-probabilities too: the unpenalised row's, of the drawn id and the top 5.
        let logprobs = Some(ornith_runtime::graph::WantLogprobs { top: 5, forced: None });
        let rows =
            [RowSample { row: 0, params, step: 4, penalties: Some(std::sync::Arc::new(seen)), logprobs, mask: None }];
        // A grammar's mask (ids ≡ 3 mod 7): sampled on the host, after the penalties (first: the
        // unmasked call below penalises the device row in place).
        let words: Vec<u32> = (0..n.div_ceil(32))
            .map(|w| (0..32).filter(|b| (w * 32 + b) % 7 == 3).fold(0u32, |acc, b| acc | 1 << b))
            .collect();
        let mask = ornith_runtime::engine::TokenMask { words };
        let mut masked = want.clone();
        mask.apply(&mut masked);
        let masked_rows = [RowSample { mask: Some(std::sync::Arc::new(mask)), logprobs: None, ..rows[0].clone() }];
        let s = gpu.sample(&logits, n, &masked_rows).unwrap().remove(0);
        assert_eq!(s.id, sample(&masked, &params, 4).unwrap(), "masked {params:?} {pen:?}");
        assert_eq!(s.id % 7, 3);
        let s = gpu.sample(&logits, n, &rows).unwrap().remove(0);
        let got = s.id;
        assert_eq!(got, sample(&want, &params, 4).unwrap(), "{params:?} {pen:?}");
        assert_eq!(s.logprobs.as_deref(), Some(&ornith_runtime::logprobs::token_logprobs(&host, got, 5)));
        if params.temperature == 0.0 {
            assert_ne!(got, top, "the presence penalty moved nothing");
        }
    }
}
