// Device helpers shared by every kernel file (included, never compiled alone).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include "../include/ornith_kernels.h"

// Programmatic dependent launch (PTX griddepcontrol: sm_90 and sm_121 alike). The runtime may launch
// a kernel with the programmatic-stream-serialization attribute (cuda::Pdl says which kernels), so
// its blocks may be scheduled while the previous kernel in the stream is still running:
//  * pdl_wait() returns once every prerequisite grid has completed and its writes are visible. A
//    kernel calls it before its first read of anything an earlier kernel wrote AND before its first
//    global write (an earlier kernel may still be reading that memory). Every kernel calls it on
//    every path that touches global memory (kernels/src/lib.rs checks each PTX entry has one), so
//    ordering stays transitive: a grid completes only after its own wait, hence after its
//    predecessor's completion.
//  * pdl_launch_dependents() lets the next kernel be scheduled once every block of this grid has
//    issued it (or exited). It changes when the next kernel starts, never what it sees.
//  * Before the wait a kernel may only read data no kernel of a step ever writes: the weights,
//    written once at load. The decode products (gemv.cu) issue their first round of weight loads
//    before the wait ("weights first"); nothing else reads or writes global memory before it,
//    with one exception: the per-slot MoE down products read their routed expert's index before
//    the wait, from L2, after a gate|up that lets them launch only once the index's writer has
//    completed (gemv.cu, moe_routed_index_early).
//  * Data an earlier kernel wrote is read with ordinary (coherent) loads, never __ldg /
//    ld.global.nc: a non-coherent load promises memory that is read-only for the kernel's whole
//    lifetime, which under PDL it is not (the kernel starts before its producer finishes), so the
//    compiler may issue it before the wait and the non-coherent cache may serve a stale line. It
//    did: with __ldg activation loads the wide NVFP4 product gave tokens 8.. of a 9-to-13-row
//    decode group different bits under PDL (H200; cuda_model's batch_invariance, the NVFP4A16
//    shallow preset). __ldg stays on the weights.
// Launched without the attribute (or by a driver that ignores it) both instructions are no-ops.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// The usual kernel entry: let the next kernel be scheduled, then wait for the previous one.
__device__ __forceinline__ void pdl_entry() {
    pdl_launch_dependents();
    pdl_wait();
}

// Whether this block is the last of `blocks` to reach the arrival counter `ticket` (the split
// products' partials meet through it: gemv.cu's gemv_wide_body, gdn_out_proj and the MoE
// combine epilogue; attention.cu's combine quantises a row through it). Called by every thread
// of the block; the answer is the same for all. The block's stores are ordered before thread 0's
// fence by the barrier, and the fence is cumulative (PTX memory model: a fence.sc orders the
// writes its thread has observed, the barrier's included), so thread 0 alone fences before it
// counts the block in, as cooperative groups' grid sync does. The last block resets the counter
// to zero for the next launch, and its thread 0 fences again before the barrier that releases
// the block to read the others' stores (through L2: __ldcg).
__device__ __forceinline__ bool last_to_arrive(uint32_t *ticket, uint32_t blocks) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const bool l = atomicAdd(ticket, 1u) == blocks - 1;
        if (l) {
            atomicExch(ticket, 0u);
            __threadfence();
        }
        last = l;
    }
    __syncthreads();
    return last;
}

// bf16 bits <-> float. bf16 -> float is exact; float -> bf16 rounds to nearest even (NaN kept).
__device__ __forceinline__ float bf2f(uint16_t b) { return __uint_as_float(((uint32_t)b) << 16); }
__device__ __forceinline__ uint16_t f2bf(float f) {
    __nv_bfloat16 h = __float2bfloat16_rn(f);
    return *reinterpret_cast<uint16_t *>(&h);
}
// Round a float to bf16 precision and back.
__device__ __forceinline__ float rbf(float f) { return bf2f(f2bf(f)); }

