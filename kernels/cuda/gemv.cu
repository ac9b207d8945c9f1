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
