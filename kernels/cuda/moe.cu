// MoE decode: router softmax -> top-k -> renormalise, SwiGLU + FP8 quantisation, weighted combine.
#include "common.cuh"

// One warp per token (common.cuh's router_topk_warp).
extern "C" __global__ void __launch_bounds__(32) moe_router_topk(const OrnithRouterParams p) {
    pdl_entry();
    router_topk_warp(p, blockIdx.x, threadIdx.x);
}

// One block per (t, slot) row: a = bf16(bf16(silu(g)) * u), then per-row FP8 quantisation.
extern "C" __global__ void __launch_bounds__(256) swiglu_quant(const OrnithSwigluQuantParams p) {
    pdl_entry();
    __shared__ float sh[32];
    const int r = blockIdx.x;
    swiglu_q8_row(p.gate_up + (size_t)r * 2 * p.inter, p.inter, p.q8 + (size_t)r * p.inter, p.scale + r, sh);
}

// SwiGLU into bf16 rows (NVFP4A16 experts take bf16 activations): one thread per output element
// e = r * inter + i over a 1-D grid (a prefill step's rows: 65,536 at 8,192 tokens x top-8, past
// grid.y's 65,535), out[r, i] = bf16(bf16(silu(g)) * u) — swiglu_quant's value before its
// quantisation.
extern "C" __global__ void __launch_bounds__(256) swiglu_bf16(const OrnithSwigluParams p) {
    pdl_entry();
    const size_t e = (size_t)blockIdx.x * 256 + threadIdx.x;
    if (e >= (size_t)p.rows * p.inter) return;
    const size_t r = e / p.inter, i = e % p.inter;
    const uint16_t *gu = p.gate_up + r * 2 * p.inter;
    p.out[e] = f2bf(swiglu_val(gu[i], gu[p.inter + i]));
}

// grid (ceil(hidden / 256), tokens): routed + gated shared expert (and the residual fold, fold
// != NULL), common.cuh's moe_combine_elem.
extern "C" __global__ void __launch_bounds__(256) moe_combine(const OrnithMoeCombineParams p) {
    pdl_entry();
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i < p.hidden) moe_combine_elem(p, blockIdx.y, i);
}
