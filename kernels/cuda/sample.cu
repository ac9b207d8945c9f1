// Sampling on the device: greedy (argmax_bf16) and temperature / min-p / top-k / top-p
// (sample_prep, sample_hist, sample_select, sample_draw; with min-p off and a top-k of at most
// ORNITH_SAMPLE_TOPK_MAX, sample_topk_block and sample_select_topk in place of the first three),
// bit-identical to ornith-runtime's `sampling::sample`.
#include "common.cuh"

// One block of 1024 threads per row: argmax, first index among equal maxima, NaN and +-inf skipped.
extern "C" __global__ void __launch_bounds__(1024) argmax_bf16(const OrnithArgmaxParams p) {
    pdl_entry();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int t = blockIdx.x, lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const uint16_t *row = p.logits + (size_t)(p.logit_row ? p.logit_row[t] : t) * p.stride;
    float bv = -INFINITY;
    int bi = -1;
    // Each thread scans its indices in increasing order (so it keeps the first of equal maxima);
    // 16-byte loads of 8 logits when the row is aligned (the 248K-entry lm_head row: 30 loads
    // per thread instead of 243 dependent 2-byte ones), the remainder one by one.
    int head = 0;
    if ((reinterpret_cast<uintptr_t>(row) & 15) == 0) {
        head = p.n & ~7;
        for (int i8 = threadIdx.x * 8; i8 < head; i8 += blockDim.x * 8) {
            const uint4 u = *reinterpret_cast<const uint4 *>(row + i8);
            const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const float v = __uint_as_float(e & 1 ? (w[e >> 1] & 0xffff0000u) : (w[e >> 1] << 16));
                if (isfinite(v) && (v > bv || (bi < 0 && v == bv))) { bv = v; bi = i8 + e; }
            }
        }
    }
    for (int i = head + threadIdx.x; i < p.n; i += blockDim.x) {
        float v = bf2f(row[i]);
        if (isfinite(v) && (v > bv || (bi < 0 && v == bv))) { bv = v; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
    }
    if (lane == 0) { sv[wid] = bv; si[wid] = bi; }
    __syncthreads();
    if (wid == 0) {
        const int nw = blockDim.x >> 5;
        bv = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : -1;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
        }
        if (lane == 0) p.idx[t] = bi;
    }
}

// ---- Penalties -------------------------------------------------------------------------------
// One thread per (id, tag) entry of the row's seen tokens (OrnithPenaltyParams): the logit edited
// in place with sampling.rs `penalize`'s single IEEE operations (__fmul_rn / __fsub_rn: never
// contracted into an FMA), rounded to bf16 like the CPU's half::bf16::from_f32.
extern "C" __global__ void __launch_bounds__(256) apply_penalties(const OrnithPenaltyParams p) {
    pdl_entry();
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= p.count) return;
    const uint32_t id = p.tokens[2 * i], tag = p.tokens[2 * i + 1];
    if (id >= (uint32_t)p.n) return;
    const uint16_t bits = p.logits[id];
    if ((bits & 0x7f80) == 0x7f80) return; // NaN and +-inf stay as they are
    const uint32_t count = tag & 0x7fffffffu;
    float v = bf2f(bits);
    if (p.repetition != 1.0f && (count > 0 || (tag >> 31) != 0))
        v = v > 0.0f ? __fmul_rn(v, p.inv_repetition) : __fmul_rn(v, p.repetition);
    v = __fsub_rn(v, __fmul_rn(p.frequency, __uint2float_rn(count)));
    if (count > 0) v = __fsub_rn(v, p.presence);
    p.logits[id] = f2bf(v);
}

// ---- Sampling with temperature, min-p, top-k, top-p ------------------------------------------
// Every value that decides the result is an integer sum or comes from single IEEE operations
// written with __fmul_rn / __fadd_rn (which nvcc never contracts into an FMA), mirroring
// `sampling.rs` line for line: the same row, params and bits give the same id as the CPU.

