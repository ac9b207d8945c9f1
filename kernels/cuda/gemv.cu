// Decode products on tensor cores: y = x · Wᵀ for a decode group of any number of tokens, BF16
// weights and FP8 (E4M3) W8A8 weights, and the MoE expert form. One kernel per form serves every
// batch size, so a token's result never depends on what else is in the group (batch invariance
// by construction, below).
//
// The tile. A warp computes 16 weight rows (the mma's M) for the group's tokens in N tiles of 8
// (tokens as N), K in steps of 64 bytes of each row: 2 mma.sync per step and N tile
// (m16n8k16 bf16 or m16n8k32 e4m3, fp32 accumulators). Lane (g = lane / 4, c = lane % 4) loads the
// 16 bytes at byte offset k + 16c of weight rows g and g + 8 and of token (8j + g)'s activations,
// for every N tile j, and feeds them to the mma unchanged: registers x, y of each load form the
// first mma's fragments, z, w the second's. That is a fixed permutation of K applied to both
// operands alike, so each product is the dot product of a row with a token, exactly; the
// weights are read once per step whatever the token count (fragments reused across N tiles).
//
// Summation order. Each output element is the fp32 sum of its row's K in the order the mma steps
// visit it, split into `ks` consecutive slices (one warp each) whose partial sums are added in
// slice order: ((s0 + s1) + s2) + ... `ks` depends only on (bytes per row, out) (gemv_tc_ksplit),
// never on the token count, and mma columns are independent, so a token's result is the same bits
// in a group of 1 or of 64. Tokens past the group reuse the last token's activations (their
// columns are computed and dropped); K past the row (a row of bytes % 64 != 0) reads as zeros.
// Cast points as the CPU reference: fp32 sum, then y = bf16(sum) (BF16) or
// bf16(sum · xs[t] · ws[row]) (FP8); E4M3 × E4M3 and bf16 × bf16 products are exact in fp32.
//
// Block = 8 warps = (8 / ks) row groups of 16 × ks slices; grid.x = ceil(ceil(out / 16) / (8 / ks)).
// The Rust launchers size grids with the same rule (cuda::gemv_tc_blocks, cuda::moe_tc_blocks).
//
// Weights first. A warp issues its first round of weight loads (2 * U 16-byte loads per lane into
// registers) and only then executes pdl_wait: launched with programmatic dependent launch after a
// small kernel (cuda::Pdl::Weights), the product's blocks are resident while that kernel runs and
// their first weights are on the way when it completes. The weights are written once at load and
// never by a kernel of a step, so reading them before the wait cannot see a stale value; nothing
// else (activations, expert indices, outputs) is touched before it. A routed expert's index comes
// from the router, so routed MoE blocks wait first; the shared expert's blocks load first.
// No L2 prefetch of the whole tile: a warp's tile is up to 16 rows x its whole slice (64 KB for the
// lm_head), and the resident warps' prefetches together overflow L2, so lines were evicted before
// use and read twice (H200, lm_head 2048 -> 248,320: 399 us with the prefetch, 302 us without;
// docs/PERF-2026-11.md, fifth session).
#include "common.cuh"
#include "fp4.cuh"
#include "mma.cuh"

#define TC_WARPS 8
// Blocks per SM: the narrow build 4 (32 warps, <= 64 registers), the wide one 2 (<= 128).
#define TC_NARROW_BLOCKS 4
#define TC_WIDE_BLOCKS 2
// The K split aims at this many warps in the grid (cuda::gemv_tc_ksplit mirrors the rule): the
// dense Linears at 2048; the MoE expert products at MOE_TARGET_WARPS per expert (or slot), since
// their grids hold many experts and a block of one 256-byte round per warp spends more on its
// set-up (the expert's index, its assignments) than on its loads. Measured on the H200 (expert
// gate|up and down, 1 / 8 / 64 tokens, docs/PERF-2026-11.md, fifth session): target 256 with MOE_U = 2
// takes a layer's expert products from 21.4 to 16.9 us at 1 token and from 359 to 280 us at 64.
#define TC_TARGET_WARPS 2048
#define MOE_TARGET_WARPS 256
// 64-byte K steps per pass of the MoE kernels (2 * MOE_U weight loads in flight per lane).
#define MOE_U 2
// 64-byte K steps per round of the dense kernels (2 * U weight loads per lane): one-tile passes
// (the narrow build) 2, streamed with the next round in flight (tc_stream); wide passes 4 for up
// to 16 tokens, 2 beyond (each load feeds 2 * NT mma, and the accumulators need the registers),
// each round loaded after the previous one's mma. Streaming the wide passes too was slower on the
// H200 (2048 -> 12,352 BF16 at 64 tokens: 54 -> 123 us; its extra registers spill), streaming the
// narrow one faster (the lm_head at 1 / 8 tokens: 300 -> 268 / 365 -> 302 us).
__host__ __device__ constexpr int tc_u(int nt) { return nt == 1 ? 2 : nt <= 2 ? 4 : 2; }
// N tiles per pass over the weights. Two builds of each dense kernel: the narrow one (1 tile =
// 8 tokens per pass, <= 64 registers, TC_NARROW_BLOCKS per SM: the memory-bound batch-1 and MoE shapes
// need the loads in flight) and the wide one (up to 8 tiles = 64 tokens per pass, <= 128
// registers, TC_WIDE_BLOCKS per SM: each weight load feeds up to 16 mma). They differ only in how many
// columns share a pass, never in a column's arithmetic, so they give the same bits; the launchers
// take the narrow build for groups of up to 8 tokens (cuda::gemv_tc_kernel). A group larger than a
// pass takes more passes (the weight tile again, from L2). The MoE kernels are narrow.
#define TC_NARROW 1
#define TC_WIDE 8

// K slices per row group: the most (<= TC_WARPS) that keep TC_TARGET_WARPS warps in the grid short
// of, each slice >= 256 bytes and a whole number of 64-byte steps.
__host__ __device__ constexpr int gemv_tc_ksplit(int row_bytes, int out, int target = TC_TARGET_WARPS) {
    int groups = (out + 15) / 16, ks = 1;
    while (ks < TC_WARPS && groups * ks < target && row_bytes % (ks * 2 * 64) == 0 && row_bytes / (ks * 2) >= 256)
        ks *= 2;
    return ks;
}

// The two mma of a 64-byte step for N tiles j < NT: the weights (wa, wb: rows g and g + 8) against
// token tile j's activations xv(j), in tile order. FP8 goes through mma_e4m3_split in every decode
// product (narrow, wide, staged and MoE alike: the same instructions, so the same bits), the
// weights' unpack (E4m3A) once for all tiles.
template <bool FP8, int NT, class Xv>
__device__ __forceinline__ void mma_step_tiles(float (&acc)[NT][4], const uint4 &wa, const uint4 &wb, Xv xv) {
    if constexpr (FP8) {
        const E4m3A a0 = e4m3_a(wa.x, wb.x, wa.y, wb.y), a1 = e4m3_a(wa.z, wb.z, wa.w, wb.w);
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const uint4 x = xv(j);
            mma_e4m3_split(acc[j], a0, x.x, x.y);
            mma_e4m3_split(acc[j], a1, x.z, x.w);
        }
    } else {
        const uint32_t a0[4] = {wa.x, wb.x, wa.y, wb.y}, a1[4] = {wa.z, wb.z, wa.w, wb.w};
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const uint4 x = xv(j);
            const uint32_t b0[2] = {x.x, x.y}, b1[2] = {x.z, x.w};
            mma_bf16(acc[j], a0, b0);
            mma_bf16(acc[j], a1, b1);
        }
    }
}

// One round of a lane's weight loads: the 16 bytes at kb + 64u + 16c (u < TC_U) of its two rows
// (byte offsets og, og8 of the tile, 16c included); past k1 zeros.
template <int TC_U>
__device__ __forceinline__ void tc_load(const uint8_t *w, uint32_t og, uint32_t og8, int kb, int k1, uint4 (&wa)[TC_U],
                                        uint4 (&wb)[TC_U]) {
    const int c = threadIdx.x & 3;
    const uint4 z = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < TC_U; u++) {
        const int off = kb + u * 64;
        const bool ok = off + 16 * c < k1;
        wa[u] = ok ? __ldg(reinterpret_cast<const uint4 *>(w + og + off)) : z;
        wb[u] = ok ? __ldg(reinterpret_cast<const uint4 *>(w + og8 + off)) : z;
    }
}

// The mma of one round: acc[j] += the round's weights · token (8j + g)'s activations at the same
// bytes (x + xoff[j], 16c included; XSH: x in shared memory, else global memory, read with
// coherent loads — never __ldg: see common.cuh on PDL).
template <bool FP8, int NT, int TC_U, bool XSH>
__device__ __forceinline__ void tc_mma(const uint8_t *x, const uint32_t (&xoff)[NT], int kb, int k1, const uint4 (&wa)[TC_U],
                                       const uint4 (&wb)[TC_U], float (&acc)[NT][4]) {
    const int c = threadIdx.x & 3;
    const uint4 z = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < TC_U; u++) {
        if (kb + u * 64 >= k1) break;  // warp-uniform
        const int off = kb + u * 64;
        const bool ok = off + 16 * c < k1;
        // activations: coherent loads (common.cuh, PDL)
        mma_step_tiles<FP8, NT>(acc, wa[u], wb[u], [&](int j) { return ok ? *reinterpret_cast<const uint4 *>(x + xoff[j] + off) : z; });
    }
}

// Byte offsets (within the 16-row tile, < 2^31) of this lane's two rows at its first chunk.
__device__ __forceinline__ void tc_rows(size_t row_bytes, int nrows, uint32_t &og, uint32_t &og8) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    og = (uint32_t)(min(g, nrows - 1) * row_bytes) + 16 * c;
    og8 = (uint32_t)(min(g + 8, nrows - 1) * row_bytes) + 16 * c;
}

// The rounds of a tile over [k0, k1), two rounds of weights in flight: round r's successor's
// successor is loaded as soon as round r's registers are free, so while a round waits on its
// activation loads and mma the next one is on the way (two sets of weight registers, used
// alternately: no copies). The caller loads the first two rounds (tc_first2) — before its
// pdl_wait, so that both are in flight when the kernel before it completes. Loading a round only
// after the previous one's mma left too few bytes in flight (H200: gemv_bf16_wide at 32 tokens
// 1.2 TB/s; a one-row product's 4 rounds per warp were 4 exposed memory latencies).
template <int TC_U>
__device__ __forceinline__ void tc_first2(const uint8_t *w, uint32_t og, uint32_t og8, int k0, int k1, uint4 (&wa)[TC_U],
                                          uint4 (&wb)[TC_U], uint4 (&na)[TC_U], uint4 (&nb)[TC_U]) {
    tc_load<TC_U>(w, og, og8, k0, k1, wa, wb);
    if (k0 + 64 * TC_U < k1) tc_load<TC_U>(w, og, og8, k0 + 64 * TC_U, k1, na, nb);
}
template <bool FP8, int NT, int TC_U, bool XSH>
__device__ __forceinline__ void tc_stream(const uint8_t *w, uint32_t og, uint32_t og8, const uint8_t *x, const uint32_t (&xoff)[NT],
                                          int k0, int k1, uint4 (&wa)[TC_U], uint4 (&wb)[TC_U], uint4 (&na)[TC_U], uint4 (&nb)[TC_U],
                                          float (&acc)[NT][4]) {
    constexpr int R = 64 * TC_U;  // bytes of a row per round
    for (int kb = k0; kb < k1; kb += 2 * R) {
        tc_mma<FP8, NT, TC_U, XSH>(x, xoff, kb, k1, wa, wb, acc);
        if (kb + 2 * R < k1) tc_load<TC_U>(w, og, og8, kb + 2 * R, k1, wa, wb);
        if (kb + R >= k1) break;
        tc_mma<FP8, NT, TC_U, XSH>(x, xoff, kb + R, k1, na, nb, acc);
        if (kb + 3 * R < k1) tc_load<TC_U>(w, og, og8, kb + 3 * R, k1, na, nb);
    }
}

