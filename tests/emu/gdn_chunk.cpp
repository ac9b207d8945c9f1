// Runs one version of kernels/cuda/gdn_chunk.cu (gdn_chunk_prep, then gdn_chunk_scan) under the CPU
// emulation (emu.h) on a fixed random input: 2 k-heads, 4 v-heads of 128, `tokens` tokens (argv[1])
// from a random state, and writes o (bf16) then the final state (fp32) to argv[2] (and with argv[3]
// the inputs there: tokens, k-heads, v-heads, head dim, row stride as int32, then qkv, ba, a_log,
// dt_bias and the initial state). Built by compare_gdn_chunk.sh and tests/emu_gdn.rs against a
// version of kernels/cuda prepared by lib.sh's emu_prepare; the grid and blocks are the kernel
// file's own (GC_D / GS_C column blocks per head, GS_THREADS threads where the file names them).
#include "gdn_chunk.cu"
#include <cstdio>
#include <cstdlib>
#include <random>
#ifndef GS_THREADS
#define GS_THREADS 256  // the scan's block before it was named
#endif
EMU_GLOBALS

int main(int argc, char **argv) {
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: %s TOKENS OUT [INPUTS_OUT]\n", argv[0]);
        return 2;
    }
    const int tokens = atoi(argv[1]), hk = 2, hv = 4, d = 128;
    const int kdim = hk * d, stride = 2 * kdim + hv * d + 8;  // q | k | v, then padding
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::vector<uint16_t> qkv((size_t)tokens * stride), ba((size_t)tokens * 2 * hv), dtb(hv);
    for (auto &x : qkv) x = f2bf(u(rng));
    for (auto &x : ba) x = f2bf(3.f * u(rng));
    for (auto &x : dtb) x = f2bf(u(rng));
    std::vector<float> alog(hv), state((size_t)hv * d * d);
    // decay rates exp(a_log) from slow to fast (the device test draws them from 0.01..16): with
    // only fast ones the state is forgotten within a chunk and a wrong decay would not show
    const float rate[4] = {0.01f, 0.1f, 1.f, 16.f};
    for (int h = 0; h < hv; h++) alog[h] = logf(rate[h % 4]);
    for (auto &x : state) x = 0.5f * u(rng);
    const int nch = (tokens + 63) / 64;
    std::vector<float> work((size_t)hv * nch * ORNITH_GDN_WORK_PER_CHUNK, NAN);
    std::vector<uint16_t> o((size_t)tokens * hv * d, 0xffff);
    OrnithGdnParams p{};
    p.qkv = qkv.data();
    p.ba = ba.data();
    p.a_log = alog.data();
    p.dt_bias = dtb.data();
    p.state = state.data();
    p.o = o.data();
    p.tokens = tokens;
    p.k_heads = hk;
    p.v_heads = hv;
    p.qkv_stride = stride;
    p.ba_stride = 2 * hv;
    p.a_offset = hv;
    p.work = work.data();
    if (argc == 4) {  // the inputs, for a comparison with the CPU reference (tests/emu_gdn.rs)
        FILE *in = fopen(argv[3], "wb");
        if (!in) return 1;
        const int32_t dims[5] = {tokens, hk, hv, d, stride};
        fwrite(dims, 4, 5, in);
        fwrite(qkv.data(), 2, qkv.size(), in);
        fwrite(ba.data(), 2, ba.size(), in);
        fwrite(alog.data(), 4, alog.size(), in);
        fwrite(dtb.data(), 2, dtb.size(), in);
        fwrite(state.data(), 4, state.size(), in);
        fclose(in);
    }
    emu_launch(gdn_chunk_prep, p, {(unsigned)nch, (unsigned)hv, 1}, 256);
    emu_launch(gdn_chunk_scan, p, {(unsigned)hv, GC_D / GS_C, 1}, GS_THREADS);
    FILE *f = fopen(argv[2], "wb");
    if (!f) return 1;
    fwrite(o.data(), 2, o.size(), f);
    fwrite(state.data(), 4, state.size(), f);
    fclose(f);
    double s = 0;
    size_t bad = 0;
    for (auto x : o) {
        const float v = bf2f(x);
        if (std::isfinite(v)) s += fabs(v); else bad++;
    }
    printf("tokens %d: sum |o| %.6f, non-finite o %zu, state[0] %.8f\n", tokens, s, bad, state[0]);
    return bad ? 1 : 0;
}