#define SAMPLE_THREADS 256
#define SAMPLE_PER_THREAD (ORNITH_SAMPLE_SLICE / SAMPLE_THREADS)
#define SELECT_THREADS 1024
#define SELECT_KEYS (ORNITH_SAMPLE_BINS / SELECT_THREADS)

// Order key of bf16 bits (integer order = float order, -0 folded into +0), or -1 for NaN / inf.
__device__ __forceinline__ int key_of(uint32_t b) {
    if ((b & 0x7f80u) == 0x7f80u) return -1;
    if (b == 0x8000u) b = 0;
    return (int)((b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u));
}
__device__ __forceinline__ float value_of_key(uint32_t key) {
    const uint32_t bits = (key & 0x8000u) ? (key & 0x7fffu) : (~key & 0xffffu);
    return __uint_as_float(bits << 16);
}
// exp(x) for x <= 0 (sampling::exp_det): Cody-Waite reduction, degree-6 Taylor, times 2^n.
__device__ __forceinline__ float exp_det(float x) {
    if (!(x >= -28.f)) return 0.f;
    const float LOG2E = __uint_as_float(0x3fb8aa3bu), LN2_HI = __uint_as_float(0x3f318000u);
    const float LN2_LO = __uint_as_float(0xb95e8083u), MAGIC = 12582912.f;
    const float n = __fsub_rn(__fadd_rn(__fmul_rn(x, LOG2E), MAGIC), MAGIC);
    const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, LN2_HI)), __fmul_rn(n, LN2_LO));
    float p = __uint_as_float(0x3ab60b61u);                  // 1/720
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3c088889u));  // 1/120
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3d2aaaabu));  // 1/24
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3e2aaaabu));  // 1/6
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.f);
    p = __fadd_rn(__fmul_rn(p, r), 1.f);
    const float scale = __uint_as_float((uint32_t)((int)n + 127) << 23);
    return __fmul_rn(p, scale);
}
// Integer weight of a key (0: dropped by the cutoff or min-p).
__device__ __forceinline__ uint64_t weight_of(uint32_t key, float vmax, const OrnithSampleRow &rp) {
    const float x = __fmul_rn(__fsub_rn(value_of_key(key), vmax), rp.inv_t);
    const float w = exp_det(x);
    if (w < rp.min_p) return 0;
    return (uint64_t)__fmul_rn(w, 1099511627776.f);  // trunc(w * 2^40)
}
// The row's largest key from the per-block maxima (-1: no finite logit).
__device__ __forceinline__ int row_max_key(const OrnithSampleParams &p, int r) {
    uint32_t m = 0;
    for (int b = 0; b < p.blocks; b++) m = max(m, p.part_max[(size_t)r * p.blocks + b]);
    return (int)m - 1;
}

// Exclusive prefix sum over the block (in thread order) of a u64; *total gets the block's sum.
template <int NT>
__device__ __forceinline__ uint64_t block_exclusive_u64(uint64_t v, uint64_t *sh, uint64_t *total) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    uint64_t inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const uint64_t u = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += u;
    }
    __syncthreads();
    if (lane == 31) sh[wid] = inc;
    __syncthreads();
    if (wid == 0) {
        uint64_t s = lane < NT / 32 ? sh[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const uint64_t u = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += u;
        }
        if (lane < NT / 32) sh[lane] = s;  // inclusive prefix of warp sums
    }
    __syncthreads();
    *total = sh[NT / 32 - 1];
    return (wid > 0 ? sh[wid - 1] : 0) + inc - v;
}