// FP8 E4M3 encode: round to nearest even, saturate to +-448 (NaN -> NaN code).
__device__ __forceinline__ uint8_t f2e4m3(float f) {
    return (uint8_t)__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
}
// Two E4M3 codes (low byte first) -> two floats (exact: every E4M3 value is a half).
__device__ __forceinline__ float2 e4m3x2_to_f2(uint16_t two) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)two, __NV_E4M3);
    __half2 hh = *reinterpret_cast<__half2 *>(&h);
    return __half22float2(hh);
}

// The row max of |x| for the FP8 activation scale keeps a NaN (cpu::fp8::quantize_act_row gives a
// row holding a NaN the NaN scale and every code 0x7F; fmaxf would drop the NaN and quantise the
// row to finite codes). A max does not depend on the order, NaN or not.
__device__ __forceinline__ float max_nan(float m, float v) { return (m != m || v != v) ? __int_as_float(0x7fc00000) : fmaxf(m, v); }
__device__ __forceinline__ float amax_add(float m, float x) { return max_nan(m, fabsf(x)); }
struct SumOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct MaxNanOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return max_nan(a, b); }
};
// Warp-wide reduction (xor butterfly: every lane gets the result).
template <class Op> __device__ __forceinline__ float warp_reduce(float v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Block-wide reduction (blockDim.x a multiple of 32, at most 1024): each warp's result through
// sh32, the warps' results reduced by every warp (lanes past the warp count hold `pad`). Every
// thread gets the result.
template <class Op> __device__ __forceinline__ float block_reduce(float v, float *sh32, float pad, Op op) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) sh32[wid] = v;
    __syncthreads();
    float r = lane < nw ? sh32[lane] : pad;
    return warp_reduce(r, op);
}
__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, SumOp{}); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce(v, MaxOp{}); }
__device__ __forceinline__ float block_sum(float v, float *sh32) { return block_reduce(v, sh32, 0.f, SumOp{}); }
// (padding -inf: it must not win for negative maxima)
__device__ __forceinline__ float block_max(float v, float *sh32) { return block_reduce(v, sh32, -INFINITY, MaxOp{}); }
__device__ __forceinline__ float warp_max_nan(float v) { return warp_reduce(v, MaxNanOp{}); }
__device__ __forceinline__ float block_max_nan(float v, float *sh32) { return block_reduce(v, sh32, -INFINITY, MaxNanOp{}); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

#define ROUTER_MAX_PER_LANE 8  // experts <= 256

// The router's top-k of token t by one warp (lane = its lane): softmax over the experts' logits
// (fp32), the top_k largest probabilities (ties: the lower expert index), renormalised to sum 1
// and rounded to bf16; writes idx[t, 0..top_k) and weight[t, 0..top_k). moe_router_topk runs one
// warp per token, moe_route_sort (moe_prefill.cu) the warps of its block, so both give these bits.
__device__ __forceinline__ void router_topk_warp(const OrnithRouterParams &p, int t, int lane) {
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

// The gated RMSNorm of one (token, head) row of `dim` <= 128 values by one warp (the CPU reference
// is cpu::norm::gated_rms_norm): element i = lane + 32 j (j < 4) of the row;
//   ss  = the lane's fp32 fma over its j in order, then warp_sum (xor butterfly)
//   n   = bf16(o[i] * rsqrt(ss / dim + eps));  n = bf16(w[i] * n)   (a plain weight, not 1 + w)
//   out = bf16(n * silu(z[i]))
// Both the gated_rmsnorm kernel (gdn.cu) and the GDN output projection's prologue (gemv.cu:
// gdn_out_proj) call it, so they give the same bits; store(i, bits) writes element i.
template <class Store>
__device__ __forceinline__ void gated_norm_warp(const uint16_t *o, const uint16_t *z, const uint16_t *w, int dim, float eps, Store store) {
    const int lane = threadIdx.x & 31;
    // weight and gate are loaded with o, before the reduction (their latency overlaps it)
    float x[4], wi[4], zv[4], ss = 0.f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int i = lane + 32 * j;
        const bool in = i < dim;
        x[j] = in ? bf2f(o[i]) : 0.f;
        wi[j] = in ? bf2f(w[i]) : 0.f;
        zv[j] = in ? bf2f(z[i]) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < 4; j++) ss = fmaf(x[j], x[j], ss);
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / (float)dim + eps);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int i = lane + 32 * j;
        if (i >= dim) continue;
        float n = rbf(x[j] * inv);
        n = rbf(wi[j] * n);
        store(i, f2bf(n * silu_f(zv[j])));
    }
}

