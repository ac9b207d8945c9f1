//! The prefix cache on the CPU backend (the tiny default model in CI): a request served from the
//! cache gives exactly the tokens and logits of a cold run, wherever its prompt leaves the cached
//! one; eviction under a tiny budget never changes an answer; concurrent sequences share blocks;
//! the pools come back whole.

use ornith_runtime::backend_cpu::CpuBackend;
use ornith_runtime::engine::{
    Capacity, Engine, EngineConfig, EventKind, GenRequest, Penalties, SamplingParams, PREFILL_CHUNK,
};
use ornith_runtime::graph::{Backend, Batch, KV_BLOCK};
use ornith_runtime::weights::Checkpoint;
use std::collections::HashMap;

mod common;
use common::ids;

mod compiled {
    ornith_macros::model!();
}

const C: usize = PREFILL_CHUNK;
const CTX: usize = 4 * C;
const SEQ_BLOCKS: usize = CTX / KV_BLOCK;

fn checkpoint() -> Checkpoint {
    Checkpoint::open(std::path::Path::new(compiled::MODEL_DIR), compiled::FINGERPRINT).expect("the tiny checkpoint")
}

fn runner(cap: Capacity) -> compiled::Compiled<CpuBackend> {
    compiled::Compiled::load(CpuBackend::new(), &checkpoint(), &cap).unwrap()
}

fn engine(slots: usize, blocks: usize, snapshots: usize) -> Engine {
    engine_with(Capacity { slots, blocks, snapshots }, C, CTX)
}

/// An engine over `cap` with steps of `max_batch_tokens` rows and requests of up to `max_context`.
fn engine_with(cap: Capacity, max_batch_tokens: usize, max_context: usize) -> Engine {
    let cfg = EngineConfig {
        max_batch_tokens,
        idle_batch_tokens: max_batch_tokens,
        max_context,
        sample_vocab: compiled::DIMS.vocab_size,
    };
    Engine::new(Box::new(runner(cap)), cfg).unwrap()
}

fn join(a: &[u32], b: &[u32]) -> Vec<u32> {
    [a, b].concat()
}

fn request(prompt: Vec<u32>, i: u64) -> GenRequest {
    let params = if i.is_multiple_of(2) {
        SamplingParams::greedy()
    } else {
        SamplingParams { temperature: 1.0, top_k: 20, top_p: 0.95, min_p: 0.0, seed: 100 + i }
    };
    GenRequest {
        prompt,
        max_tokens: 5,
        params,
        penalties: Penalties::NONE,
        stop_ids: Vec::new(),
        force: vec![],
        logprobs: None,
        constraint: None,
    }
}

/// Runs `engine` until idle: tokens and cached prompt tokens by id.
fn drain(e: &mut Engine) -> (HashMap<u64, Vec<u32>>, HashMap<u64, usize>) {
    drain_observing(e, |_| {})
}

/// [`drain`], calling `after_step` with the engine after every step.
fn drain_observing(
    e: &mut Engine,
    mut after_step: impl FnMut(&Engine),
) -> (HashMap<u64, Vec<u32>>, HashMap<u64, usize>) {
    let (mut toks, mut cached) = (HashMap::new(), HashMap::new());
    while e.has_work() {
        for ev in e.step() {
            match ev.kind {
                EventKind::Token(t) => toks.entry(ev.id).or_insert_with(Vec::new).push(t),
                EventKind::Admitted { cached_tokens } => {
                    cached.insert(ev.id, cached_tokens);
                }
                EventKind::Error { message, .. } => panic!("request {}: {message}", ev.id),
                EventKind::Finished(_) | EventKind::Logprobs(_) => {}
            }
        }
        after_step(e);
    }
    (toks, cached)
}

/// The tokens of `req` on an engine without a prefix cache (one chunk per step, a context of
/// up to 8 chunks).
fn cold(req: &GenRequest) -> Vec<u32> {
    let mut e = engine_with(Capacity { slots: 1, blocks: 8 * C / KV_BLOCK, snapshots: 0 }, C, 8 * C);
    e.submit(0, req.clone()).unwrap();
    let (toks, cached) = drain(&mut e);
    assert_eq!(cached[&0], 0);
    toks[&0].clone()
}