// Grid (blocks, rows): block b zeroes its share of row r's histogram and writes 1 + its largest
// key over columns [b * SLICE, (b + 1) * SLICE).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_prep(const OrnithSampleParams p) {
    pdl_entry();
    __shared__ uint32_t sm[SAMPLE_THREADS / 32];
    const int b = blockIdx.x, r = blockIdx.y;
    uint32_t *h = p.hist + (size_t)r * ORNITH_SAMPLE_BINS;
    for (int i = b * SAMPLE_THREADS + threadIdx.x; i < ORNITH_SAMPLE_BINS; i += p.blocks * SAMPLE_THREADS) h[i] = 0;
    if (b == 0 && threadIdx.x == 0) {
        p.done[r] = 0;
        p.idx[r] = -2;  // overwritten by sample_draw; -2 left over would be an internal error
    }
    const uint16_t *row = p.logits + (size_t)(p.logit_row ? p.logit_row[r] : r) * p.stride;
    const int base = b * ORNITH_SAMPLE_SLICE, end = min(p.n, base + ORNITH_SAMPLE_SLICE);
    uint32_t m = 0;
    for (int i = base + threadIdx.x; i < end; i += SAMPLE_THREADS) m = max(m, (uint32_t)(key_of(row[i]) + 1));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < SAMPLE_THREADS / 32; w++) m = max(m, sm[w]);
        p.part_max[(size_t)r * p.blocks + b] = m;
    }
}

// Grid (blocks, rows): histogram of the keys with a nonzero weight (warp-aggregated atomics).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_hist(const OrnithSampleParams p) {
    pdl_entry();
    const int b = blockIdx.x, r = blockIdx.y, lane = threadIdx.x & 31;
    const int kmax = row_max_key(p, r);
    if (kmax < 0) return;
    const float vmax = value_of_key((uint32_t)kmax);
    const OrnithSampleRow rp = p.row[r];
    const uint16_t *row = p.logits + (size_t)(p.logit_row ? p.logit_row[r] : r) * p.stride;
    uint32_t *h = p.hist + (size_t)r * ORNITH_SAMPLE_BINS;
    const int base = b * ORNITH_SAMPLE_SLICE, end = min(p.n, base + ORNITH_SAMPLE_SLICE);
#pragma unroll 1
    for (int k = 0; k < SAMPLE_PER_THREAD; k++) {  // uniform trip count: every lane reaches the match
        const int i = base + k * SAMPLE_THREADS + threadIdx.x;
        int key = i < end ? key_of(row[i]) : -1;
        if (key >= 0 && weight_of((uint32_t)key, vmax, rp) == 0) key = -1;
        const uint32_t tag = key >= 0 ? (uint32_t)key : 0x10000u + lane;  // unused lanes match only themselves
        const uint32_t same = __match_any_sync(0xffffffffu, tag);
        if (key >= 0 && lane == __ffs(same) - 1) atomicAdd(&h[key], (uint32_t)__popc(same));
    }
}

