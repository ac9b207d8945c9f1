// A CPU emulation of the CUDA subset the SIMT kernels use (tests/emu/README.md): one std::thread per
// CUDA thread, a std::barrier per block (__syncthreads) and per warp (__syncwarp, shuffles), the
// builtins and vector types they name. kernels/cuda/common.cuh itself is compiled on top of it
// (emu_prepare in lib.sh removes its two PTX statements), so the device helpers are not restated.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
using std::max;
using std::min;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __align__(n) __attribute__((aligned(n)))
// A block's static shared variables: function-local statics, one instance for the program, which
// is one per block since a harness runs the blocks of a grid one after another. (emu_prepare
// rewrites each `extern __shared__` array into a pointer to `emu_smem`, the dynamic shared memory.)
#define __shared__ static

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};
extern thread_local Dim3 threadIdx;
extern Dim3 blockIdx, gridDim, blockDim;
extern std::barrier<> *g_block_bar;
extern std::barrier<> *g_warp_bar[32];
extern uint32_t g_shfl[32][32];
extern int emu_dynamic_smem;  // the launch's dynamic shared memory in bytes (%dynamic_smem_size)

inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { g_warp_bar[threadIdx.x >> 5]->arrive_and_wait(); }
// Every lane of the warp calls a shuffle (the kernels' shuffles are warp-uniform).
template <class T> inline T emu_shfl(T v, int src_of_lane(int, int), int arg) {
    static_assert(sizeof(T) == 4, "32-bit shuffles");
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    memcpy(&g_shfl[w][l], &v, 4);
    __syncwarp();
    const int s = src_of_lane(l, arg);
    T r;
    memcpy(&r, &g_shfl[w][s], 4);
    __syncwarp();
    return r;
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) {
    return emu_shfl<T>(v, [](int l, int o) { return l ^ o; }, o);
}
template <class T> inline T __shfl_up_sync(unsigned, T v, int d) {
    return emu_shfl<T>(v, [](int l, int d) { return l >= d ? l - d : l; }, d);
}
template <class T> inline T __shfl_down_sync(unsigned, T v, int d) {
    return emu_shfl<T>(v, [](int l, int d) { return l + d < 32 ? l + d : l; }, d);
}
template <class T> inline T __shfl_sync(unsigned, T v, int s) {
    return emu_shfl<T>(v, [](int, int s) { return s & 31; }, s);
}
inline bool __any_sync(unsigned, bool p) {
    int any = p;
    for (int o = 1; o < 32; o <<= 1) any |= __shfl_xor_sync(0xffffffffu, any, o);
    return any != 0;
}
template <class T> inline T atomicAdd(T *a, T v) { return std::atomic_ref<T>(*a).fetch_add(v); }
template <class T> inline T atomicExch(T *a, T v) { return std::atomic_ref<T>(*a).exchange(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <class T> inline T __ldcg(const T *p) { return *p; }
template <class T> inline T __ldg(const T *p) { return *p; }
inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int32_t u) { float f; memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }

struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { uint32_t x, y; };
struct alignas(16) uint4 { uint32_t x, y, z, w; };
struct alignas(16) int4 { int32_t x, y, z, w; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline int4 make_int4(int32_t a, int32_t b, int32_t c, int32_t d) { return {a, b, c, d}; }
#include <cuda_bf16.h>
#include <cuda_fp8.h>
inline float2 __half22float2(__half2 h) { return {h.x, h.y}; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }  // not the device's rounding: emulated bits only

// Runs every block of a grid in turn, `threads` std::threads each, `smem` bytes of dynamic shared
// memory reported (the harness's `emu_smem`, filled with 0xff first: NaN as fp32, so a read of an
// entry no thread wrote shows in the outputs).
extern uint8_t emu_smem[];
extern const size_t emu_smem_size;
template <class P> void emu_launch(void (*k)(P), P p, Dim3 grid, unsigned threads, int smem = 0) {
    gridDim = grid;
    blockDim = {threads, 1, 1};
    emu_dynamic_smem = smem;
    for (unsigned bz = 0; bz < std::max(grid.z, 1u); bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                blockIdx = {bx, by, bz};
                std::barrier<> bb(threads);
                std::vector<std::barrier<> *> wb;
                for (unsigned w = 0; w < threads / 32; w++) {
                    wb.push_back(new std::barrier<>(32));
                    g_warp_bar[w] = wb.back();
                }
                g_block_bar = &bb;
                memset(emu_smem, 0xff, emu_smem_size);
                std::vector<std::thread> ts;
                for (unsigned t = 0; t < threads; t++) ts.emplace_back([=] { threadIdx = {t, 0, 0}; k(p); });
                for (auto &t : ts) t.join();
                for (auto *b : wb) delete b;
            }
}
// The definitions the declarations above need, once per harness (after its includes).
#define EMU_GLOBALS                                  \
    thread_local Dim3 threadIdx;                     \
    Dim3 blockIdx, gridDim, blockDim;                \
    std::barrier<> *g_block_bar;                     \
    std::barrier<> *g_warp_bar[32];                  \
    uint32_t g_shfl[32][32];                         \
    int emu_dynamic_smem;                            \
    alignas(16) uint8_t emu_smem[256 * 1024];        \
    const size_t emu_smem_size = sizeof emu_smem;
