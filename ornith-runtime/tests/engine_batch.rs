//! Many sequences at once on the CPU backend (the tiny default model in CI): a request's tokens
//! and logits do not depend on what else runs or when it arrived; admission, cancel and the pools
//! behave as the engine documents.

use ornith_runtime::backend_cpu::CpuBackend;
use ornith_runtime::engine::{
    drain, Capacity, Engine, EngineConfig, Event, EventKind, Finish, GenRequest, Penalties, Runner, SamplingParams,
    PREFILL_CHUNK,
};
use ornith_runtime::graph::{Backend, Batch, SeqRows, KV_BLOCK};
use ornith_runtime::weights::Checkpoint;
use std::collections::HashMap;

mod common;
use common::ids as prompt;

mod compiled {
    ornith_macros::model!();
}

fn checkpoint() -> Checkpoint {
    Checkpoint::open(std::path::Path::new(compiled::MODEL_DIR), compiled::FINGERPRINT).expect("the tiny checkpoint")
}

fn runner(slots: usize, blocks: usize) -> compiled::Compiled<CpuBackend> {
    compiled::Compiled::load(CpuBackend::new(), &checkpoint(), &Capacity { slots, blocks, snapshots: 0 }).unwrap()
}

const CTX: usize = 4096;

fn engine(slots: usize, blocks: usize, max_batch_tokens: usize) -> Engine {
    engine_idle(slots, blocks, max_batch_tokens, max_batch_tokens)
}

/// [`engine`] whose steps with no decode row take `idle_batch_tokens` prefill rows.
fn engine_idle(slots: usize, blocks: usize, max_batch_tokens: usize, idle_batch_tokens: usize) -> Engine {
    Engine::new(Box::new(runner(slots, blocks)), config(max_batch_tokens, idle_batch_tokens)).unwrap()
}

/// Contexts of [`CTX`], the model's vocabulary sampled, the given step budgets.
fn config(max_batch_tokens: usize, idle_batch_tokens: usize) -> EngineConfig {
    EngineConfig { max_batch_tokens, idle_batch_tokens, max_context: CTX, sample_vocab: compiled::DIMS.vocab_size }
}

/// The tokens `r` gives alone: a one-slot engine with `max_batch_tokens` prefill rows per step.
fn alone(r: &GenRequest, max_batch_tokens: usize) -> Vec<u32> {
    let mut e = engine(1, CTX / KV_BLOCK, max_batch_tokens);
    e.submit(0, r.clone()).unwrap();
    let (toks, errs) = drain(&mut e);
    assert!(errs.is_empty(), "{errs:?}");
    toks[&0].clone()
}

/// Appends each token event of a step to its request's tokens; an error event fails the test.
fn keep_tokens(toks: &mut HashMap<u64, Vec<u32>>, events: Vec<Event>) {
    for ev in events {
        match ev.kind {
            EventKind::Token(t) => toks.entry(ev.id).or_default().push(t),
            EventKind::Error { message, .. } => panic!("request {}: {message}", ev.id),
            EventKind::Finished(_) | EventKind::Admitted { .. } | EventKind::Logprobs(_) => {}
        }
    }
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 1.0, top_k: 20, top_p: 0.95, min_p: 0.0, seed }
}

/// Mixed lengths (one prompt spans two prefill chunks), greedy and seeded sampling.
fn requests() -> Vec<GenRequest> {
    let lens = [5, 300, 1, 2500, 17, 64, 129, 8];
    lens.iter()
        .enumerate()
        .map(|(i, &n)| {
            let params = if i % 2 == 0 { SamplingParams::greedy() } else { sampled(1000 + i as u64) };
            plain(prompt(n, i as u64), 6 + (i as u64 % 3) * 5, params)
        })
        .collect()
}

