// Decode GEMV / few-row GEMM: BF16 weights and FP8 (E4M3) W8A8 weights, and the MoE expert GEMV.
// Memory-bound: each warp streams one weight row with 16-byte loads, UNROLL loads in flight per lane.
#include "common.cuh"

#define GEMV_WARPS 8
#define GEMV_UNROLL 4

// Before pdl_wait (see common.cuh): pull the `bytes` of weights from `row` on (one warp's rows,
// contiguous) toward L2, one 128-byte line per lane per step, so the first loads after the wait hit
// L2 instead of DRAM. Weights are never written during decode, so this is safe while the previous
// kernel still runs.
__device__ __forceinline__ void prefetch_range_l2(const void *row, size_t bytes) {
    const char *b = static_cast<const char *>(row);
    for (size_t off = (size_t)(threadIdx.x & 31) * 128; off < bytes; off += 32 * 128) prefetch_l2(b + off);
}

// Dot of 8 bf16 weights with 8 bf16 activations, fp32 FMAs in element order.
__device__ __forceinline__ float dot8_bf16(const uint4 &w, const uint4 &x, float acc) {
    const uint32_t wa[4] = {w.x, w.y, w.z, w.w};
    const uint32_t xa[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int e = 0; e < 4; e++) {
        acc = fmaf(__uint_as_float(wa[e] << 16), __uint_as_float(xa[e] << 16), acc);
        acc = fmaf(__uint_as_float(wa[e] & 0xffff0000u), __uint_as_float(xa[e] & 0xffff0000u), acc);
    }
    return acc;
}

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
#pragma unroll
            for (int t = 0; t < T; t++)
                acc[t] = dot8_bf16(wv[u], __ldg(reinterpret_cast<const uint4 *>(p.x + (size_t)t * p.x_stride) + c), acc[t]);
        }
    }
#pragma unroll
    for (int t = 0; t < T; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0) p.y[(size_t)t * p.y_stride + row] = f2bf(s);
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_bf16(const OrnithGemvBf16Params p) {
    pdl_launch_dependents();
    int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row < p.out) prefetch_range_l2(p.w + (size_t)row * p.in, (size_t)p.in * 2);
    pdl_wait();
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
    pdl_launch_dependents();
    int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row < p.out) prefetch_range_l2(p.w + (size_t)row * p.in, (size_t)p.in);
    pdl_wait();
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

// =============================================================================================
// Single-token GEMVs: the decode step's shape. Same math and cast points as the kernels above; the
// work layout differs so that every lane keeps 8 independent 16-byte weight loads in flight
// whatever the row length:
//   a warp owns R consecutive rows and reads U chunks of each per pass, all R * U = 8 loads issued
//   before the first FMA, with U = 8, 4, 2, 1 where a row has >= 8, >= 4, >= 2, < 2 chunks per
//   lane (ceil(n16 / 32), n16 = 16-byte chunks per row) and R = 8 / U (gemv1_rows).
// So short rows (the MoE down projection: 512 FP8 codes = 32 chunks, R = 8) keep 128 B in flight
// per lane like long ones. Lane l sums chunks l, l + 32, l + 64, ... of each row in that order, as
// the multi-token kernels do, so for one token they produce the same bits. Block = GEMV_WARPS
// warps, grid = ceil(out / (GEMV_WARPS * R)) (x tokens and slots for the MoE form); the Rust
// launchers size grids with the same rule (`gemv1_rows`). __launch_bounds__(256, 4): <= 64
// registers, 32 warps per SM.
// =============================================================================================
__host__ __device__ constexpr int gemv1_u(int n16) {
    return n16 > 7 * 32 ? 8 : n16 > 3 * 32 ? 4 : n16 > 32 ? 2 : 1;
}
__host__ __device__ constexpr int gemv1_rows(int n16) { return 8 / gemv1_u(n16); }

