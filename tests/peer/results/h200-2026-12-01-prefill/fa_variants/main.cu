// Times flash-prefill variants against the first (the old shipped algorithm: 32-key tiles double
// buffered, e^x) at the kernel test's small shapes and 2,048-query chunks over deep caches; prints
// TFLOP/s (causal FLOPs) and max |d| / rms and relative L2 against the first variant.
// fa_var.cuh: the templated variants of run 1 (fa_variants_1.txt, 2026-12-01; "fast h1 bk64 stag"
// is the committed kernel's algorithm). fa_prod.cuh: kernels/cuda/flash_attn.cu at b12083e with
// three knobs (table lookup per tile, tree reductions, fragment prefetch) — prepared, NOT run
// (no device call after run 1); fa_dsplit.cuh: the head dim split between two warps
// (prepared, NOT run). This file lists the second set of variants.
// Build: nvcc -O3 -std=c++17 -arch=sm_90 -L<cuda lib dir with libcudart_static.a> -o fa_bench main.cu
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cmath>
#include <cuda_runtime.h>
#include "fa_var.cuh"
#include "fa_prod.cuh"
#include "fa_dsplit.cuh"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

typedef void (*Kern)(const OrnithFlashAttnParams);
struct Var { const char *name; Kern k; int heads; int threads; int smem; };

template <int H, int BK, bool ST, bool F> Var mk(const char *n) {
    return Var{n, fa_var<H, BK, ST, F>, H, 128 * H, fa_smem<H, BK, ST>()};
}

static uint16_t f2b(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); }
static float b2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }

int main(int argc, char **argv) {
    std::vector<Var> vars = {
        mk<1, 32, false, false>("base h1 bk32 dbl"),
        mk<2, 32, true, true>("fast h2 bk32 stag"),
        Var{"prod", fa_prod<false, false, false>, 1, 128, 3 * 64 * 512},
        Var{"prod hoist", fa_prod<true, false, false>, 1, 128, 3 * 64 * 512},
        Var{"prod hoist tree", fa_prod<true, true, false>, 1, 128, 3 * 64 * 512},
        Var{"prod hoist tree pref", fa_prod<true, true, true>, 1, 128, 3 * 64 * 512},
        Var{"prod hoist pref", fa_prod<true, false, true>, 1, 128, 3 * 64 * 512},
        Var{"prod pref", fa_prod<false, false, true>, 1, 128, 3 * 64 * 512},
        Var{"dsplit bk32", fa_dsplit, 1, 256, DS_SMEM},
    };
    for (auto &v : vars) {
        CK(cudaFuncSetAttribute(v.k, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
        cudaFuncAttributes a; CK(cudaFuncGetAttributes(&a, v.k));
        int nb = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, v.k, v.threads, v.smem));
        printf("%-20s regs %d spill-local %zu B smem %d KiB blocks/SM %d\n", v.name, a.numRegs, a.localSizeBytes, v.smem / 1024, nb);
    }
    const int H = 16, HKV = 2, D = 256;
    const int maxk = 261000 + 2048;
    const int nblk = (maxk + 255) / 256 + 1;
    size_t kvn = (size_t)nblk * 256 * HKV * D;
    std::vector<uint16_t> hk(kvn), hv(kvn), hq((size_t)8192 * H * D), hg((size_t)8192 * H * 2 * D);
    uint64_t s = 12345;
    auto rnd = [&]() { s = s * 6364136223846793005ull + 1442695040888963407ull; return ((s >> 33) & 0xffffff) / 8388608.0f - 1.0f; };
    for (auto &x : hk) x = f2b(rnd() * 2.0f);
    for (auto &x : hv) x = f2b(rnd());
    for (auto &x : hq) x = f2b(rnd() * 2.0f);
    for (auto &x : hg) x = f2b(rnd() * 3.0f);
    std::vector<int> table(nblk);
    for (int i = 0; i < nblk; i++) table[i] = nblk - 1 - i;  // reversed, like the tests
    uint16_t *dq, *dk, *dv, *dg, *o0, *o1; int *dt;
    CK(cudaMalloc(&dq, hq.size() * 2)); CK(cudaMalloc(&dg, hg.size() * 2));
    CK(cudaMalloc(&dk, kvn * 2)); CK(cudaMalloc(&dv, kvn * 2)); CK(cudaMalloc(&dt, nblk * 4));
    CK(cudaMalloc(&o0, hq.size() * 2)); CK(cudaMalloc(&o1, hq.size() * 2));
    CK(cudaMemcpy(dq, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dg, hg.data(), hg.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dk, hk.data(), kvn * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv, hv.data(), kvn * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dt, table.data(), nblk * 4, cudaMemcpyHostToDevice));
    struct Shape { int t, p0; bool gated; };
    std::vector<Shape> shapes = {{37, 300, true}, {130, 5, false}, {2048, 0, false}, {8192, 0, true}, {2048, 6144, false},
                                 {2048, 30720, false}, {2048, 129024, false}, {2048, 258952, false}};
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    printf("%-20s %7s %7s %9s %8s %10s %10s\n", "variant", "tokens", "pos0", "ms", "TFLOP/s", "max|d|/rms", "relL2");
    for (auto sh : shapes) {
        OrnithFlashAttnParams p{};
        p.q = dq; p.k_cache = dk; p.v_cache = dv; p.qg = sh.gated ? dg : nullptr; p.tokens = sh.t; p.pos0 = sh.p0;
        p.q_heads = H; p.kv_heads = HKV; p.scale = 1.0f / 16.0f; p.table = dt;
        double pairs = 0; for (int i = 0; i < sh.t; i++) pairs += sh.p0 + i + 1;
        double flops = 4.0 * D * H * pairs;
        size_t on = (size_t)sh.t * H * D;
        std::vector<uint16_t> ref(on), got(on);
        int reps = sh.t * (double)(sh.p0 + sh.t) > 1e8 ? 5 : 20;
        for (size_t vi = 0; vi < vars.size(); vi++) {
            auto &v = vars[vi];
            p.out = vi == 0 ? o0 : o1;
            CK(cudaMemset(p.out, 0xff, on * 2));
            dim3 grid((sh.t + 63) / 64, H / v.heads);
            v.k<<<grid, v.threads, v.smem>>>(p); CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
            std::vector<float> ts;
            for (int r = 0; r < reps; r++) {
                cudaEventRecord(e0); v.k<<<grid, v.threads, v.smem>>>(p); cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
                float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms);
            }
            std::sort(ts.begin(), ts.end());
            float ms = ts[ts.size() / 2];
            CK(cudaMemcpy(vi == 0 ? ref.data() : got.data(), p.out, on * 2, cudaMemcpyDeviceToHost));
            double worst = 0, num = 0, den = 0, rms = 0; long bad = 0;
            for (size_t i = 0; i < on; i++) rms += (double)b2f(ref[i]) * b2f(ref[i]);
            rms = sqrt(rms / on);
            if (vi > 0) for (size_t i = 0; i < on; i++) {
                double a = b2f(ref[i]), b = b2f(got[i]);
                if (!std::isfinite(b)) { bad++; continue; }
                double d = fabs(a - b); worst = std::max(worst, d / rms); num += d * d; den += a * a;
            }
            printf("%-20s %7d %7d %9.3f %8.1f %10.2e %10.2e%s\n", v.name, sh.t, sh.p0, ms, flops / ms / 1e9, worst,
                   vi ? sqrt(num / std::max(den, 1e-30)) : 0.0, bad ? " NONFINITE" : "");
        }
    }
    return 0;
}