// Grid (rows), 1024 threads: thread t owns the keys 65535 - 64t down to 65472 - 64t (descending),
// scans counts and masses in that order and finds the top-k and top-p thresholds.
extern "C" __global__ void __launch_bounds__(SELECT_THREADS) sample_select(const OrnithSampleParams p) {
    pdl_entry();
    __shared__ uint64_t sh[SELECT_THREADS / 32];
    __shared__ uint32_t s_thr_k, s_thr;
    __shared__ uint64_t s_total_k, s_kept;
    const int r = blockIdx.x, t = threadIdx.x;
    const int kmax = row_max_key(p, r);
    if (kmax < 0) {
        if (t == 0) {
            p.sel[2 * r] = 0;
            p.sel[2 * r + 1] = 0;
        }
        return;
    }
    const float vmax = value_of_key((uint32_t)kmax);
    const OrnithSampleRow rp = p.row[r];
    const uint32_t *h = p.hist + (size_t)r * ORNITH_SAMPLE_BINS;
    const int hi = ORNITH_SAMPLE_BINS - 1 - t * SELECT_KEYS;  // this thread's keys: hi, hi - 1, ..., hi - 63
    uint64_t c = 0, m = 0;
    for (int j = 0; j < SELECT_KEYS; j++) {
        const uint32_t n = h[hi - j];
        if (n) {
            c += n;
            m += n * weight_of((uint32_t)(hi - j), vmax, rp);
        }
    }
    uint64_t c_all, m_all;
    const uint64_t c_before = block_exclusive_u64<SELECT_THREADS>(c, sh, &c_all);
    const uint64_t m_before = block_exclusive_u64<SELECT_THREADS>(m, sh, &m_all);
    if (t == 0) {
        s_thr_k = 0;
        s_total_k = m_all;
    }
    __syncthreads();
    // top-k: the thread whose keys reach the k-th surviving token.
    const uint64_t k = rp.top_k;
    if (k > 0 && c_before < k && c_before + c >= k) {
        uint64_t seen = c_before, mass = m_before;
        for (int j = 0; j < SELECT_KEYS; j++) {
            const uint32_t n = h[hi - j];
            if (!n) continue;
            seen += n;
            mass += n * weight_of((uint32_t)(hi - j), vmax, rp);
            if (seen >= k) {
                s_thr_k = (uint32_t)(hi - j);
                s_total_k = mass;
                break;
            }
        }
    }
    __syncthreads();
    const uint32_t thr_k = s_thr_k;
    const uint64_t total_k = s_total_k;
    // top-p: the kept keys are a descending prefix (the largest key always qualifies); each
    // thread finds its lowest kept key and the cut is the lowest of those.
    if (t == 0) s_thr = 0xffffffffu;
    __syncthreads();
    if (rp.top_p < 1.f && hi >= (int)thr_k) {
        uint64_t above = m_before;
        int lowest = -1;
        for (int j = 0; j < SELECT_KEYS && hi - j >= (int)thr_k; j++) {
            const uint32_t n = h[hi - j];
            if (!n) continue;
            if (!(__ull2double_rn(above) < __dmul_rn((double)rp.top_p, __ull2double_rn(total_k)))) break;
            lowest = hi - j;
            above += n * weight_of((uint32_t)(hi - j), vmax, rp);
        }
        if (lowest >= 0) atomicMin(&s_thr, (uint32_t)lowest);
    }
    __syncthreads();
    const uint32_t thr = rp.top_p < 1.f ? s_thr : thr_k;
    // Kept mass: the thread holding the threshold key adds its part down to it.
    if (t == 0) s_kept = 0;
    __syncthreads();
    if (hi >= (int)thr && hi - SELECT_KEYS < (int)thr) {
        uint64_t mass = m_before;
        for (int j = 0; hi - j >= (int)thr; j++) {
            const uint32_t n = h[hi - j];
            if (n) mass += n * weight_of((uint32_t)(hi - j), vmax, rp);
        }
        s_kept = mass;
    }
    __syncthreads();
    if (t == 0) {
        p.sel[2 * r] = s_kept;
        p.sel[2 * r + 1] = (uint64_t)thr | ((uint64_t)kmax << 16) | (1ull << 32);
    }
}

// ---- Top-k of at most ORNITH_SAMPLE_TOPK_MAX with min-p off: candidate lists, no histogram ----
// The histogram path above spends its time in sample_hist's atomics (a row's 248K logits land on
// a few thousand bins). When every row has 1 <= top_k <= TOPK_MAX and min_p == 0 (the launcher's
// rule), two kernels replace prep, hist and select:
//   sample_topk_block  block b of row r: T_b = the k-th largest key of its slice (counted with
//                      multiplicity; every key when the slice has fewer than k), and the list of
//                      its distinct keys >= T_b with their counts (at most k entries).
//   sample_select_topk one block per row: T = the k-th largest key of the union of the lists;
//                      the distinct keys >= T with their summed counts (at most k); then the
//                      weights, top-p and the kept mass as sample_select computes them.
// Why the lists suffice: a key K >= T (T the row's true k-th largest) has fewer than k keys above
// it in the row, so fewer than k in any slice, so K >= T_b and every slice lists all of its K;
// the union therefore counts every key >= T exactly, and its k-th largest is T. Why min-p off:
// the histogram counts only keys of nonzero weight; with min_p == 0 a key's weight is zero
// exactly when trunc(exp_det(x) * 2^40) == 0, and x = (v - vmax) * inv_t is monotone in the key
// while {x : exp_det(x) >= 2^-40} is an up-set (every f32 in [-28, 0] checked: the cut is
// between -27.725887 and -27.725885; sampling.rs `weight_cut_is_monotone`), so the keys of
// nonzero weight are the largest ones. When at least k keys survive, the survivors' k-th largest
// is T; when fewer do, both paths keep every survivor. (exp_det itself is not monotone to the
// last ulp elsewhere, so a min-p cut could leave a hole: min-p rows take the histogram path.)
// The lists live in the histogram's memory: row r, block b's list is hist[(r * blocks + b) *
// TOPK_MAX ..] as key << 16 | count, its length in part_max[r * blocks + b].