// acc[j] += rows (w, 16 rows of row_bytes, the first nrows real) · tokens of N tile j over the
// bytes [k0, k1) of each row; xoff[j] = byte offset of this lane's token (8j + g) in x. PIPE: the
// rounds as tc_stream (the dense one-tile passes); else each round loaded after the previous
// one's mma (the wide passes, tc_u; the MoE products: 4 blocks per SM within 64 registers). The
// same rounds and mma order either way, so the same sums.
template <bool FP8, int NT, int TC_U, bool PIPE>
__device__ __forceinline__ void tc_tile(const uint8_t *w, size_t row_bytes, int nrows, const uint8_t *x,
                                        const uint32_t (&xoff)[NT], int k0, int k1, float (&acc)[NT][4]) {
    uint32_t og, og8;
    tc_rows(row_bytes, nrows, og, og8);
    x += 16 * (threadIdx.x & 3);
    if constexpr (PIPE) {
        if (k0 >= k1) return;
        uint4 wa[TC_U], wb[TC_U], na[TC_U], nb[TC_U];
        tc_first2<TC_U>(w, og, og8, k0, k1, wa, wb, na, nb);
        pdl_wait();  // weights first: the first two rounds are in flight before the wait
        tc_stream<FP8, NT, TC_U, false>(w, og, og8, x, xoff, k0, k1, wa, wb, na, nb, acc);
    } else {
        for (int kb = k0; kb < k1; kb += 64 * TC_U) {
            uint4 wa[TC_U], wb[TC_U];
            tc_load<TC_U>(w, og, og8, kb, k1, wa, wb);
            if (kb == k0) pdl_wait();  // weights first, as above
            tc_mma<FP8, NT, TC_U, false>(x, xoff, kb, k1, wa, wb, acc);
        }
    }
}

// tc_tile for one token whose input row the block computes itself (the norm prologue): the warp
// issues its first two rounds of weight loads (has: the warp has rows), every thread of the
// block waits and runs `prologue` (block-wide: it synchronises the block and leaves the row in
// shared memory at x), then the tile streams on from the loaded rounds. The same rounds and mma
// order as tc_tile, so the same sums.
template <bool FP8, int TC_U, class Prologue>
__device__ __forceinline__ void tc_tile_prologue(const uint8_t *w, size_t row_bytes, int nrows, bool has, const uint8_t *x,
                                                 int k0, int k1, float (&acc)[1][4], Prologue prologue) {
    uint32_t og, og8;
    tc_rows(row_bytes, nrows, og, og8);
    uint4 wa[TC_U], wb[TC_U], na[TC_U], nb[TC_U];
    if (has) tc_first2<TC_U>(w, og, og8, k0, k1, wa, wb, na, nb);
    pdl_wait();
    prologue();
    if (!has) return;
    const uint32_t xoff[1] = {0};
    tc_stream<FP8, 1, TC_U, true>(w, og, og8, x + 16 * (threadIdx.x & 3), xoff, k0, k1, wa, wb, na, nb, acc);
}

// The norm prologue (OrnithNormIn): one residual row of `hidden` (<= ORNITH_NORM_MAX_HIDDEN)
// normalised as rmsnorm_residual does it (common.cuh's rms_* steps, element i = thread + 256 j,
// the same block_sum and block_max over the block's 256 threads: the same bits), into shared
// memory: bf16 values at xb (BF16), or e4m3 codes at xq and the row's scale at *xsc (FP8). All
// inputs are loaded before the first store (rmsnorm_residual's rule).
#define NORM_PER_THREAD (ORNITH_NORM_MAX_HIDDEN / 256)
template <bool FP8>
__device__ __forceinline__ void norm_prologue(const OrnithNormIn &n, int hidden, uint8_t *xs_out, float *xsc, float *sh) {
    uint16_t rv[NORM_PER_THREAD], av[NORM_PER_THREAD], wv[NORM_PER_THREAD];
#pragma unroll
    for (int j = 0; j < NORM_PER_THREAD; j++) {
        const int i = threadIdx.x + j * 256;
        const bool in = i < hidden;
        rv[j] = in ? n.res[i] : (uint16_t)0;
        av[j] = in && n.add ? n.add[i] : (uint16_t)0;
        wv[j] = in ? n.weight[i] : (uint16_t)0;
    }
    float r[NORM_PER_THREAD];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_PER_THREAD; j++) {
        r[j] = 0.f;
        if (threadIdx.x + j * 256 < hidden) {
            float v = bf2f(rv[j]);
            if (n.add) v = rms_add(v, av[j]);
            r[j] = v;
            ss = fmaf(v, v, ss);
        }
    }
    ss = block_sum(ss, sh);
    const float inv = rms_inv(ss, hidden, n.eps);
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_PER_THREAD; j++) {
        const int i = threadIdx.x + j * 256;
        if (i < hidden) {
            const float y = rms_out(r[j], inv, wv[j]);
            r[j] = y;
            amax = amax_add(amax, y);
            if (!FP8) reinterpret_cast<uint16_t *>(xs_out)[i] = f2bf(y);
        }
    }
    if (FP8) {
        amax = block_max_nan(amax, sh);
        const float scale = act_scale(amax);
        if (threadIdx.x == 0) *xsc = scale;
#pragma unroll
        for (int j = 0; j < NORM_PER_THREAD; j++) {
            const int i = threadIdx.x + j * 256;
            if (i < hidden) xs_out[i] = quant_e4m3(r[j], scale);
        }
    }
    __syncthreads();
}

// Adds the ks slices' partial sums of each row group in slice order into the slice-0 warp's acc,
// one N tile at a time (every warp of the block calls it; `red` holds TC_WARPS x 4 x 32 floats).
template <int NT>
__device__ __forceinline__ void tc_reduce(float (&acc)[NT][4], int ks, float *red) {
    if (ks == 1) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, s = warp % ks;
#pragma unroll
    for (int j = 0; j < NT; j++) {
        if (s != 0)
#pragma unroll
            for (int i = 0; i < 4; i++) red[(warp * 4 + i) * 32 + lane] = acc[j][i];
        __syncthreads();
        if (s == 0)
            for (int ss = 1; ss < ks; ss++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[j][i] += red[((warp + ss) * 4 + i) * 32 + lane];
        __syncthreads();
    }
}

// Where a warp works: its 16 rows from row0, its K slice [k0, k1), and whether it holds the sums.
struct TcPlace {
    int row0, k0, k1, ks;
    bool lead;
};
// `row_bytes` is what the split rule sees; a row holds row_bytes >> shift bytes (the NVFP4 forms
// split by weights, 1 byte each as FP8, over rows of half a byte per weight: shift 1).
__device__ __forceinline__ TcPlace tc_place(int row_bytes, int out, int target = TC_TARGET_WARPS, int shift = 0) {
    const int ks = gemv_tc_ksplit(row_bytes, out, target), warp = threadIdx.x >> 5, s = warp % ks;
    const int slice = (ks == 1 ? row_bytes : row_bytes / ks) >> shift;
    TcPlace t;
    t.ks = ks;
    t.row0 = (blockIdx.x * (TC_WARPS / ks) + warp / ks) * 16;
    t.k0 = s * slice;
    t.k1 = t.k0 + slice;
    t.lead = s == 0;
    return t;
}

// One output of a decode product into the pending delta: y[o] = bf16(v); with a fold
// (OrnithGemvBf16Params.fold) the residual at the same place first takes the delta y holds:
// fold[o] = bf16(fold[o] + y_old[o]) (rmsnorm_residual's add). tc_store and gdn_out_proj's.
__device__ __forceinline__ void store_delta(uint16_t *y, uint16_t *fold, size_t o, float v) {
    if (fold) fold[o] = f2bf(rms_add(bf2f(fold[o]), y[o]));
    y[o] = f2bf(v);
}

// The lead warp's stores of a dense pass: y[t * y_stride + row] = bf16(sum) (BF16) or
// bf16(sum · xs[t] · ws[row]) (FP8); with a fold (OrnithGemvBf16Params.fold) the residual at the
// same place first takes the delta y holds: fold = bf16(fold + y_old) (rmsnorm_residual's add).
template <bool FP8, int NT>
__device__ __forceinline__ void tc_store(const float (&acc)[NT][4], int row0, int t0, int tokens, int out, uint16_t *y, int y_stride,
                                         const float *ws, const float *xs, uint16_t *fold) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = row0 + g + (i >> 1) * 8, t = t0 + 8 * j + 2 * c + (i & 1);
            if (row < out && t < tokens)
                store_delta(y, fold, (size_t)t * y_stride + row, FP8 ? acc[j][i] * xs[t] * ws[row] : acc[j][i]);
        }
}

// Dense form: y[t * y_stride + o] for t < tokens, o < out; x rows of x_stride elements.
template <bool FP8, int NT>
__device__ __forceinline__ void gemv_tc_pass(const uint8_t *w, const float *ws, const uint8_t *x, const float *xs, uint16_t *y,
                                             int tokens, int t0, int in, int out, int x_stride, int y_stride, const TcPlace &pl,
                                             float *red, uint16_t *fold) {
    constexpr int ES = FP8 ? 1 : 2;
    const int g = (threadIdx.x & 31) >> 2;
    const size_t row_bytes = (size_t)in * ES;
    uint32_t xoff[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) xoff[j] = (uint32_t)(min(t0 + 8 * j + g, tokens - 1) * x_stride * ES);
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.f;
    const int nrows = max(1, min(16, out - pl.row0));
    if (pl.row0 < out) tc_tile<FP8, NT, tc_u(NT), NT == 1>(w + (size_t)pl.row0 * row_bytes, row_bytes, nrows, x, xoff, pl.k0, pl.k1, acc);
    pdl_wait();  // (done inside the tile; here for a warp without one, before the write)
    tc_reduce<NT>(acc, pl.ks, red);
    if (!pl.lead || pl.row0 >= out) return;
    tc_store<FP8, NT>(acc, pl.row0, t0, tokens, out, y, y_stride, ws, xs, fold);
}

template <int N> struct Nt {
    static constexpr int v = N;
};
// Runs pass(t0, Nt<NT>{}) for each pass of up to 8 * NTMAX tokens over a group of `tokens`, NT the
// pass's N tiles rounded up to a built size (a column's arithmetic does not depend on NT).
template <int NTMAX, class Pass> __device__ __forceinline__ void tc_passes(int tokens, Pass pass) {
    for (int t0 = 0; t0 < tokens; t0 += 8 * NTMAX) {
        const int nt = (min(tokens - t0, 8 * NTMAX) + 7) / 8;
        if (NTMAX == 1) {
            pass(t0, Nt<1>{});
            continue;
        }
        switch (nt) {
            case 1:
            case 2: pass(t0, Nt<2>{}); break;
            case 3: pass(t0, Nt<3>{}); break;
            case 4: pass(t0, Nt<4>{}); break;
            case 5:
            case 6: pass(t0, Nt<6>{}); break;
            default: pass(t0, Nt<NTMAX>{}); break;
        }
    }
}