// The steps of the zero-centred RMSNorm with its residual add, in the order rmsnorm_residual
// (norm.cu) and the decode products' norm prologue (gemv.cu) both take them, so the two give the
// same bits (the CPU reference is ornith-runtime/src/cpu/norm.rs):
//   h  = bf16(res + add)                     (the residual stream is bf16)
//   ss = fma(h, h, ss)                       (per thread, elements i = thread + 256 j, j ascending;
//                                             then block_sum over 256 threads)
//   y  = bf16(h * rsqrt(ss / hidden + eps) * (1 + w))
__device__ __forceinline__ float rms_add(float res, uint16_t add) { return rbf(res + bf2f(add)); }
__device__ __forceinline__ float rms_inv(float ss, int hidden, float eps) { return rsqrtf(ss / (float)hidden + eps); }
__device__ __forceinline__ float rms_out(float h, float inv, uint16_t w) { return rbf(h * inv * (1.f + bf2f(w))); }

// The MoE combine of token t's hidden element i (OrnithMoeCombineParams; moe.cu's moe_combine and
// the per-slot down products' epilogue, gemv.cu, so both give the same bits):
//   routed = bf16(sum_j bf16(ys[t, j, i] * weight[t, j]))   (j ascending, fp32 sum)
//   shared = bf16(bf16(sigmoid(gate_logit[t])) * ys[t, top_k, i]);  out[t, i] = bf16(routed + shared)
// and with a fold the residual first takes the old delta: fold[t, i] = bf16(fold + out_old).
// The expert outputs are read through L2 (__ldcg): the epilogue reads other blocks' stores.
__device__ __forceinline__ void moe_combine_elem(const OrnithMoeCombineParams &p, int t, int i) {
    const int slots = p.top_k + 1;
    const uint16_t *ys = p.ys + (size_t)t * slots * p.hidden + i;
    float routed = 0.f;
    for (int j = 0; j < p.top_k; j++) routed += rbf(bf2f(__ldcg(ys + (size_t)j * p.hidden)) * p.weight[t * p.top_k + j]);
    routed = rbf(routed);
    const float g = rbf(sigmoid_f(bf2f(p.gate_logit[(size_t)t * p.gate_stride])));
    const float shared = rbf(g * bf2f(__ldcg(ys + (size_t)p.top_k * p.hidden)));
    const size_t o = (size_t)t * p.hidden + i;
    if (p.fold) p.fold[o] = f2bf(rms_add(bf2f(p.fold[o]), p.out[o]));
    p.out[o] = f2bf(routed + shared);
}

// Per-token FP8 activation quantisation exactly as compressed-tensors 0.19 does it (the CPU
// reference is ornith-runtime/src/cpu/fp8.rs):
//   scale = bf16(amax / 448), or 2^-7 (bf16 eps) when that is 0;
//   q     = e4m3(clamp(bf16(x / scale) + 0, -448, 448))   (x/scale rounded to bf16 first; +0 maps -0 to +0)
__device__ __forceinline__ float act_scale(float amax) {
    float s = rbf(__fdiv_rn(amax, ORNITH_FP8_MAX));
    return s == 0.f ? 0.0078125f : s;
}
// A NaN quotient (a NaN scale or x, or inf / inf) is the NaN code 0x7F, as the CPU's clamp keeps
// the NaN and its encoder maps it to 0x7F (fmaxf / fminf would have clamped it to -448).
__device__ __forceinline__ uint8_t quant_e4m3(float v, float scale) {
    float q = __fadd_rn(rbf(__fdiv_rn(v, scale)), 0.f);
    if (q != q) return 0x7F;
    return f2e4m3(fminf(fmaxf(q, -ORNITH_FP8_MAX), ORNITH_FP8_MAX));
}