#[test]
fn every_request_gives_the_tokens_it_gives_alone_with_staggered_arrivals() {
    let reqs = requests();
    // Alone: one sequence at a time.
    let solo: Vec<Vec<u32>> = reqs.iter().map(|r| alone(r, 2048)).collect();
    // Together: 4 slots, a small step budget, arrivals spread over the first steps.
    let mut e = engine(4, 4 * CTX / KV_BLOCK, 96);
    let mut toks: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut next = 0;
    let mut steps = 0;
    while next < reqs.len() || e.has_work() {
        if next < reqs.len() && steps % 3 == 0 {
            e.submit(next as u64, reqs[next].clone()).unwrap();
            next += 1;
        }
        keep_tokens(&mut toks, e.step());
        steps += 1;
    }
    for (i, r) in reqs.iter().enumerate() {
        let got = &toks[&(i as u64)];
        assert_eq!(got.len() as u64, r.max_tokens);
        assert_eq!(got, &solo[i], "request {i} (prompt {}) differs in a batch", r.prompt.len());
    }
    assert!(e.stats().peak_running >= 3, "the requests did overlap: {:?}", e.stats());
    assert_eq!(e.pool_usage(), (4, 4, 4 * CTX / KV_BLOCK, 4 * CTX / KV_BLOCK), "every slot and block came back");
}

/// Logits, not only tokens: decode rows of three sequences in one step equal each sequence's
/// own decode step bit for bit, and so does a step mixing decode rows with a prefill chunk.
#[test]
fn logits_in_a_batch_are_bit_identical_to_logits_alone() {
    let b = CpuBackend::new();
    let r = runner(4, 64);
    let (m, mut pools) = (r.model, r.pools);
    let prompts = [prompt(7, 1), prompt(40, 2), prompt(3, 3)];
    let tables: Vec<Vec<u32>> = (0..3).map(|i| (0..16).map(|j| (j * 4 + i) as u32).collect()).collect();
    let mut alone = Vec::new();
    for p in &prompts {
        let mut st = compiled::Model::new_state(&b, CTX).unwrap();
        m.prefill(&b, &mut st, p, false, &mut |_, _| {}).unwrap();
        let l = b.logits_to_host(&m.decode_step(&b, &mut st, 42).unwrap()).unwrap();
        alone.push(l);
    }
    for (i, p) in prompts.iter().enumerate() {
        pools.clear_slot(&b, i).unwrap();
        let batch = Batch::single(p, i, 0, tables[i].clone(), false);
        m.forward(&b, &mut pools, &batch, &mut |_, _| {}).unwrap();
    }
    // Sequence 3 (slot 3) prefills in the same step as the decode rows of the other three.
    pools.clear_slot(&b, 3).unwrap();
    let extra = prompt(11, 4);
    let mut batch = Batch::default();
    for (i, p) in prompts.iter().enumerate() {
        batch.ids.push(42);
        batch.seqs.push(SeqRows { slot: i, pos: p.len(), len: 1, blocks: tables[i].clone() });
    }
    batch.ids.extend_from_slice(&extra);
    batch.seqs.push(SeqRows { slot: 3, pos: 0, len: extra.len(), blocks: (48..64).collect() });
    let l = b.logits_to_host(&m.forward(&b, &mut pools, &batch, &mut |_, _| {}).unwrap()).unwrap();
    let v = compiled::DIMS.vocab_size;
    assert_eq!(l.len(), 4 * v);
    for (i, a) in alone.iter().enumerate() {
        let row = &l[i * v..(i + 1) * v];
        assert!(row.iter().zip(a).all(|(x, y)| x.to_bits() == y.to_bits()), "sequence {i}'s logits differ in a batch");
    }
    let mut st = compiled::Model::new_state(&b, CTX).unwrap();
    let solo = b.logits_to_host(&m.prefill(&b, &mut st, &extra, false, &mut |_, _| {}).unwrap()).unwrap();
    assert!(l[3 * v..].iter().zip(&solo).all(|(x, y)| x.to_bits() == y.to_bits()), "the prefill chunk differs");
}

#[test]
fn a_short_request_after_a_long_one_finishes_first() {
    let mut e = engine(2, 2 * CTX / KV_BLOCK, 2048);
    let long = plain(prompt(PREFILL_CHUNK + 900, 9), 4, SamplingParams::greedy());
    let short = plain(prompt(6, 10), 2, SamplingParams::greedy());
    e.submit(1, long).unwrap();
    e.submit(2, short).unwrap();
    let mut order = Vec::new();
    while e.has_work() {
        for ev in e.step() {
            if let EventKind::Finished(f) = ev.kind {
                assert_eq!(f, Finish::Length);
                order.push(ev.id);
            }
        }
    }
    assert_eq!(order, [2, 1]);
}