// The rows a launch's K split is chosen for (OrnithGemv*Params.split_out).
__device__ __forceinline__ int split_rows(int split_out, int out) { return split_out > 0 ? split_out : out; }

// The dense form of one row that the block computes itself: after its first weight loads,
// `prologue(xrow, &xsc, sh)` (block-wide, synchronising the block at its end) leaves the row in
// dynamic shared memory (in * ES bytes: bf16 values, or e4m3 codes with their scale in xsc);
// then the pass of one token as above.
template <bool FP8, class Prologue>
__device__ __forceinline__ void gemv_tc_prologue(const uint8_t *w, const float *ws, uint16_t *y, int in, int out, int y_stride,
                                                 int split_out, uint16_t *fold, Prologue prologue) {
    __shared__ float red[TC_WARPS * 4 * 32];
    extern __shared__ __align__(16) uint8_t xrow[];
    __shared__ float sh[32], xsc;
    constexpr int ES = FP8 ? 1 : 2;
    const TcPlace pl = tc_place(in * ES, split_rows(split_out, out));
    const size_t row_bytes = (size_t)in * ES;
    float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
    const int nrows = max(1, min(16, out - pl.row0));
    tc_tile_prologue<FP8, tc_u(1)>(w + (size_t)pl.row0 * row_bytes, row_bytes, nrows, pl.row0 < out, xrow, pl.k0, pl.k1, acc,
                                   [&] { prologue(xrow, &xsc, sh); });
    tc_reduce<1>(acc, pl.ks, red);
    if (!pl.lead || pl.row0 >= out) return;
    tc_store<FP8, 1>(acc, pl.row0, 0, 1, out, y, y_stride, ws, &xsc, fold);
}
// With the norm prologue (OrnithNormIn).
template <bool FP8>
__device__ __forceinline__ void gemv_tc_norm(const uint8_t *w, const float *ws, uint16_t *y, int in, int out, int y_stride,
                                             int split_out, const OrnithNormIn &norm, uint16_t *fold) {
    gemv_tc_prologue<FP8>(w, ws, y, in, out, y_stride, split_out, fold,
                          [&](uint8_t *xrow, float *xsc, float *sh) { norm_prologue<FP8>(norm, in, xrow, xsc, sh); });
}

// This block row's token group (the rule below, gemv_tc; cuda::token_groups sizes grid.y): returns
// its first token and leaves its count in `tokens`. gemv_tc and gemv_fp4 both split by it.
__device__ __forceinline__ int token_group(int &tokens) {
    const int per = ((tokens + (int)gridDim.y - 1) / (int)gridDim.y + 7) / 8 * 8, tbeg = (int)blockIdx.y * per;
    tokens = min(per, tokens - tbeg);
    return tbeg;
}

// Token groups (grid.y): block row y takes tokens [y * per, min(tokens, (y + 1) * per)), per =
// ceil(tokens / gridDim.y) rounded up to whole N tiles, as a group of its own (its passes, the
// last-token reuse and the stores bounded by the group's end). A column's arithmetic does not
// depend on which tokens share its pass, so the bits are those of one group (cuda::gemv_tc_launch
// splits the wide build's groups when its row tiles alone leave the SMs short of blocks).
template <bool FP8, int NTMAX>
__device__ __forceinline__ void gemv_tc(const uint8_t *w, const float *ws, const uint8_t *x, const float *xs, uint16_t *y,
                                        int tokens, int in, int out, int x_stride, int y_stride, int split_out, uint16_t *fold) {
    __shared__ float red[TC_WARPS * 4 * 32];
    constexpr int ES = FP8 ? 1 : 2;
    const TcPlace pl = tc_place(in * ES, split_rows(split_out, out));
    if (NTMAX > 1 && gridDim.y > 1) {  // the group's rows of x, xs, y and fold (the narrow build has one group)
        const int tbeg = token_group(tokens);
        x += (size_t)tbeg * x_stride * ES;
        if (FP8) xs += tbeg;
        y += (size_t)tbeg * y_stride;
        if (fold) fold += (size_t)tbeg * y_stride;
    }
    // The pass loop of tc_passes, written out: through a lambda nvcc allocates this form's
    // registers differently (gemv_bf16: 20 bytes of spills instead of 4, ptxas sm_90).
    for (int t0 = 0; t0 < tokens; t0 += 8 * NTMAX) {
        const int nt = (min(tokens - t0, 8 * NTMAX) + 7) / 8;
        if (NTMAX == 1) {
            gemv_tc_pass<FP8, 1>(w, ws, x, xs, y, tokens, t0, in, out, x_stride, y_stride, pl, red, fold);
            continue;
        }
        switch (nt) {
            case 1:
            case 2: gemv_tc_pass<FP8, 2>(w, ws, x, xs, y, tokens, t0, in, out, x_stride, y_stride, pl, red, fold); break;
            case 3: gemv_tc_pass<FP8, 3>(w, ws, x, xs, y, tokens, t0, in, out, x_stride, y_stride, pl, red, fold); break;
            case 4: gemv_tc_pass<FP8, 4>(w, ws, x, xs, y, tokens, t0, in, out, x_stride, y_stride, pl, red, fold); break;
            case 5:
            case 6: gemv_tc_pass<FP8, 6>(w, ws, x, xs, y, tokens, t0, in, out, x_stride, y_stride, pl, red, fold); break;
            default: gemv_tc_pass<FP8, NTMAX>(w, ws, x, xs, y, tokens, t0, in, out, x_stride, y_stride, pl, red, fold); break;
        }
    }
}

// y[t, o] = bf16(Σ_i x[t, i] · w[o, i]) for any number of tokens (BF16 weights).
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_NARROW_BLOCKS) gemv_bf16(const OrnithGemvBf16Params p) {
    pdl_launch_dependents();
    gemv_tc<false, TC_NARROW>(reinterpret_cast<const uint8_t *>(p.w), nullptr, reinterpret_cast<const uint8_t *>(p.x), nullptr,
                              p.y, p.tokens, p.in, p.out, p.x_stride, p.y_stride, p.split_out, p.fold);
}
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_WIDE_BLOCKS) gemv_bf16_wide(const OrnithGemvBf16Params p) {
    pdl_launch_dependents();
    gemv_tc<false, TC_WIDE>(reinterpret_cast<const uint8_t *>(p.w), nullptr, reinterpret_cast<const uint8_t *>(p.x), nullptr,
                            p.y, p.tokens, p.in, p.out, p.x_stride, p.y_stride, p.split_out, p.fold);
}

// y[t, o] = bf16((Σ_i e4m3(xq[t, i]) · e4m3(w[o, i])) · xs[t] · ws[o]) for any number of tokens.
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_NARROW_BLOCKS) gemv_fp8(const OrnithGemvFp8Params p) {
    pdl_launch_dependents();
    gemv_tc<true, TC_NARROW>(p.w, p.ws, p.xq, p.xs, p.y, p.tokens, p.in, p.out, p.x_stride, p.y_stride, p.split_out, p.fold);
}
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_WIDE_BLOCKS) gemv_fp8_wide(const OrnithGemvFp8Params p) {
    pdl_launch_dependents();
    gemv_tc<true, TC_WIDE>(p.w, p.ws, p.xq, p.xs, p.y, p.tokens, p.in, p.out, p.x_stride, p.y_stride, p.split_out, p.fold);
}

// =============================================================================================
// The staged build (gemv_*_staged): the same bits as the narrow and wide builds, for the groups
// where the wide build's activation traffic dominates (cuda::gemv_staged: an unsplit row, the
// lm_head's, from 9 tokens; split rows measured slower staged in the decode graph, see below); up
// to ORNITH_WIDE_TOKENS tokens per launch (a larger group takes several). In gemv_tc a warp reads its tokens' activations from global
// memory for every mma step, 4 bytes of activations per weight byte at 64 tokens (16 rows share
// them), so those groups ran at L2's pace (H200, 64 tokens: the lm_head 1.1 TB/s, the attention
// q|k|v 0.3 TB/s; tests/peer/gemv_wide). Here a block's warps all work on the same K slice, so the
// block stages the slice's activations in shared memory once for all its rows:
//   grid (ceil(groups / 8), ks): block x takes row groups 8x .. 8x + 7, one warp each, over
//   all the launch's token tiles; block y is the K slice s of every one of them,
//   [s * slice, (s + 1) * slice) as tc_place (cuda::gemv_wide_grid). Builds with several warps
//   per row group (each a share of the token tiles) were measured too and were no faster where
//   this build runs (the lm_head's 15,520 groups fill the SMs); they tripled the PTX the driver
//   compiles at first start.
// Activations go through shared memory in chunks of WIDE_XC bytes per token (cp.async, double
// buffered; rows at a stride of WIDE_XC + 64 bytes, so the 8 lanes of a 16-byte load phase hit
// distinct banks), weights through registers two rounds ahead (tc_stream's scheme). Each warp's
// sums are its rows' K slice in the narrow kernel's step and mma order (tc_mma, the same K
// permutation), so a slice's partial is the same fp32 value in every build. With ks > 1 the
// slices meet in global memory: every block writes its partials (wide_part[s][t][o]), and the
// last block of a row tile to arrive (wide_ticket, reset by that block) adds them in slice order,
// ((p0 + p1) + p2) + ..., tc_reduce's order: the same bits. Measured against the wide build
// (H200, L2 flushed, tests/peer/gemv_wide run 3): lm_head 894 -> 376 us at 64 tokens, 498 -> 307
// at 32; q|k|v 62.5 -> 38.5 us, o_proj 37.7 -> 25.8, GDN in 61.1 -> 55.9 at 64; at 16-32 tokens the
// split products were as fast or faster in the wide build. In the decode graph (L2 warm, 64
// sequences) the staged split products were slower than the wide ones (the BF16 products 3.83 ->
// 4.50 ms per step, FP8 1.11 -> 1.16), so only the lm_head takes this build; the split path stays
// checked by the kernel tests (cuda::STAGED_ALWAYS).
#define WIDE_XC ORNITH_WIDE_XC
#define WIDE_XSTRIDE (WIDE_XC + 64)

// tc_load for a round wholly inside the row (no bounds checks).
template <int U>
__device__ __forceinline__ void tc_load_full(const uint8_t *w, uint32_t og, uint32_t og8, int kb, uint4 (&wa)[U], uint4 (&wb)[U]) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        wa[u] = __ldg(reinterpret_cast<const uint4 *>(w + og + kb + u * 64));
        wb[u] = __ldg(reinterpret_cast<const uint4 *>(w + og8 + kb + u * 64));
    }
}
// tc_mma for a round wholly inside the chunk, activations from the shared chunk xc at byte
// xoff[j] + kb + 64u (kb with the lane's 16c): the same loads and mma in the same order.
template <bool FP8, int NT, int U>
__device__ __forceinline__ void wide_mma(const uint8_t *xc, const uint32_t (&xoff)[NT], int kb, const uint4 (&wa)[U],
                                         const uint4 (&wb)[U], float (&acc)[NT][4]) {
#pragma unroll
    for (int u = 0; u < U; u++)
        mma_step_tiles<FP8, NT>(acc, wa[u], wb[u], [&](int j) { return *reinterpret_cast<const uint4 *>(xc + xoff[j] + kb + 64 * u); });
}

