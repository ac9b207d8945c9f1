// MoE grouped by expert: counting sort of (token, slot) assignments (prefill chunks and decode
// groups; a decode group's with its router top-k in one launch), SwiGLU + FP8 requantisation
// (compressed-tensors semantics) and the weighted combine of prefill. The expert GEMMs are
// gemm_fp8 in grouped mode (gemm.cu); the router is moe_router_topk (moe.cu).
#include "common.cuh"

#define MS_THREADS 1024
#define MS_MAX_EXPERTS 1024
static_assert(ORNITH_MOE_SORT_STAGE_MAX <= 65536, "staged assignments are 16-bit");
static_assert(ORNITH_MOE_SORT_WINDOW * 2 <= 99 * 1024, "a window of staged rows fits a block's shared memory");

// The launch's dynamic shared memory in bytes (PTX %dynamic_smem_size): moe_sort's launcher alone
// decides whether the sorted rows are staged, by passing the window's bytes or none.
__device__ __forceinline__ int dynamic_smem_bytes() {
    unsigned b;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(b));
    return (int)b;
}

// Exclusive prefix sum of v over the block's threads in thread order (MS_THREADS threads = 32
// warps): a shuffle scan in each warp, then one over the warp totals. Every thread calls it.
__device__ __forceinline__ int ms_exclusive_scan(int v, int *tot) {
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
        int t = tot[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        tot[lane] = t;  // inclusive over warps 0..lane
    }
    __syncthreads();
    const int r = (w > 0 ? tot[w - 1] : 0) + x - v;
    __syncthreads();  // tot is reused by the next scan
    return r;
}