#[test]
fn admission_waits_for_memory_refuses_what_never_fits_and_cancel_frees() {
    // Two slots, blocks for 1.5 full-context sequences.
    let blocks = CTX / KV_BLOCK * 3 / 2;
    let mut e = engine(2, blocks, 2048);
    let req = |n: usize, max: u64| plain(prompt(n, n as u64), max, SamplingParams::greedy());
    // Longer than the context: refused at once, nothing queued.
    let err = e.submit(1, req(CTX, 1)).unwrap_err();
    assert_eq!(err.code, "context_length_exceeded");
    assert!(e.submit(1, req(0, 1)).is_err() && e.submit(1, req(3, 0)).is_err());
    // A full-context request reserves most blocks; the next one waits until it is gone.
    e.submit(1, req(10, (CTX - 10) as u64)).unwrap();
    e.submit(2, req(10, (CTX - 10) as u64)).unwrap();
    e.submit(3, req(10, 4)).unwrap();
    e.step();
    assert_eq!((e.running(), e.waiting()), (1, 2), "request 2 waits for blocks and 3 waits behind it (FIFO)");
    assert!(e.submit(3, req(4, 4)).is_err(), "an id in use is refused");
    // Cancelling the running one frees its slot and blocks: the others start.
    assert!(e.cancel(1));
    assert!(!e.cancel(1));
    let (free_slots, _, free_blocks, _) = e.pool_usage();
    assert_eq!((free_slots, free_blocks), (2, blocks));
    e.step();
    assert_eq!((e.running(), e.waiting()), (2, 0));
    assert!(e.cancel(2) && e.cancel(3));
    assert_eq!(e.pool_usage(), (2, 2, blocks, blocks));
    assert_eq!(e.stats().cancelled, 3);
}

#[test]
fn stop_ids_end_a_sequence_and_pools_never_leak_over_a_thousand_requests() {
    let mut e = engine(8, 8 * 4, 512);
    let mut stats_tokens = 0u64;
    for i in 0..1000u64 {
        let params = if i % 3 == 0 { SamplingParams::greedy() } else { sampled(i) };
        let n = 1 + (i as usize * 7) % 40;
        e.submit(i, plain(prompt(n, i), 1 + i % 4, params)).unwrap();
        stats_tokens += 1 + i % 4;
        if i % 50 == 49 {
            let (toks, errs) = drain(&mut e);
            assert!(errs.is_empty(), "{errs:?}");
            assert_eq!(toks.len(), 50);
        }
    }
    assert_eq!(e.stats().sampled, stats_tokens);
    assert_eq!(e.stats().finished, 1000);
    assert_eq!(e.pool_usage(), (8, 8, 32, 32), "every slot and block came back");
    // A stop id ends the sequence on the token that is one.
    let r = plain(prompt(5, 77), 50, SamplingParams::greedy());
    e.submit(5000, r.clone()).unwrap();
    let first = drain(&mut e).0[&5000][0];
    e.submit(5001, GenRequest { stop_ids: vec![first], ..r }).unwrap();
    let (mut toks, mut fin) = (Vec::new(), None);
    while e.has_work() {
        for ev in e.step() {
            match ev.kind {
                EventKind::Token(t) => toks.push(t),
                EventKind::Finished(f) => fin = Some(f),
                EventKind::Error { message, .. } => panic!("request {}: {message}", ev.id),
                _ => {}
            }
        }
    }
    assert_eq!((toks, fin), (vec![first], Some(Finish::Stop)));
}

#[test]
fn runner_reports_its_pools() {
    let r = runner(3, 10);
    assert_eq!(r.capacity(), Capacity { slots: 3, blocks: 10, snapshots: 0 });
    assert_eq!(r.window(), compiled::DIMS.max_position_embeddings);
}