template <bool FP8, int NT>
__device__ __forceinline__ void gemv_wide_body(const uint8_t *w, const float *ws, const uint8_t *x, const float *xs, uint16_t *y,
                                               int tokens, int in, int out, int x_stride, int y_stride, int split_out,
                                               uint16_t *fold, float *part, uint32_t *ticket) {
    extern __shared__ __align__(16) uint8_t xsm[];
    constexpr int ES = FP8 ? 1 : 2, U = 2, R = 64 * U;
    const int row_bytes = in * ES;
    const int ks = gemv_tc_ksplit(row_bytes, split_rows(split_out, out));
    const int slice = ks == 1 ? row_bytes : row_bytes / ks;
    const int s = blockIdx.y, k0 = s * slice, k1 = k0 + slice;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int row0 = (blockIdx.x * TC_WARPS + warp) * 16;
    const bool has = row0 < out;
    const int nrows = max(1, min(16, out - row0));
    const uint8_t *wt = w + (size_t)(has ? row0 : 0) * row_bytes;
    uint32_t og, og8;
    tc_rows(row_bytes, nrows, og, og8);
    uint4 wa[U], wb[U], na[U], nb[U];
    if (has) tc_first2<U>(wt, og, og8, k0, k1, wa, wb, na, nb);
    pdl_wait();  // weights first: the first two rounds are in flight before the wait
    // Stage chunk ci of the slice's activations (token rows r < 8 NT, past the group the last
    // token's, as the narrow kernel's columns; bytes past k1 zeros) into buffer ci & 1.
    const int rows = 8 * NT, nch = (slice + WIDE_XC - 1) / WIDE_XC;
    auto stage = [&](int ci) {
        const uint32_t buf = smem_u32(xsm) + (ci & 1) * (ORNITH_WIDE_TOKENS * WIDE_XSTRIDE);
        const int kc = k0 + ci * WIDE_XC;
        for (int q = threadIdx.x; q < rows * (WIDE_XC / 16); q += TC_WARPS * 32) {
            const int r = q / (WIDE_XC / 16), ch = q % (WIDE_XC / 16), off = kc + 16 * ch;
            const bool ok = off < k1;
            const uint8_t *src = x + (size_t)min(r, tokens - 1) * x_stride * ES + (ok ? off : 0);
            cp_async16(buf + r * WIDE_XSTRIDE + 16 * ch, src, ok ? 16 : 0);
        }
        cp_commit();
    };
    stage(0);
    uint32_t xoff[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) xoff[j] = (uint32_t)((8 * j + g) * WIDE_XSTRIDE);
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.f;
    for (int ci = 0; ci < nch; ci++) {
        if (ci + 1 < nch) stage(ci + 1);
        else cp_commit();  // an empty group keeps the wait count below
        cp_wait<1>();
        __syncthreads();  // chunk ci is in shared memory for every warp
        const int kc = k0 + ci * WIDE_XC, ke = min(kc + WIDE_XC, k1) - kc;
        const uint8_t *xc = xsm + (ci & 1) * (ORNITH_WIDE_TOKENS * WIDE_XSTRIDE);
        // Rounds in pairs as tc_stream (WIDE_XC is a whole number of pairs, so a pair never
        // straddles two chunks): mma of a round, then the round two ahead into its registers.
        // A round inside the slice takes the unchecked forms (wide_mma, tc_load_full): the checks
        // of tc_mma / tc_load cost more instructions than the mma (H200 profile: 18 per mma).
        auto round = [&](int kb, const uint4(&ra)[U], const uint4(&rb)[U]) {
            if (kb + R <= ke) wide_mma<FP8, NT, U>(xc, xoff, 16 * c + kb, ra, rb, acc);
            else tc_mma<FP8, NT, U, true>(xc + 16 * c, xoff, kb, ke, ra, rb, acc);
        };
        auto load = [&](int kn, uint4(&ra)[U], uint4(&rb)[U]) {
            if (kn + R <= k1) tc_load_full<U>(wt, og, og8, kn, ra, rb);
            else if (kn < k1) tc_load<U>(wt, og, og8, kn, k1, ra, rb);
        };
        if (has)
            for (int kb = 0; kb < ke; kb += 2 * R) {
                round(kb, wa, wb);
                load(kc + kb + 2 * R, wa, wb);
                if (kb + R >= ke) break;
                round(kb + R, na, nb);
                load(kc + kb + 3 * R, na, nb);
            }
        __syncthreads();  // every warp is done with buffer ci & 1 before chunk ci + 2 lands there
    }
    if (ks > 1) {
        float *ps = part + (size_t)s * tokens * out;
        if (has)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int row = row0 + g + (i >> 1) * 8, t = 8 * j + 2 * c + (i & 1);
                    if (row < out && t < tokens) ps[(size_t)t * out + row] = acc[j][i];
                }
        if (!last_to_arrive(ticket + blockIdx.x, (uint32_t)ks)) return;
        if (!has) return;
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = row0 + g + (i >> 1) * 8, t = 8 * j + 2 * c + (i & 1);
                if (row < out && t < tokens) {
                    const float *pp = part + (size_t)t * out + row;
                    float sum = __ldcg(pp);
                    for (int ss = 1; ss < ks; ss++) sum += __ldcg(pp + (size_t)ss * tokens * out);
                    acc[j][i] = sum;
                }
            }
    }
    if (has) tc_store<FP8, NT>(acc, row0, 0, tokens, out, y, y_stride, ws, xs, fold);
}

// The staged products over up to ORNITH_WIDE_TOKENS tokens: NT, the N tiles of the launch's
// tokens, the fewest built that cover them (a column's arithmetic does not depend on NT).
template <bool FP8>
__device__ __forceinline__ void gemv_wide(const uint8_t *w, const float *ws, const uint8_t *x, const float *xs, uint16_t *y,
                                          int tokens, int in, int out, int x_stride, int y_stride, int split_out, uint16_t *fold,
                                          float *part, uint32_t *ticket) {
    const int nt = (tokens + 7) / 8;
#define WIDE_CASE(N) gemv_wide_body<FP8, N>(w, ws, x, xs, y, tokens, in, out, x_stride, y_stride, split_out, fold, part, ticket)
    if (nt <= 1) WIDE_CASE(1);
    else if (nt == 2) WIDE_CASE(2);
    else if (nt == 3) WIDE_CASE(3);
    else if (nt == 4) WIDE_CASE(4);
    else if (nt <= 6) WIDE_CASE(6);
    else WIDE_CASE(8);
#undef WIDE_CASE
}
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_WIDE_BLOCKS) gemv_bf16_staged(const OrnithGemvBf16Params p) {
    pdl_launch_dependents();
    gemv_wide<false>(reinterpret_cast<const uint8_t *>(p.w), nullptr, reinterpret_cast<const uint8_t *>(p.x), nullptr, p.y,
                     p.tokens, p.in, p.out, p.x_stride, p.y_stride, p.split_out, p.fold, p.wide_part, p.wide_ticket);
}
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_WIDE_BLOCKS) gemv_fp8_staged(const OrnithGemvFp8Params p) {
    pdl_launch_dependents();
    gemv_wide<true>(p.w, p.ws, p.xq, p.xs, p.y, p.tokens, p.in, p.out, p.x_stride, p.y_stride, p.split_out, p.fold,
                    p.wide_part, p.wide_ticket);
}

// The same products of one row whose input the block computes first (OrnithNormIn, weight
// required): x (BF16) or xq / xs (FP8) unused. Kernels of their own, so that the prologue's
// registers leave the plain builds' allocation alone; 3 blocks per SM (<= 80 registers: the
// first round of weights stays in registers across the prologue without spills; the GDN input
// projection's 386 blocks still fit one wave of the H200's 132 SMs).
#define TC_NORM_BLOCKS 3
// gemv_fp8_quant holds a row of up to 256 * this many elements in registers (one L2 pass; longer
// rows are read twice, as quantize_fp8_rows reads them: the same bits either way).
#define QUANT_PROLOGUE_REGS 16
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_NORM_BLOCKS) gemv_bf16_norm(const OrnithGemvBf16Params p) {
    pdl_launch_dependents();
    gemv_tc_norm<false>(reinterpret_cast<const uint8_t *>(p.w), nullptr, p.y, p.in, p.out, p.y_stride, p.split_out, p.norm, p.fold);
}
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_NORM_BLOCKS) gemv_fp8_norm(const OrnithGemvFp8Params p) {
    pdl_launch_dependents();
    gemv_tc_norm<true>(p.w, p.ws, p.y, p.in, p.out, p.y_stride, p.split_out, p.norm, p.fold);
}
// gemv_fp8 of one bf16 row (OrnithGemvFp8Params.xb) that every block quantises itself after its
// first weight loads, with quantize_fp8_rows' code (common.cuh's quant_row_256: the same codes
// and scale, so the bits of quantize_fp8_rows then gemv_fp8), without that launch. The decode
// o_proj of one row: the attention combine's last block quantised it there before, a serial tail
// (ticket, the row read back, a block max) that every later kernel waited for.
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_NORM_BLOCKS) gemv_fp8_quant(const OrnithGemvFp8Params p) {
    pdl_launch_dependents();
    gemv_tc_prologue<true>(p.w, p.ws, p.y, p.in, p.out, p.y_stride, p.split_out, p.fold, [&](uint8_t *xrow, float *xsc, float *sh) {
        quant_row_256<QUANT_PROLOGUE_REGS>(p.xb, p.in, xrow, xsc, sh);
        __syncthreads();
    });
}

// =============================================================================================
// The GDN output projection with its gated RMSNorm (decode groups; OrnithGdnOutParams).
// out_proj's input is `heads` heads of 128 values, each normalised on its own, so here the K split
// follows the heads: block (x, h) takes rows 128x .. 128x + 127 (8 warps of 16) over head h's 256
// bytes of each row — two rounds of U = 2, both loaded before pdl_wait and held in registers for
// every token of the launch — and computes head h's gated norm for each token itself (warp w takes
// tokens w, w + 8, ...; common.cuh's gated_norm_warp, the gated_rmsnorm kernel's arithmetic, so
// the same bits) into shared memory. A head's product is the fp32 sum of its 4 K steps in tc_mma's
// order and permutation, written to part[h][t][r]; the heads meet in global memory and are added
// in head order by the last block of the row tile to arrive (ticket) or by gdn_out_reduce (more
// tokens): the same function (gdn_out_sum), so a token's bits do not depend on its group.
// Why: the dense form splits 4096 inputs over at most the 8 warps of a block (gemv_tc_ksplit):
// 128 blocks reading 16 KB per warp in 8 rounds (~1.75 TB/s in the batch-1 graph, H200); here the
// 512 blocks fit one wave (4 per SM) and have the whole matrix in flight from their first
// instruction, and the gated_rmsnorm launch is gone.
#define GO_DIM ORNITH_GDN_OUT_DIM
#define GO_XS (2 * GO_DIM + 64)  // bytes per token row in shared memory (16-byte phases conflict-free)

