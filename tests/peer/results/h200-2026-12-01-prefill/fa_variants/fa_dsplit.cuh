// Prepared, NOT run: flash prefill with the head dim split between two warps (64 O registers per
// thread instead of 128, so 16 warps per SM). Block = 64 queries of one head, 8 warps; warp w
// owns rows (w % 4) * 16 .. + 16 and, of each 32-key tile, scores of keys (w / 4) * 16 .. + 16
// (all 256 dims) and the output dims (w / 4) * 128 .. + 128. The two warps of a row group swap
// their partial row max and row sum through shared memory (named barrier per pair) and write
// bf16(P) to shared memory, from which both read the P fragments of all 32 keys.
// Same math and cast points as flash_attn_prefill (exp2, log2 e folded in; l from fp32 P, the
// two halves summed in a fixed order so both warps hold the same m and l).
#pragma once
#include "../../../../../kernels/cuda/common.cuh"
#include "../../../../../kernels/cuda/mma.cuh"

#define DS_D 256
#define DS_BQ 64
#define DS_BK 32
#define DS_ROW 512
#define DS_PROW 80  // bytes per P row: 32 bf16 + 16 pad (conflict-free ldmatrix)
#define DS_SMEM (DS_BQ * DS_ROW + 2 * DS_BK * DS_ROW + DS_BQ * DS_PROW + 4 * DS_BQ * 4)

__device__ __forceinline__ uint32_t dswz(int row, int chunk) {
    return (uint32_t)(row * DS_ROW + ((chunk ^ (row & 7)) << 4));
}
__device__ __forceinline__ float ds_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ void pair_sync(int id) { asm volatile("bar.sync %0, 64;" ::"r"(id) : "memory"); }

