// Decode GEMV / few-row GEMM: BF16 weights and FP8 (E4M3) W8A8 weights, and the MoE expert GEMV.
// Memory-bound: each warp streams one weight row with 16-byte loads, UNROLL loads in flight per lane.
#include "common.cuh"

#define GEMV_WARPS 8
#define GEMV_UNROLL 4

// y[t, row] for t < T: one warp, row of `in` bf16 weights; x rows read through L1 (shared by all warps).
template <int T>
__device__ __forceinline__ void gemv_bf16_row(const OrnithGemvBf16Params &p, int row) {
    const int lane = threadIdx.x & 31;
    const uint4 *w = reinterpret_cast<const uint4 *>(p.w + (size_t)row * p.in);
    const int n16 = p.in / 8;  // 16-byte chunks per row
    float acc[T];
#pragma unroll
    for (int t = 0; t < T; t++) acc[t] = 0.f;
    for (int base = lane; base < n16; base += 32 * GEMV_UNROLL) {
        uint4 wv[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            int c = base + u * 32;
            wv[u] = c < n16 ? __ldg(w + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            int c = base + u * 32;
            if (c >= n16) break;
            const uint32_t wa[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
#pragma unroll
            for (int t = 0; t < T; t++) {
                uint4 xv = __ldg(reinterpret_cast<const uint4 *>(p.x + (size_t)t * p.x_stride) + c);
                const uint32_t xa[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    acc[t] = fmaf(__uint_as_float(wa[e] << 16), __uint_as_float(xa[e] << 16), acc[t]);
                    acc[t] = fmaf(__uint_as_float(wa[e] & 0xffff0000u), __uint_as_float(xa[e] & 0xffff0000u), acc[t]);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < T; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0) p.y[(size_t)t * p.y_stride + row] = f2bf(s);
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_bf16(const OrnithGemvBf16Params p) {
    int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= p.out) return;
    switch (p.tokens) {
        case 1: gemv_bf16_row<1>(p, row); break;
        case 2: gemv_bf16_row<2>(p, row); break;
        case 3: gemv_bf16_row<3>(p, row); break;
        case 4: gemv_bf16_row<4>(p, row); break;
        case 5: gemv_bf16_row<5>(p, row); break;
        case 6: gemv_bf16_row<6>(p, row); break;
        case 7: gemv_bf16_row<7>(p, row); break;
        case 8: gemv_bf16_row<8>(p, row); break;
        default: break;
    }
}

// Dot of 16 E4M3 weights with 16 E4M3 activations, fp32 accumulation (products of E4M3 values
// are exact in fp32; the sum rounds).
__device__ __forceinline__ float dot16_e4m3(const uint4 &w, const uint4 &x, float acc) {
    const uint32_t wa[4] = {w.x, w.y, w.z, w.w};
    const uint32_t xa[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float2 w0 = e4m3x2_to_f2((uint16_t)(wa[e] & 0xffff)), w1 = e4m3x2_to_f2((uint16_t)(wa[e] >> 16));
        float2 x0 = e4m3x2_to_f2((uint16_t)(xa[e] & 0xffff)), x1 = e4m3x2_to_f2((uint16_t)(xa[e] >> 16));
        acc = fmaf(w0.x, x0.x, acc);
        acc = fmaf(w0.y, x0.y, acc);
        acc = fmaf(w1.x, x1.x, acc);
        acc = fmaf(w1.y, x1.y, acc);
    }
    return acc;
}

// acc[t] = sum_i e4m3(w[i]) * e4m3(x_t[i]) over one row of `in` codes, one warp.
template <int T>
__device__ __forceinline__ void fp8_row_dot(const uint8_t *wrow, const uint8_t *x, size_t x_stride, int in,
                                            float (&acc)[T]) {
    const int lane = threadIdx.x & 31;
    const uint4 *w = reinterpret_cast<const uint4 *>(wrow);
    const int n16 = in / 16;
#pragma unroll
    for (int t = 0; t < T; t++) acc[t] = 0.f;
    for (int base = lane; base < n16; base += 32 * GEMV_UNROLL) {
        uint4 wv[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            int c = base + u * 32;
            wv[u] = c < n16 ? __ldg(w + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            int c = base + u * 32;
            if (c >= n16) break;
#pragma unroll
            for (int t = 0; t < T; t++) {
                uint4 xv = __ldg(reinterpret_cast<const uint4 *>(x + (size_t)t * x_stride) + c);
                acc[t] = dot16_e4m3(wv[u], xv, acc[t]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < T; t++) acc[t] = warp_sum(acc[t]);
}

template <int T>
__device__ __forceinline__ void gemv_fp8_row(const OrnithGemvFp8Params &p, int row) {
    float acc[T];
    fp8_row_dot<T>(p.w + (size_t)row * p.in, p.xq, (size_t)p.x_stride, p.in, acc);
    if ((threadIdx.x & 31) == 0) {
        float ws = p.ws[row];
#pragma unroll
        for (int t = 0; t < T; t++) p.y[(size_t)t * p.y_stride + row] = f2bf(acc[t] * p.xs[t] * ws);
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_fp8(const OrnithGemvFp8Params p) {
    int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= p.out) return;
    switch (p.tokens) {
        case 1: gemv_fp8_row<1>(p, row); break;
        case 2: gemv_fp8_row<2>(p, row); break;
        case 3: gemv_fp8_row<3>(p, row); break;
        case 4: gemv_fp8_row<4>(p, row); break;
        case 5: gemv_fp8_row<5>(p, row); break;
        case 6: gemv_fp8_row<6>(p, row); break;
        case 7: gemv_fp8_row<7>(p, row); break;
        case 8: gemv_fp8_row<8>(p, row); break;
        default: break;
    }
}

// MoE expert GEMV: grid (rows / GEMV_WARPS, top_k + 1 slots, tokens). Slot top_k is the shared expert.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) moe_gemv_fp8(const OrnithMoeGemvParams p) {
    int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    int slot = blockIdx.y, t = blockIdx.z;
    if (row >= p.out) return;
    const uint8_t *w;
    float ws;
    if (slot < p.top_k) {
        int e = p.idx[t * p.top_k + slot];
        if (e < 0 || e >= p.experts) e = 0;  // the router never writes such an index; stay in bounds
        w = p.w + ((size_t)e * p.out + row) * p.in;
        ws = p.ws[(size_t)e * p.out + row];
    } else {
        w = p.shared_w + (size_t)row * p.in;
        ws = p.shared_ws[row];
    }
    const uint8_t *x = p.xq + (size_t)t * p.x_tok_stride + (size_t)slot * p.x_slot_stride;
    float xs = p.xs[t * p.xs_tok_stride + slot * p.xs_slot_stride];
    float acc[1];
    fp8_row_dot<1>(w, x, 0, p.in, acc);
    if ((threadIdx.x & 31) == 0) {
        int slots = p.top_k + 1;
        p.y[((size_t)t * slots + slot) * p.out + row] = f2bf(acc[0] * xs * ws);
    }
}

// =============================================================================================
// v2 decode GEMVs. Same math and cast points as the kernels above (fp32 sums of exact products,
// one bf16 rounding of the scaled sum); only the work layout and the E4M3 decoding differ.
//  * Persistent warps: the launcher sizes the grid to the resident blocks (SMs x occupancy, at
//    most one wave) and every warp walks row groups g = warp * gridDim.x + block, +total warps.
//  * Row teams: G lanes (a power of two, G * U <= in/16 chunks where possible) share one row, so
//    a warp covers 32/G rows at once and every lane has U independent 16-byte weight loads in
//    flight (U = 8: 128 B per lane) even for short rows (the MoE down rows are 512 B).
//  * Weights are streamed once: ld.global.nc with L1::no_allocate keeps L1 for the x rows.
//  * FP8: x is decoded once per block into shared memory as x * 2^112 (exact: every E4M3 value
//    times a power of two), and each weight code is decoded with integer ops only, as w * 2^-120:
//    the code's sign goes to bit 31 and its 7 exponent/mantissa bits to bits 26..20 of an fp32,
//    whose value is then 2^(e-127) (1 + m/8) = w * 2^-120 for e > 0 and, as an fp32 denormal,
//    m * 2^-129 = w * 2^-120 for e = 0. Each product is w * x * 2^-8: exact (<= 8 significant
//    bits, a multiple of 2^-26, so never denormal), and every partial sum is a multiple of 2^-26
//    below 2^24, so the fp32 sum rounds exactly as the unscaled one; s * 256 restores it exactly.
//    (The E4M3 NaN codes 0x7f/0xff, which no quantiser emits, decode to +-480 here, not NaN.)
// =============================================================================================
#define GEMV2_WARPS 8
#define GEMV2_MIN_BLOCKS 3
// Shared-memory capacity for decoded x rows (floats): T * in (gemv_fp8_v2) or
// tokens * (x_slot_stride ? slots : 1) * in (moe_gemv_fp8_v2) must not exceed it; the launchers check.
#define GEMV2_X_FLOATS 8192
// Weight chunks in flight per lane (FP8): 8 (128 B) for 1-2 tokens, 4 for 3-4, 2 above, where the T x
// float4s per chunk would otherwise spill.
__host__ __device__ constexpr int gemv2_fp8_u(int tokens) { return tokens <= 2 ? 8 : tokens <= 4 ? 4 : 2; }

__device__ __forceinline__ uint4 ld_stream16(const uint4 *p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// Team size: the largest power of two G <= 32 with G * u <= n16 (1 if n16 < u). The Rust
// launchers mirror this (`gemv2_team`) to size the grid.
__device__ __forceinline__ int gemv2_team(int n16, int u) {
    int g = 32;
    while (g > 1 && g * u > n16) g >>= 1;
    return g;
}

// Asks L2 for the weight chunks this lane reads in its first pass over a row: issued before the
// block stages x (a dependent global read plus a barrier), so the first weight loads find L2 warm.
__device__ __forceinline__ void prefetch_first_pass(const uint4 *w, int n16, int G, int lt, int u) {
    for (int i = 0, c = lt; i < u && c < n16; i++, c += G) asm volatile("prefetch.global.L2 [%0];" ::"l"(w + c));
}

// Sum over the G lanes of a team (xor offsets < G stay inside it); every lane gets the sum.
__device__ __forceinline__ float team_sum(float v, int g) {
    for (int o = g >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Byte j of q (an E4M3 code) as the fp32 value code * 2^-120 (see the header comment).
template <int J>
__device__ __forceinline__ float e4m3_pow2m120(uint32_t q) {
    const int32_t top = (int32_t)(q << (24 - 8 * J));  // code in bits 31..24
    return __int_as_float((top >> 4) & (int32_t)0x87f00000);
}

template <int T>
__device__ __forceinline__ void gemv_bf16_v2_impl(const OrnithGemvBf16Params &p) {
    constexpr int U = T <= 2 ? 8 : 4;  // keeps U * T x chunks within the register budget
    const int n16 = p.in >> 3;
    const int G = gemv2_team(n16, U), R = 32 / G;
    const int lane = threadIdx.x & 31, team = lane / G, lt = lane & (G - 1);
    const int groups = (p.out + R - 1) / R, nwarps = gridDim.x * GEMV2_WARPS;
    for (int g = (threadIdx.x >> 5) * gridDim.x + blockIdx.x; g < groups; g += nwarps) {
        const int row = g * R + team, rrow = min(row, p.out - 1);  // spare teams reread the last row
        const uint4 *w = reinterpret_cast<const uint4 *>(p.w + (size_t)rrow * p.in);
        float acc[T];
#pragma unroll
        for (int t = 0; t < T; t++) acc[t] = 0.f;
        for (int base = lt; base < n16; base += G * U) {
            uint4 wv[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int c = base + u * G;
                wv[u] = c < n16 ? ld_stream16(w + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int c = base + u * G;
                if (c >= n16) break;
                const uint32_t wa[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
#pragma unroll
                for (int t = 0; t < T; t++) {
                    const uint4 xv = __ldg(reinterpret_cast<const uint4 *>(p.x + (size_t)t * p.x_stride) + c);
                    const uint32_t xa[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        acc[t] = fmaf(__uint_as_float(wa[e] << 16), __uint_as_float(xa[e] << 16), acc[t]);
                        acc[t] = fmaf(__uint_as_float(wa[e] & 0xffff0000u), __uint_as_float(xa[e] & 0xffff0000u), acc[t]);
                    }
                }
            }
        }
#pragma unroll
        for (int t = 0; t < T; t++) {
            const float s = team_sum(acc[t], G);
            if (lt == 0 && row < p.out) p.y[(size_t)t * p.y_stride + row] = f2bf(s);
        }
    }
}

extern "C" __global__ void __launch_bounds__(GEMV2_WARPS * 32, GEMV2_MIN_BLOCKS) gemv_bf16_v2(const OrnithGemvBf16Params p) {
    switch (p.tokens) {
        case 1: gemv_bf16_v2_impl<1>(p); break;
        case 2: gemv_bf16_v2_impl<2>(p); break;
        case 3: gemv_bf16_v2_impl<3>(p); break;
        case 4: gemv_bf16_v2_impl<4>(p); break;
        case 5: gemv_bf16_v2_impl<5>(p); break;
        case 6: gemv_bf16_v2_impl<6>(p); break;
        case 7: gemv_bf16_v2_impl<7>(p); break;
        case 8: gemv_bf16_v2_impl<8>(p); break;
        default: break;
    }
}

// Decodes `rows` x rows of `in` E4M3 codes into xs as x * 2^112, row r = t * per_tok + s read
// from x + t * tok_stride + s * slot_stride. Layout per row: float4 (k, c) at k * n16 + c holds
// elements 16c + 4k .. 16c + 4k + 3, so a team reading chunk c = lt + G u for fixed k hits
// consecutive float4s (no bank conflicts), and teams reading the same c share a broadcast.
__device__ __forceinline__ void stage_x_fp8(float4 *xs, const uint8_t *x, size_t tok_stride, size_t slot_stride,
                                            int tokens, int per_tok, int in) {
    const int n16 = in >> 4, per_row = n16 * 4;
    for (int i = threadIdx.x; i < tokens * per_tok * per_row; i += blockDim.x) {
        const int r = i / per_row, q4 = i - r * per_row, c = q4 >> 2, k = q4 & 3;
        const int t = r / per_tok, s = r - t * per_tok;
        const uint32_t q = *reinterpret_cast<const uint32_t *>(x + t * tok_stride + s * slot_stride + 4 * (size_t)q4);
        const float2 a = e4m3x2_to_f2((uint16_t)(q & 0xffff)), b = e4m3x2_to_f2((uint16_t)(q >> 16));
        const float sc = 0x1p112f;
        xs[(size_t)r * per_row + k * n16 + c] = make_float4(a.x * sc, a.y * sc, b.x * sc, b.y * sc);
    }
}

// acc[t] += sum over this lane's chunks of w * x_t * 2^-8 (see the header comment); one team
// shares the row `w` (n16 chunks); x row t starts at float4 xs + t * x_row_f4.
template <int T>
__device__ __forceinline__ void fp8_team_dot(const uint4 *w, const float4 *xs, int x_row_f4, int n16, int G, int lt,
                                             float (&acc)[T]) {
    constexpr int U = gemv2_fp8_u(T);
    for (int base = lt; base < n16; base += G * U) {
        uint4 wv[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = base + u * G;
            wv[u] = c < n16 ? ld_stream16(w + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = base + u * G;
            if (c >= n16) break;
            const uint32_t wa[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float w0 = e4m3_pow2m120<0>(wa[k]), w1 = e4m3_pow2m120<1>(wa[k]);
                const float w2 = e4m3_pow2m120<2>(wa[k]), w3 = e4m3_pow2m120<3>(wa[k]);
#pragma unroll
                for (int t = 0; t < T; t++) {
                    const float4 xv = xs[t * x_row_f4 + k * n16 + c];
                    acc[t] = fmaf(w0, xv.x, acc[t]);
                    acc[t] = fmaf(w1, xv.y, acc[t]);
                    acc[t] = fmaf(w2, xv.z, acc[t]);
                    acc[t] = fmaf(w3, xv.w, acc[t]);
                }
            }
        }
    }
}

template <int T>
__device__ __forceinline__ void gemv_fp8_v2_impl(const OrnithGemvFp8Params &p, float4 *xs) {
    const int n16 = p.in >> 4;
    const int G = gemv2_team(n16, gemv2_fp8_u(T)), R = 32 / G;
    const int groups = (p.out + R - 1) / R, nwarps = gridDim.x * GEMV2_WARPS;
    if ((int)blockIdx.x >= groups) return;  // no work for this block (uniform, before the barrier)
    const int lane = threadIdx.x & 31, team = lane / G, lt = lane & (G - 1);
    const int g0 = (threadIdx.x >> 5) * gridDim.x + blockIdx.x;
    if (g0 < groups)
        prefetch_first_pass(reinterpret_cast<const uint4 *>(p.w + (size_t)min(g0 * R + team, p.out - 1) * p.in), n16, G, lt,
                            gemv2_fp8_u(T));
    stage_x_fp8(xs, p.xq, (size_t)p.x_stride, 0, T, 1, p.in);
    __syncthreads();
    for (int g = g0; g < groups; g += nwarps) {
        const int row = g * R + team, rrow = min(row, p.out - 1);
        float acc[T];
#pragma unroll
        for (int t = 0; t < T; t++) acc[t] = 0.f;
        fp8_team_dot<T>(reinterpret_cast<const uint4 *>(p.w + (size_t)rrow * p.in), xs, 4 * n16, n16, G, lt, acc);
        const float ws = p.ws[rrow];
#pragma unroll
        for (int t = 0; t < T; t++) {
            const float s = team_sum(acc[t], G) * 256.f;  // exact: undoes the 2^-8 of the products
            if (lt == 0 && row < p.out) p.y[(size_t)t * p.y_stride + row] = f2bf(s * p.xs[t] * ws);
        }
    }
}

extern "C" __global__ void __launch_bounds__(GEMV2_WARPS * 32, GEMV2_MIN_BLOCKS) gemv_fp8_v2(const OrnithGemvFp8Params p) {
    __shared__ float4 xs[GEMV2_X_FLOATS / 4];
    switch (p.tokens) {
        case 1: gemv_fp8_v2_impl<1>(p, xs); break;
        case 2: gemv_fp8_v2_impl<2>(p, xs); break;
        case 3: gemv_fp8_v2_impl<3>(p, xs); break;
        case 4: gemv_fp8_v2_impl<4>(p, xs); break;
        case 5: gemv_fp8_v2_impl<5>(p, xs); break;
        case 6: gemv_fp8_v2_impl<6>(p, xs); break;
        case 7: gemv_fp8_v2_impl<7>(p, xs); break;
        case 8: gemv_fp8_v2_impl<8>(p, xs); break;
        default: break;
    }
}

// MoE expert GEMV, v2: the work items (token t, slot j, row group) are walked by persistent warps
// (row groups fastest, so neighbouring warps stream neighbouring rows of one expert); the grid is
// 1-D. The x rows of every (t, j) (or of every t when x_slot_stride is 0) are staged once per block.
extern "C" __global__ void __launch_bounds__(GEMV2_WARPS * 32, GEMV2_MIN_BLOCKS) moe_gemv_fp8_v2(const OrnithMoeGemvParams p) {
    __shared__ float4 xs[GEMV2_X_FLOATS / 4];
    const int slots = p.top_k + 1, per_tok = p.x_slot_stride ? slots : 1;
    const int n16 = p.in >> 4;
    const int G = gemv2_team(n16, gemv2_fp8_u(1)), R = 32 / G;
    const int rgroups = (p.out + R - 1) / R, items = p.tokens * slots * rgroups, nwarps = gridDim.x * GEMV2_WARPS;
    if ((int)blockIdx.x >= items) return;
    const int lane = threadIdx.x & 31, team = lane / G, lt = lane & (G - 1);
    // weight row and row scale of work item `it` for this lane's team (the row clamped in bounds)
    auto row_of = [&](int it, float *ws) -> const uint8_t * {
        const int rg = it % rgroups, ts = it / rgroups, slot = ts % slots, t = ts / slots;
        const int rrow = min(rg * R + team, p.out - 1);
        if (slot == p.top_k) {
            if (ws) *ws = __ldg(p.shared_ws + rrow);
            return p.shared_w + (size_t)rrow * p.in;
        }
        int e = __ldg(p.idx + t * p.top_k + slot);
        if (e < 0 || e >= p.experts) e = 0;  // the router never writes such an index; stay in bounds
        if (ws) *ws = __ldg(p.ws + (size_t)e * p.out + rrow);
        return p.w + ((size_t)e * p.out + rrow) * p.in;
    };
    const int it0 = (threadIdx.x >> 5) * gridDim.x + blockIdx.x;
    if (it0 < items) prefetch_first_pass(reinterpret_cast<const uint4 *>(row_of(it0, nullptr)), n16, G, lt, gemv2_fp8_u(1));
    stage_x_fp8(xs, p.xq, (size_t)p.x_tok_stride, (size_t)p.x_slot_stride, p.tokens, per_tok, p.in);
    __syncthreads();
    for (int it = it0; it < items; it += nwarps) {
        const int rg = it % rgroups, ts = it / rgroups, slot = ts % slots, t = ts / slots;
        const int row = rg * R + team;
        float ws;
        const uint8_t *w = row_of(it, &ws);
        float acc[1] = {0.f};
        const int xr = t * per_tok + (per_tok > 1 ? slot : 0);
        fp8_team_dot<1>(reinterpret_cast<const uint4 *>(w), xs + (size_t)xr * 4 * n16, 0, n16, G, lt, acc);
        const float s = team_sum(acc[0], G) * 256.f;  // exact: undoes the 2^-8 of the products
        if (lt == 0 && row < p.out) {
            const float xsc = p.xs[t * p.xs_tok_stride + slot * p.xs_slot_stride];
            p.y[((size_t)t * slots + slot) * p.out + row] = f2bf(s * xsc * ws);
        }
    }
}