// Sum of the heads' partials of output (t, r) in head order: ((p0 + p1) + p2) + ... (loads in
// groups of G issued before their adds; the order of the adds does not depend on G, so neither do
// the bits). gdn_out_proj's last block takes G = 32 (the real model's heads in one L2 round trip),
// gdn_out_reduce G = 16 (32 held 101 registers and cut its occupancy: 64 sequences 186 -> 139 us
// per step with 16, H200, docs/PERF-2026-12-early.md twentieth session).
template <int G>
__device__ __forceinline__ float gdn_out_sum(const OrnithGdnOutParams &p, int t, int r) {
    const float *pp = p.part + (size_t)t * p.out + r;
    const size_t hs = (size_t)p.tokens * p.out;
    float sum = 0.f;
    for (int h0 = 0; h0 < p.heads; h0 += G) {
        float v[G];
#pragma unroll
        for (int i = 0; i < G; i++) v[i] = h0 + i < p.heads ? __ldcg(pp + (size_t)(h0 + i) * hs) : 0.f;
#pragma unroll
        for (int i = 0; i < G; i++)
            if (h0 + i < p.heads) sum = h0 + i == 0 ? v[i] : sum + v[i];
    }
    return sum;
}
// y[t, r] = bf16(sum), the residual fold first (store_delta, as tc_store).
__device__ __forceinline__ void gdn_out_store(const OrnithGdnOutParams &p, int t, int r, float sum) {
    store_delta(p.y, p.fold, (size_t)t * p.y_stride + r, sum);
}

extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_NARROW_BLOCKS) gdn_out_proj(const OrnithGdnOutParams p) {
    pdl_launch_dependents();
    __shared__ __align__(16) uint8_t xs[ORNITH_WIDE_TOKENS * GO_XS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int h = blockIdx.y, row_bytes = 2 * GO_DIM * p.heads, k0 = h * 2 * GO_DIM, k1 = k0 + 2 * GO_DIM;
    const int row0 = (blockIdx.x * TC_WARPS + warp) * 16;
    const bool has = row0 < p.out;
    const int nrows = max(1, min(16, p.out - row0));
    const uint8_t *wt = reinterpret_cast<const uint8_t *>(p.w) + (size_t)(has ? row0 : 0) * row_bytes;
    uint32_t og, og8;
    tc_rows(row_bytes, nrows, og, og8);
    uint4 wa[2], wb[2], na[2], nb[2];
    if (has) tc_first2<2>(wt, og, og8, k0, k1, wa, wb, na, nb);
    pdl_wait();  // weights first: the head's whole slice is in flight before the wait
    for (int t = warp; t < p.tokens; t += TC_WARPS) {
        uint16_t *row = reinterpret_cast<uint16_t *>(xs + t * GO_XS);
        gated_norm_warp(p.o + (size_t)t * p.o_stride + h * GO_DIM, p.z + (size_t)t * p.z_stride + h * GO_DIM, p.norm_w, GO_DIM,
                        p.eps, [&](int i, uint16_t v) { row[i] = v; });
    }
    __syncthreads();
    float *part = p.part + (size_t)h * p.tokens * p.out;
    if (has)
        for (int t0 = 0; t0 < p.tokens; t0 += 8) {
            // Tokens past the launch's reuse its last token's row (their columns are dropped).
            const uint32_t xoff[1] = {(uint32_t)(min(t0 + g, p.tokens - 1) * GO_XS)};
            float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
            tc_mma<false, 1, 2, true>(xs + 16 * c, xoff, 0, 2 * GO_DIM, wa, wb, acc);
            tc_mma<false, 1, 2, true>(xs + 16 * c, xoff, 128, 2 * GO_DIM, na, nb, acc);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = row0 + g + (i >> 1) * 8, t = t0 + 2 * c + (i & 1);
                if (row < p.out && t < p.tokens) part[(size_t)t * p.out + row] = acc[0][i];
            }
        }
    if (p.ticket == nullptr) return;  // gdn_out_reduce adds the heads
    if (!last_to_arrive(p.ticket + blockIdx.x, (uint32_t)p.heads)) return;
    for (int q = threadIdx.x; q < p.tokens * 128; q += TC_WARPS * 32) {
        const int t = q >> 7, r = blockIdx.x * 128 + (q & 127);
        if (r < p.out) gdn_out_store(p, t, r, gdn_out_sum<32>(p, t, r));
    }
}
// The heads' sums of a launch of more than ORNITH_GDN_OUT_TICKET_TOKENS tokens, one thread per
// output (t, r) = (q / out, q % out).
extern "C" __global__ void __launch_bounds__(256) gdn_out_reduce(const OrnithGdnOutParams p) {
    pdl_entry();
    const int q = blockIdx.x * 256 + threadIdx.x;
    if (q >= p.tokens * p.out) return;
    gdn_out_store(p, q / p.out, q % p.out, gdn_out_sum<16>(p, q / p.out, q % p.out));
}

// =============================================================================================
// NVFP4A16 decode products (fp4.cuh): the same tile, summation order and K split with the weight
// rows dequantised to bf16 in registers and the bf16 mma. K steps are 64 bytes of codes (128
// weights per row): lane (g, c) loads the 16 code bytes at offset k + 16c of rows g and g + 8
// (weights 32c .. 32c + 31 of the step, two groups of 16) and their two scale bytes; word q of
// those codes (weights 32c + 8q .. + 7) dequantises to 4 bf16x2 registers, the A fragments of 2
// mma.m16n8k16, and the token's 8 activations at the same weights (16 bytes) are their B
// fragments. Again a fixed permutation of K applied to both operands, so each product is the dot
// product of a dequantised row with a token, exactly. The K split is the dense rule applied to
// the weights per row (in, as if a byte each: the slices hold in / 2 / ks code bytes), so a
// token's result is the same bits in a group of 1 or of 64.
// Cast points as the CPU reference (cpu::linear::linear_nvfp4): bf16 weights, fp32 sum, bf16(sum).
// =============================================================================================

// A lane's place in the NVFP4 tile at the round starting at code byte kb of its rows: its 16 code
// bytes of rows g and g + 8 at w + oa + 64u, w + ob + 64u (16c included) and their scale byte
// pairs at ws + (oa + 64u) / 8, ws + (ob + 64u) / 8 (one scale byte per 8 code bytes, rows of
// row_bytes / 8), the activations at x + xk + 256u (+ the token's offset; code byte 16c <->
// weight 32c <-> activation byte 64c), and rem = k1 - kb - 16c, the code bytes of the lane's rows
// left in the slice (step u is in while 64u < rem). 32-bit offsets from the tile's three base
// pointers (a lane keeps 4 registers of place, not 10 of pointers).
struct Fp4Lane {
    uint32_t oa, ob, xk;
    int rem;
};

__device__ __forceinline__ Fp4Lane fp4_lane(size_t row_bytes, int nrows, int k0, int k1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const uint32_t rg = min(g, nrows - 1), rg8 = min(g + 8, nrows - 1);
    return Fp4Lane{(uint32_t)(rg * row_bytes) + 16 * c + k0, (uint32_t)(rg8 * row_bytes) + 16 * c + k0, (uint32_t)(64 * c + 4 * k0),
                   k1 - k0 - 16 * c};
}

template <int TC_U> __device__ __forceinline__ void fp4_next(Fp4Lane &l) {
    l.oa += 64 * TC_U;
    l.ob += 64 * TC_U;
    l.xk += 256 * TC_U;
    l.rem -= 64 * TC_U;
}

// One round of a lane's NVFP4 loads: codes and scale byte pairs of its steps u < TC_U; zeros for
// a step past the slice.
template <int TC_U, bool FULL = false>
__device__ __forceinline__ void fp4_load(const uint8_t *w, const uint8_t *ws, const Fp4Lane &l, uint4 (&wa)[TC_U], uint4 (&wb)[TC_U],
                                         uint32_t (&sa)[TC_U], uint32_t (&sb)[TC_U]) {
    const uint4 *ca = reinterpret_cast<const uint4 *>(w + l.oa), *cb = reinterpret_cast<const uint4 *>(w + l.ob);
    const uint16_t *pa = reinterpret_cast<const uint16_t *>(ws + (l.oa >> 3)), *pb = reinterpret_cast<const uint16_t *>(ws + (l.ob >> 3));
#pragma unroll
    for (int u = 0; u < TC_U; u++) {
        const bool ok = FULL || 64 * u < l.rem;
        wa[u] = ok ? __ldg(ca + 4 * u) : make_uint4(0, 0, 0, 0);
        wb[u] = ok ? __ldg(cb + 4 * u) : make_uint4(0, 0, 0, 0);
        sa[u] = ok ? __ldg(pa + 4 * u) : 0u;
        sb[u] = ok ? __ldg(pb + 4 * u) : 0u;
    }
}

// The dequantisation and mma of one NVFP4 round (token j's activations at x + xoff[j] + l.xk; a step
// past the slice reads zeros: its weights are zero, but the row past it need not be finite).
template <int NT, int TC_U, bool FULL = false>
__device__ __forceinline__ void fp4_mma(const OrnithFp4Entry *tab, const Fp4Lane &l, const uint8_t *x, const uint32_t (&xoff)[NT],
                                        const uint4 (&wa)[TC_U], const uint4 (&wb)[TC_U], const uint32_t (&sa)[TC_U],
                                        const uint32_t (&sb)[TC_U], float (&acc)[NT][4]) {
    const uint4 z = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < TC_U; u++) {
        if (!FULL && 64 * u >= l.rem + 16 * (threadIdx.x & 3)) break;  // warp-uniform: the step is past k1
        const bool ok = FULL || 64 * u < l.rem;
        const uint32_t ca[4] = {wa[u].x, wa[u].y, wa[u].z, wa[u].w}, cb[4] = {wb[u].x, wb[u].y, wb[u].z, wb[u].w};
#pragma unroll
        for (int h = 0; h < 2; h++) {  // the lane's two groups of this step
            const Fp4Lut la = fp4_entry(tab, (sa[u] >> (8 * h)) & 0xffu);
            const Fp4Lut lb = fp4_entry(tab, (sb[u] >> (8 * h)) & 0xffu);
#pragma unroll
            for (int q = 2 * h; q < 2 * h + 2; q++) {
                uint32_t ra[4], rb[4];
                fp4_word(ca[q], la, ra);
                fp4_word(cb[q], lb, rb);
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    const uint4 xv = ok ? *reinterpret_cast<const uint4 *>(x + (xoff[j] + l.xk) + 256 * u + 16 * q) : z;
                    const uint32_t a0[4] = {ra[0], rb[0], ra[1], rb[1]}, a1[4] = {ra[2], rb[2], ra[3], rb[3]};
                    const uint32_t b0[2] = {xv.x, xv.y}, b1[2] = {xv.z, xv.w};
                    mma_bf16(acc[j], a0, b0);
                    mma_bf16(acc[j], a1, b1);
                }
            }
        }
    }
}

// One round: loads, then (first: after the PDL wait, weights first as tc_tile) the mma.
template <int NT, int TC_U, bool FULL = false>
__device__ __forceinline__ void fp4_round(const uint8_t *w, const uint8_t *ws, const OrnithFp4Entry *tab, const Fp4Lane &l,
                                          const uint8_t *x, const uint32_t (&xoff)[NT], bool first, float (&acc)[NT][4]) {
    uint4 wa[TC_U], wb[TC_U];
    uint32_t sa[TC_U], sb[TC_U];
    fp4_load<TC_U, FULL>(w, ws, l, wa, wb, sa, sb);
    if (first) pdl_wait();
    fp4_mma<NT, TC_U, FULL>(tab, l, x, xoff, wa, wb, sa, sb, acc);
}