/// What vLLM does to one row of logits (its mask formulation over the whole vocabulary, written
/// apart from the engine's sparse bookkeeping): a seen token's logit (prompt or output) is scaled
/// by `1 / repetition` when positive and by `repetition` otherwise; then `frequency` times its
/// output count and `presence` once if generated are subtracted. Rounded to bf16 (the sampler's
/// contract, `sampling::penalize`).
fn oracle_penalised(logits: &[f32], prompt: &[u32], out: &[u32], p: &Penalties) -> Vec<u16> {
    let v = logits.len();
    let mut counts = vec![0u32; v];
    for &t in out {
        counts[t as usize] += 1;
    }
    let mut in_prompt = vec![false; v];
    for &t in prompt {
        in_prompt[t as usize] = true;
    }
    let inv_r = 1.0f32 / p.repetition;
    (0..v)
        .map(|i| {
            let mut x = logits[i];
            if !x.is_finite() {
                return half::bf16::from_f32(x).to_bits();
            }
            if in_prompt[i] || counts[i] > 0 {
                x *= if x > 0.0 { inv_r } else { p.repetition };
            }
            x -= p.frequency * counts[i] as f32;
            x -= p.presence * if counts[i] > 0 { 1.0 } else { 0.0 };
            half::bf16::from_f32(x).to_bits()
        })
        .collect()
}

/// The model alone on the CPU backend, one token at a time: `r.prompt` prefilled, then
/// `r.max_tokens` decode steps, each token drawn from the logits penalised by `oracle_penalised`
/// (argmax or `sampling::sample` at that step) unless a forced token is pending (`r.force`: once
/// a plan's trigger holds — the output ends with its tokens, or reaches its count before ending
/// with its `unless` — its tokens replace the next draws).
fn oracle(r: &GenRequest) -> Vec<u32> {
    use ornith_runtime::engine::Trigger;
    let b = CpuBackend::new();
    let m = runner(1, CTX / KV_BLOCK).model;
    let n = compiled::DIMS.vocab_size;
    let mut st = compiled::Model::new_state(&b, CTX).unwrap();
    let mut logits = b.logits_to_host(&m.prefill(&b, &mut st, &r.prompt, false, &mut |_, _| {}).unwrap()).unwrap();
    let (mut out, mut pending, mut plans) = (Vec::<u32>::new(), std::collections::VecDeque::new(), r.force.clone());
    // Plans whose trigger holds now fire in order; a count whose `unless` was just met is dropped.
    let fire = |out: &[u32], plans: &mut Vec<_>, pending: &mut std::collections::VecDeque<u32>| {
        plans.retain(|f: &ornith_runtime::engine::Forcing| {
            let (go, keep) = match &f.when {
                Trigger::After(a) => (out.ends_with(a), !out.ends_with(a)),
                Trigger::Count { tokens, unless } => {
                    let met = !unless.is_empty() && out.ends_with(unless);
                    let go = !met && out.len() as u64 >= *tokens;
                    (go, !met && !go)
                }
            };
            if go {
                pending.extend(f.tokens.iter().copied());
            }
            keep
        });
    };
    fire(&out, &mut plans, &mut pending);
    for step in 0..r.max_tokens {
        let row = oracle_penalised(&logits[..n], &r.prompt, &out, &r.penalties);
        let drawn = ornith_runtime::sampling::sample(&row, &r.params, step).unwrap();
        out.push(pending.pop_front().unwrap_or(drawn));
        fire(&out, &mut plans, &mut pending);
        logits = b.logits_to_host(&m.decode_step(&b, &mut st, *out.last().unwrap()).unwrap()).unwrap();
    }
    out
}

/// `reqs` run at once on one engine (a slot each); every request's tokens.
fn run_together(reqs: &[GenRequest]) -> HashMap<u64, Vec<u32>> {
    let mut e = engine(reqs.len(), reqs.len() * CTX / KV_BLOCK, 2048);
    for (i, r) in reqs.iter().enumerate() {
        e.submit(i as u64, r.clone()).unwrap();
    }
    let (toks, errs) = drain(&mut e);
    assert!(errs.is_empty(), "{errs:?}");
    toks
}