// acc[r] = warp-summed dot of row r (rows of n16 chunks, consecutive from w; only the first nr
// exist, the others read as zeros) with x; FP8 selects E4M3 x E4M3 chunks of 16, else bf16 x bf16
// chunks of 8. Every lane gets the sums.
template <bool FP8, int R, int U>
__device__ __forceinline__ void rows_dot1(const uint4 *w, int nr, const uint4 *x, int n16, float (&acc)[R]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    for (int base = lane; base < n16; base += 32 * U) {
        uint4 wv[R][U];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int c = base + u * 32;
                wv[r][u] = c < n16 && r < nr ? __ldg(w + (size_t)r * n16 + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = base + u * 32;
            if (c >= n16) break;
            const uint4 xv = __ldg(x + c);
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] = FP8 ? dot16_e4m3(wv[r][u], xv, acc[r]) : dot8_bf16(wv[r][u], xv, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = warp_sum(acc[r]);
}

// y[row] = bf16(x . w[row]) (BF16) or bf16((xq . w[row]) * xs * ws[row]) (FP8) for one token.
template <bool FP8, int R, int U>
__device__ __forceinline__ void gemv1_impl(const uint8_t *wb, const float *ws, const uint8_t *x, const float *xs,
                                           uint16_t *y, int in, int out) {
    constexpr int ES = FP8 ? 1 : 2;
    const int n16 = in * ES / 16;
    const int row0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * R;
    if (row0 < out) prefetch_range_l2(wb + (size_t)row0 * in * ES, (size_t)(min(row0 + R, out) - row0) * in * ES);
    pdl_wait();
    if (row0 >= out) return;
    float acc[R];
    rows_dot1<FP8, R, U>(reinterpret_cast<const uint4 *>(wb + (size_t)row0 * in * ES), min(R, out - row0),
                         reinterpret_cast<const uint4 *>(x), n16, acc);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++)
        if (lane == r && row0 + r < out) y[row0 + r] = f2bf(FP8 ? acc[r] * xs[0] * ws[row0 + r] : acc[r]);
}

template <bool FP8>
__device__ __forceinline__ void gemv1(const uint8_t *wb, const float *ws, const uint8_t *x, const float *xs, uint16_t *y,
                                      int in, int out) {
    switch (gemv1_u(in * (FP8 ? 1 : 2) / 16)) {
        case 8: gemv1_impl<FP8, 1, 8>(wb, ws, x, xs, y, in, out); break;
        case 4: gemv1_impl<FP8, 2, 4>(wb, ws, x, xs, y, in, out); break;
        case 2: gemv1_impl<FP8, 4, 2>(wb, ws, x, xs, y, in, out); break;
        default: gemv1_impl<FP8, 8, 1>(wb, ws, x, xs, y, in, out); break;
    }
}

// gemv_bf16 for tokens = 1 (OrnithGemvBf16Params; tokens and strides unused).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 4) gemv_bf16_t1(const OrnithGemvBf16Params p) {
    pdl_launch_dependents();
    gemv1<false>(reinterpret_cast<const uint8_t *>(p.w), nullptr, reinterpret_cast<const uint8_t *>(p.x), nullptr, p.y, p.in, p.out);
}

// gemv_fp8 for tokens = 1 (OrnithGemvFp8Params; tokens and strides unused).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 4) gemv_fp8_t1(const OrnithGemvFp8Params p) {
    pdl_launch_dependents();
    gemv1<true>(p.w, p.ws, p.xq, p.xs, p.y, p.in, p.out);
}

// MoE expert GEMV: grid (ceil(out / (GEMV_WARPS * R)), top_k + 1 slots, tokens), R = gemv1_rows(in / 16).
// Slot top_k is the shared expert, whose rows are known before the router has run (prefetched
// before the wait); a routed expert's index is read after it.
template <int R, int U>
__device__ __forceinline__ void moe_gemv_impl(const OrnithMoeGemvParams &p) {
    const int slot = blockIdx.y, t = blockIdx.z;
    const int row0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * R;
    const size_t in = (size_t)p.in;
    if (slot == p.top_k && row0 < p.out) prefetch_range_l2(p.shared_w + row0 * in, (size_t)(min(row0 + R, p.out) - row0) * in);
    pdl_wait();
    if (row0 >= p.out) return;
    const uint8_t *wb;
    const float *ws;
    if (slot < p.top_k) {
        int e = p.idx[t * p.top_k + slot];
        if (e < 0 || e >= p.experts) e = 0;  // the router never writes such an index; stay in bounds
        wb = p.w + (size_t)e * p.out * in;
        ws = p.ws + (size_t)e * p.out;
    } else {
        wb = p.shared_w;
        ws = p.shared_ws;
    }
    const uint8_t *x = p.xq + (size_t)t * p.x_tok_stride + (size_t)slot * p.x_slot_stride;
    const float xs = p.xs[t * p.xs_tok_stride + slot * p.xs_slot_stride];
    float acc[R];
    rows_dot1<true, R, U>(reinterpret_cast<const uint4 *>(wb + (size_t)row0 * in), min(R, p.out - row0),
                          reinterpret_cast<const uint4 *>(x), p.in / 16, acc);
    const int lane = threadIdx.x & 31, slots = p.top_k + 1;
#pragma unroll
    for (int r = 0; r < R; r++)
        if (lane == r && row0 + r < p.out) p.y[((size_t)t * slots + slot) * p.out + row0 + r] = f2bf(acc[r] * xs * ws[row0 + r]);
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 4) moe_gemv_fp8(const OrnithMoeGemvParams p) {
    pdl_launch_dependents();
    switch (gemv1_u(p.in / 16)) {
        case 8: moe_gemv_impl<1, 8>(p); break;
        case 4: moe_gemv_impl<2, 4>(p); break;
        case 2: moe_gemv_impl<4, 2>(p); break;
        default: moe_gemv_impl<8, 1>(p); break;
    }
}