// Counts `bin` (skipped when < 0) into a shared histogram, one atomic per distinct bin of the warp.
__device__ __forceinline__ void count_bin(uint32_t *cnt, int bin, uint32_t n, int lane) {
    const uint32_t tag = bin >= 0 ? (uint32_t)bin : 0x10000u + lane;
    const uint32_t same = __match_any_sync(0xffffffffu, tag);
    if (bin >= 0 && lane == __ffs(same) - 1) atomicAdd(&cnt[bin], n * __popc(same));
}
// Over a 256-bin count histogram ranked from the top bin down: the bin where the running count
// first reaches `need` (thread t looks at bin 255 - t). Writes *s_bin and *s_above (the count in
// the bins above it) when found; leaves them otherwise (fewer than `need` in all). 256 threads.
__device__ __forceinline__ void kth_bin(const uint32_t *cnt, uint32_t need, uint64_t *sh, int *s_bin,
                                        uint32_t *s_above) {
    const uint32_t c = cnt[255 - threadIdx.x];
    uint64_t all;
    const uint64_t before = block_exclusive_u64<SAMPLE_THREADS>(c, sh, &all);
    if (before < need && before + c >= need) {
        *s_bin = 255 - (int)threadIdx.x;
        *s_above = (uint32_t)before;
    }
    __syncthreads();
}

// Grid (blocks, rows), 256 threads: block b's candidate list (above).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_topk_block(const OrnithSampleParams p) {
    pdl_entry();
    static_assert(SAMPLE_THREADS == 256, "one thread per histogram bin");
    __shared__ uint32_t cnt[256];
    __shared__ uint64_t sh[SAMPLE_THREADS / 32];
    __shared__ int s_hb, s_lb, s_keys[ORNITH_SAMPLE_TOPK_MAX];
    __shared__ uint32_t s_above, s_above2, s_n;
    const int b = blockIdx.x, r = blockIdx.y, t = threadIdx.x, lane = t & 31;
    if (b == 0 && t == 0) {
        p.done[r] = 0;
        p.idx[r] = -2;  // overwritten by sample_draw; -2 left over would be an internal error
    }
    const uint32_t k = p.row[r].top_k;  // 1 ..= ORNITH_SAMPLE_TOPK_MAX (the launcher's rule)
    const uint16_t *row = p.logits + (size_t)(p.logit_row ? p.logit_row[r] : r) * p.stride;
    const int base = b * ORNITH_SAMPLE_SLICE, end = min(p.n, base + ORNITH_SAMPLE_SLICE);
    int key[SAMPLE_PER_THREAD];
#pragma unroll
    for (int e = 0; e < SAMPLE_PER_THREAD; e++) {
        const int i = base + e * SAMPLE_THREADS + t;
        key[e] = i < end ? key_of(row[i]) : -1;
    }
    // T_b's high byte, then its low byte among the keys of that high byte.
    cnt[t] = 0;
    if (t == 0) { s_hb = -1; s_lb = -1; s_n = 0; }
    __syncthreads();