fn plain(prompt: Vec<u32>, max_tokens: u64, params: SamplingParams) -> GenRequest {
    GenRequest {
        prompt,
        max_tokens,
        params,
        penalties: Penalties::NONE,
        stop_ids: vec![],
        force: vec![],
        logprobs: None,
        constraint: None,
    }
}

/// Penalties through the engine on the CPU backend: four requests at once (greedy with the
/// model card's presence penalty and a repetition penalty; seeded sampling with frequency and
/// presence; greedy without penalties; greedy with negative ones), each equal to `oracle`'s
/// step-by-step run. The penalties change the greedy output (the last request differs from the
/// same prompt without them).
#[test]
fn penalties_match_a_step_by_step_oracle() {
    let base = plain(prompt(40, 77), 24, SamplingParams::greedy());
    let reqs = [
        GenRequest { penalties: Penalties { presence: 1.5, frequency: 0.0, repetition: 1.3 }, ..base.clone() },
        GenRequest {
            params: sampled(5),
            penalties: Penalties { presence: 0.5, frequency: 0.75, repetition: 1.0 },
            ..base.clone()
        },
        base.clone(),
        // Negative penalties and a repetition penalty below 1 pull the output back to what the
        // prompt and the output hold.
        GenRequest { penalties: Penalties { presence: -2.0, frequency: -2.0, repetition: 0.5 }, ..base.clone() },
    ];
    let toks = run_together(&reqs);
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(toks[&(i as u64)], oracle(r), "request {i} ({:?}) differs from the oracle", r.penalties);
    }
    assert_ne!(toks[&3], toks[&2], "the penalties changed nothing");
}

/// Forced continuations (`GenRequest::force`: forced tool calls, thinking budgets): from the
/// first token; after a two-token trigger taken from the request's own unforced greedy output;
/// a count (a budget) that fires, one whose `unless` the output meets first, and a count whose
/// forced tokens are the trigger of a second plan; a sampled request and one with a penalty too.
/// Each equals `oracle`'s step-by-step run (the draws replaced by the forced tokens at the same
/// steps); all at once with an unforced request.
#[test]
fn forced_tokens_follow_their_trigger_and_the_model_continues_from_them() {
    use ornith_runtime::engine::{Forcing, Trigger};
    let base = plain(prompt(30, 5), 12, SamplingParams::greedy());
    let unforced = oracle(&base);
    let forced = vec![4001, 4002, 4003];
    let at_once = vec![Forcing { when: Trigger::After(vec![]), tokens: forced.clone() }];
    let count =
        |tokens: u64, unless: Vec<u32>| Forcing { when: Trigger::Count { tokens, unless }, tokens: forced.clone() };
    let reqs = [
        GenRequest { force: at_once.clone(), ..base.clone() },
        GenRequest {
            force: vec![Forcing { when: Trigger::After(unforced[1..3].to_vec()), tokens: forced.clone() }],
            ..base.clone()
        },
        GenRequest { params: sampled(9), force: at_once.clone(), ..base.clone() },
        GenRequest { penalties: Penalties { presence: 1.5, ..Penalties::NONE }, force: at_once, ..base.clone() },
        base.clone(),
        GenRequest { force: vec![count(4, vec![4999])], ..base.clone() },
        GenRequest { force: vec![count(4, vec![unforced[2]])], ..base.clone() },
        GenRequest {
            force: vec![count(2, vec![4003]), Forcing { when: Trigger::After(vec![4003]), tokens: vec![4010, 4011] }],
            ..base.clone()
        },
    ];
    let toks = run_together(&reqs);
    assert_eq!(toks[&0][..3], forced[..], "forced from the first token");
    assert_eq!(toks[&1][..3], unforced[..3], "the output up to the trigger is the model's own");
    assert_eq!(toks[&1][3..6], forced[..], "forced right after the trigger");
    assert_eq!(toks[&4], unforced, "an unforced request next to them is unchanged");
    assert_eq!(toks[&5][..7], [&unforced[..4], &forced[..]].concat()[..], "a count fires at its length");
    assert_eq!(toks[&6], unforced, "a count whose `unless` came first never fires");
    assert_eq!(
        toks[&7][..7],
        [&unforced[..2], &forced[..], &[4010, 4011]].concat()[..],
        "a budget's close fires the call"
    );
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(toks[&(i as u64)], oracle(r), "request {i} differs from the oracle");
    }
}