/// Logits bit for bit: a prompt resumed from a snapshot (the K/V blocks of the cached chunks
/// shared, the state copied from the snapshot row) equals a cold prefill of the same prompt,
/// and so does the decode step after it.
#[test]
fn logits_resumed_from_a_snapshot_are_bit_identical_to_a_cold_run() {
    let b = CpuBackend::new();
    let r = runner(Capacity { slots: 3, blocks: 3 * SEQ_BLOCKS, snapshots: 1 });
    let (m, mut pools) = (r.model, r.pools);
    let snap_row = 3;
    let table = |s: usize| -> Vec<u32> { (0..SEQ_BLOCKS as u32).map(|j| j + (s * SEQ_BLOCKS) as u32).collect() };
    let run = |pools: &mut compiled::Pools<CpuBackend>, slot: usize, blocks: Vec<u32>, ids: &[u32], pos: usize| {
        let batch = Batch::single(ids, slot, pos, blocks, false);
        b.logits_to_host(&m.forward(&b, pools, &batch, &mut |_, _| {}).unwrap()).unwrap()
    };
    let base = ids(2 * C + 300, 1);
    // The first prompt's two full chunks into slot 0; the state at 2C to the snapshot row.
    for c in 0..2 {
        run(&mut pools, 0, table(0), &base[c * C..(c + 1) * C], c * C);
    }
    pools.copy_slot(&b, 0, snap_row).unwrap();
    // A prompt that shares those two chunks and goes on differently.
    let q = join(&base[..2 * C], &ids(200, 2));
    let cold_prefill: Vec<f32> = {
        pools.clear_slot(&b, 1).unwrap();
        run(&mut pools, 1, table(1), &q[..C], 0);
        run(&mut pools, 1, table(1), &q[C..2 * C], C);
        run(&mut pools, 1, table(1), &q[2 * C..], 2 * C)
    };
    pools.copy_slot(&b, snap_row, 2).unwrap();
    let shared: Vec<u32> = table(0)[..2 * C / KV_BLOCK].iter().chain(&table(2)[2 * C / KV_BLOCK..]).copied().collect();
    let resumed = run(&mut pools, 2, shared.clone(), &q[2 * C..], 2 * C);
    let same = |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(same(&cold_prefill, &resumed), "the resumed prefill's logits differ from the cold run's");
    let d_cold = run(&mut pools, 1, table(1), &[42], q.len());
    let d_resumed = run(&mut pools, 2, shared, &[42], q.len());
    assert!(same(&d_cold, &d_resumed), "the decode step after a resumed prefill differs");
}

/// Prompts that leave the cached one on, before and after a snapshot boundary, and the same
/// prompt again: each resumes at the deepest snapshot it shares (the tokens say where) and gives
/// the cold run's tokens, greedy and seeded.
#[test]
fn a_cached_prefix_gives_the_cold_tokens_wherever_the_prompt_leaves_it() {
    let base = ids(2 * C + 300, 3);
    let other = |i: u64| ids(400, 40 + i);
    let cases: Vec<(&str, Vec<u32>, usize)> = vec![
        ("the same prompt", base.clone(), 2 * C),
        ("leaving it on the boundary 2C", join(&base[..2 * C], &other(1)), 2 * C),
        ("leaving it before the boundary 2C", join(&base[..2 * C - 50], &other(2)), C),
        ("leaving it after the boundary 2C", join(&base[..2 * C + 100], &other(3)), 2 * C),
        ("leaving it inside the first chunk", join(&base[..C - 1], &other(4)), 0),
        ("ending on the boundary 2C", base[..2 * C].to_vec(), C),
    ];
    let mut e = engine(2, 2 * SEQ_BLOCKS, 8);
    e.submit(0, request(base.clone(), 0)).unwrap();
    let (toks, cached) = drain(&mut e);
    assert_eq!((cached[&0], &toks[&0]), (0, &cold(&request(base.clone(), 0))));
    for (i, (what, prompt, want_cached)) in cases.into_iter().enumerate() {
        // Greedy and seeded sampling in turn.
        let id = 1 + i as u64;
        let req = request(prompt, id);
        e.submit(id, req.clone()).unwrap();
        let (toks, cached) = drain(&mut e);
        assert_eq!(cached[&id], want_cached, "{what}: tokens served from the cache");
        assert_eq!(toks[&id], cold(&req), "{what}: tokens differ from a cold run");
    }
    let st = e.stats().cache;
    assert_eq!((st.hits, st.misses, st.cached_tokens), (5, 2, (8 * C) as u64), "{st:?}");
    e.evict_cache();
    assert_eq!(e.pool_usage(), (2, 2, 2 * SEQ_BLOCKS, 2 * SEQ_BLOCKS), "every slot and block came back");
    assert_eq!(e.cache_usage(), (0, 0, 8));
}

/// Two snapshots and the blocks of two sequences: pairs of requests over three families of
/// prefixes (the second of a pair resumes from the first's snapshots) evict each other's
/// snapshots and chunks all the time, and every answer is still the cold one.
#[test]
fn eviction_under_a_tiny_budget_never_changes_an_answer() {
    let roots: Vec<Vec<u32>> = (0..3).map(|f| ids(2 * C + 10, 10 + f)).collect();
    let reqs: Vec<GenRequest> = (0..8u64)
        .map(|i| {
            let root = &roots[(i / 2 % 3) as usize];
            let cut = [2 * C, C + 7, 2 * C + 5][(i % 3) as usize];
            request(join(&root[..cut], &ids(30 + i as usize, 100 + i)), i)
        })
        .collect();
    let mut e = engine(2, 2 * SEQ_BLOCKS, 2);
    let mut got = HashMap::new();
    for pair in reqs.chunks(2).enumerate() {
        for (j, r) in pair.1.iter().enumerate() {
            e.submit((2 * pair.0 + j) as u64, r.clone()).unwrap();
        }
        got.extend(drain(&mut e).0);
    }
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(got[&(i as u64)], cold(r), "request {i} differs from a cold run");
    }
    let st = e.stats().cache;
    assert!(st.hits >= 2 && st.snapshots_evicted >= 2 && st.chunks_evicted >= 2, "the budget was exercised: {st:?}");
    e.evict_cache();
    assert_eq!(e.pool_usage(), (2, 2, 2 * SEQ_BLOCKS, 2 * SEQ_BLOCKS));
}

