// Prefill GEMM variants (tests/peer/gemm_variants): persistent blocks that run one continuous
// cp.async pipeline over the (tile, k-tile) sequence of every tile they own, so that the next
// tile's first stages load under the current tile's last mma and its epilogue (the shipped kernel
// fills and drains the pipeline once per tile: 2 of 18 stage times at K = 2048, 2 of 6 at K = 512).
// Same smem layout, swizzle, fragments and FP8 promotion as kernels/cuda/gemm.cu; knobs: tile
// BM x BN, warps WM x (8 / WM), stages, min blocks per SM, tile order, FP8 promotion on/off.
// Run 3 also skipped the ldmatrix + mma of 16-row fragments past a tile's last row (warp-uniform
// `if (mi >= live) break`): no gain on the grouped shapes and 10-25% slower elsewhere (the branch
// stops the unrolled fragment loads from being scheduled together); removed.
#pragma once
#include "../../../kernels/cuda/common.cuh"
#include "../../../kernels/cuda/mma.cuh"

template <bool FP8> __device__ __forceinline__ void vmma32(float *c, const uint32_t *a, const uint32_t *b) {
    if (FP8) mma_e4m3(c, a, b); else mma_bf16(c, a, b);
}
__device__ __forceinline__ uint32_t vswz(int row, int chunk) { return (uint32_t)(row * 128 + ((chunk ^ (row & 7)) << 4)); }

template <int BM, int BN> constexpr int var_smem(int stages) { return stages * (BM + BN) * 128; }