// acc[j] += dequantised rows (codes w, scale bytes ws: 16 rows, the first nrows real; tab the
// rows' dequantisation table) · tokens of N tile j over code bytes [k0, k1) of each row.
// FR: the rounds whose steps all lie inside the slice (kb + 64 TC_U <= k1: every lane's step u
// then starts below k1) run without the bounds tests (FULL), a partial last round as before;
// the same loads, zeros and mma, so the same bits. The grouped MoE build's (see there).
template <int NT, int TC_U, bool FR = false>
__device__ __forceinline__ void tc_tile_fp4(const uint8_t *w, const uint8_t *ws, const OrnithFp4Entry *tab, size_t row_bytes, int nrows,
                                            const uint8_t *x, const uint32_t (&xoff)[NT], int k0, int k1, float (&acc)[NT][4]) {
    Fp4Lane l = fp4_lane(row_bytes, nrows, k0, k1);
    int kb = k0;
    if (FR)
        for (; kb + 64 * TC_U <= k1; kb += 64 * TC_U, fp4_next<TC_U>(l)) {
            fp4_round<NT, TC_U, true>(w, ws, tab, l, x, xoff, kb == k0, acc);
        }
    for (; kb < k1; kb += 64 * TC_U, fp4_next<TC_U>(l)) {
        fp4_round<NT, TC_U>(w, ws, tab, l, x, xoff, kb == k0, acc);
    }
}

// tc_tile_fp4 for one column whose bf16 input row the block computes itself (as
// tc_tile_prologue): the warp issues its first round's loads (has: the warp has rows), the block
// waits and runs `prologue` (block-wide, leaving the row in shared memory at x), then the rounds
// go on. The same rounds and mma order as tc_tile_fp4, so the same sums.
template <int TC_U, class Prologue>
__device__ __forceinline__ void tc_tile_fp4_prologue(const uint8_t *w, const uint8_t *ws, const OrnithFp4Entry *tab, size_t row_bytes,
                                                     int nrows, bool has, const uint8_t *x, int k0, int k1, float (&acc)[1][4],
                                                     Prologue prologue) {
    Fp4Lane l = fp4_lane(row_bytes, nrows, k0, k1);
    uint4 wa[TC_U], wb[TC_U];
    uint32_t sa[TC_U], sb[TC_U];
    if (has) fp4_load<TC_U>(w, ws, l, wa, wb, sa, sb);
    pdl_wait();
    prologue();
    if (!has) return;
    const uint32_t xoff[1] = {0};
    fp4_mma<1, TC_U>(tab, l, x, xoff, wa, wb, sa, sb, acc);
    fp4_next<TC_U>(l);
    for (int kb = k0 + 64 * TC_U; kb < k1; kb += 64 * TC_U, fp4_next<TC_U>(l)) {
        fp4_round<1, TC_U>(w, ws, tab, l, x, xoff, false, acc);
    }
}

// 64-byte code steps per round of the NVFP4 tile (each dequantises to 256 bytes of bf16 per row):
// 2 in the narrow and per-slot MoE builds, 1 in the wide build (its accumulators take the
// registers) and in the grouped MoE build (FP4_GROUPED_BLOCKS). The
// dependent chain codes -> scale -> table entry -> mma is latency: one step at a time left these
// kernels at 60-700 GB/s (H200, first run). The narrow and MoE builds run FP4_BLOCKS blocks per SM
// (<= 80 registers, no spills with U 2; ptxas sm_90 and sm_121): with 2 (U 4, 128 registers) a
// layer's gate|up grid at one token (288 blocks) took two waves on the H200's 132 SMs. Streaming
// the rounds as tc_stream (U 1, the next round in flight) was 5-8% slower at one token (H200).
__host__ __device__ constexpr int fp4_u(int nt) { return nt == 1 ? 2 : 1; }
#define FP4_BLOCKS 3

// The table of the 16 rows from row0 (tab_rows % 16 == 0: a row group never straddles two).
__device__ __forceinline__ const OrnithFp4Entry *fp4_tab(const OrnithFp4Entry *tab, int row0, int tab_rows) {
    return tab + (size_t)(row0 / tab_rows) * 256;
}

// FOLD: the build takes OrnithGemvNvfp4Params.fold (the narrow one: a fold comes with a norm
// that ran in a prologue, one decode row; the wide build's registers are its accumulators').
template <int NT, bool FOLD>
__device__ __forceinline__ void gemv_fp4_pass(const OrnithGemvNvfp4Params &p, int t0, const TcPlace &pl, float *red) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const size_t row_bytes = (size_t)p.in / 2;
    uint32_t xoff[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) xoff[j] = (uint32_t)(min(t0 + 8 * j + g, p.tokens - 1) * p.x_stride * 2);
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.f;
    const int nrows = max(1, min(16, p.out - pl.row0));
    if (pl.row0 < p.out)
        tc_tile_fp4<NT, fp4_u(NT)>(p.w + (size_t)pl.row0 * row_bytes, p.ws + (size_t)pl.row0 * (row_bytes / 8),
                                  fp4_tab(p.tab, pl.row0, p.tab_rows), row_bytes, nrows,
                                  reinterpret_cast<const uint8_t *>(p.x), xoff, pl.k0, pl.k1, acc);
    pdl_wait();
    tc_reduce<NT>(acc, pl.ks, red);
    if (!pl.lead || pl.row0 >= p.out) return;
    // store_delta's two steps in two loops, the fold's first (each output is this lane's alone):
    // one loop holding both spilled 8 bytes on sm_121 (ptxas, the narrow build).
    if (FOLD && p.fold)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = pl.row0 + g + (i >> 1) * 8, t = t0 + 8 * j + 2 * c + (i & 1);
                const size_t o = (size_t)t * p.y_stride + row;
                if (row < p.out && t < p.tokens) p.fold[o] = f2bf(rms_add(bf2f(p.fold[o]), p.y[o]));
            }
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = pl.row0 + g + (i >> 1) * 8, t = t0 + 8 * j + 2 * c + (i & 1);
            if (row < p.out && t < p.tokens) p.y[(size_t)t * p.y_stride + row] = f2bf(acc[j][i]);
        }
}

template <int NTMAX> __device__ __forceinline__ void gemv_fp4(const OrnithGemvNvfp4Params &launch) {
    __shared__ float red[TC_WARPS * 4 * 32];
    const TcPlace pl = tc_place(launch.in, split_rows(launch.split_out, launch.out), TC_TARGET_WARPS, 1);
    OrnithGemvNvfp4Params p = launch;
    if (NTMAX > 1 && gridDim.y > 1) {  // token groups over grid.y, as gemv_tc
        const int tbeg = token_group(p.tokens);
        p.x += (size_t)tbeg * p.x_stride;
        p.y += (size_t)tbeg * p.y_stride;
    }
    tc_passes<NTMAX>(p.tokens, [&](int t0, auto nt) { gemv_fp4_pass<decltype(nt)::v, NTMAX == TC_NARROW>(p, t0, pl, red); });
}

// y[t, o] = bf16(Σ_i x[t, i] · wd[o, i]) for any number of tokens (NVFP4A16 weights).
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, FP4_BLOCKS) gemv_nvfp4(const OrnithGemvNvfp4Params p) {
    pdl_launch_dependents();
    gemv_fp4<TC_NARROW>(p);
}
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_WIDE_BLOCKS) gemv_nvfp4_wide(const OrnithGemvNvfp4Params p) {
    pdl_launch_dependents();
    gemv_fp4<TC_WIDE>(p);
}

// One column of an NVFP4 product (matrix w, ws, tab of `out` rows, `in` weights per row) whose
// bf16 input row the block computes itself: after its first weight loads, `prologue(xrow, sh)`
// (block-wide, synchronising the block at its end) leaves the row in shared memory; then the
// column's pass as tc_tile_fp4's, and each row's sum to `store(row, sum)` (the lead warp's lanes
// (g, 0), which hold column 0: acc[0][0] and acc[0][2]). gemv_nvfp4_norm's and the per-slot
// MoE prologue forms'.
template <class Prologue, class Store>
__device__ __forceinline__ void fp4_prologue_column(const uint8_t *w, const uint8_t *ws, const OrnithFp4Entry *tab, int tab_rows, int in,
                                                    int out, const TcPlace &pl, Prologue prologue, Store store) {
    __shared__ float red[TC_WARPS * 4 * 32];
    extern __shared__ __align__(16) uint8_t xrow[];
    __shared__ float sh[32];
    const size_t row_bytes = (size_t)in / 2;
    float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
    const int nrows = max(1, min(16, out - pl.row0));
    tc_tile_fp4_prologue<fp4_u(1)>(w + (size_t)pl.row0 * row_bytes, ws + (size_t)pl.row0 * (row_bytes / 8), fp4_tab(tab, pl.row0, tab_rows),
                                   row_bytes, nrows, pl.row0 < out, xrow, pl.k0, pl.k1, acc, [&] { prologue(xrow, sh); });
    tc_reduce<1>(acc, pl.ks, red);
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    if (!pl.lead || pl.row0 >= out || c != 0) return;
#pragma unroll
    for (int v = 0; v < 2; v++) {
        const int row = pl.row0 + g + 8 * v;
        if (row < out) store(row, acc[0][2 * v]);
    }
}

// gemv_nvfp4 of one row whose input is the norm of a residual row (OrnithGemvNvfp4Params.norm),
// computed by every block after its first weight loads as gemv_bf16_norm's: the bits of
// rmsnorm_residual then gemv_nvfp4 (the same K split, rounds and mma order), without the norm's
// launch or its stores; the fold as gemv_nvfp4's.
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, FP4_BLOCKS) gemv_nvfp4_norm(const OrnithGemvNvfp4Params p) {
    pdl_launch_dependents();
    const TcPlace pl = tc_place(p.in, split_rows(p.split_out, p.out), TC_TARGET_WARPS, 1);
    fp4_prologue_column(
        p.w, p.ws, p.tab, p.tab_rows, p.in, p.out, pl,
        [&](uint8_t *xrow, float *sh) { norm_prologue<false>(p.norm, p.in, xrow, nullptr, sh); },
        [&](int row, float sum) { store_delta(p.y, p.fold, row, sum); });
}

// =============================================================================================
// MoE expert products (FP8): y[(t * (top_k + 1) + slot) * out + o] for every (token, slot), slot
// top_k being the shared expert. The same tile and summation order as the dense form with the
// expert's rows as M and (token, slot) pairs as N, so the two grids below give the same bits:
//   moe_gemv_fp8     grid (tiles, top_k + 1, tokens): one pair per block (the routed expert's index
//                    read after pdl_wait);
//   moe_gemv_grouped grid (tiles, active + ceil(tokens / 8), 1), active = min(experts, tokens *
//                    top_k): block y takes the y-th expert with assignments (moe_sort's
//                    row_info: the expert, its pairs row_assign[a0 .. a0 + count), a = token *
//                    top_k + slot; none past their number), the last ceil(tokens / 8) block rows the shared
//                    expert, 8 tokens each (one pass: with the whole group in one block row the
//                    shared expert's 8 passes at 64 tokens were the step's critical path) — each
//                    routed expert's weights read once per step.
// tiles = moe_tc_blocks(in, out) (the dense rule on one expert's [out, in], MOE_TARGET_WARPS).
// =============================================================================================