__global__ void __launch_bounds__(256, 2) fa_dsplit(const OrnithFlashAttnParams p) {
    pdl_entry();
    extern __shared__ __align__(128) uint8_t smem[];
    const uint32_t sq = smem_u32(smem);
    const uint32_t sk = sq + DS_BQ * DS_ROW, sv = sk + DS_BK * DS_ROW, sp = sv + DS_BK * DS_ROW;
    uint16_t *pw = reinterpret_cast<uint16_t *>(smem + DS_BQ * DS_ROW + 2 * DS_BK * DS_ROW);
    float *red = reinterpret_cast<float *>(smem + DS_BQ * DS_ROW + 2 * DS_BK * DS_ROW + DS_BQ * DS_PROW);
    // red: [0] max of half 0, [1] max of half 1, [2] sum of half 0, [3] sum of half 1; 64 rows each
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, rg = warp & 3, half = warp >> 2;
    const int qb = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, kvh = h / (p.q_heads / p.kv_heads);
    const int q0 = qb * DS_BQ;
    const int qend = min(q0 + DS_BQ, p.tokens);
    const int nkeys = p.pos0 + qend;
    const int ntiles = (nkeys + DS_BK - 1) / DS_BK;
    const size_t kv_pitch = (size_t)p.kv_heads * DS_D;

    for (int id = tid; id < DS_BQ * 32; id += 256) {
        int r = id >> 5, c = id & 31, t = q0 + r;
        const uint16_t *src = p.q + ((size_t)t * p.q_heads + h) * DS_D + c * 8;
        cp_async16(sq + dswz(r, c), t < p.tokens ? (const void *)src : (const void *)p.q, t < p.tokens ? 16 : 0);
    }
    auto load_tile = [&](const uint16_t *cache, uint32_t dst, int tile) {
        const int j0 = tile * DS_BK, c = tid & 31, r0 = tid >> 5;
        const size_t row0 = (size_t)__ldg(p.table + j0 / ORNITH_KV_BLOCK) * ORNITH_KV_BLOCK + j0 % ORNITH_KV_BLOCK;
        const uint16_t *src = cache + (row0 + r0) * kv_pitch + (size_t)kvh * DS_D + c * 8;
#pragma unroll
        for (int r = r0; r < DS_BK; r += 8, src += 8 * kv_pitch) {
            const bool ok = j0 + r < nkeys;
            cp_async16(dst + dswz(r, c), ok ? (const void *)src : (const void *)cache, ok ? 16 : 0);
        }
    };
    load_tile(p.k_cache, sk, 0);
    cp_commit();

    const int gq = lane >> 2, tq = lane & 3;
    const int qrow0 = rg * 16 + gq;
    const int qpos[2] = {p.pos0 + q0 + qrow0, p.pos0 + q0 + qrow0 + 8};
    const int wfirst = p.pos0 + q0 + rg * 16, wlast = wfirst + 15;
    const float c2 = p.scale * 1.4426950408889634f;
    float o[16][4];
#pragma unroll
    for (int i = 0; i < 16; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};

    for (int tile = 0; tile < ntiles; tile++) {
        cp_wait<0>();
        __syncthreads();
        load_tile(p.v_cache, sv, tile);
        cp_commit();
        const int kbase = tile * DS_BK;
        const bool active = kbase <= wlast;  // uniform over the pair
        float s[2][4];
        if (active) {
#pragma unroll
            for (int j = 0; j < 2; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < DS_D / 16; ks++) {
                uint32_t a[4], b[2][2];
                int ra = rg * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                ldsm_x4(sq + dswz(ra, 2 * ks + (lane >> 4)), a[0], a[1], a[2], a[3]);
                int rb = half * 16 + (lane >> 4) * 8 + (lane & 7);
                ldsm_x4(sk + dswz(rb, 2 * ks + ((lane >> 3) & 1)), b[0][0], b[0][1], b[1][0], b[1][1]);
                mma_bf16(s[0], a, b[0]);
                mma_bf16(s[1], a, b[1]);
            }
        }
        cp_wait<0>();
        __syncthreads();
        if (tile + 1 < ntiles) load_tile(p.k_cache, sk, tile + 1);
        cp_commit();
        if (!active) continue;
        const bool masked = kbase + DS_BK - 1 > wfirst;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nj = 0; nj < 2; nj++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int hr = e >> 1;
                if (masked) {
                    int key = kbase + half * 16 + nj * 8 + tq * 2 + (e & 1);
                    s[nj][e] = key <= qpos[hr] ? s[nj][e] : -INFINITY;
                }
                mx[hr] = fmaxf(mx[hr], s[nj][e]);
            }
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
            mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
            if (tq == 0) red[half * DS_BQ + qrow0 + 8 * hr] = mx[hr];
        }
        pair_sync(1 + rg);
        float alpha[2];
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            float other = red[(1 - half) * DS_BQ + qrow0 + 8 * hr];
            float m = fmaxf(mrow[hr], fmaxf(mx[hr], other) * c2);
            alpha[hr] = ds_exp2(mrow[hr] - m);
            mrow[hr] = m;
        }
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int nj = 0; nj < 2; nj++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int hr = e >> 1;
                float pv = ds_exp2(fmaf(s[nj][e], c2, -mrow[hr]));
                s[nj][e] = pv;
                rs[hr] += pv;
            }
            // bf16(P) rows gq, gq + 8 of the pair, keys half * 16 + nj * 8 + tq * 2 (+1)
            const int col = half * 16 + nj * 8 + tq * 2;
            *reinterpret_cast<uint32_t *>(reinterpret_cast<uint8_t *>(pw) + qrow0 * DS_PROW + col * 2) = pack_bf16x2(s[nj][0], s[nj][1]);
            *reinterpret_cast<uint32_t *>(reinterpret_cast<uint8_t *>(pw) + (qrow0 + 8) * DS_PROW + col * 2) = pack_bf16x2(s[nj][2], s[nj][3]);
        }
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            rs[hr] += __shfl_xor_sync(0xffffffffu, rs[hr], 1);
            rs[hr] += __shfl_xor_sync(0xffffffffu, rs[hr], 2);
            if (tq == 0) red[(2 + half) * DS_BQ + qrow0 + 8 * hr] = rs[hr];
        }
        pair_sync(1 + rg);  // partner's sum and P are in
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            float both = red[2 * DS_BQ + qrow0 + 8 * hr] + red[3 * DS_BQ + qrow0 + 8 * hr];  // half 0 + half 1
            lrow[hr] = lrow[hr] * alpha[hr] + both;
        }
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int i = 0; i < 16; i++) {
                o[i][0] *= alpha[0];
                o[i][1] *= alpha[0];
                o[i][2] *= alpha[1];
                o[i][3] *= alpha[1];
            }
        }
        // O[16 rows][this half's 128 dims] += P[16 rows][32 keys] V[32 keys][dims]
#pragma unroll
        for (int ks = 0; ks < DS_BK / 16; ks++) {
            uint32_t a[4];
            {
                int r = rg * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                ldsm_x4(sp + r * DS_PROW + (ks * 16 + (lane >> 4) * 8) * 2, a[0], a[1], a[2], a[3]);
            }
#pragma unroll
            for (int dj = 0; dj < 16; dj += 2) {
                uint32_t b0[2], b1[2];
                int r = ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
                int c = half * 16 + dj + (lane >> 4);
                ldsm_x4_t(sv + dswz(r, c), b0[0], b0[1], b1[0], b1[1]);
                mma_bf16(o[dj], a, b0);
                mma_bf16(o[dj + 1], a, b1);
            }
        }
    }
    cp_wait<0>();
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int t = q0 + qrow0 + hr * 8;
        if (t >= p.tokens) continue;
        uint16_t *dst = p.out + ((size_t)t * p.q_heads + h) * DS_D;
        const uint16_t *gate = p.qg ? p.qg + ((size_t)t * p.q_heads + h) * 2 * DS_D + DS_D : nullptr;
#pragma unroll
        for (int dj = 0; dj < 16; dj++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int d = half * 128 + dj * 8 + tq * 2 + e;
                float v = rbf(o[dj][hr * 2 + e] / lrow[hr]);
                if (gate) v = v * rbf(sigmoid_f(bf2f(gate[d])));
                dst[d] = f2bf(v);
            }
    }
}