#pragma unroll
    for (int e = 0; e < SAMPLE_PER_THREAD; e++) count_bin(cnt, key[e] >= 0 ? key[e] >> 8 : -1, 1, lane);
    __syncthreads();
    kth_bin(cnt, k, sh, &s_hb, &s_above);
    const int hb = s_hb;
    int thr = -1;  // -1: fewer than k keys in the slice, every one listed
    if (hb >= 0) {
        cnt[t] = 0;
        __syncthreads();
#pragma unroll
        for (int e = 0; e < SAMPLE_PER_THREAD; e++) count_bin(cnt, key[e] >> 8 == hb ? key[e] & 255 : -1, 1, lane);
        __syncthreads();
        kth_bin(cnt, k - s_above, sh, &s_lb, &s_above2);
        thr = hb << 8 | s_lb;
    }
    // The keys above T_b: fewer than k of them.
#pragma unroll
    for (int e = 0; e < SAMPLE_PER_THREAD; e++)
        if (key[e] > thr) s_keys[atomicAdd(&s_n, 1u)] = key[e];
    __syncthreads();
    if (t < 32) {
        const int mine = lane < (int)s_n ? s_keys[lane] : -1;
        const uint32_t same = __match_any_sync(0xffffffffu, mine >= 0 ? (uint32_t)mine : 0x10000u + lane);
        const int lead = mine >= 0 && lane == __ffs(same) - 1;
        int rank = 0;  // distinct keys larger than this one
        for (int j = 0; j < 32; j++) {
            const int kj = __shfl_sync(0xffffffffu, mine, j), lj = __shfl_sync(0xffffffffu, lead, j);
            rank += lj && kj > mine;
        }
        const uint32_t distinct = __popc(__ballot_sync(0xffffffffu, lead));
        const size_t at = (size_t)r * p.blocks + b;
        uint32_t *list = p.hist + at * ORNITH_SAMPLE_TOPK_MAX;
        if (lead) list[rank] = (uint32_t)mine << 16 | __popc(same);
        if (lane == 0) {
            uint32_t len = distinct;
            if (thr >= 0) list[len++] = (uint32_t)thr << 16 | (cnt[s_lb] & 0xffffu);  // T_b and its count
            p.part_max[at] = len;
        }
    }
}