/// Two requests with the same first two chunks submitted together: the second waits for the
/// first to prefill them, then shares their K/V blocks (the pool holds them once) and resumes
/// from the snapshot; both give their cold tokens.
#[test]
fn concurrent_sequences_with_a_common_prefix_share_its_blocks() {
    let common = ids(2 * C + 10, 20);
    let a = request(join(&common, &ids(50, 21)), 0);
    let b = request(join(&common, &ids(70, 22)), 1);
    let blocks_of = |r: &GenRequest| (r.prompt.len() + r.max_tokens as usize - 1).div_ceil(KV_BLOCK);
    let total = 2 * SEQ_BLOCKS;
    let mut e = engine(2, total, 4);
    e.submit(1, a.clone()).unwrap();
    e.submit(2, b.clone()).unwrap();
    let mut used_together = None;
    let (toks, cached) = drain_observing(&mut e, |e| {
        if e.running() == 2 && used_together.is_none() {
            used_together = Some(total - e.pool_usage().2);
        }
    });
    assert_eq!((cached[&1], cached[&2]), (0, 2 * C), "the second request resumed after the shared chunks");
    assert_eq!(
        used_together,
        Some(blocks_of(&a) + blocks_of(&b) - 2 * C / KV_BLOCK),
        "the shared chunks' blocks are held once"
    );
    assert_eq!((&toks[&1], &toks[&2]), (&cold(&a), &cold(&b)));
    e.evict_cache();
    assert_eq!(e.pool_usage(), (2, 2, total, total));
}

/// Without a prefix cache (`--prefix-cache-bytes 0`) nothing is cached or waited for.
#[test]
fn a_disabled_cache_serves_nothing() {
    let p = ids(2 * C + 10, 30);
    let mut e = engine(2, 2 * SEQ_BLOCKS, 0);
    e.submit(1, request(p.clone(), 0)).unwrap();
    e.submit(2, request(p.clone(), 0)).unwrap();
    let first = e.step();
    assert_eq!(e.running(), 2, "no waiting for a shared prefix when nothing can be cached");
    let admitted: Vec<_> =
        first.iter().filter(|ev| matches!(ev.kind, EventKind::Admitted { cached_tokens: 0 })).collect();
    assert_eq!(admitted.len(), 2);
    let (toks, cached) = drain(&mut e);
    assert!(cached.is_empty(), "admitted in the first step");
    assert_eq!(toks[&1], toks[&2]);
    assert_eq!(e.stats().cache, Default::default());
}

/// Steps of several chunks (`--max-batch-tokens` of four chunks): a long prompt prefills in fewer
/// steps, each ending where the prefix cache may keep a snapshot (here its tail boundaries 5C and
/// 6C), and gives the tokens of one chunk per step; the chunks and snapshots cached are the same,
/// and so is the resume of a prompt that shares 5 of its chunks. Without a cache, nothing stops
/// a step before its budget.
#[test]
fn steps_of_several_chunks_give_the_tokens_and_the_cache_of_one_chunk_per_step() {
    let ctx = 8 * C;
    let make = |max_batch_tokens: usize, snapshots: usize| {
        engine_with(Capacity { slots: 1, blocks: ctx / KV_BLOCK, snapshots }, max_batch_tokens, ctx)
    };
    let p = ids(6 * C + 100, 50);
    let q = join(&p[..5 * C + 10], &ids(60, 51));
    let (cold_p, cold_q) = (cold(&request(p.clone(), 1)), cold(&request(q.clone(), 2)));
    // (max_batch_tokens, snapshots, steps of the first request: prefill steps + 4 decode steps)
    for (mbt, snaps, want_steps) in [(C, 8, 7 + 4), (4 * C, 8, 4 + 4), (4 * C, 0, 2 + 4)] {
        let mut e = make(mbt, snaps);
        e.submit(0, request(p.clone(), 1)).unwrap();
        let (t0, _) = drain(&mut e);
        assert_eq!(e.stats().steps, want_steps, "max_batch_tokens {mbt}, {snaps} snapshots: steps");
        assert_eq!(t0[&0], cold_p, "max_batch_tokens {mbt}: tokens differ from a cold run");
        let usage = e.cache_usage();
        e.submit(1, request(q.clone(), 2)).unwrap();
        let (t1, cached) = drain(&mut e);
        let (want_cached, want_usage) = if snaps > 0 { (5 * C, (6, 2, 8)) } else { (0, (0, 0, 0)) };
        assert_eq!((cached[&1], usage), (want_cached, want_usage), "max_batch_tokens {mbt}: what was cached");
        assert_eq!(t1[&1], cold_q, "max_batch_tokens {mbt}: the resumed tokens differ");
    }
}