/// A step's prefill budget (`max_batch_tokens`) does not shrink with its decode rows: with one
/// sequence decoding and a budget of two chunks, the next step takes both waiting prompts' whole
/// chunks beside the decode row (the decode rows run as their own group, not in the prefill's
/// MoE segment). Every request still gives the tokens it gives alone.
#[test]
fn decode_rows_leave_the_prefill_budget_whole() {
    let c = PREFILL_CHUNK;
    let reqs = [
        plain(prompt(9, 40), 12, SamplingParams::greedy()),
        plain(prompt(c, 41), 3, SamplingParams::greedy()),
        plain(prompt(c, 42), 3, sampled(7)),
    ];
    let mut e = engine(3, 3 * CTX / KV_BLOCK, 2 * c);
    let mut toks: HashMap<u64, Vec<u32>> = HashMap::new();
    e.submit(0, reqs[0].clone()).unwrap();
    keep_tokens(&mut toks, e.step()); // request 0's prompt: it decodes from now on
    e.submit(1, reqs[1].clone()).unwrap();
    e.submit(2, reqs[2].clone()).unwrap();
    let before = e.stats();
    keep_tokens(&mut toks, e.step());
    let after = e.stats();
    assert_eq!(after.decode_rows - before.decode_rows, 1, "request 0's decode row");
    assert_eq!(after.prefill_rows - before.prefill_rows, 2 * c as u64, "both prompts' chunks in one step");
    let (rest, errs) = drain(&mut e);
    assert!(errs.is_empty(), "{errs:?}");
    for (id, t) in rest {
        toks.entry(id).or_default().extend(t);
    }
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(toks[&(i as u64)], alone(r, 2 * c), "request {i}");
    }
}

/// A step with no decode row takes `idle_batch_tokens` prefill rows (`serve` on CUDA: 8,192 where
/// 2,048 is the budget beside decoding streams), one with a decode row `max_batch_tokens`: a lone
/// two-chunk prompt is prefilled in one step, a second one that arrives while the first decodes
/// one chunk per step. Every request gives the tokens it gives alone in one-chunk steps, and an
/// idle budget below `max_batch_tokens` is refused.
#[test]
fn a_step_with_no_decode_row_takes_the_idle_budget() {
    let c = PREFILL_CHUNK;
    let reqs = [plain(prompt(c + 100, 50), 3, sampled(3)), plain(prompt(c + 50, 51), 3, SamplingParams::greedy())];
    let mut e = engine_idle(2, 2 * CTX / KV_BLOCK, c, 2 * c);
    let mut toks: HashMap<u64, Vec<u32>> = HashMap::new();
    e.submit(0, reqs[0].clone()).unwrap();
    let before = e.stats();
    keep_tokens(&mut toks, e.step());
    let after = e.stats();
    assert_eq!(after.prefill_rows - before.prefill_rows, (c + 100) as u64, "the lone prompt in one step");
    assert_eq!(toks[&0].len(), 1, "request 0 sampled its first token: it decodes from now on");
    e.submit(1, reqs[1].clone()).unwrap();
    for want in [c, 50] {
        let before = e.stats();
        keep_tokens(&mut toks, e.step());
        let after = e.stats();
        assert_eq!(after.decode_rows - before.decode_rows, 1, "request 0's decode row");
        assert_eq!(after.prefill_rows - before.prefill_rows, want as u64, "request 1 beside a decode row");
    }
    let (rest, errs) = drain(&mut e);
    assert!(errs.is_empty(), "{errs:?}");
    for (id, t) in rest {
        toks.entry(id).or_default().extend(t);
    }
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(toks[&(i as u64)], alone(r, c), "request {i}");
    }
    let refused = Engine::new(Box::new(runner(1, CTX / KV_BLOCK)), config(c, c - 1));
    assert!(refused.is_err(), "an idle budget below the step's");
}
