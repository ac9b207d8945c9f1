// kernels/cuda/moe_prefill.cu's swiglu_quant_ct, moe_combine_prefill and moe_sort on the CPU
// emulation (emu.h), their outputs written to argv[2] for compare_moe_prefill.sh: swiglu_quant_ct's
// codes and scales (37 rows, inter 8 to 2,048), moe_combine_prefill's rows (hidden 2,048, 264 and
// 100, top-k 8 and 11) launched in the form argv[1] names ("scalar": one column per thread, the
// only form before the 8-column one; "vector": 8 columns per thread where hidden allows), and
// moe_sort's results in a canonical form (the offsets, then each expert's assignments sorted: the
// order inside a group follows the atomics) at 8, 300, 2,048, 5,000 and 8,192 tokens, with the
// dynamic shared memory the version's own header constants make its launcher pass.
#include "moe_prefill.cu"
#include <cstdio>
#include <random>
#include <string>
EMU_GLOBALS

static std::mt19937 rng(47);
static uint16_t bfr(float scale) {
    return __float2bfloat16_rn(std::uniform_real_distribution<float>(-scale, scale)(rng)).bits;
}
template <class T> static void put(FILE *f, const std::vector<T> &v) { fwrite(v.data(), sizeof(T), v.size(), f); }

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    const bool vector = std::string(argv[1]) == "vector";
    FILE *f = fopen(argv[2], "wb");
    for (int inter : {8, 256, 264, 512, 520, 1024, 2048}) {
        const int rows = 37;
        std::vector<uint16_t> gu((size_t)rows * 2 * inter);
        for (auto &x : gu) x = bfr(3.f);
        std::vector<uint8_t> q8((size_t)rows * inter, 0xAA);
        std::vector<float> sc(rows, -1.f);
        OrnithSwigluQuantParams p{gu.data(), q8.data(), sc.data(), rows, inter};
        emu_launch(swiglu_quant_ct, p, {(unsigned)((rows + 7) / 8), 1, 1}, 256);
        put(f, q8);
        put(f, sc);
    }
    for (auto [tokens, k, hidden] : {std::tuple{37, 8, 2048}, {5, 8, 264}, {3, 11, 2056}, {7, 8, 100}}) {
        const int rows = tokens * k, gs = 3;
        std::vector<uint16_t> ys((size_t)rows * hidden), sy((size_t)tokens * hidden), gl((size_t)tokens * gs);
        for (auto &x : ys) x = bfr(4.f);
        for (auto &x : sy) x = bfr(4.f);
        for (auto &x : gl) x = bfr(6.f);
        std::vector<float> w(rows);
        for (auto &x : w) x = std::uniform_real_distribution<float>(0.f, 0.5f)(rng);
        std::vector<int32_t> row_of(rows);
        for (int i = 0; i < rows; i++) row_of[i] = i;
        std::shuffle(row_of.begin(), row_of.end(), rng);
        std::vector<uint16_t> out((size_t)tokens * hidden, 0xffff);
        OrnithMoeCombinePrefillParams p{ys.data(), row_of.data(), w.data(), sy.data(), gl.data(), out.data(), tokens, k, hidden, gs};
        const bool wide = vector && hidden % 8 == 0;  // the buffers are 16-byte aligned
        const unsigned blocks = wide ? (hidden + 2047) / 2048 : (hidden + 255) / 256;
        emu_launch(moe_combine_prefill, p, {blocks, (unsigned)tokens, 1}, 256);
        put(f, out);
    }
    for (int tokens : {8, 300, 2048, 5000, 8192}) {
        const int k = 8, e = 256, n = tokens * k;
        std::vector<int32_t> idx(n);
        for (auto &x : idx) x = std::uniform_int_distribution<int>(0, x % 7 ? e - 1 : 3)(rng);  // a few hot experts
        std::vector<int32_t> go(e + 1), to(3 * (e + 1)), rt(n, -1), ro(n, -1), ra(n, -1), ri(4 * std::min(e, n), -1);
        OrnithMoeSortParams p{idx.data(), go.data(), to.data(), rt.data(), ro.data(), ra.data(), ri.data(), tokens, k, e};
        int smem = 0;
        if (n >= ORNITH_MOE_SORT_STAGE_MIN && n <= ORNITH_MOE_SORT_STAGE_MAX) {
#ifdef ORNITH_MOE_SORT_WINDOW
            smem = 2 * std::min(n, (int)ORNITH_MOE_SORT_WINDOW);
#else
            smem = 2 * ORNITH_MOE_SORT_STAGE_MAX;
#endif
        }
        emu_launch(moe_sort, p, {1, 1, 1}, 1024, smem);
        // the canonical form, and the invariants the order inside a group does not change
        std::vector<int32_t> groups;
        int bad = 0;
        for (int x = 0; x < e; x++) {
            std::vector<int32_t> g(ra.begin() + go[x], ra.begin() + go[x + 1]);
            for (int pos = go[x]; pos < go[x + 1]; pos++) {
                const int a = ra[pos];
                bad += a < 0 || a >= n || idx[a] != x || ro[a] != pos || rt[pos] != a / k;
            }
            std::sort(g.begin(), g.end());
            groups.insert(groups.end(), g.begin(), g.end());
        }
        printf("moe_sort %d tokens: %d rows inconsistent (dynamic shared memory %d bytes)\n", tokens, bad, smem);
        put(f, go);
        put(f, to);
        put(f, groups);
        put(f, ri);
        if (bad) return 1;
    }
    fclose(f);
    return 0;
}