// Grid (rows), 256 threads: T from the union of the row's lists, then sample_select's thresholds
// over the (at most k) distinct keys >= T, in a 64-slot table (open addressing).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_select_topk(const OrnithSampleParams p) {
    pdl_entry();
    __shared__ uint32_t cnt[256], tkey[64], tcnt[64], s_key[32], s_cnt[32], u_key[32], u_cnt[32];
    __shared__ uint64_t sh[SAMPLE_THREADS / 32];
    __shared__ int s_hb, s_lb;
    __shared__ uint32_t s_above, s_above2;
    const int r = blockIdx.x, t = threadIdx.x, lane = t & 31;
    const OrnithSampleRow rp = p.row[r];
    const uint32_t *lists = p.hist + (size_t)r * p.blocks * ORNITH_SAMPLE_TOPK_MAX;
    const uint32_t *len = p.part_max + (size_t)r * p.blocks;
    const int entries = p.blocks * ORNITH_SAMPLE_TOPK_MAX;
    constexpr uint32_t EMPTY = 0xffffffffu;
    cnt[t] = 0;
    if (t < 64) { tkey[t] = EMPTY; tcnt[t] = 0; }
    if (t == 0) { s_hb = -1; s_lb = -1; }
    __syncthreads();
    for (int i = t; i < entries; i += SAMPLE_THREADS)
        if ((uint32_t)(i % ORNITH_SAMPLE_TOPK_MAX) < len[i / ORNITH_SAMPLE_TOPK_MAX]) atomicAdd(&cnt[lists[i] >> 24], lists[i] & 0xffffu);
    __syncthreads();
    kth_bin(cnt, rp.top_k, sh, &s_hb, &s_above);
    const int hb = s_hb;
    uint32_t thr_k = 0;  // fewer than k finite logits in the row: every key
    if (hb >= 0) {
        cnt[t] = 0;
        __syncthreads();
        for (int i = t; i < entries; i += SAMPLE_THREADS)
            if ((uint32_t)(i % ORNITH_SAMPLE_TOPK_MAX) < len[i / ORNITH_SAMPLE_TOPK_MAX] && (int)(lists[i] >> 24) == hb)
                atomicAdd(&cnt[(lists[i] >> 16) & 255], lists[i] & 0xffffu);
        __syncthreads();
        kth_bin(cnt, rp.top_k - s_above, sh, &s_lb, &s_above2);
        thr_k = (uint32_t)(hb << 8 | s_lb);
    }
    // The distinct keys >= T (at most k <= 32 of 64 slots) with their counts summed over blocks.
    for (int i = t; i < entries; i += SAMPLE_THREADS) {
        if ((uint32_t)(i % ORNITH_SAMPLE_TOPK_MAX) >= len[i / ORNITH_SAMPLE_TOPK_MAX]) continue;
        const uint32_t e = lists[i], key = e >> 16;
        if (key < thr_k) continue;
        uint32_t s = (key * 0x9e3779b1u) >> 26;
        for (;;) {
            const uint32_t old = atomicCAS(&tkey[s], EMPTY, key);
            if (old == EMPTY || old == key) break;
            s = (s + 1) & 63;
        }
        atomicAdd(&tcnt[s], e & 0xffffu);
    }
    __syncthreads();
    if (t >= 32) return;
    // Compact the table, then rank into descending key order.
    const uint32_t a = tkey[lane], a2 = tkey[lane + 32];
    const uint32_t ma = __ballot_sync(0xffffffffu, a != EMPTY), mb = __ballot_sync(0xffffffffu, a2 != EMPTY);
    const uint32_t below = (1u << lane) - 1;
    const int nd = __popc(ma) + __popc(mb);
    if (a != EMPTY) { u_key[__popc(ma & below)] = a; u_cnt[__popc(ma & below)] = tcnt[lane]; }
    if (a2 != EMPTY) { u_key[__popc(ma) + __popc(mb & below)] = a2; u_cnt[__popc(ma) + __popc(mb & below)] = tcnt[lane + 32]; }
    __syncwarp();
    if (lane < nd) {
        int rank = 0;
        for (int j = 0; j < nd; j++) rank += u_key[j] > u_key[lane];
        s_key[rank] = u_key[lane];
        s_cnt[rank] = u_cnt[lane];
    }
    __syncwarp();
    if (nd == 0) {  // no finite logit
        if (lane == 0) {
            p.sel[2 * r] = 0;
            p.sel[2 * r + 1] = 0;
        }
        return;
    }
    const uint32_t kmax = s_key[0], key = lane < nd ? s_key[lane] : 0;
    const float vmax = value_of_key(kmax);
    const uint64_t w = lane < nd ? weight_of(key, vmax, rp) : 0, m = lane < nd ? (uint64_t)s_cnt[lane] * w : 0;
    uint64_t total = m, above = m;  // warp sum; inclusive prefix in descending key order
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const uint64_t u = __shfl_up_sync(0xffffffffu, above, o);
        if (lane >= o) above += u;
    }
    above -= m;
    uint32_t thr = thr_k;
    if (rp.top_p < 1.f) {
        const bool keep = w != 0 && __ull2double_rn(above) < __dmul_rn((double)rp.top_p, __ull2double_rn(total));
        thr = __reduce_min_sync(0xffffffffu, keep ? key : 0xffffffffu);
    }
    uint64_t kept = lane < nd && key >= thr ? m : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) kept += __shfl_xor_sync(0xffffffffu, kept, o);
    if (lane == 0) {
        p.sel[2 * r] = kept;
        p.sel[2 * r + 1] = (uint64_t)thr | ((uint64_t)kmax << 16) | (1ull << 32);
    }
}

