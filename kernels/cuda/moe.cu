// MoE decode: router (softmax -> top-k -> renormalise; alone or fused with its GEMV), and the
// fused tail SwiGLU + FP8 quantisation -> expert down projections -> weighted combine.
#include "common.cuh"

#define ROUTER_MAX_PER_LANE 8  // experts <= 256

// Softmax over lg[0 .. experts) (read through L2: in the fused router another block wrote them),
// top-k, renormalise; one warp, results in oi_row / ow_row [top_k].
__device__ __forceinline__ void router_topk_warp(const uint16_t *lg, int experts, int top_k, int32_t *oi_row, float *ow_row) {
    const int lane = threadIdx.x & 31;
    float v[ROUTER_MAX_PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_PER_LANE; j++) {
        int e = lane + 32 * j;
        v[j] = e < experts ? bf2f(__ldcg(lg + e)) : -INFINITY;
        mx = fmaxf(mx, v[j]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_PER_LANE; j++) {
        int e = lane + 32 * j;
        v[j] = e < experts ? expf(v[j] - mx) : 0.f;
        sum += v[j];
    }
    sum = warp_sum(sum);
    // p = exp(l - max) / sum   (fp32 softmax); -1 marks "taken / absent" (probabilities are >= 0)
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_PER_LANE; j++) v[j] = (lane + 32 * j) < experts ? v[j] / sum : -1.f;
    float tsum = 0.f;
    for (int k = 0; k < top_k; k++) {
        // lane-local best (first index wins among equals: j ascending means index ascending)
        float bv = -2.f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < ROUTER_MAX_PER_LANE; j++)
            if (v[j] > bv) { bv = v[j]; bi = lane + 32 * j; }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
#pragma unroll
        for (int j = 0; j < ROUTER_MAX_PER_LANE; j++)
            if (lane + 32 * j == bi) v[j] = -1.f;
        if (lane == 0) { oi_row[k] = bi; ow_row[k] = bv; }
        tsum += bv;  // sum of the chosen probabilities, in descending order
    }
    __syncwarp();
    if (lane == 0)
        for (int k = 0; k < top_k; k++) ow_row[k] = rbf(ow_row[k] / tsum);  // renormalised in fp32, then bf16
}

// One warp per token.
extern "C" __global__ void __launch_bounds__(32) moe_router_topk(const OrnithRouterParams p) {
    pdl_entry();
    const int t = blockIdx.x;
    router_topk_warp(p.logits + (size_t)t * p.logit_stride, p.experts, p.top_k, p.idx + (size_t)t * p.top_k, p.weight + (size_t)t * p.top_k);
}

