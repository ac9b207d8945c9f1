//! Helpers shared by the GPU test modules (`tests`, `prefill_tests`).
use super::CudaContext;
use cudarc::driver::sys::CUevent_flags;
use rand::SeedableRng;

pub(super) type R = rand::rngs::StdRng;
/// A NaN bf16 pattern: outputs are poisoned with it first, so an element left unwritten fails.
pub(super) const POISON: u16 = 0xffff;

pub(super) fn ctx() -> CudaContext {
    CudaContext::new(0).expect("these tests need a CUDA device")
}

/// The persistent GEMMs (gemm.cu) take every grid-th tile through one pipeline: `run` again with
/// grids of 1 and 5 blocks (each block then runs many tiles, the cursor crossing tile and group
/// boundaries mid-pipeline) must give `got` bit for bit — a tile's sums do not depend on the grid.
pub(super) fn same_bits_with_few_blocks<T: PartialEq>(
    c: &mut CudaContext,
    what: &str,
    got: &[T],
    mut run: impl FnMut(&CudaContext) -> Vec<T>,
) {
    let saved = c.gemm_blocks.clone();
    for n in [1u32, 5] {
        c.gemm_blocks.values_mut().for_each(|b| *b = n);
        let again = run(c);
        c.gemm_blocks.clone_from(&saved);
        assert!(again == got, "{what}: a grid of {n} persistent blocks changed the result");
    }
}

pub(super) fn rng(seed: u64) -> R {
    R::seed_from_u64(seed)
}

/// Times `f` with device events: median of 20 runs after 3 warm-ups, in seconds.
pub(super) fn time_it(c: &CudaContext, f: impl FnMut()) -> f64 {
    timed(c, f, || {})
}

/// Times `f` with device events like [`time_it`], but with L2 cold: before each run a 256 MiB
/// buffer (more than any L2: 50 MB on the H200) is zeroed, evicting the operands, as in decode,
/// where each weight matrix is read once per token between ~5 GB of other reads. Median of 20.
pub(super) fn time_cold(c: &CudaContext, f: impl FnMut()) -> f64 {
    let mut flush = c.alloc::<u8>(256 << 20).unwrap();
    timed(c, f, || c.stream().memset_zeros(&mut flush).unwrap())
}

