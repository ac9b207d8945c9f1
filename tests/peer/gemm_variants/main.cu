// Times prefill GEMM variants (gemm_var.cuh) against the shipped kernels (kernels/cuda/gemm.cu,
// included as is) at the full preset's prefill shapes (2,048-token chunks): the BF16 GDN
// projections and router, the FP8 attention / shared-expert products, the grouped FP8 expert
// products with 16,384 routed rows (top-8 of 256, multinomial counts). Prints per variant: regs,
// spills, blocks/SM, us, TFLOP/s (useful FLOPs), max |d| against the shipped kernel, and for the
// output's distance from an fp64 reference (sampled rows: the largest in bf16 ulps of the result,
// the share of outputs whose bf16 differs from the reference's rounding, and the largest error
// beyond that rounding in fp32 eps of sum |a w|).
// Runs (H200, outputs in tests/peer/results/h200-2026-12-02-d/gemm_variants_N.txt): 1-3 against
// the one-tile-per-block kernels (run 1 stopped at an odd-stride store of a variant, fixed); run 4,
// the list below (run 3's), against the persistent kernels of 769488a (BF16 promoted, 64-row tiles).
// Build (on the device): nvcc -O3 -std=c++17 -arch=sm_90 -o gemm_bench main.cu
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cmath>
#include <random>
#include <cuda_runtime.h>
#include "../../../kernels/cuda/gemm.cu"
#include "gemm_var.cuh"

// The shipped kernels' grid: persistent from the 2026-12-02 ninth session on (runs 1-3 timed the
// earlier one-tile-per-block kernels with BASE_PERSISTENT false).
#ifndef BASE_PERSISTENT
#define BASE_PERSISTENT true
#endif
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

typedef void (*Kern)(const OrnithGemmParams);
struct Var { const char *name; Kern k; int smem; bool persistent; int bm; };

template <bool FP8, bool P, int BM, int BN, int WM, int ST, int MINB, bool MF> Var mk(const char *n) {
    return Var{n, gemm_var<FP8, P, BM, BN, WM, ST, MINB, MF>, var_smem<BM, BN>(ST), true, BM};
}

static uint16_t f2b(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); }
static float b2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static double e4m3(uint8_t c) {
    int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
    return s ? -v : v;
}

static int g_sms;
static int occupancy(const Var &v) {
    int nb = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, v.k, 256, v.smem));
    return nb;
}

// Mean us of one launch (5 groups of 10 launches, median group).
static float time_it(const Var &v, const OrnithGemmParams &p, dim3 grid) {
    for (int i = 0; i < 3; i++) v.k<<<grid, 256, v.smem>>>(p);
    CK(cudaDeviceSynchronize());
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int r = 0; r < 5; r++) {
        CK(cudaEventRecord(a));
        for (int i = 0; i < 10; i++) v.k<<<grid, 256, v.smem>>>(p);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms; CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms * 100.f);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[2];
}

struct Shape { const char *name; bool fp8; bool grouped; int rows; int in; int out; };