// The router GEMV and the top-k in one launch (OrnithRouterGemvParams): one warp per row
// (in / 8 chunks, 8 loads in flight per lane, the single-token GEMV's summation order), then the
// last block to finish (counted with an atomic after a fence, so it sees every block's logits)
// runs router_topk_warp and resets the counter for the next launch.
extern "C" __global__ void __launch_bounds__(256) moe_router_gemv(const OrnithRouterGemvParams p) {
    __shared__ bool last;
    pdl_launch_dependents();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * 8 + warp, rows = p.experts + 1, n16 = p.in / 8;
    const uint4 *w = reinterpret_cast<const uint4 *>(p.w + (size_t)min(row, rows - 1) * p.in);
    if (row < rows) prefetch_range_l2(reinterpret_cast<const uint8_t *>(w), (size_t)p.in * 2);
    pdl_wait();
    if (row < rows) {
        const uint4 *x = reinterpret_cast<const uint4 *>(p.x);
        float acc = 0.f;
        for (int base = lane; base < n16; base += 32 * 8) {
            uint4 wv[8];
#pragma unroll
            for (int u = 0; u < 8; u++) wv[u] = base + 32 * u < n16 ? __ldg(w + base + 32 * u) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < 8; u++) {
                if (base + 32 * u >= n16) break;
                acc = dot8_bf16(wv[u], __ldg(x + base + 32 * u), acc);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) p.logits[row] = f2bf(acc);
    }
    __threadfence();  // this block's logits are visible device-wide before it is counted
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(p.counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (warp == 0) router_topk_warp(p.logits, p.experts, p.top_k, p.idx, p.weight);
    if (threadIdx.x == 0) *p.counter = 0u;
}

// a = bf16(bf16(silu(g)) * u): the SwiGLU of one gate_up element pair (the reference's cast points).
__device__ __forceinline__ float swiglu_bf(const uint16_t *gu, int inter, int i) {
    return rbf(rbf(silu_f(bf2f(gu[i]))) * bf2f(gu[inter + i]));
}

// OrnithMoeDownParams. Block (row group, token t): after the wait, lanes j < top_k read the expert
// indices and prefetch their rows; warp w stages slots w, w + 8 (SwiGLU, amax, scale, E4M3 codes
// into shared memory, the codes and scale of swiglu_quant); then warp w computes row o of every
// slot with one 16-byte load per slot in flight per lane (the loop order of moe_gemv_fp8, so the
// same sums), and lane 0 combines the slots as moe_combine does.
extern "C" __global__ void __launch_bounds__(256) moe_down_combine(const OrnithMoeDownParams p) {
    __shared__ __align__(16) uint8_t aq[ORNITH_MOE_DOWN_MAX_SLOTS * ORNITH_MOE_DOWN_MAX_INTER];
    __shared__ float asc[ORNITH_MOE_DOWN_MAX_SLOTS];
    pdl_launch_dependents();
    const int t = blockIdx.z, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * 8 + warp, k = p.top_k, slots = k + 1, in = p.inter;
    const bool live = row < p.hidden;
    if (live) prefetch_range_l2(p.shared_w + (size_t)row * in, (size_t)in);
    pdl_wait();
    int my_e = 0;
    if (lane < k) {
        my_e = p.idx[t * k + lane];
        if (my_e < 0 || my_e >= p.experts) my_e = 0;  // the router never writes such an index; stay in bounds
        if (live)  // this lane alone pulls the whole row of its slot's expert toward L2
            for (int off = 0; off < in; off += 128) prefetch_l2(p.w + ((size_t)my_e * p.hidden + row) * in + off);
    }
    const uint16_t *gu_t = p.gate_up + (size_t)t * slots * 2 * in;
    for (int j = warp; j < slots; j += 8) {
        const uint16_t *g = gu_t + (size_t)j * 2 * in;
        float amax = 0.f;
        for (int i = lane; i < in; i += 32) amax = fmaxf(amax, fabsf(swiglu_bf(g, in, i)));
        const float sc = act_scale(warp_max(amax));
        for (int i = lane; i < in; i += 32) aq[j * in + i] = quant_e4m3(swiglu_bf(g, in, i), sc);
        if (lane == 0) asc[j] = sc;
    }
    __syncthreads();
    if (p.aq && blockIdx.x == 0) {  // test output: the staged codes and scales
        for (int i = threadIdx.x; i < slots * in; i += blockDim.x) p.aq[(size_t)t * slots * in + i] = aq[i];
        if (threadIdx.x < slots) p.ascale[t * slots + threadIdx.x] = asc[threadIdx.x];
    }
    if (!live) return;
    int ex[ORNITH_MOE_DOWN_MAX_SLOTS];  // expert of slot j (j < top_k), from lane j
    const uint4 *wr[ORNITH_MOE_DOWN_MAX_SLOTS];
#pragma unroll
    for (int j = 0; j < ORNITH_MOE_DOWN_MAX_SLOTS; j++) {
        ex[j] = __shfl_sync(0xffffffffu, my_e, j);
        wr[j] = reinterpret_cast<const uint4 *>(j < k ? p.w + ((size_t)ex[j] * p.hidden + row) * in : p.shared_w + (size_t)row * in);
    }
    float acc[ORNITH_MOE_DOWN_MAX_SLOTS];
#pragma unroll
    for (int j = 0; j < ORNITH_MOE_DOWN_MAX_SLOTS; j++) acc[j] = 0.f;
    const int n16 = in / 16;
    for (int c = lane; c < n16; c += 32) {
        uint4 wv[ORNITH_MOE_DOWN_MAX_SLOTS];
#pragma unroll
        for (int j = 0; j < ORNITH_MOE_DOWN_MAX_SLOTS; j++) wv[j] = j < slots ? __ldg(wr[j] + c) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < ORNITH_MOE_DOWN_MAX_SLOTS; j++)
            if (j < slots) acc[j] = dot16_e4m3(wv[j], *reinterpret_cast<const uint4 *>(aq + j * in + 16 * c), acc[j]);
    }
#pragma unroll
    for (int j = 0; j < ORNITH_MOE_DOWN_MAX_SLOTS; j++) acc[j] = warp_sum(acc[j]);
    if (lane != 0) return;
    // y_j = bf16(sum * s_j * ws_j[o]);  routed = bf16(sum_j bf16(y_j * weight_j));
    // out = bf16(routed + bf16(bf16(sigmoid(gate)) * y_shared))
    float routed = 0.f, y_shared = 0.f;
#pragma unroll
    for (int j = 0; j < ORNITH_MOE_DOWN_MAX_SLOTS; j++) {
        if (j >= slots) break;
        const float ws = j < k ? p.ws[(size_t)ex[j] * p.hidden + row] : p.shared_ws[row];
        const float y = rbf(acc[j] * asc[j] * ws);
        if (p.ys) p.ys[((size_t)t * slots + j) * p.hidden + row] = f2bf(y);
        if (j < k) routed += rbf(y * p.weight[t * k + j]);
        else y_shared = y;
    }
    routed = rbf(routed);
    const float g = rbf(sigmoid_f(bf2f(p.gate_logit[(size_t)t * p.gate_stride])));
    p.out[(size_t)t * p.hidden + row] = f2bf(routed + rbf(g * y_shared));
}