// One block: histogram, prefix sums, scatter (see OrnithMoeSortParams). Thread e owns expert e
// (experts <= MS_THREADS): its group offset, tile offset and place among the experts with
// assignments (its row_info row) are
// exclusive prefix sums over the experts before it (parallel scans; a serial loop over 256
// experts in one thread took ~5 us, most of the kernel). The order of the assignments inside
// an expert's group follows the atomics and is not fixed: every consumer's result per
// assignment is independent of its place in the group.
// (moe_sort_block: the body, called by the block's MS_THREADS threads after their PDL wait;
// `staged`: shared memory for `window` sorted rows' assignments (16 bits each), or null.)
__device__ __forceinline__ void moe_sort_block(const OrnithMoeSortParams &p, uint16_t *staged, int window) {
    __shared__ int cnt[MS_MAX_EXPERTS];
    __shared__ int cur[MS_MAX_EXPERTS];
    __shared__ int tot[MS_THREADS / 32];
    __shared__ int nact;
    const int n = p.tokens * p.top_k;
    for (int e = threadIdx.x; e < p.experts; e += MS_THREADS) cnt[e] = 0;
    __syncthreads();
    for (int a = threadIdx.x; a < n; a += MS_THREADS) atomicAdd(&cnt[p.idx[a]], 1);
    __syncthreads();
    const int e = threadIdx.x;
    const bool own = e < p.experts;
    const int c = own ? cnt[e] : 0, active = c > 0 ? 1 : 0;
    const int tiles = (c + ORNITH_GROUPED_ROWS - 1) / ORNITH_GROUPED_ROWS;
    // The 96- and 128-row tiles' counts in one scan, 16 bits each: with tokens * top_k < 2^21 rows
    // over <= MS_MAX_EXPERTS experts (checked by the launcher) the 96-row sum stays below 2^16 and
    // the 128-row one below 2^15, so the packed int never overflows.
    const int wide = (c + ORNITH_GROUPED_MID_ROWS - 1) / ORNITH_GROUPED_MID_ROWS |
                     (c + ORNITH_GROUPED_WIDE_ROWS - 1) / ORNITH_GROUPED_WIDE_ROWS << 16;
    const int off = ms_exclusive_scan(c, tot);
    const int toff = ms_exclusive_scan(tiles, tot);
    const int woff = ms_exclusive_scan(wide, tot);
    const int na = ms_exclusive_scan(active, tot);
    int32_t *mid = p.tile_offsets + p.experts + 1, *wid = mid + p.experts + 1;
    if (own) {
        p.group_offsets[e] = off;
        p.tile_offsets[e] = toff;
        mid[e] = woff & 0xffff;
        wid[e] = woff >> 16;
        cur[e] = off;
        if (p.row_info && active) reinterpret_cast<int4 *>(p.row_info)[na] = make_int4(e, off, c, 0);
    }
    if (e == p.experts - 1) {
        p.group_offsets[p.experts] = off + c;
        p.tile_offsets[p.experts] = toff + tiles;
        mid[p.experts] = (woff + wide) & 0xffff;
        wid[p.experts] = (woff + wide) >> 16;
        nact = na + active;
    }
    __syncthreads();
    if (p.row_info)
        for (int y = nact + threadIdx.x; y < min(p.experts, n); y += MS_THREADS)
            reinterpret_cast<int4 *>(p.row_info)[y] = make_int4(0, 0, 0, 0);
    if (staged) {
        // Sorted rows staged in shared memory, then written in row order: the scatter's stores of
        // row_token (and row_assign) hit a new 32-byte sector each, and one SM issuing a 2,048-token
        // chunk's 16,384 of them took ~24 us (H200; 41.5 -> 15.9 us staged, H100 kernel test). A
        // decode group's few hundred rows keep the direct scatter and no shared memory. Rows go
        // through shared memory `window` at a time: the first window while the positions are
        // taken, each later one from row_of read back (this block's own coalesced writes, visible
        // to it after the barrier).
        for (int a = threadIdx.x; a < n; a += MS_THREADS) {
            const int pos = atomicAdd(&cur[p.idx[a]], 1);
            if (pos < window) staged[pos] = (uint16_t)a;
            p.row_of[a] = pos;
        }
        for (int w0 = 0; w0 < n; w0 += window) {
            if (w0 > 0) {
                __syncthreads();  // the previous window's write-out has read its entries
                for (int a = threadIdx.x; a < n; a += MS_THREADS) {
                    const int pos = p.row_of[a] - w0;
                    if (pos >= 0 && pos < window) staged[pos] = (uint16_t)a;
                }
            }
            __syncthreads();
            const int w1 = min(n, w0 + window);
            for (int pos = w0 + threadIdx.x; pos < w1; pos += MS_THREADS) {
                const int a = staged[pos - w0];
                p.row_token[pos] = a / p.top_k;
                if (p.row_assign) p.row_assign[pos] = a;
            }
        }
        return;
    }
    for (int a = threadIdx.x; a < n; a += MS_THREADS) {
        int pos = atomicAdd(&cur[p.idx[a]], 1);
        p.row_token[pos] = a / p.top_k;
        p.row_of[a] = pos;
        if (p.row_assign) p.row_assign[pos] = a;
    }
}
extern "C" __global__ void __launch_bounds__(MS_THREADS) moe_sort(const OrnithMoeSortParams p) {
    pdl_entry();
    extern __shared__ __align__(16) uint16_t ms_staged[];  // the assignment of each sorted row
    const int window = dynamic_smem_bytes() / 2;            // staged rows per window; 0: scattered
    moe_sort_block(p, window > 0 ? ms_staged : nullptr, window);
}

// A decode group's router top-k and moe_sort of its idx in one block (OrnithMoeRouteParams; at
// most MS_THREADS / 32 tokens, one per warp): warp w runs common.cuh's router_topk_warp on token w
// (moe_router_topk's bits), then, past a barrier that makes the block's idx writes visible to all
// its threads, moe_sort_block (moe_sort's). Separately, the sort was one more launch waiting on the
// top-k's grid: ~2.2 us per MoE layer in an 8-sequence step's graph (H100, docs/PERF-2026-12-late.md,
// thirty-third session).
extern "C" __global__ void __launch_bounds__(MS_THREADS) moe_route_sort(const OrnithMoeRouteParams p) {
    pdl_entry();
    const int warp = threadIdx.x >> 5;
    if (warp < p.router.tokens) router_topk_warp(p.router, warp, threadIdx.x & 31);
    __syncthreads();
    moe_sort_block(p.sort, nullptr, 0);  // a decode group's <= 256 rows: scattered directly
}

