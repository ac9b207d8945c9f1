// The counting sort of a batch's (token, slot) assignments by expert (OrnithMoeSortParams), as the
// body of one block of NT threads, thread e owning expert e (experts <= NT). moe_sort and
// moe_route_sort (moe_prefill.cu) run it in blocks of 1,024 threads; the router products with the
// routing in their last block (gemv.cu: gemv_bf16_route, gemv_bf16_norm_route) in their 256.
// The same outputs for any NT: offsets are prefix sums over the experts in expert order, and the
// scatter's order inside a group is not fixed either way (see moe_sort_block).
// (Included by the kernel files, never compiled alone.)
#pragma once
#include "common.cuh"

#define MS_TILE 64        // rows per tile of gemm_fp8_grouped (GB_GROUPED_M in gemm.cu)
#define MS_TILE_WIDE 128  // rows per tile of gemm_nvfp4_grouped_128 (GB_GROUPED_WIDE_M in gemm.cu)

// Exclusive prefix sum of v over the block's NT threads in thread order: a shuffle scan in each
// warp, then one over the NT / 32 warp totals by warp 0. Every thread calls it.
template <int NT> __device__ __forceinline__ int ms_exclusive_scan(int v, int *tot) {
    constexpr int NW = NT / 32;
    static_assert(NT % 32 == 0 && NW <= 32, "one warp scans the warp totals");
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) tot[w] = x;
    __syncthreads();
    if (w == 0) {
        int t = lane < NW ? tot[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        if (lane < NW) tot[lane] = t;  // inclusive over warps 0..lane
    }
    __syncthreads();
    const int r = (w > 0 ? tot[w - 1] : 0) + x - v;
    __syncthreads();  // tot is reused by the next scan
    return r;
}

// Histogram, prefix sums, scatter (see OrnithMoeSortParams), by the block's NT threads after their
// PDL wait. Thread e owns expert e (experts <= NT): its group offset, tile offset and place among
// the experts with assignments (its row_info row) are exclusive prefix sums over the experts
// before it (parallel scans; a serial loop over 256 experts in one thread took ~5 us, most of the
// kernel). The order of the assignments inside an expert's group follows the atomics and is not
// fixed: every consumer's result per assignment is independent of its place in the group.
template <int NT> __device__ __forceinline__ void moe_sort_block(const OrnithMoeSortParams &p) {
    __shared__ int cnt[NT];
    __shared__ int cur[NT];
    __shared__ int tot[NT / 32];
    __shared__ int nact;
    const int n = p.tokens * p.top_k;
    for (int e = threadIdx.x; e < p.experts; e += NT) cnt[e] = 0;
    __syncthreads();
    for (int a = threadIdx.x; a < n; a += NT) atomicAdd(&cnt[p.idx[a]], 1);
    __syncthreads();
    const int e = threadIdx.x;
    const bool own = e < p.experts;
    const int c = own ? cnt[e] : 0, tiles = (c + MS_TILE - 1) / MS_TILE, active = c > 0 ? 1 : 0;
    const int wide = (c + MS_TILE_WIDE - 1) / MS_TILE_WIDE;
    const int off = ms_exclusive_scan<NT>(c, tot);
    const int toff = ms_exclusive_scan<NT>(tiles, tot);
    const int woff = ms_exclusive_scan<NT>(wide, tot);
    const int na = ms_exclusive_scan<NT>(active, tot);
    if (own) {
        p.group_offsets[e] = off;
        p.tile_offsets[e] = toff;
        p.tile_offsets[p.experts + 1 + e] = woff;
        cur[e] = off;
        if (p.row_info && active) reinterpret_cast<int4 *>(p.row_info)[na] = make_int4(e, off, c, 0);
    }
    if (e == p.experts - 1) {
        p.group_offsets[p.experts] = off + c;
        p.tile_offsets[p.experts] = toff + tiles;
        p.tile_offsets[2 * p.experts + 1] = woff + wide;
        nact = na + active;
    }
    __syncthreads();
    if (p.row_info)
        for (int y = nact + threadIdx.x; y < min(p.experts, n); y += NT)
            reinterpret_cast<int4 *>(p.row_info)[y] = make_int4(0, 0, 0, 0);
    for (int a = threadIdx.x; a < n; a += NT) {
        int pos = atomicAdd(&cur[p.idx[a]], 1);
        p.row_token[pos] = a / p.top_k;
        p.row_of[a] = pos;
        if (p.row_assign) p.row_assign[pos] = a;
    }
}