int main() {
    cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
    g_sms = prop.multiProcessorCount;
    printf("%s, %d SMs\n", prop.name, g_sms);
    std::vector<Var> bf = {
        Var{"base gemm_bf16", gemm_bf16, 3 * 256 * 128, BASE_PERSISTENT, 128},
        mk<false, false, 128, 128, 2, 3, 2, true>("p 128x128 w64x32 s3 b2 mf"),
        mk<false, true, 128, 128, 2, 3, 1, true>("p 128x128 PROMO s3 b1 mf"),
        mk<false, false, 128, 256, 2, 3, 1, true>("p 128x256 w64x64 s3 b1 mf"),
        mk<false, true, 128, 256, 2, 3, 1, true>("p 128x256 PROMO s3 b1 mf"),
        mk<false, false, 64, 64, 2, 3, 2, true>("p 64x64 w32x16 s3 b2 mf"),
        mk<false, false, 64, 64, 2, 4, 3, true>("p 64x64 w32x16 s4 b3 mf"),
    };
    std::vector<Var> f8 = {
        Var{"base gemm_fp8", gemm_fp8, 3 * 256 * 128, BASE_PERSISTENT, 128},
        mk<true, true, 128, 128, 2, 3, 1, true>("p 128x128 promo s3 b1 mf"),
        mk<true, true, 128, 128, 2, 4, 1, true>("p 128x128 promo s4 b1 mf"),
        mk<true, true, 64, 64, 2, 3, 2, true>("p 64x64 promo s3 b2 mf"),
        mk<true, false, 128, 256, 2, 3, 1, true>("p 128x256 nopro s3 b1 mf"),
    };
    std::vector<Var> gr = {
        Var{"base gemm_fp8_grouped", gemm_fp8_grouped, 3 * 192 * 128, BASE_PERSISTENT, 64},
        mk<true, true, 64, 128, 2, 3, 2, false>("p 64x128 promo s3 b2 nf skip"),
        mk<true, true, 64, 128, 2, 4, 2, false>("p 64x128 promo s4 b2 nf skip"),
        mk<true, true, 32, 128, 2, 3, 3, false>("p 32x128 promo s3 b3 nf skip"),
        mk<true, true, 32, 128, 2, 4, 2, false>("p 32x128 promo s4 b2 nf skip"),
        mk<true, true, 64, 64, 2, 3, 3, false>("p 64x64 promo s3 b3 nf skip"),
        mk<true, false, 64, 128, 2, 3, 2, false>("p 64x128 nopro s3 b2 nf skip"),
    };
    for (auto *vs : {&bf, &f8, &gr})
        for (auto &v : *vs) {
            CK(cudaFuncSetAttribute(v.k, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
            cudaFuncAttributes a; CK(cudaFuncGetAttributes(&a, v.k));
            printf("%-28s regs %3d local %4zu B smem %3d KiB blocks/SM %d\n", v.name, a.numRegs, a.localSizeBytes, v.smem / 1024, occupancy(v));
        }

    std::vector<Shape> shapes = {
        {"bf16 2048x2048->12352 (GDN in)", false, false, 2048, 2048, 12352},
        {"bf16 2048x4096->2048 (GDN out)", false, false, 2048, 4096, 2048},
        {"bf16 2048x2048->257 (router)", false, false, 2048, 2048, 257},
        {"fp8 2048x2048->8192 (q|gate)", true, false, 2048, 2048, 8192},
        {"fp8 2048x2048->1024 (kv / sh gate|up)", true, false, 2048, 2048, 1024},
        {"fp8 2048x4096->2048 (attn o)", true, false, 2048, 4096, 2048},
        {"fp8 2048x512->2048 (sh down)", true, false, 2048, 512, 2048},
        {"grp 16384x2048->1024 (gate|up)", true, true, 16384, 2048, 1024},
        {"grp 16384x512->2048 (down)", true, true, 16384, 512, 2048},
    };
    std::mt19937_64 rng(42);
    std::uniform_real_distribution<float> U(-1.f, 1.f);
    const int E = 256, TOK = 2048, TOPK = 8;
    // Routing: each token picks 8 distinct experts uniformly; rows sorted by expert.
    std::vector<int> cnt(E, 0), row_token;
    std::vector<std::vector<int>> by(E);
    for (int t = 0; t < TOK; t++) {
        std::vector<int> pick;
        while ((int)pick.size() < TOPK) { int e = rng() % E; if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e); }
        for (int e : pick) by[e].push_back(t);
    }
    std::vector<int> goff(E + 1, 0);
    for (int e = 0; e < E; e++) { goff[e + 1] = goff[e] + (int)by[e].size(); for (int t : by[e]) row_token.push_back(t); }
    int maxc = 0; for (int e = 0; e < E; e++) maxc = std::max(maxc, (int)by[e].size());
    printf("routing: %d rows, max %d per expert\n", goff[E], maxc);

    for (auto &s : shapes) {
        auto &vs = s.grouped ? gr : (s.fp8 ? f8 : bf);
        const int G = s.grouped ? E : 1;
        const int arows = s.grouped && s.in == 2048 ? TOK : s.rows;  // gate|up gathers token rows
        const int es = s.fp8 ? 1 : 2;
        std::vector<uint8_t> ha((size_t)arows * s.in * es), hw((size_t)G * s.out * s.in * es);
        std::vector<float> has(arows), hws((size_t)G * s.out);
        if (s.fp8) {
            for (auto &x : ha) { x = (uint8_t)(rng() & 0xff); if ((x & 0x7f) == 0x7f) x = 0x7e; }
            for (auto &x : hw) { x = (uint8_t)(rng() & 0xff); if ((x & 0x7f) == 0x7f) x = 0x7e; }
            for (auto &x : has) x = 0.002f * (1.f + 0.5f * U(rng));
            for (auto &x : hws) x = 0.001f * (1.f + 0.5f * U(rng));
        } else {
            uint16_t *a16 = (uint16_t *)ha.data(), *w16 = (uint16_t *)hw.data();
            for (size_t i = 0; i < ha.size() / 2; i++) a16[i] = f2b(U(rng));
            for (size_t i = 0; i < hw.size() / 2; i++) w16[i] = f2b(U(rng) * 0.05f);
        }
        void *da, *dw; float *das, *dws; uint16_t *dy0, *dy; int *dgo = nullptr, *dto = nullptr, *drows = nullptr;
        CK(cudaMalloc(&da, ha.size())); CK(cudaMalloc(&dw, hw.size()));
        CK(cudaMalloc(&das, has.size() * 4)); CK(cudaMalloc(&dws, hws.size() * 4));
        CK(cudaMalloc(&dy0, (size_t)s.rows * s.out * 2)); CK(cudaMalloc(&dy, (size_t)s.rows * s.out * 2));
        CK(cudaMemcpy(da, ha.data(), ha.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dw, hw.data(), hw.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(das, has.data(), has.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dws, hws.data(), hws.size() * 4, cudaMemcpyHostToDevice));
        if (s.grouped) {
            CK(cudaMalloc(&dgo, (E + 1) * 4)); CK(cudaMalloc(&dto, (E + 1) * 4));
            CK(cudaMemcpy(dgo, goff.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
            if (s.in == 2048) {
                CK(cudaMalloc(&drows, row_token.size() * 4));
                CK(cudaMemcpy(drows, row_token.data(), row_token.size() * 4, cudaMemcpyHostToDevice));
            }
        }
        const double flops = 2.0 * s.rows * s.in * s.out;
        std::vector<uint16_t> y0((size_t)s.rows * s.out), y((size_t)s.rows * s.out);
        printf("\n== %s: %.1f GFLOP\n", s.name, flops * 1e-9);
        for (size_t vi = 0; vi < vs.size(); vi++) {
            auto &v = vs[vi];
            OrnithGemmParams p{};
            p.a = da; p.a_scale = s.fp8 ? das : nullptr; p.a_rows = drows; p.w = dw; p.w_scale = s.fp8 ? dws : nullptr;
            p.y = vi == 0 ? dy0 : dy; p.rows = s.rows; p.in = s.in; p.out = s.out; p.a_stride = s.in; p.y_stride = s.out;
            p.groups = G;
            int mtiles = (s.rows + v.bm - 1) / v.bm;
            if (s.grouped) {
                std::vector<int> to(E + 1, 0);
                for (int e = 0; e < E; e++) to[e + 1] = to[e] + (goff[e + 1] - goff[e] + v.bm - 1) / v.bm;
                CK(cudaMemcpy(dto, to.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
                p.group_offsets = dgo; p.tile_offsets = dto;
                mtiles = to[E];
            }
            dim3 grid;
            if (v.persistent) {
                int total = mtiles * ((s.out + 127) / 128);
                grid = dim3(std::min(total, occupancy(v) * g_sms));
                if (s.grouped) grid = dim3(occupancy(v) * g_sms);
            } else {
                grid = dim3((s.out + 127) / 128, s.grouped ? (s.rows + 63) / 64 + E : mtiles);
            }
            CK(cudaMemset(p.y, 0xff, (size_t)s.rows * s.out * 2));
            float us = time_it(v, p, grid);
            CK(cudaMemcpy(vi == 0 ? y0.data() : y.data(), p.y, y.size() * 2, cudaMemcpyDeviceToHost));
            double maxd = 0; size_t nan = 0;
            if (vi > 0)
                for (size_t i = 0; i < y.size(); i++) {
                    float a = b2f(y0[i]), b = b2f(y[i]);
                    if (a != a || b != b) { nan++; continue; }
                    maxd = std::max(maxd, (double)fabsf(a - b));
                }
            // fp64 reference on sampled rows (FP8 shapes): distance in bf16 ulps, flips.
            double max_ulp = 0; long flips = 0, n_ref = 0;
            double max_ex = 0;
            {
                const auto &yy = vi == 0 ? y0 : y;
                for (int r = 0; r < s.rows; r += s.rows / 16) {
                    int g = 0;
                    if (s.grouped) while (goff[g + 1] <= r) g++;
                    int ar = (s.grouped && s.in == 2048) ? row_token[r] : r;
                    for (int o = 0; o < s.out; o++) {
                        double acc = 0, mag = 0;
                        if (s.fp8) {
                            const uint8_t *ap = &ha[(size_t)ar * s.in], *wp = &hw[((size_t)g * s.out + o) * s.in];
                            for (int k = 0; k < s.in; k++) { double t = e4m3(ap[k]) * e4m3(wp[k]); acc += t; mag += fabs(t); }
                        } else {
                            const uint16_t *ap = (const uint16_t *)ha.data() + (size_t)ar * s.in, *wp = (const uint16_t *)hw.data() + (size_t)o * s.in;
                            for (int k = 0; k < s.in; k++) { double t = (double)b2f(ap[k]) * b2f(wp[k]); acc += t; mag += fabs(t); }
                        }
                        const double sc = s.fp8 ? (double)has[ar] * hws[(size_t)g * s.out + o] : 1.0;
                        double ref = s.fp8 ? (double)(float)((float)acc * has[ar] * hws[(size_t)g * s.out + o]) : acc;
                        float got = b2f(yy[(size_t)r * s.out + o]);
                        float rb = b2f(f2b((float)ref));
                        double ulp = std::ldexp(1.0, std::ilogb(std::max(fabs(ref), 1e-30)) - 7);
                        max_ulp = std::max(max_ulp, fabs(got - ref) / ulp);
                        flips += got != rb; n_ref++;
                        // |got - ref| beyond bf16 rounding of the exact value, in fp32 eps of sum |a w|
                        double ex = fabs(got - acc * sc) - 0.5 * ulp;
                        if (ex > 0) max_ex = std::max(max_ex, ex / (mag * sc * 1.1920929e-7));
                    }
                }
            }
            printf("  %-28s %8.1f us %6.1f TFLOP/s  max|d| %.3g%s", v.name, us, flops / us * 1e-6, maxd, nan ? " NaN!" : "");
            printf("  ref: max %.2f ulp, %.3f%% flips, excess %.1f eps", max_ulp, 100.0 * flips / std::max(n_ref, 1L), max_ex);
            printf("\n");
        }
        cudaFree(da); cudaFree(dw); cudaFree(das); cudaFree(dws); cudaFree(dy0); cudaFree(dy);
        if (dgo) cudaFree(dgo); if (dto) cudaFree(dto); if (drows) cudaFree(drows);
    }
    return 0;
}