// SwiGLU + per-row FP8 quantisation with compressed-tensors semantics, one warp per row
// (SQ_ROWS rows per block of 256 threads):
//   a_i = bf16( bf16(silu(g_i)) * u_i ),  g = gate_up[r, 0:inter], u = gate_up[r, inter:2 inter]
//   scale = bf16(amax / 448) (2^-7 if 0);  q = e4m3(clamp(bf16(a / scale) + 0, -448, 448))
// (`cpu::moe::Mlp::forward` then `cpu::fp8::quantize_act_row`). inter <= 2048, a multiple of 8, and
// the rows 16-byte aligned: lane l takes elements 8l..8l+7 of each 256 (16-byte loads of g and u,
// 8-byte stores of codes). Rows of up to SQ_HELD values (the model's experts and shared expert:
// 512) keep a in registers between the max and the codes; longer rows compute a twice (the second
// read of the row hits L1). Either way the same function of the same inputs, and a max does not
// depend on the order, so the bits are those of the one-block-per-row form this replaced (which ran
// the 16,384 rows of a 2,048-token chunk at ~0.7 TB/s, bounded by 256-thread blocks doing 2
// elements each). Computing a twice for every row cost the 512-value rows about half their time in
// issue (silu's expf and IEEE division per element; H100, docs/PERF.md, forty-seventh session).
#define SQ_ROWS 8
#define SQ_HELD 512
__device__ __forceinline__ void swiglu8(const uint16_t *gu, int inter, int i, float (&a)[8]) {
    const uint4 g = *reinterpret_cast<const uint4 *>(gu + i), u = *reinterpret_cast<const uint4 *>(gu + inter + i);
    const uint32_t gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        a[2 * j] = rbf(rbf(silu_f(bf2f((uint16_t)(gw[j] & 0xffffu)))) * bf2f((uint16_t)(uw[j] & 0xffffu)));
        a[2 * j + 1] = rbf(rbf(silu_f(bf2f((uint16_t)(gw[j] >> 16)))) * bf2f((uint16_t)(uw[j] >> 16)));
    }
}
// Eight codes of a at `scale`, stored at q + i (8-byte aligned).
__device__ __forceinline__ void store_codes8(uint8_t *q, int i, const float (&a)[8], float scale) {
    uint32_t w[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const uint32_t c = quant_e4m3(a[j], scale);
        w[j >> 2] |= c << (8 * (j & 3));
    }
    *reinterpret_cast<uint2 *>(q + i) = make_uint2(w[0], w[1]);
}
extern "C" __global__ void __launch_bounds__(32 * SQ_ROWS) swiglu_quant_ct(const OrnithSwigluQuantParams p) {
    pdl_entry();
    const int lane = threadIdx.x & 31, r = blockIdx.x * SQ_ROWS + (threadIdx.x >> 5);
    if (r >= p.rows) return;
    const uint16_t *gu = p.gate_up + (size_t)r * 2 * p.inter;
    uint8_t *q = p.q8 + (size_t)r * p.inter;
    float amax = 0.f;
    if (p.inter <= SQ_HELD) {
        constexpr int H = SQ_HELD / 256;
        float a[H][8];
#pragma unroll
        for (int h = 0; h < H; h++) {
            const int i = 8 * lane + 256 * h;
            if (i < p.inter) {
                swiglu8(gu, p.inter, i, a[h]);
#pragma unroll
                for (int j = 0; j < 8; j++) amax = amax_add(amax, a[h][j]);
            }
        }
        amax = warp_max_nan(amax);  // a NaN in the row: the NaN scale, so every code 0x7F (quant_e4m3)
        const float scale = act_scale(amax);
        if (lane == 0) p.scale[r] = scale;
#pragma unroll
        for (int h = 0; h < H; h++) {
            const int i = 8 * lane + 256 * h;
            if (i < p.inter) store_codes8(q, i, a[h], scale);
        }
        return;
    }
    for (int i = 8 * lane; i < p.inter; i += 256) {
        float a[8];
        swiglu8(gu, p.inter, i, a);
#pragma unroll
        for (int j = 0; j < 8; j++) amax = amax_add(amax, a[j]);
    }
    amax = warp_max_nan(amax);
    const float scale = act_scale(amax);
    if (lane == 0) p.scale[r] = scale;
    for (int i = 8 * lane; i < p.inter; i += 256) {
        float a[8];
        swiglu8(gu, p.inter, i, a);
        store_codes8(q, i, a, scale);
    }
}