// MoE expert GEMV grouped by expert, for a decode group of many tokens: grid
// (ceil(out / (GEMV_WARPS * R)), active + 1, 1) where `active = min(experts, tokens * top_k)`.
// Block y < active takes the y-th expert that has assignments (`active_list`, from moe_sort; blocks
// past `*active_count` exit) and runs its rows over every (token, slot) routed to it
// (`row_assign[group_offsets[e] .. group_offsets[e + 1]]`, a = token * top_k + slot); the last
// block y is the shared expert over every token (slot top_k). A warp loads each weight chunk once
// per MG assignments (4, or 2 for the 8-row form, within the register budget) and applies it to each: every (token, slot, row) is summed in exactly
// rows_dot1's order (lane chunks l, l + 32, ..., per u within a pass, then warp_sum) and scaled as
// moe_gemv_impl does, so the result is bit-identical to moe_gemv_fp8 whatever the grouping —
// the weights are read once per expert and step instead of once per (token, slot).
template <int R, int U, int MG>
__device__ __forceinline__ void moe_gemv_grouped_impl(const OrnithMoeGemvParams &p) {
    const int row0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * R;
    const bool shared = blockIdx.y == gridDim.y - 1;
    const size_t in = (size_t)p.in;
    if (shared && row0 < p.out) prefetch_range_l2(p.shared_w + row0 * in, (size_t)(min(row0 + R, p.out) - row0) * in);
    pdl_wait();
    if (row0 >= p.out) return;
    int a0 = 0, a1 = p.tokens;
    const uint8_t *wb = p.shared_w;
    const float *ws = p.shared_ws;
    if (!shared) {
        if ((int)blockIdx.y >= *p.active_count) return;
        const int e = p.active_list[blockIdx.y];
        a0 = p.group_offsets[e];
        a1 = p.group_offsets[e + 1];
        wb = p.w + (size_t)e * p.out * in;
        ws = p.ws + (size_t)e * p.out;
    }
    const int lane = threadIdx.x & 31, slots = p.top_k + 1, n16 = p.in / 16, nr = min(R, p.out - row0);
    const uint4 *w = reinterpret_cast<const uint4 *>(wb + (size_t)row0 * in);
    for (int g0 = a0; g0 < a1; g0 += MG) {
        const int ng = min(MG, a1 - g0);
        int tok[MG], slot[MG];
        const uint4 *x[MG];
        float xs[MG], acc[MG][R];
#pragma unroll
        for (int j = 0; j < MG; j++) {
            const int jj = min(j, ng - 1);  // unused lanes of the pass repeat the last assignment
            const int a = shared ? -1 : p.row_assign[g0 + jj];
            tok[j] = shared ? g0 + jj : a / p.top_k;
            slot[j] = shared ? p.top_k : a % p.top_k;
            x[j] = reinterpret_cast<const uint4 *>(p.xq + (size_t)tok[j] * p.x_tok_stride + (size_t)slot[j] * p.x_slot_stride);
            xs[j] = p.xs[tok[j] * p.xs_tok_stride + slot[j] * p.xs_slot_stride];
#pragma unroll
            for (int r = 0; r < R; r++) acc[j][r] = 0.f;
        }
        for (int base = lane; base < n16; base += 32 * U) {
            uint4 wv[R][U];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const int c = base + u * 32;
                    wv[r][u] = c < n16 && r < nr ? __ldg(w + (size_t)r * n16 + c) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int c = base + u * 32;
                if (c >= n16) break;
#pragma unroll
                for (int j = 0; j < MG; j++) {
                    const uint4 xv = __ldg(x[j] + c);
#pragma unroll
                    for (int r = 0; r < R; r++) acc[j][r] = dot16_e4m3(wv[r][u], xv, acc[j][r]);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < MG; j++) {
#pragma unroll
            for (int r = 0; r < R; r++) acc[j][r] = warp_sum(acc[j][r]);
            if (j >= ng) continue;
#pragma unroll
            for (int r = 0; r < R; r++)
                if (lane == r && row0 + r < p.out)
                    p.y[((size_t)tok[j] * slots + slot[j]) * p.out + row0 + r] = f2bf(acc[j][r] * xs[j] * ws[row0 + r]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 2) moe_gemv_grouped(const OrnithMoeGemvParams p) {
    pdl_launch_dependents();
    switch (gemv1_u(p.in / 16)) {
        case 8: moe_gemv_grouped_impl<1, 8, 4>(p); break;
        case 4: moe_gemv_grouped_impl<2, 4, 4>(p); break;
        case 2: moe_gemv_grouped_impl<4, 2, 4>(p); break;
        default: moe_gemv_grouped_impl<8, 1, 2>(p); break;
    }
}
