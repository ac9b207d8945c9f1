// NVFP4A16 weights (compressed-tensors nvfp4-pack-quantized), BF16 activations: the dequantiser
// (prefill: dequantise to bf16, then the BF16 GEMM) and the decode GEMV that dequantises the
// packed codes in registers. The math (ornith_kernels.h, model_spec::nvfp4):
//   wd[o, i] = bf16( e2m1(code[o, i]) * f32( f32(e4m3(ws[o, i/16])) / gs ) )
// with the division and the product single IEEE f32 operations (__fdiv_rn, __fmul_rn: never
// contracted or approximated), rounded to nearest even: bit-identical to the CPU reference.
#include "common.cuh"

#define NVFP4_WARPS 8

// E2M1 code (bit 3 sign, bits 0-2 magnitude index) -> f32, exactly: index m >= 2 is
// 2^((m >> 1) - 1) * (1 + (m & 1) / 2); m = 1 is 0.5, m = 0 is 0.
__device__ __forceinline__ float e2m1_to_f32(uint32_t c) {
    const uint32_t m = c & 7u;
    uint32_t bits = m >= 2u ? (((m >> 1) + 126u) << 23) | ((m & 1u) << 22) : (m == 1u ? 126u << 23 : 0u);
    return __uint_as_float(bits | ((c & 8u) << 28));
}

// The effective scale of a group: f32(e4m3(s)) / gs.
__device__ __forceinline__ float group_scale(uint8_t s, float gs) {
    return __fdiv_rn(e4m3x2_to_f2((uint16_t)s).x, gs);
}

// One dequantised weight as f32 (a bf16 value).
__device__ __forceinline__ float dq(uint32_t code, float s) { return rbf(__fmul_rn(e2m1_to_f32(code), s)); }

// y = wd as bf16 [out, in]: one thread per packed byte (two weights). Grid ceil(out * in / 2 / 256).
extern "C" __global__ void __launch_bounds__(256) nvfp4_dequant(const OrnithNvfp4Params p) {
    pdl_launch_dependents();
    pdl_wait();
    const size_t n = (size_t)p.out * p.in / 2;
    const size_t b = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n) return;
    const size_t i = 2 * b;  // element index of the low nibble; both nibbles share a group (16 | in)
    const size_t o = i / p.in, col = i % p.in;
    const float s = group_scale(p.ws[o * (p.in / 16) + col / 16], p.gs);
    const uint32_t byte = p.w[b];
    p.y[i] = f2bf(__fmul_rn(e2m1_to_f32(byte & 15u), s));
    p.y[i + 1] = f2bf(__fmul_rn(e2m1_to_f32(byte >> 4), s));
}

// acc[t] += sum over one 32-weight chunk (16 code bytes `wv`, two groups with scales s0, s1) of
// wd * x_t, fp32 FMAs in element order; x_t chunk = 4 x 16 bytes of bf16.
template <int T>
__device__ __forceinline__ void chunk32(const uint4 &wv, float s0, float s1, const uint16_t *x, size_t x_stride,
                                        size_t c, float (&acc)[T]) {
    const uint32_t wa[4] = {wv.x, wv.y, wv.z, wv.w};
    float w[32];
#pragma unroll
    for (int e = 0; e < 4; e++)
#pragma unroll
        for (int k = 0; k < 8; k++) w[e * 8 + k] = dq((wa[e] >> (4 * k)) & 15u, e < 2 ? s0 : s1);
#pragma unroll
    for (int t = 0; t < T; t++) {
        const uint4 *xr = reinterpret_cast<const uint4 *>(x + (size_t)t * x_stride) + 4 * c;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const uint4 xv = __ldg(xr + q);
            const uint32_t xa[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                acc[t] = fmaf(w[q * 8 + 2 * e], __uint_as_float(xa[e] << 16), acc[t]);
                acc[t] = fmaf(w[q * 8 + 2 * e + 1], __uint_as_float(xa[e] & 0xffff0000u), acc[t]);
            }
        }
    }
}

// One warp per output row: lane l takes the 32-weight chunks l, l + 32, l + 64, ... in that order
// (16 code bytes and 2 scale bytes each), then the warp sum. Each token's sum runs the same
// operations in the same order whatever `tokens` is, so a row's result is bit-identical alone and
// in a batch.
template <int T>
__device__ __forceinline__ void gemv_nvfp4_row(const OrnithNvfp4Params &p, int row) {
    const int lane = threadIdx.x & 31, n32 = p.in / 32;
    const uint4 *w = reinterpret_cast<const uint4 *>(p.w + (size_t)row * (p.in / 2));
    const uint8_t *ws = p.ws + (size_t)row * (p.in / 16);
    float acc[T];
#pragma unroll
    for (int t = 0; t < T; t++) acc[t] = 0.f;
    for (int c = lane; c < n32; c += 32) {
        const uint4 wv = __ldg(w + c);
        const float s0 = group_scale(ws[2 * c], p.gs), s1 = group_scale(ws[2 * c + 1], p.gs);
        chunk32<T>(wv, s0, s1, p.x, (size_t)p.x_stride, (size_t)c, acc);
    }
#pragma unroll
    for (int t = 0; t < T; t++) {
        const float s = warp_sum(acc[t]);
        if (lane == 0) p.y[(size_t)t * p.y_stride + row] = f2bf(s);
    }
}

