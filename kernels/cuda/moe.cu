// MoE decode: router softmax -> top-k -> renormalise, SwiGLU + FP8 quantisation, weighted combine.
#include "common.cuh"

#define ROUTER_MAX_PER_LANE 8  // experts <= 256

// One warp per token.
extern "C" __global__ void __launch_bounds__(32) moe_router_topk(const OrnithRouterParams p) {
    pdl_entry();
    const int t = blockIdx.x, lane = threadIdx.x;
    const uint16_t *lg = p.logits + (size_t)t * p.logit_stride;
    float v[ROUTER_MAX_PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_PER_LANE; j++) {
        int e = lane + 32 * j;
        v[j] = e < p.experts ? bf2f(lg[e]) : -INFINITY;
        mx = fmaxf(mx, v[j]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_PER_LANE; j++) {
        int e = lane + 32 * j;
        v[j] = e < p.experts ? expf(v[j] - mx) : 0.f;
        sum += v[j];
    }
    sum = warp_sum(sum);
    // p = exp(l - max) / sum   (fp32 softmax); -1 marks "taken / absent" (probabilities are >= 0)
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_PER_LANE; j++) v[j] = (lane + 32 * j) < p.experts ? v[j] / sum : -1.f;
    float tsum = 0.f;
    int32_t *oi_row = p.idx + (size_t)t * p.top_k;
    float *ow_row = p.weight + (size_t)t * p.top_k;
    // the k-th choice is kept by lane k (top_k <= 32) and written once at the end: reading the
    // weights back from memory would cost a round trip per choice
    float my_w = 0.f;
    int my_i = 0;
    for (int k = 0; k < p.top_k; k++) {
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
        if (lane == k) { my_i = bi; my_w = bv; }
        tsum += bv;  // sum of the chosen probabilities, in descending order (every lane the same)
    }
    if (lane < p.top_k) {
        oi_row[lane] = my_i;
        ow_row[lane] = rbf(my_w / tsum);  // renormalised in fp32, then bf16
    }
}

// One block per (t, slot) row: a = bf16(bf16(silu(g)) * u), then per-row FP8 quantisation.
extern "C" __global__ void __launch_bounds__(256) swiglu_quant(const OrnithSwigluQuantParams p) {
    pdl_entry();
    __shared__ float sh[32];
    const int r = blockIdx.x;
    swiglu_q8_row(p.gate_up + (size_t)r * 2 * p.inter, p.inter, p.q8 + (size_t)r * p.inter, p.scale + r, sh);
}

// SwiGLU into bf16 rows (NVFP4A16 experts take bf16 activations): grid (ceil(inter / 256), rows),
// out[r, i] = bf16(bf16(silu(g)) * u) — swiglu_quant's value before its quantisation.
extern "C" __global__ void __launch_bounds__(256) swiglu_bf16(const OrnithSwigluParams p) {
    pdl_entry();
    const int r = blockIdx.y, i = blockIdx.x * 256 + threadIdx.x;
    if (i >= p.inter) return;
    const uint16_t *gu = p.gate_up + (size_t)r * 2 * p.inter;
    p.out[(size_t)r * p.inter + i] = f2bf(swiglu_val(gu[i], gu[p.inter + i]));
}

// grid (ceil(hidden / 256), tokens): routed + gated shared expert (and the residual fold, fold
// != NULL), common.cuh's moe_combine_elem.
extern "C" __global__ void __launch_bounds__(256) moe_combine(const OrnithMoeCombineParams p) {
    pdl_entry();
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i < p.hidden) moe_combine_elem(p, blockIdx.y, i);
}
