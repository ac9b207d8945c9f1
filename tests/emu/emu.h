// A CPU emulation of the CUDA subset the SIMT kernels use (tests/emu/README.md): one std::thread per
// CUDA thread, a std::barrier per block (__syncthreads) and per warp (__syncwarp, shuffles).
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <thread>
#include <vector>
#include "ornith_kernels.h"  // kernels/include, on the include path
using std::min;
using std::max;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
// A block's static shared variables: function-local statics, one instance for the program, which
// is one per block since the harness runs the blocks of a grid one after another. (`extern
// __shared__` arrays are rewritten to plain `extern` by the compare scripts; the harness defines
// `smem_raw`.)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
extern thread_local Dim3 threadIdx;
extern Dim3 blockIdx, gridDim, blockDim;
extern std::barrier<> *g_block_bar;
extern std::barrier<> *g_warp_bar[32];
extern float g_shfl[32][32];
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { g_warp_bar[threadIdx.x >> 5]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    g_shfl[w][l] = v;
    __syncwarp();
    float r = g_shfl[w][l ^ o];
    __syncwarp();
    return r;
}
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(8) uint2 { uint32_t x, y; };
struct alignas(16) uint4 { uint32_t x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }  // not the device's rounding: emulated bits only
inline void pdl_wait() {}
inline void pdl_launch_dependents() {}
inline void pdl_entry() {}
inline float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
inline uint16_t f2bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
inline float rbf(float f) { return bf2f(f2bf(f)); }
inline float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }
inline float silu_f(float x) { return x / (1.f + expf(-x)); }
// common.cuh's reductions, the same trees.
struct SumOp {
    float operator()(float a, float b) const { return a + b; }
};
template <class Op> inline float warp_reduce(float v, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
template <class Op> inline float block_reduce(float v, float *sh32, float pad, Op op) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) sh32[wid] = v;
    __syncthreads();
    float r = lane < nw ? sh32[lane] : pad;
    return warp_reduce(r, op);
}
inline float warp_sum(float v) { return warp_reduce(v, SumOp{}); }
inline float block_sum(float v, float *sh32) { return block_reduce(v, sh32, 0.f, SumOp{}); }
// common.cuh's gated RMSNorm of one row by one warp (gdn.cu's gated_rmsnorm).
template <class Store>
inline void gated_norm_warp(const uint16_t *o, const uint16_t *z, const uint16_t *w, int dim, float eps, Store store) {
    const int lane = threadIdx.x & 31;
    float x[4], wi[4], zv[4], ss = 0.f;
    for (int j = 0; j < 4; j++) {
        const int i = lane + 32 * j;
        const bool in = i < dim;
        x[j] = in ? bf2f(o[i]) : 0.f;
        wi[j] = in ? bf2f(w[i]) : 0.f;
        zv[j] = in ? bf2f(z[i]) : 0.f;
    }
    for (int j = 0; j < 4; j++) ss = fmaf(x[j], x[j], ss);
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / (float)dim + eps);
    for (int j = 0; j < 4; j++) {
        const int i = lane + 32 * j;
        if (i >= dim) continue;
        float n = rbf(x[j] * inv);
        n = rbf(wi[j] * n);
        store(i, f2bf(n * silu_f(zv[j])));
    }
}