// Grid ceil(out / NVFP4_WARPS), block NVFP4_WARPS * 32.
extern "C" __global__ void __launch_bounds__(NVFP4_WARPS * 32) gemv_nvfp4(const OrnithNvfp4Params p) {
    pdl_launch_dependents();
    pdl_wait();
    const int row = blockIdx.x * NVFP4_WARPS + (threadIdx.x >> 5);
    if (row >= p.out) return;
    switch (p.tokens) {
        case 1: gemv_nvfp4_row<1>(p, row); break;
        case 2: gemv_nvfp4_row<2>(p, row); break;
        case 3: gemv_nvfp4_row<3>(p, row); break;
        case 4: gemv_nvfp4_row<4>(p, row); break;
        case 5: gemv_nvfp4_row<5>(p, row); break;
        case 6: gemv_nvfp4_row<6>(p, row); break;
        case 7: gemv_nvfp4_row<7>(p, row); break;
        case 8: gemv_nvfp4_row<8>(p, row); break;
        default: break;
    }
}

// MoE expert GEMV over NVFP4 experts grouped by expert, for a decode group of many tokens: grid
// (ceil(out / NVFP4_WARPS), active + 1, 1), active = min(experts, tokens * top_k). Block y < active
// takes the y-th expert with assignments (active_list; blocks past *active_count exit) and runs
// each of its rows over every (token, slot) routed to it (row_assign[group_offsets[e] ..
// group_offsets[e + 1]], a = token * top_k + slot), MG assignments per pass: each 32-weight chunk
// is loaded once per pass and applied to each. The last block y is the shared
// expert over every token (slot top_k). Every (token, slot, row) is summed in gemv_nvfp4_row's
// order (lane chunks l, l + 32, ..., then the warp sum), so it is bit-identical to gemv_nvfp4 on
// that expert and that row whatever the grouping: the result does not depend on the batch.
#define NVFP4_MG 4
extern "C" __global__ void __launch_bounds__(NVFP4_WARPS * 32) moe_gemv_nvfp4_grouped(const OrnithMoeGemvNvfp4Params p) {
    pdl_launch_dependents();
    pdl_wait();
    const int row = blockIdx.x * NVFP4_WARPS + (threadIdx.x >> 5);
    if (row >= p.out) return;
    const bool shared = blockIdx.y == gridDim.y - 1;
    int a0 = 0, a1 = p.tokens;
    const uint8_t *wb = p.shared_w, *sb = p.shared_ws;
    float gs = p.shared_gs;
    if (!shared) {
        if ((int)blockIdx.y >= *p.active_count) return;
        const int e = p.active_list[blockIdx.y];
        a0 = p.group_offsets[e];
        a1 = p.group_offsets[e + 1];
        wb = p.w + (size_t)e * p.out * (p.in / 2);
        sb = p.ws + (size_t)e * p.out * (p.in / 16);
        gs = p.gs[e];
    }
    const int lane = threadIdx.x & 31, slots = p.top_k + 1, n32 = p.in / 32;
    const uint4 *w = reinterpret_cast<const uint4 *>(wb + (size_t)row * (p.in / 2));
    const uint8_t *ws = sb + (size_t)row * (p.in / 16);
    for (int g0 = a0; g0 < a1; g0 += NVFP4_MG) {
        const int ng = min(NVFP4_MG, a1 - g0);
        int tok[NVFP4_MG], slot[NVFP4_MG];
        const uint16_t *x[NVFP4_MG];
        float acc[NVFP4_MG];
#pragma unroll
        for (int j = 0; j < NVFP4_MG; j++) {
            const int jj = min(j, ng - 1);  // unused lanes of the pass repeat the last assignment
            const int a = shared ? -1 : p.row_assign[g0 + jj];
            tok[j] = shared ? g0 + jj : a / p.top_k;
            slot[j] = shared ? p.top_k : a % p.top_k;
            x[j] = p.x + (size_t)tok[j] * p.x_tok_stride + (size_t)slot[j] * p.x_slot_stride;
            acc[j] = 0.f;
        }
        for (int c = lane; c < n32; c += 32) {
            const uint4 wv = __ldg(w + c);
            const float s0 = group_scale(ws[2 * c], gs), s1 = group_scale(ws[2 * c + 1], gs);
#pragma unroll
            for (int j = 0; j < NVFP4_MG; j++) {
                float a[1] = {acc[j]};
                chunk32<1>(wv, s0, s1, x[j], 0, (size_t)c, a);
                acc[j] = a[0];
            }
        }
#pragma unroll
        for (int j = 0; j < NVFP4_MG; j++) {
            const float sum = warp_sum(acc[j]);
            if (j < ng && lane == 0) p.y[((size_t)tok[j] * slots + slot[j]) * p.out + row] = f2bf(sum);
        }
    }
}