// Grid (blocks, rows): each block's kept mass in its slice; the last block to finish finds the
// block where the running sum passes the target — the first block j whose exclusive prefix sum
// plus its own mass exceeds the target (else the last block), from a block-wide prefix sum over
// the blocks' masses, 256 at a time (one thread walking them read them one dependent L2 round
// trip after another) — and walks that slice in id order.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_draw(const OrnithSampleParams p) {
    pdl_entry();
    __shared__ uint64_t sh[SAMPLE_THREADS / 32];
    __shared__ int s_last, s_block;
    __shared__ uint64_t s_before;
    const int b = blockIdx.x, r = blockIdx.y, t = threadIdx.x;
    if (t == 0) s_block = -1;
    const uint64_t info = p.sel[2 * r + 1];
    if (!(info >> 32)) {  // no finite logit
        if (b == 0 && t == 0) p.idx[r] = -1;
        return;
    }
    const uint32_t thr = (uint32_t)(info & 0xffff), kmax = (uint32_t)((info >> 16) & 0xffff);
    const uint64_t kept = p.sel[2 * r];
    const float vmax = value_of_key(kmax);
    const OrnithSampleRow rp = p.row[r];
    const uint16_t *row = p.logits + (size_t)(p.logit_row ? p.logit_row[r] : r) * p.stride;
    // Thread t's columns: 8 consecutive ones, so that thread order is id order.
    const int lo = b * ORNITH_SAMPLE_SLICE + t * SAMPLE_PER_THREAD;
    uint64_t mine = 0;
#pragma unroll
    for (int e = 0; e < SAMPLE_PER_THREAD; e++) {
        const int i = lo + e;
        const int key = i < p.n ? key_of(row[i]) : -1;
        if (key >= (int)thr) mine += weight_of((uint32_t)key, vmax, rp);
    }
    uint64_t block_total;
    const uint64_t before = block_exclusive_u64<SAMPLE_THREADS>(mine, sh, &block_total);
    if (t == 0) {
        p.part_sum[(size_t)r * p.blocks + b] = block_total;
        __threadfence();
        s_last = atomicAdd(&p.done[r], 1u) == (uint32_t)p.blocks - 1;
    }
    __syncthreads();
    if (!s_last) return;
    // The last block: every block's sum is visible (each fenced before counting itself).
    const uint64_t target = __umul64hi(rp.bits, kept);
    const uint64_t *ps = p.part_sum + (size_t)r * p.blocks;
    uint64_t base = 0;
    for (int j0 = 0; j0 < p.blocks; j0 += SAMPLE_THREADS) {  // uniform: every thread sees s_block
        const int j = j0 + t;
        const uint64_t s = j < p.blocks ? __ldcg(ps + j) : 0;
        uint64_t chunk;
        const uint64_t before = base + block_exclusive_u64<SAMPLE_THREADS>(s, sh, &chunk);
        // Exactly one block qualifies: prefixes only grow, and a block of zero mass never holds it.
        if (j < p.blocks && before <= target && (target < before + s || j == p.blocks - 1)) {
            s_block = j;
            s_before = before;
        }
        base += chunk;
        __syncthreads();
        if (s_block >= 0) break;
    }
    const int lo2 = s_block * ORNITH_SAMPLE_SLICE + t * SAMPLE_PER_THREAD;
    uint64_t w2[SAMPLE_PER_THREAD];
    uint64_t mine2 = 0;
#pragma unroll
    for (int e = 0; e < SAMPLE_PER_THREAD; e++) {
        const int i = lo2 + e;
        const int key = i < p.n ? key_of(row[i]) : -1;
        w2[e] = key >= (int)thr ? weight_of((uint32_t)key, vmax, rp) : 0;
        mine2 += w2[e];
    }
    uint64_t unused;
    uint64_t acc = s_before + block_exclusive_u64<SAMPLE_THREADS>(mine2, sh, &unused);
    if (acc <= target && acc + mine2 > target) {
#pragma unroll
        for (int e = 0; e < SAMPLE_PER_THREAD; e++) {
            acc += w2[e];
            if (w2[e] && acc > target) {
                p.idx[r] = lo2 + e;
                break;
            }
        }
    }
    if (t == 0) p.done[r] = 0;
}