// Per-token FP8 of one row of `cols` bf16 values by a block of 256 threads (quantize_fp8_rows;
// attention.cu's combine for an FP8 o_proj): scale = act_scale(max |x|) (block_max_nan over the
// block, a NaN kept), *scale_out = scale (thread 0), q[i] = quant_e4m3(x[i], scale). Rows of up to
// REGS * 256 values are read once into registers (no load after a store: each would wait a memory
// round trip); longer rows, and every row with REGS = 0, are read twice (the same values: the same
// bits). quantize_fp8_rows keeps 32 per thread; the combine 0 (the registers would halve the
// blocks per SM of every combine block for the one that quantises). Loads through L2 (__ldcg): the
// combine's row was written by other blocks of its own launch.
template <int REGS>
__device__ __forceinline__ void quant_row_256(const uint16_t *x, int cols, uint8_t *q, float *scale_out, float *sh) {
    const bool regs = REGS > 0 && cols <= REGS * 256;
    constexpr int R = REGS > 0 ? REGS : 1;
    uint16_t xv[R];
    float amax = 0.f;
    if (regs) {
#pragma unroll
        for (int j = 0; j < R; j++) {
            const int i = threadIdx.x + 256 * j;
            xv[j] = i < cols ? __ldcg(x + i) : (uint16_t)0;  // 0 adds nothing to the max of |x|
        }
#pragma unroll
        for (int j = 0; j < R; j++) amax = amax_add(amax, bf2f(xv[j]));
    } else {
        for (int i = threadIdx.x; i < cols; i += 256) amax = amax_add(amax, bf2f(__ldcg(x + i)));
    }
    amax = block_max_nan(amax, sh);
    const float scale = act_scale(amax);
    if (threadIdx.x == 0) *scale_out = scale;
    if (regs) {
#pragma unroll
        for (int j = 0; j < R; j++) {
            const int i = threadIdx.x + 256 * j;
            if (i < cols) q[i] = quant_e4m3(bf2f(xv[j]), scale);
        }
    } else {
        for (int i = threadIdx.x; i < cols; i += 256) q[i] = quant_e4m3(bf2f(__ldcg(x + i)), scale);
    }
}

// SwiGLU of one expert gate|up row with its per-row FP8 quantisation, as swiglu_quant (moe.cu) and
// the expert down product's prologue (gemv.cu: moe_gemv_fp8_swiglu) both compute it (the same
// bits; the CPU reference is cpu::moe):
//   a[i] = swiglu_val(g[i], u[i]) = bf16(bf16(silu(g[i])) * u[i])   g = gu[0:inter], u = gu[inter:2 inter]
//   (swiglu_bf16 and the NVFP4 down product's prologue stop here, at a)
//   scale = act_scale(max |a|)  (block_max_nan over the block's 256 threads: a NaN is kept)
//   q[i] = quant_e4m3(a[i], scale)
// Element i = thread + 256 j (inter <= ORNITH_SWIGLU_MAX_INTER, the header's). q and *scale
// (thread 0) may be global or shared memory; a caller reading q from shared memory synchronises
// the block first.
__device__ __forceinline__ float swiglu_val(uint16_t g, uint16_t u) { return rbf(rbf(silu_f(bf2f(g))) * bf2f(u)); }
__device__ __forceinline__ void swiglu_q8_row(const uint16_t *gu, int inter, uint8_t *q, float *scale, float *sh) {
    constexpr int PER = ORNITH_SWIGLU_MAX_INTER / 256;
    float a[PER];
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int i = threadIdx.x + 256 * j;
        a[j] = 0.f;
        if (i < inter) {
            a[j] = swiglu_val(gu[i], gu[inter + i]);
            amax = amax_add(amax, a[j]);
        }
    }
    amax = block_max_nan(amax, sh);
    const float sc = act_scale(amax);
    if (threadIdx.x == 0) *scale = sc;
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int i = threadIdx.x + 256 * j;
        if (i < inter) q[i] = quant_e4m3(a[j], sc);
    }
}