// The (token, slot) pair of each column of a block: from a list of assignments
// (a = token * top_k + slot), or tokens t_base, t_base + 1, ... of one fixed slot.
struct MoeCols {
    const int32_t *assign;
    int top_k, n, t_base, slot;
    __device__ __forceinline__ void pair(int i, int &t, int &s) const {
        if (assign) {
            const int a = assign[i];
            t = a / top_k;
            s = a % top_k;
        } else {
            t = t_base + i;
            s = slot;
        }
    }
};

template <int NT>
__device__ __forceinline__ void moe_tc_pass(const OrnithMoeGemvParams &p, const uint8_t *wb, const float *ws, const MoeCols &cols,
                                            int n0, const TcPlace &pl, float *red) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, slots = p.top_k + 1;
    uint32_t xoff[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        int t, slot;
        cols.pair(min(n0 + 8 * j + g, cols.n - 1), t, slot);
        xoff[j] = (uint32_t)(t * p.x_tok_stride + slot * p.x_slot_stride);
    }
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.f;
    const int nrows = max(1, min(16, p.out - pl.row0));
    if (pl.row0 < p.out) tc_tile<true, NT, MOE_U, false>(wb + (size_t)pl.row0 * p.in, (size_t)p.in, nrows, p.xq, xoff, pl.k0, pl.k1, acc);
    pdl_wait();
    tc_reduce<NT>(acc, pl.ks, red);
    if (!pl.lead || pl.row0 >= p.out) return;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int n = n0 + 8 * j + 2 * c + h;
            if (n >= cols.n) continue;
            int t, slot;
            cols.pair(n, t, slot);
            const float xs = p.xs[t * p.xs_tok_stride + slot * p.xs_slot_stride];
#pragma unroll
            for (int v = 0; v < 2; v++) {
                const int row = pl.row0 + g + 8 * v;
                if (row < p.out) p.y[((size_t)t * slots + slot) * p.out + row] = f2bf(acc[j][2 * v + h] * xs * ws[row]);
            }
        }
}

__device__ __forceinline__ void moe_tc(const OrnithMoeGemvParams &p, const uint8_t *wb, const float *ws, const MoeCols &cols,
                                       const TcPlace &pl) {
    __shared__ float red[TC_WARPS * 4 * 32];
    for (int n0 = 0; n0 < cols.n; n0 += 8 * TC_NARROW) moe_tc_pass<TC_NARROW>(p, wb, ws, cols, n0, pl, red);
}

// The grouped grids' last ceil(tokens / 8) block rows run the shared expert, 8 tokens each: this
// block's index among them, or -1 for a routed expert's block row.
__device__ __forceinline__ int moe_shared_row(int tokens) {
    return (int)blockIdx.y - ((int)gridDim.y - (tokens + 7) / 8);
}

// A grouped grid's routed block row: its expert e and the range [a0, a0 + count) of row_assign
// (moe_sort's row_info, one 16-byte load: the expert and its range together, so the weight loads
// go out after one round trip; count 0 past the experts with assignments). An expert index out
// of range (never written) is clamped.
__device__ __forceinline__ int moe_row(const int32_t *row_info, int experts, int &e, int &a0) {
    const int4 r = reinterpret_cast<const int4 *>(row_info)[blockIdx.y];
    e = min(max(r.x, 0), experts - 1);
    a0 = max(r.y, 0);
    return r.z;
}

// The routed expert e's weights (an index the router never writes is clamped into range).
__device__ __forceinline__ void moe_expert(const OrnithMoeGemvParams &p, int e, const uint8_t *&wb, const float *&ws) {
    if (e < 0 || e >= p.experts) e = 0;
    wb = p.w + (size_t)e * p.out * p.in;
    ws = p.ws + (size_t)e * p.out;
}

// The per-slot form whose input row the block computes itself: after its first weight loads,
// `prologue(xrow, &xsc, sh)` (block-wide, synchronising the block at its end) leaves the
// (token t, slot) column's e4m3 codes in shared memory and their scale in xsc; then the pass of
// that one column as moe_tc_pass.
template <class Prologue>
__device__ __forceinline__ void moe_tc_prologue(const OrnithMoeGemvParams &p, const uint8_t *wb, const float *ws, int t, int slot,
                                                const TcPlace &pl, Prologue prologue) {
    __shared__ float red[TC_WARPS * 4 * 32];
    extern __shared__ __align__(16) uint8_t xrow[];
    __shared__ float sh[32], xsc;
    float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
    const int nrows = max(1, min(16, p.out - pl.row0));
    // One 64-byte step per round: the two rounds held across the prologue fit 64 registers.
    tc_tile_prologue<true, 1>(wb + (size_t)pl.row0 * p.in, (size_t)p.in, nrows, pl.row0 < p.out, xrow, pl.k0, pl.k1, acc,
                              [&] { prologue(xrow, &xsc, sh); });
    tc_reduce<1>(acc, pl.ks, red);
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    if (!pl.lead || pl.row0 >= p.out || c != 0) return;  // column 0 = lane (g, 0)'s acc[0][0], acc[0][2]
#pragma unroll
    for (int v = 0; v < 2; v++) {
        const int row = pl.row0 + g + 8 * v;
        if (row < p.out) p.y[((size_t)t * (p.top_k + 1) + slot) * p.out + row] = f2bf(acc[0][2 * v] * xsc * ws[row]);
    }
}

// The per-slot down products' combine epilogue (OrnithMoeGemvParams.combine, when its out is
// set): the last of the grid's top_k + 1 slot blocks of (token t, block column x) to store its
// outputs combines the column's rows [x R, x R + R) of token t's hidden row as moe_combine does
// (R = 16 TC_WARPS / ks, the rows the column's blocks cover), reading the others' outputs
// through L2 after the ticket (common.cuh last_to_arrive, moe_combine_elem).
__device__ __forceinline__ void moe_combine_epilogue(const OrnithMoeCombineParams &c, uint32_t *ticket, int t, int ks) {
    if (!c.out || !last_to_arrive(ticket + (size_t)t * gridDim.x + blockIdx.x, gridDim.y)) return;
    const int rows = 16 * (TC_WARPS / ks), r0 = (int)blockIdx.x * rows, r1 = min(r0 + rows, c.hidden);
    for (int i = r0 + (int)threadIdx.x; i < r1; i += (int)blockDim.x) moe_combine_elem(c, t, i);
}

// The weights of (token t, slot) in the per-slot forms: the shared expert's, or the routed
// expert's, whose index is the router's output and so is read after the wait (the shared
// expert's blocks issue their first weight loads before it, in the tile).
__device__ __forceinline__ void moe_slot_weights(const OrnithMoeGemvParams &p, int t, int slot, const uint8_t *&wb,
                                                 const float *&ws) {
    wb = p.shared_w;
    ws = p.shared_ws;
    if (slot != p.top_k) {
        pdl_wait();
        moe_expert(p, p.idx[t * p.top_k + slot], wb, ws);
    }
}

// The per-slot pair's PDL order ("routed index early"). The per-slot gate|up forms
// (moe_gemv_fp8, moe_gemv_fp8_norm and their NVFP4 twins) let the next kernel launch only after
// their routed blocks' wait: no block of the down product can start before the router's top-k
// grid has completed. So the down product (the *_swiglu forms, only ever launched right after a
// per-slot gate|up) reads its routed index before its own wait — the one exception to "only
// weights before the wait" (common.cuh): that index's writer has completed, and the next writer
// of it (the next layer's top-k) waits for this grid. The read goes to L2 (ld.global.cg: no stale
// L1 line of the previous layer's index, held by an earlier grid's blocks on this SM, can serve
// it), and the routed expert's first weight loads then go out before the wait like the shared
// expert's. H200, full preset, batch 1 at 2K (tests/peer/results/h200-2026-12-05): NVFP4A16
// 412.3 / 413.0 -> 421.9 tok/s (s58a, one call; in the graph gate|up 377 -> 343, down 361 -> 305
// us per step, the router's top-k 83 -> 102); FP8 389.4 -> 396.1 (s58c; gate|up 442 -> 417, down
// 377 -> 331, top-k 98 -> 117). Bits unchanged (only when loads issue).
__device__ __forceinline__ int moe_routed_index_early(const int32_t *idx, int t, int top_k, int slot) {
    return __ldcg(idx + t * top_k + slot);
}
__device__ __forceinline__ void moe_slot_weights_early(const OrnithMoeGemvParams &p, int t, int slot, const uint8_t *&wb,
                                                       const float *&ws) {
    wb = p.shared_w;
    ws = p.shared_ws;
    if (slot != p.top_k) moe_expert(p, moe_routed_index_early(p.idx, t, p.top_k, slot), wb, ws);
}

// Per-slot gate|up without the norm prologue (decode groups of 2 or 3 rows, whose norm kernel ran
// before): the routed-index-early order above.
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_NARROW_BLOCKS) moe_gemv_fp8(const OrnithMoeGemvParams p) {
    const TcPlace pl = tc_place(p.in, p.out, MOE_TARGET_WARPS);
    const int slot = blockIdx.y, t = blockIdx.z;
    const uint8_t *wb;
    const float *ws;
    moe_slot_weights(p, t, slot, wb, ws);
    pdl_launch_dependents();  // routed blocks: after the wait (see moe_routed_index_early)
    moe_tc(p, wb, ws, MoeCols{nullptr, p.top_k, 1, t, slot}, pl);
}

// moe_gemv_fp8 with the norm prologue (OrnithMoeGemvParams.norm; the gate|up product, in = hidden).
// The next kernel may launch once every block has issued its first weight loads and waited (the
// trigger opens the prologue; moe_routed_index_early).
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_NARROW_BLOCKS) moe_gemv_fp8_norm(const OrnithMoeGemvParams p) {
    const TcPlace pl = tc_place(p.in, p.out, MOE_TARGET_WARPS);
    const int slot = blockIdx.y, t = blockIdx.z;
    const uint8_t *wb;
    const float *ws;
    moe_slot_weights(p, t, slot, wb, ws);
    OrnithNormIn n = p.norm;
    n.res += (size_t)t * p.in;
    if (n.add) n.add += (size_t)t * p.in;
    moe_tc_prologue(p, wb, ws, t, slot, pl, [&](uint8_t *xrow, float *xsc, float *sh) {
        pdl_launch_dependents();
        norm_prologue<true>(n, p.in, xrow, xsc, sh);
    });
}

// moe_gemv_fp8 with the SwiGLU prologue (OrnithMoeGemvParams.gate_up; the down product, in =
// inter): the block quantises its (token, slot) row of SwiGLU(gate|up) itself, as swiglu_quant;
// with OrnithMoeGemvParams.combine the token's last blocks combine the slots (moe_combine_epilogue).
// The routed index before the wait (moe_routed_index_early).
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_NARROW_BLOCKS) moe_gemv_fp8_swiglu(const OrnithMoeGemvParams p) {
    pdl_launch_dependents();
    const TcPlace pl = tc_place(p.in, p.out, MOE_TARGET_WARPS);
    const int slot = blockIdx.y, t = blockIdx.z;
    const uint8_t *wb;
    const float *ws;
    moe_slot_weights_early(p, t, slot, wb, ws);
    const uint16_t *gu = p.gate_up + ((size_t)t * (p.top_k + 1) + slot) * 2 * p.in;
    moe_tc_prologue(p, wb, ws, t, slot, pl, [&](uint8_t *xrow, float *xsc, float *sh) {
        swiglu_q8_row(gu, p.in, xrow, xsc, sh);
        __syncthreads();
    });
    moe_combine_epilogue(p.combine, p.ticket, t, pl.ks);
}

extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_NARROW_BLOCKS) moe_gemv_grouped(const OrnithMoeGemvParams p) {
    pdl_launch_dependents();
    const TcPlace pl = tc_place(p.in, p.out, MOE_TARGET_WARPS);
    const int sy = moe_shared_row(p.tokens);
    if (sy >= 0) {  // the shared expert, tokens 8 sy .. (weights first: the tile waits after its first loads)
        moe_tc(p, p.shared_w, p.shared_ws, MoeCols{nullptr, p.top_k, min(8, p.tokens - 8 * sy), 8 * sy, p.top_k}, pl);
        return;
    }
    pdl_wait();  // row_info and row_assign are moe_sort's output
    int e, a0;
    const int count = moe_row(p.row_info, p.experts, e, a0);
    if (count <= 0) return;
    const uint8_t *wb;
    const float *ws;
    moe_expert(p, e, wb, ws);
    moe_tc(p, wb, ws, MoeCols{p.row_assign + a0, p.top_k, count, 0, 0}, pl);
}


// =============================================================================================
// MoE expert products (NVFP4A16): moe_gemv_fp8's two grids over NVFP4 experts and bf16
// activations, the NVFP4 tile above, the same K split (moe_tc_blocks on the weights per row):
//   moe_gemv_nvfp4          grid (tiles, top_k + 1, tokens), one (token, slot) per block;
//   moe_gemv_nvfp4_grouped  grid (tiles, active + ceil(tokens / 8), 1), each routed expert's weights read once per step.
// Both give the same bits for a (token, slot, row).
// =============================================================================================

template <int NT, int U = fp4_u(NT), bool FR = false>
__device__ __forceinline__ void moe_fp4_pass(const OrnithMoeGemvNvfp4Params &p, const uint8_t *wb, const uint8_t *sb,
                                             const OrnithFp4Entry *tb, const MoeCols &cols, int n0, const TcPlace &pl, float *red) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, slots = p.top_k + 1;
    const size_t row_bytes = (size_t)p.in / 2;
    uint32_t xoff[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        int t, slot;
        cols.pair(min(n0 + 8 * j + g, cols.n - 1), t, slot);
        xoff[j] = (uint32_t)((t * p.x_tok_stride + slot * p.x_slot_stride) * 2);
    }
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.f;
    const int nrows = max(1, min(16, p.out - pl.row0));
    if (pl.row0 < p.out)
        tc_tile_fp4<NT, U, FR>(wb + (size_t)pl.row0 * row_bytes, sb + (size_t)pl.row0 * (row_bytes / 8),
                               fp4_tab(tb, pl.row0, p.tab_rows), row_bytes, nrows, reinterpret_cast<const uint8_t *>(p.x),
                               xoff, pl.k0, pl.k1, acc);
    pdl_wait();
    tc_reduce<NT>(acc, pl.ks, red);
    if (!pl.lead || pl.row0 >= p.out) return;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int n = n0 + 8 * j + 2 * c + h;
            if (n >= cols.n) continue;
            int t, slot;
            cols.pair(n, t, slot);
#pragma unroll
            for (int v = 0; v < 2; v++) {
                const int row = pl.row0 + g + 8 * v;
                if (row < p.out) p.y[((size_t)t * slots + slot) * p.out + row] = f2bf(acc[j][2 * v + h]);
            }
        }
}

template <int U = fp4_u(TC_NARROW), bool FR = false>
__device__ __forceinline__ void moe_fp4(const OrnithMoeGemvNvfp4Params &p, const uint8_t *wb, const uint8_t *sb, const OrnithFp4Entry *tb,
                                        const MoeCols &cols, const TcPlace &pl) {
    __shared__ float red[TC_WARPS * 4 * 32];
    for (int n0 = 0; n0 < cols.n; n0 += 8 * TC_NARROW) moe_fp4_pass<TC_NARROW, U, FR>(p, wb, sb, tb, cols, n0, pl, red);
}

// The routed expert e's codes, scales and tables (an index the router never writes is clamped).
__device__ __forceinline__ void moe_fp4_expert(const OrnithMoeGemvNvfp4Params &p, int e, const uint8_t *&wb, const uint8_t *&sb,
                                               const OrnithFp4Entry *&tb) {
    if (e < 0 || e >= p.experts) e = 0;
    wb = p.w + (size_t)e * p.out * (p.in / 2);
    sb = p.ws + (size_t)e * p.out * (p.in / 16);
    tb = p.tab + (size_t)e * (p.out / p.tab_rows) * 256;
}

// The weights of (token t, slot) in the per-slot forms, as moe_slot_weights: the routed index
// after the wait, the shared expert's weights before it.
__device__ __forceinline__ void moe_fp4_slot_weights(const OrnithMoeGemvNvfp4Params &p, int t, int slot, const uint8_t *&wb,
                                                     const uint8_t *&sb, const OrnithFp4Entry *&tb) {
    wb = p.shared_w;
    sb = p.shared_ws;
    tb = p.shared_tab;
    if (slot != p.top_k) {
        pdl_wait();
        moe_fp4_expert(p, p.idx[t * p.top_k + slot], wb, sb, tb);
    }
}

// Per-slot gate|up without the norm prologue: moe_gemv_fp8's routed-index-early order.
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, FP4_BLOCKS) moe_gemv_nvfp4(const OrnithMoeGemvNvfp4Params p) {
    const TcPlace pl = tc_place(p.in, p.out, MOE_TARGET_WARPS, 1);
    const int slot = blockIdx.y, t = blockIdx.z;
    const uint8_t *wb, *sb;
    const OrnithFp4Entry *tb;
    moe_fp4_slot_weights(p, t, slot, wb, sb, tb);
    pdl_launch_dependents();  // routed blocks: after the wait (moe_routed_index_early)
    moe_fp4(p, wb, sb, tb, MoeCols{nullptr, p.top_k, 1, t, slot}, pl);
}

// The per-slot NVFP4 form whose bf16 input row the block computes itself (fp4_prologue_column):
// the (token t, slot) column.
template <class Prologue>
__device__ __forceinline__ void moe_fp4_prologue(const OrnithMoeGemvNvfp4Params &p, const uint8_t *wb, const uint8_t *sb,
                                                 const OrnithFp4Entry *tb, int t, int slot, const TcPlace &pl, Prologue prologue) {
    fp4_prologue_column(wb, sb, tb, p.tab_rows, p.in, p.out, pl, prologue,
                        [&](int row, float sum) { p.y[((size_t)t * (p.top_k + 1) + slot) * p.out + row] = f2bf(sum); });
}

// moe_gemv_nvfp4 with the norm prologue (OrnithMoeGemvNvfp4Params.norm; the gate|up product, in =
// hidden): token t's normalised bf16 row as rmsnorm_residual writes it. The next kernel may
// launch once every block has waited (moe_gemv_fp8_norm's order).
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, FP4_BLOCKS) moe_gemv_nvfp4_norm(const OrnithMoeGemvNvfp4Params p) {
    const TcPlace pl = tc_place(p.in, p.out, MOE_TARGET_WARPS, 1);
    const int slot = blockIdx.y, t = blockIdx.z;
    const uint8_t *wb, *sb;
    const OrnithFp4Entry *tb;
    moe_fp4_slot_weights(p, t, slot, wb, sb, tb);
    OrnithNormIn n = p.norm;
    n.res += (size_t)t * p.in;
    if (n.add) n.add += (size_t)t * p.in;
    moe_fp4_prologue(p, wb, sb, tb, t, slot, pl, [&](uint8_t *xrow, float *sh) {
        pdl_launch_dependents();
        norm_prologue<false>(n, p.in, xrow, nullptr, sh);
    });
}

// moe_gemv_nvfp4 with the SwiGLU prologue (OrnithMoeGemvNvfp4Params.gate_up; the down product, in =
// inter): the (token, slot) row of SwiGLU(gate|up) in bf16 as swiglu_bf16 writes it; the combine
// epilogue as moe_gemv_fp8_swiglu's; the routed index before the wait (moe_routed_index_early).
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, FP4_BLOCKS) moe_gemv_nvfp4_swiglu(const OrnithMoeGemvNvfp4Params p) {
    pdl_launch_dependents();
    const TcPlace pl = tc_place(p.in, p.out, MOE_TARGET_WARPS, 1);
    const int slot = blockIdx.y, t = blockIdx.z;
    const uint8_t *wb = p.shared_w, *sb = p.shared_ws;
    const OrnithFp4Entry *tb = p.shared_tab;
    if (slot != p.top_k) moe_fp4_expert(p, moe_routed_index_early(p.idx, t, p.top_k, slot), wb, sb, tb);
    const uint16_t *gu = p.gate_up + ((size_t)t * (p.top_k + 1) + slot) * 2 * p.in;
    moe_fp4_prologue(p, wb, sb, tb, t, slot, pl, [&](uint8_t *xrow, float *) {
        for (int i = threadIdx.x; i < p.in; i += blockDim.x) reinterpret_cast<uint16_t *>(xrow)[i] = f2bf(swiglu_val(gu[i], gu[p.in + i]));
        __syncthreads();
    });
    moe_combine_epilogue(p.combine, p.ticket, t, pl.ks);
}

// The grouped form takes one 64-byte step per round at FP4_GROUPED_BLOCKS blocks per SM (64
// registers; ptxas spills 12 bytes on sm_90, 20 on sm_121) where the per-slot forms take 2 at
// FP4_BLOCKS: its grid is thousands of blocks, so more resident warps hide more of the
// dequantisation chain than a second step in flight per warp does (H200, 32 sequences: 7,191
// against 7,543 us of grouped products per step; 8 sequences 2,642 against 2,694). The per-slot grids at one token (288
// blocks) are resident either way. The same rounds in the same order: the same bits. Its full
// rounds skip the bounds tests (tc_tile_fp4's FR; H200, 8 / 32 sequences: grouped products 2,641
// -> 2,586 and 7,209 -> 7,105 us per step); the per-slot forms' were slower (norm 387 -> 397 us,
// SwiGLU 370 -> 380 at one sequence) and keep the tested rounds.
#define FP4_GROUPED_BLOCKS 4
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, FP4_GROUPED_BLOCKS) moe_gemv_nvfp4_grouped(const OrnithMoeGemvNvfp4Params p) {
    pdl_launch_dependents();
    const TcPlace pl = tc_place(p.in, p.out, MOE_TARGET_WARPS, 1);
    const int sy = moe_shared_row(p.tokens);
    if (sy >= 0) {  // the shared expert, tokens 8 sy .. (as moe_gemv_grouped)
        moe_fp4<1, true>(p, p.shared_w, p.shared_ws, p.shared_tab, MoeCols{nullptr, p.top_k, min(8, p.tokens - 8 * sy), 8 * sy, p.top_k},
                         pl);
        return;
    }
    pdl_wait();  // row_info and row_assign are moe_sort's output
    int e, a0;
    const int count = moe_row(p.row_info, p.experts, e, a0);
    if (count <= 0) return;
    const uint8_t *wb, *sb;
    const OrnithFp4Entry *tb;
    moe_fp4_expert(p, e, wb, sb, tb);
    moe_fp4<1, true>(p, wb, sb, tb, MoeCols{p.row_assign + a0, p.top_k, count, 0, 0}, pl);
}