// FP8: PROMOTE accumulates each 128-byte stage in a fresh fragment (the shipped numerics); without
// it the mma accumulates into the running sum. MFAST: consecutive tiles walk rows (the weights of
// one column tile stay in L2 across a wave) instead of columns.
template <bool FP8, bool PROMOTE, int BM, int BN, int WM, int STAGES, int MINB, bool MFAST>
__global__ void __launch_bounds__(256, MINB) gemm_var(const OrnithGemmParams p) {
    pdl_entry();
    constexpr int ES = FP8 ? 1 : 2, WN = 8 / WM, TM = BM / WM, TN = BN / WN, MI = TM / 16, NJ = TN / 8;
    constexpr int AC = BM / 32, WC = BN / 32, STAGE = (BM + BN) * 128;
    static_assert(MI >= 1 && NJ % 2 == 0 && AC >= 1 && WC >= 1, "tile shape");
    extern __shared__ __align__(128) uint8_t smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp / WN, wn = warp % WN;
    const bool grouped = p.group_offsets != nullptr;
    const int ntn = (p.out + BN - 1) / BN;
    const int ntm = grouped ? p.tile_offsets[p.groups] : (p.rows + BM - 1) / BM;
    const int total = ntm * ntn;
    const int kbytes = p.in * ES, ktiles = (kbytes + 127) / 128;
    const uint8_t *A = (const uint8_t *)p.a;
    const size_t a_pitch = (size_t)p.a_stride * ES, w_pitch = (size_t)p.in * ES;

    // Tile t -> group, rows [row0, row_end), first output n0.
    auto resolve = [&](int t, int &g, int &row0, int &row_end, int &n0) {
        int mt, nt;
        if (MFAST) { mt = t % ntm; nt = t / ntm; } else { nt = t % ntn; mt = t / ntn; }
        n0 = nt * BN;
        if (grouped) {
            int lo = 0, hi = p.groups - 1;
            while (lo < hi) {
                int mid = (lo + hi + 1) >> 1;
                if (p.tile_offsets[mid] <= mt) lo = mid; else hi = mid - 1;
            }
            g = lo;
            row0 = p.group_offsets[g] + (mt - p.tile_offsets[g]) * BM;
            row_end = p.group_offsets[g + 1];
        } else {
            g = 0;
            row0 = mt * BM;
            row_end = p.rows;
        }
    };

    // The load cursor: tile lt, k-tile lk, and this thread's source rows of that tile.
    int lt = blockIdx.x, lk = 0;
    const uint8_t *a_src[AC], *w_src[WC];
    bool a_ok[AC], w_ok[WC];
    auto set_load_tile = [&](int t) {
        int g, row0, row_end, n0;
        resolve(t, g, row0, row_end, n0);
        const uint8_t *W = (const uint8_t *)p.w + (size_t)g * p.out * p.in * ES;
#pragma unroll
        for (int i = 0; i < AC; i++) {
            int id = tid + 256 * i, gr = row0 + (id >> 3);
            a_ok[i] = gr < row_end;
            int ar = a_ok[i] ? (p.a_rows ? p.a_rows[gr] : gr) : 0;
            a_src[i] = A + (size_t)ar * a_pitch + ((id & 7) << 4);
        }
#pragma unroll
        for (int i = 0; i < WC; i++) {
            int id = tid + 256 * i, gn = n0 + (id >> 3);
            w_ok[i] = gn < p.out;
            w_src[i] = W + (size_t)(w_ok[i] ? gn : 0) * w_pitch + ((id & 7) << 4);
        }
    };
    if (lt < total) set_load_tile(lt);
    const uint32_t sbase = smem_u32(smem);
    auto issue = [&](int stage) {
        if (lt < total) {
            const uint32_t sa = sbase + stage * STAGE, sb = sa + BM * 128;
            const int kb = lk * 128;
#pragma unroll
            for (int i = 0; i < AC; i++) {
                int id = tid + 256 * i, r = id >> 3, c = id & 7;
                bool in = a_ok[i] && kb + (c << 4) < kbytes;
                cp_async16(sa + vswz(r, c), in ? a_src[i] + kb : A, in ? 16 : 0);
            }
#pragma unroll
            for (int i = 0; i < WC; i++) {
                int id = tid + 256 * i, r = id >> 3, c = id & 7;
                bool in = w_ok[i] && kb + (c << 4) < kbytes;
                cp_async16(sb + vswz(r, c), in ? w_src[i] + kb : A, in ? 16 : 0);
            }
            if (++lk == ktiles) {
                lk = 0;
                lt += gridDim.x;
                if (lt < total) set_load_tile(lt);
            }
        }
        cp_commit();
    };

    float acc[MI][NJ][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) issue(s);

    int ct = blockIdx.x, ck = 0, stage = 0;
    int c_g = 0, c_row0 = 0, c_row_end = 0, c_n0 = 0;
    if (ct < total) resolve(ct, c_g, c_row0, c_row_end, c_n0);
    while (ct < total) {
        cp_wait<STAGES - 2>();
        __syncthreads();
        issue(stage == 0 ? STAGES - 1 : stage - 1);
        const uint32_t sa = sbase + stage * STAGE, sb = sa + BM * 128;
        float part[PROMOTE ? MI : 1][PROMOTE ? NJ : 1][4];
        if (PROMOTE)
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < NJ; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) part[PROMOTE ? i : 0][PROMOTE ? j : 0][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < 4; ks++) {
            uint32_t af[MI][4], bfr[NJ][2];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                int r = wm * TM + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                ldsm_x4(sa + vswz(r, 2 * ks + (lane >> 4)), af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
            }
#pragma unroll
            for (int nj = 0; nj < NJ; nj += 2) {
                int r = wn * TN + nj * 8 + (lane >> 4) * 8 + (lane & 7);
                ldsm_x4(sb + vswz(r, 2 * ks + ((lane >> 3) & 1)), bfr[nj][0], bfr[nj][1], bfr[nj + 1][0], bfr[nj + 1][1]);
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int nj = 0; nj < NJ; nj++) {
                    if (PROMOTE) vmma32<FP8>(part[PROMOTE ? mi : 0][PROMOTE ? nj : 0], af[mi], bfr[nj]);
                    else vmma32<FP8>(acc[mi][nj], af[mi], bfr[nj]);
                }
        }
        if (PROMOTE)
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < NJ; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[i][j][e] += part[PROMOTE ? i : 0][PROMOTE ? j : 0][e];
        stage = stage + 1 == STAGES ? 0 : stage + 1;
        if (++ck == ktiles) {
            const int g = c_g, row0 = c_row0, row_end = c_row_end, n0 = c_n0;
            const float *ws = FP8 ? p.w_scale + (size_t)g * p.out : nullptr;
            const int gq = lane >> 2, tq = lane & 3;
            const bool pairs = (p.y_stride & 1) == 0 && ((uintptr_t)p.y & 3) == 0;  // bf16x2 stores
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int r = row0 + wm * TM + mi * 16 + gq + h * 8;
                    if (r >= row_end) continue;
                    float sx = FP8 ? p.a_scale[p.a_rows ? p.a_rows[r] : r] : 1.f;
                    uint16_t *yr = p.y + (size_t)r * p.y_stride;
#pragma unroll
                    for (int nj = 0; nj < NJ; nj++) {
                        int o = n0 + wn * TN + nj * 8 + tq * 2;
                        float v0 = acc[mi][nj][h * 2], v1 = acc[mi][nj][h * 2 + 1];
                        if (FP8) { v0 = v0 * sx * ws[o < p.out ? o : 0]; v1 = v1 * sx * ws[o + 1 < p.out ? o + 1 : 0]; }
                        if (pairs && o + 1 < p.out) {
                            *reinterpret_cast<uint32_t *>(yr + o) = (uint32_t)f2bf(v0) | ((uint32_t)f2bf(v1) << 16);
                        } else {
                            if (o < p.out) yr[o] = f2bf(v0);
                            if (o + 1 < p.out) yr[o + 1] = f2bf(v1);
                        }
                    }
                }
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < NJ; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
            ck = 0;
            ct += gridDim.x;
            if (ct < total) resolve(ct, c_g, c_row0, c_row_end, c_n0);
        }
    }
    cp_wait<0>();
}