/// Median event time of 20 runs of `f` after 3 warm-ups, `before` run (untimed) ahead of each.
fn timed(c: &CudaContext, mut f: impl FnMut(), mut before: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let mut v = Vec::new();
    for _ in 0..20 {
        before();
        let a = c.driver().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
        let b = c.driver().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
        a.record(c.stream()).unwrap();
        f();
        b.record(c.stream()).unwrap();
        b.synchronize().unwrap();
        v.push(a.elapsed_ms(&b).unwrap() as f64 / 1e3);
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Positions per K/V block (`ORNITH_KV_BLOCK`).
pub(super) const KVB: usize = ornith_kernels::bindings::ORNITH_KV_BLOCK as usize;

/// A block table of `need` blocks in a cache of `need + 1` blocks, in reverse order and
/// skipping block 0 (`table[i] = need - i`), so that a kernel reading the cache as contiguous
/// rows, or through the identity, reads the wrong rows.
pub(super) fn reversed_table(need: usize) -> Vec<i32> {
    (0..need).map(|i| (need - i) as i32).collect()
}

/// The paged cache `[blocks, KVB, row]` holding the logical rows `[len, row]` (position p at
/// row `table[p / KVB] · KVB + p % KVB`); every other row is `fill` (same length as the cache).
pub(super) fn page(logical: &[u16], row: usize, table: &[i32], fill: &[u16]) -> Vec<u16> {
    let mut out = fill.to_vec();
    for (p, r) in logical.chunks(row).enumerate() {
        let at = (table[p / KVB] as usize * KVB + p % KVB) * row;
        out[at..at + row].copy_from_slice(r);
    }
    out
}

/// The logical rows `[len, row]` of a paged cache (inverse of [`page`]).
pub(super) fn unpage(paged: &[u16], row: usize, table: &[i32], len: usize) -> Vec<u16> {
    (0..len)
        .flat_map(|p| {
            let at = (table[p / KVB] as usize * KVB + p % KVB) * row;
            paged[at..at + row].to_vec()
        })
        .collect()
}

/// `n` random bf16 bit patterns, uniform in (-scale, scale) before rounding.
pub(super) fn bfv(r: &mut R, n: usize, scale: f32) -> Vec<u16> {
    use rand::Rng;
    (0..n).map(|_| half::bf16::from_f32(r.random_range(-1.0f32..1.0) * scale).to_bits()).collect()
}

/// A residual fold (`fold` of the dense decode products and of `moe_combine`: the writer of the
/// next delta adds the old one into the residual first): `launch(delta, residual)` overwrites a
/// pending delta `add` while folding it into a copy of `res`; the residual must then be
/// `res_after` (`rmsnorm_residual`'s) and the new delta `want` (the product without a fold).
pub(super) fn check_fold(
    c: &CudaContext,
    what: &str,
    res: &[u16],
    add: &[u16],
    res_after: &[u16],
    want: &[u16],
    launch: impl FnOnce(super::Ptr, super::Ptr),
) {
    let (fold_res, delta) = (c.upload(res).unwrap(), c.upload(add).unwrap());
    launch(c.addr(&delta), c.addr(&fold_res));
    assert_eq!(
        c.download(&fold_res).unwrap(),
        res_after,
        "{what} fold {}: the residual is not rmsnorm_residual's",
        res.len()
    );
    assert!(c.download(&delta).unwrap() == want, "{what} with a fold changed its output");
}

/// The per-slot down products' combine epilogue (`moe_gemv_fp8_swiglu`, `moe_gemv_nvfp4_swiglu`
/// with `combine` set) against `moe_combine` after the product: `want_y` is the product's output
/// without the epilogue, `got_y` the buffer `launch` has the product write (the epilogue's `ys`).
/// Random routing weights (bf16 values, as the router writes them), gate logits at stride 3, a
/// pending delta and a residual fold; the combined rows and the folded residual must be the
/// same bits, on two launches in a row (the counters are zero again after each).
pub(super) fn check_combine_epilogue(
    c: &CudaContext,
    r: &mut R,
    want_y: &cudarc::driver::CudaSlice<u16>,
    got_y: &cudarc::driver::CudaSlice<u16>,
    (tokens, top_k, hidden): (usize, usize, usize),
    name: &str,
    launch: impl Fn(ornith_kernels::bindings::OrnithMoeCombineParams),
) {
    use rand::Rng;
    let wt: Vec<f32> = (0..tokens * top_k).map(|_| half::bf16::from_f32(r.random_range(0.0..0.5)).to_f32()).collect();
    let (gl, delta, fold) = (bfv(r, tokens * 3, 4.0), bfv(r, tokens * hidden, 1.0), bfv(r, tokens * hidden, 8.0));
    let (dwt, dgl) = (c.upload(&wt).unwrap(), c.upload(&gl).unwrap());
    let (want_out, want_fold) = (c.upload(&delta).unwrap(), c.upload(&fold).unwrap());
    let params = |ys: super::Ptr, out: super::Ptr, fold: super::Ptr| {
        super::moe::combine_params(ys, c.addr(&dwt), c.addr(&dgl), out, tokens, top_k, hidden, 3, Some(fold)).unwrap()
    };
    c.k_combine_with(params(c.addr(want_y), c.addr(&want_out), c.addr(&want_fold))).unwrap();
    let (wo, wf) = (c.download(&want_out).unwrap(), c.download(&want_fold).unwrap());
    assert!(wo != delta && wf != fold, "{name}: moe_combine left its outputs as they were");
    for rep in 0..2 {
        let (got_out, got_fold) = (c.upload(&delta).unwrap(), c.upload(&fold).unwrap());
        launch(params(c.addr(got_y), c.addr(&got_out), c.addr(&got_fold)));
        assert!(
            c.download(got_y).unwrap() == c.download(want_y).unwrap(),
            "{name}: the product's outputs changed (launch {rep})"
        );
        assert!(
            c.download(&got_out).unwrap() == wo,
            "{name}: the combined rows differ from moe_combine's (launch {rep})"
        );
        assert!(
            c.download(&got_fold).unwrap() == wf,
            "{name}: the folded residual differs from moe_combine's (launch {rep})"
        );
    }
}

/// FNV-1a of a result's bits, printed beside the error figures so that two builds' outputs can be
/// compared bit for bit from their logs (a kernel change meant to keep every bit).
pub(super) fn digest(v: &[u16]) -> u64 {
    v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        let h = (h ^ u64::from(x & 0xff)).wrapping_mul(0x0100_0000_01b3);
        (h ^ u64::from(x >> 8)).wrapping_mul(0x0100_0000_01b3)
    })
}