// Weighted combine + gated shared expert (see OrnithMoeCombinePrefillParams), per token t (blockIdx.y)
// and column c, in the header's order for every column:
//   routed = bf16(sum_j fp32 bf16(ys[row_of[t k + j], c] * weight[t k + j]))  (j = 0..top_k-1 in turn)
//   out[t, c] = bf16(routed + bf16(bf16(sigmoid(gate_logit[t])) * shared_y[t, c]))
// The launcher picks the form by the grid: gridDim.x * 256 < hidden means 8 columns per thread
// (hidden a multiple of 8, rows 16-byte aligned: 16-byte loads of each of a group of up to 8 rows
// issued before their sums; at one column per thread the 2-byte loads ran a 2,048-token chunk's
// 75 MB at ~1.6 TB/s, H100), otherwise one column per thread. Same bits either way.
#define MC_RB 8  // rows whose loads a thread issues before their sums
__device__ __forceinline__ void bf16x8(const uint4 v, float (&x)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        x[2 * j] = bf2f((uint16_t)(w[j] & 0xffffu));
        x[2 * j + 1] = bf2f((uint16_t)(w[j] >> 16));
    }
}
extern "C" __global__ void __launch_bounds__(256) moe_combine_prefill(const OrnithMoeCombinePrefillParams p) {
    pdl_entry();
    const int t = blockIdx.y;
    if (gridDim.x * 256 < p.hidden) {
        const int c = 8 * (blockIdx.x * 256 + threadIdx.x);
        if (c >= p.hidden) return;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int j0 = 0; j0 < p.top_k; j0 += MC_RB) {
            uint4 v[MC_RB];
            float w[MC_RB];
#pragma unroll
            for (int j = 0; j < MC_RB; j++) {
                if (j0 + j < p.top_k) {
                    const int a = t * p.top_k + j0 + j;
                    w[j] = p.weight[a];
                    v[j] = *reinterpret_cast<const uint4 *>(p.ys + (size_t)p.row_of[a] * p.hidden + c);
                }
            }
#pragma unroll
            for (int j = 0; j < MC_RB; j++) {
                if (j0 + j < p.top_k) {
                    float y[8];
                    bf16x8(v[j], y);
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[e] += rbf(y[e] * w[j]);
                }
            }
        }
        const float gate = rbf(sigmoid_f(bf2f(p.gate_logit[(size_t)t * p.gate_stride])));
        float sy[8];
        bf16x8(*reinterpret_cast<const uint4 *>(p.shared_y + (size_t)t * p.hidden + c), sy);
        uint32_t o[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float lo = rbf(acc[2 * e]) + rbf(gate * sy[2 * e]);
            const float hi = rbf(acc[2 * e + 1]) + rbf(gate * sy[2 * e + 1]);
            o[e] = (uint32_t)f2bf(lo) | (uint32_t)f2bf(hi) << 16;
        }
        *reinterpret_cast<uint4 *>(p.out + (size_t)t * p.hidden + c) = make_uint4(o[0], o[1], o[2], o[3]);
        return;
    }
    const int c = blockIdx.x * 256 + threadIdx.x;
    if (c >= p.hidden) return;
    float acc = 0.f;
    for (int j = 0; j < p.top_k; j++) {
        const int a = t * p.top_k + j;
        const float y = bf2f(p.ys[(size_t)p.row_of[a] * p.hidden + c]);
        acc += rbf(y * p.weight[a]);
    }
    const float routed = rbf(acc);
    const float gate = rbf(sigmoid_f(bf2f(p.gate_logit[(size_t)t * p.gate_stride])));
    const float sh = rbf(gate * bf2f(p.shared_y[(size_t)t * p.hidden + c]));
    p.out[(size_t)t * p.hidden + c] = f2bf(routed + sh);
}
