// Times variants of the wide decode products (var.cuh) against the shipped kernels
// (kernels/cuda/gemv.cu, included as is; the launcher's rule: gemv_* for up to 8 tokens, gemv_*_wide
// beyond) at the full preset's decode shapes and 1-64 tokens. Prints per variant: registers, spills,
// blocks/SM; per (shape, tokens): us with L2 flushed before each launch (median of 15), GB/s of
// weights, bf16 outputs differing from the shipped kernel's, and for the variants that change the
// arithmetic (CVT) the largest error against an fp64 reference (in fp32 eps of sum |x w|, sampled
// rows) and whether tokens 0 and 63 of the 64-token group equal their one-token results.
// Build (on the device): nvcc -O3 -std=c++17 -arch=sm_90 -o gemv_bench main.cu
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cmath>
#include <random>
#include <cuda_runtime.h>
#include "../../../kernels/cuda/gemv.cu"
#include "var.cuh"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

typedef void (*Kern)(const OrnithGemvFp8Params);
// wn > 0: the split-block wide kernel (gemv.cu's gemv_wide) with WN = wn, grid (groups / (8 / wn), ks).
struct Var { const char *name; Kern k; int smem; bool fp8; bool exact; int wn; };
template <bool FP8, bool SMEM, bool CVT, int U, int S, int MINB> Var mk(const char *n) {
    return Var{n, wv_gemv<FP8, SMEM, CVT, U, S, MINB>, SMEM ? 8 * S * 16 * 64 * U : 0, FP8, !CVT, 0};
}
template <bool FP8, int WN> __global__ void __launch_bounds__(256, TC_WIDE_BLOCKS) nw_gemv(const OrnithGemvFp8Params p) {
    gemv_wide_wn<FP8, WN>(p.w, p.ws, p.xq, p.xs, p.y, p.tokens, p.in, p.out, p.x_stride, p.y_stride, 0, nullptr, p.wide_part, p.wide_ticket);
}
template <bool FP8, int WN> Var nw(const char *n) { return Var{n, nw_gemv<FP8, WN>, WIDE_SMEM, FP8, true, WN}; }

static uint16_t f2b(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); }
static float b2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static double e4m3(uint8_t c) {
    int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
    return s ? -v : v;
}

// The shipped kernels behind the Var signature.
__global__ void __launch_bounds__(256, TC_NARROW_BLOCKS) base_bf16(const OrnithGemvFp8Params p) {
    gemv_tc<false, TC_NARROW>(p.w, nullptr, p.xq, nullptr, p.y, p.tokens, p.in, p.out, p.in, p.out, 0, nullptr);
}
__global__ void __launch_bounds__(256, TC_WIDE_BLOCKS) base_bf16_wide(const OrnithGemvFp8Params p) {
    gemv_tc<false, TC_WIDE>(p.w, nullptr, p.xq, nullptr, p.y, p.tokens, p.in, p.out, p.in, p.out, 0, nullptr);
}
__global__ void __launch_bounds__(256, TC_NARROW_BLOCKS) base_fp8(const OrnithGemvFp8Params p) {
    gemv_tc<true, TC_NARROW>(p.w, p.ws, p.xq, p.xs, p.y, p.tokens, p.in, p.out, p.in, p.out, 0, nullptr);
}
__global__ void __launch_bounds__(256, TC_WIDE_BLOCKS) base_fp8_wide(const OrnithGemvFp8Params p) {
    gemv_tc<true, TC_WIDE>(p.w, p.ws, p.xq, p.xs, p.y, p.tokens, p.in, p.out, p.in, p.out, 0, nullptr);
}

static void *g_flush;
static const size_t FLUSH = 256u << 20;
static float time_it(Kern k, int smem, const OrnithGemvFp8Params &p, dim3 grid) {
    for (int i = 0; i < 2; i++) k<<<grid, 256, smem>>>(p);
    CK(cudaDeviceSynchronize());
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int r = 0; r < 15; r++) {
        CK(cudaMemsetAsync(g_flush, r, FLUSH));
        CK(cudaEventRecord(a));
        k<<<grid, 256, smem>>>(p);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms; CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms * 1000.f);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[7];
}

struct Shape { const char *name; bool fp8; int in; int out; };

