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
#define __shared__
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
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
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
inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v = v + __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