int main() {
    cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
    CK(cudaMalloc(&g_flush, FLUSH));
    std::vector<Var> vars = {
        nw<false, 1>("bf16 split-block WN1"),
        nw<false, 2>("bf16 split-block WN2"),
        nw<false, 4>("bf16 split-block WN4"),
        nw<true, 1>("fp8 split-block WN1"),
        nw<true, 2>("fp8 split-block WN2"),
        nw<true, 4>("fp8 split-block WN4"),
        mk<true, false, true, 2, 1, 2>("fp8 reg CVT U2 b2"),
    };
    float *dpart; uint32_t *dticket;
    CK(cudaMalloc(&dpart, (size_t)ORNITH_WIDE_SPLIT_ROWS * ORNITH_WIDE_TOKENS * 4));
    CK(cudaMalloc(&dticket, ORNITH_WIDE_TICKETS * 4));
    CK(cudaMemset(dticket, 0, ORNITH_WIDE_TICKETS * 4));
    for (auto &v : vars) {
        CK(cudaFuncSetAttribute(v.k, cudaFuncAttributeMaxDynamicSharedMemorySize, std::max(v.smem, 1)));
        cudaFuncAttributes a; CK(cudaFuncGetAttributes(&a, v.k));
        int nb = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, v.k, 256, v.smem));
        printf("%-26s regs %3d local %4zu B smem %3d KiB blocks/SM %d\n", v.name, a.numRegs, a.localSizeBytes, v.smem / 1024, nb);
    }
    for (Kern k : {base_bf16, base_bf16_wide, base_fp8, base_fp8_wide}) {
        cudaFuncAttributes a; CK(cudaFuncGetAttributes(&a, k));
        printf("base kernel regs %3d local %4zu B\n", a.numRegs, a.localSizeBytes);
    }
    std::vector<Shape> shapes = {
        {"bf16 2048->12352 (GDN in)", false, 2048, 12352},
        {"bf16 4096->2048 (GDN out)", false, 4096, 2048},
        {"bf16 2048->257 (router)", false, 2048, 257},
        {"bf16 2048->248320 (lm_head)", false, 2048, 248320},
        {"fp8 2048->9216 (attn qkv)", true, 2048, 9216},
        {"fp8 4096->2048 (attn o)", true, 4096, 2048},
    };
    const int TOKS[] = {8, 16, 32, 64};
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<float> U(-1.f, 1.f);
    // ONLY=<shape name prefix>, TOK=<tokens>: one case (for profilers).
    const char *only = getenv("ONLY"), *tokenv = getenv("TOK");
    for (auto &s : shapes) {
        if (only && strncmp(s.name, only, strlen(only)) != 0) continue;
        const int es = s.fp8 ? 1 : 2, T = 64;
        std::vector<uint8_t> hx((size_t)T * s.in * es), hw((size_t)s.out * s.in * es);
        std::vector<float> hxs(T), hws(s.out);
        if (s.fp8) {
            for (auto &x : hx) { x = (uint8_t)(rng() & 0xff); if ((x & 0x7f) == 0x7f) x = 0x7e; }
            for (auto &x : hw) { x = (uint8_t)(rng() & 0xff); if ((x & 0x7f) == 0x7f) x = 0x7e; }
            for (auto &x : hxs) x = 0.002f * (1.f + 0.5f * U(rng));
            for (auto &x : hws) x = 0.001f * (1.f + 0.5f * U(rng));
        } else {
            uint16_t *x16 = (uint16_t *)hx.data(), *w16 = (uint16_t *)hw.data();
            for (size_t i = 0; i < hx.size() / 2; i++) x16[i] = f2b(U(rng));
            for (size_t i = 0; i < hw.size() / 2; i++) w16[i] = f2b(U(rng) * 0.05f);
        }
        uint8_t *dx, *dw; float *dxs, *dws; uint16_t *dy0, *dy, *dy1;
        CK(cudaMalloc(&dx, hx.size())); CK(cudaMalloc(&dw, hw.size()));
        CK(cudaMalloc(&dxs, T * 4)); CK(cudaMalloc(&dws, s.out * 4));
        CK(cudaMalloc(&dy0, (size_t)T * s.out * 2)); CK(cudaMalloc(&dy, (size_t)T * s.out * 2)); CK(cudaMalloc(&dy1, (size_t)s.out * 2));
        CK(cudaMemcpy(dx, hx.data(), hx.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dw, hw.data(), hw.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dxs, hxs.data(), T * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dws, hws.data(), s.out * 4, cudaMemcpyHostToDevice));
        // fp64 reference of the first 32 rows for every token, and sum |x w| for the error scale.
        const int RR = 32;
        std::vector<double> ref((size_t)T * RR), mag((size_t)T * RR);
        for (int t = 0; t < T; t++)
            for (int o = 0; o < RR; o++) {
                double acc = 0, m = 0;
                for (int i = 0; i < s.in; i++) {
                    double a, b;
                    if (s.fp8) { a = e4m3(hx[(size_t)t * s.in + i]); b = e4m3(hw[(size_t)o * s.in + i]); }
                    else { a = b2f(((uint16_t *)hx.data())[(size_t)t * s.in + i]); b = b2f(((uint16_t *)hw.data())[(size_t)o * s.in + i]); }
                    acc += a * b; m += std::fabs(a * b);
                }
                const double sc = s.fp8 ? (double)hxs[t] * hws[o] : 1.0;
                ref[(size_t)t * RR + o] = acc * sc; mag[(size_t)t * RR + o] = m * sc;
            }
        const int ks = gemv_tc_ksplit(s.in * es, s.out);
        const dim3 grid(((s.out + 15) / 16 + TC_WARPS / ks - 1) / (TC_WARPS / ks));
        const double gb = (double)hw.size() * 1e-9;
        printf("\n== %s: ks %d, grid %d, %.1f MB\n", s.name, ks, grid.x, gb * 1e3);
        for (int tok : TOKS) {
            if (tokenv && tok != atoi(tokenv)) continue;
            OrnithGemvFp8Params p{};
            p.xq = dx; p.xs = dxs; p.w = dw; p.ws = dws; p.tokens = tok; p.in = s.in; p.out = s.out;
            p.x_stride = s.in; p.y_stride = s.out; p.wide_part = dpart; p.wide_ticket = dticket;
            Kern base = s.fp8 ? (tok <= 8 ? base_fp8 : base_fp8_wide) : (tok <= 8 ? base_bf16 : base_bf16_wide);
            p.y = dy0;
            CK(cudaMemset(dy0, 0xff, (size_t)T * s.out * 2));
            const float ub = time_it(base, 0, p, grid);
            std::vector<uint16_t> y0((size_t)tok * s.out), y((size_t)tok * s.out);
            CK(cudaMemcpy(y0.data(), dy0, y0.size() * 2, cudaMemcpyDeviceToHost));
            auto err = [&](const std::vector<uint16_t> &yy) {
                double e = 0;
                for (int t = 0; t < tok; t++)
                    for (int o = 0; o < RR; o++) {
                        const double r = ref[(size_t)t * RR + o], d = std::fabs(b2f(yy[(size_t)t * s.out + o]) - r);
                        const double half_ulp = std::ldexp(1.0, std::ilogb(std::fabs(r) + 1e-30) - 8);
                        e = std::max(e, std::max(0.0, d - half_ulp) / (mag[(size_t)t * RR + o] * 1.1920929e-7));
                    }
                return e;
            };
            printf("  tokens %2d  %-26s %8.2f us %7.0f GB/s  err %.1f eps\n", tok, "base", ub, gb / (ub * 1e-6), err(y0));
            for (auto &v : vars) {
                if (v.fp8 != s.fp8) continue;
                p.y = dy;
                CK(cudaMemset(dy, 0xff, (size_t)T * s.out * 2));
                const dim3 vg = v.wn ? dim3(((s.out + 15) / 16 + 8 / v.wn - 1) / (8 / v.wn), ks) : grid;
                if (v.wn && tok <= 8) continue;  // the wide build serves 9..64 tokens
                const float u = time_it(v.k, v.smem, p, vg);
                CK(cudaMemcpy(y.data(), dy, y.size() * 2, cudaMemcpyDeviceToHost));
                size_t diff = 0;
                for (size_t i = 0; i < y.size(); i++) diff += y[i] != y0[i];
                char inv[64] = "";
                if ((!v.exact || v.wn) && tok == 64) {
                    bool same = true;
                    for (int t : {0, 63}) {
                        OrnithGemvFp8Params q = p;
                        q.tokens = 1; q.xq = dx + (size_t)t * s.in * es; q.xs = dxs + t; q.y = dy1;
                        v.k<<<vg, 256, v.smem>>>(q);
                        std::vector<uint16_t> y1(s.out);
                        CK(cudaMemcpy(y1.data(), dy1, s.out * 2, cudaMemcpyDeviceToHost));
                        for (int o = 0; o < s.out; o++) same &= y1[o] == y[(size_t)t * s.out + o];
                    }
                    snprintf(inv, sizeof inv, "  1-token bits %s", same ? "same" : "DIFFER");
                }
                printf("  tokens %2d  %-26s %8.2f us %7.0f GB/s  %.2fx  differ %zu%s  err %.1f eps%s\n", tok, v.name, u, gb / (u * 1e-6), ub / u,
                       diff, v.exact && diff ? " (BITS CHANGED)" : "", err(y), inv);
            }
        }
        CK(cudaFree(dx)); CK(cudaFree(dw)); CK(cudaFree(dxs)); CK(cudaFree(dws)); CK(cudaFree(dy0)); CK(cudaFree(dy)); CK(cudaFree(dy1));
    }
    return 0;
}
