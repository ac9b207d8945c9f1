// Variant template of the causal flash prefill (same math and params as flash_attn_prefill):
// HEADS q heads of one kv group per block (4 warps each, 64 queries), BK keys per tile,
// STAGGER: K and V single-buffered, V(j) loaded during S(j) and K(j+1) during softmax + PV(j)
// (else K and V double-buffered together). FAST: exp2 with log2e folded into the scale, masking
// only on tiles crossing the warp's diagonal, warps skip tiles past their last query, O rescale
// skipped when no row max moved.
#pragma once
#include "../../../../../kernels/cuda/common.cuh"
#include "../../../../../kernels/cuda/mma.cuh"

#define V_D 256
#define V_BQ 64
#define V_ROW 512

__device__ __forceinline__ uint32_t vswz(int row, int chunk) {
    return (uint32_t)(row * V_ROW + ((chunk ^ (row & 7)) << 4));
}
__device__ __forceinline__ float ex2f(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <int HEADS, int BK, bool STAGGER> constexpr int fa_smem() {
    return HEADS * V_BQ * V_ROW + (STAGGER ? 2 : 4) * BK * V_ROW;
}

template <int HEADS, int BK, bool STAGGER, bool FAST>
__global__ void __launch_bounds__(128 * HEADS) fa_var(const OrnithFlashAttnParams p) {
    constexpr int NT = 128 * HEADS;
    constexpr int NB = STAGGER ? 1 : 2;
    constexpr int NJ = BK / 8;
    pdl_entry();
    extern __shared__ __align__(128) uint8_t smem[];
    const uint32_t sq = smem_u32(smem);
    const uint32_t sk0 = sq + HEADS * V_BQ * V_ROW;
    const uint32_t sv0 = sk0 + NB * BK * V_ROW;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int qb = gridDim.x - 1 - blockIdx.x;
    const int h0 = blockIdx.y * HEADS, kvh = h0 / (p.q_heads / p.kv_heads);
    const int hw = h0 + warp / 4;  // this warp's q head
    const int q0 = qb * V_BQ;
    const int qend = min(q0 + V_BQ, p.tokens);
    const int nkeys = p.pos0 + qend;
    const int ntiles = (nkeys + BK - 1) / BK;
    const size_t kv_pitch = (size_t)p.kv_heads * V_D;

    for (int id = tid; id < HEADS * V_BQ * 32; id += NT) {
        int r = id >> 5, c = id & 31, t = q0 + (r & (V_BQ - 1)), hh = h0 + r / V_BQ;
        const uint16_t *src = p.q + ((size_t)t * p.q_heads + hh) * V_D + c * 8;
        cp_async16(sq + vswz(r, c), t < p.tokens ? (const void *)src : (const void *)p.q, t < p.tokens ? 16 : 0);
    }
    auto load = [&](const uint16_t *base, uint32_t dst0, int tile) {
        for (int id = tid; id < BK * 32; id += NT) {
            int r = id >> 5, c = id & 31, j = tile * BK + r;
            bool ok = j < nkeys;
            const size_t krow = ok ? (size_t)__ldg(p.table + j / ORNITH_KV_BLOCK) * ORNITH_KV_BLOCK + j % ORNITH_KV_BLOCK : 0;
            size_t off = krow * kv_pitch + (size_t)kvh * V_D + c * 8;
            cp_async16(dst0 + vswz(r, c), ok ? (const void *)(base + off) : (const void *)base, ok ? 16 : 0);
        }
    };
    load(p.k_cache, sk0, 0);
    if (!STAGGER) load(p.v_cache, sv0, 0);
    cp_commit();

    const int gq = lane >> 2, tq = lane & 3;
    const int wrow0 = (warp & 3) * 16;        // first of the warp's 16 rows within its head's 64
    const int qrow0 = wrow0 + gq;
    const int qpos[2] = {p.pos0 + q0 + qrow0, p.pos0 + q0 + qrow0 + 8};
    const int wmin = p.pos0 + q0 + wrow0, wmax = wmin + 15;
    const uint32_t sqw = sq + (warp / 4) * V_BQ * V_ROW;  // this head's Q rows
    const float sl = FAST ? p.scale * 1.4426950408889634f : p.scale;
    float o[32][4];
#pragma unroll
    for (int i = 0; i < 32; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};

    for (int tile = 0; tile < ntiles; tile++) {
        uint32_t sk, sv;
        cp_wait<0>();
        __syncthreads();
        if (STAGGER) {
            load(p.v_cache, sv0, tile);
            cp_commit();
            sk = sk0;
            sv = sv0;
        } else {
            if (tile + 1 < ntiles) {
                load(p.k_cache, sk0 + ((tile + 1) & 1) * BK * V_ROW, tile + 1);
                load(p.v_cache, sv0 + ((tile + 1) & 1) * BK * V_ROW, tile + 1);
            }
            cp_commit();
            sk = sk0 + (tile & 1) * BK * V_ROW;
            sv = sv0 + (tile & 1) * BK * V_ROW;
        }
        const int kbase = tile * BK;
        const bool active = !FAST || kbase <= wmax;
        float s[NJ][4];
        if (active) {
#pragma unroll
            for (int j = 0; j < NJ; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < V_D / 16; ks++) {
                uint32_t a[4], b[NJ][2];
                {
                    int r = wrow0 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    ldsm_x4(sqw + vswz(r, 2 * ks + (lane >> 4)), a[0], a[1], a[2], a[3]);
                }
#pragma unroll
                for (int nj = 0; nj < NJ; nj += 2) {
                    int r = nj * 8 + (lane >> 4) * 8 + (lane & 7);
                    ldsm_x4(sk + vswz(r, 2 * ks + ((lane >> 3) & 1)), b[nj][0], b[nj][1], b[nj + 1][0], b[nj + 1][1]);
                }
#pragma unroll
                for (int nj = 0; nj < NJ; nj++) mma_bf16(s[nj], a, b[nj]);
            }
        }
        if (STAGGER) {
            cp_wait<0>();
            __syncthreads();
            if (tile + 1 < ntiles) load(p.k_cache, sk0, tile + 1);
            cp_commit();
        }
        if (!active) continue;
        float mx[2] = {mrow[0], mrow[1]};
        const bool need_mask = !FAST || kbase + BK - 1 > wmin;
        if (FAST) {
            // raw max (scale > 0 commutes with max), then p = 2^(s sl - m)
            float rm[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int nj = 0; nj < NJ; nj++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int hr = e >> 1;
                    float v = s[nj][e];
                    if (need_mask) {
                        int key = kbase + nj * 8 + tq * 2 + (e & 1);
                        v = key <= qpos[hr] ? v : -INFINITY;
                        s[nj][e] = v;
                    }
                    rm[hr] = fmaxf(rm[hr], v);
                }
#pragma unroll
            for (int hr = 0; hr < 2; hr++) mx[hr] = fmaxf(mx[hr], rm[hr] * sl);
        } else {
#pragma unroll
            for (int nj = 0; nj < NJ; nj++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int hr = e >> 1, key = kbase + nj * 8 + tq * 2 + (e & 1);
                    float v = s[nj][e] * p.scale;
                    v = key <= qpos[hr] ? v : -INFINITY;
                    s[nj][e] = v;
                    mx[hr] = fmaxf(mx[hr], v);
                }
        }
        float alpha[2];
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
            mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
            alpha[hr] = FAST ? ex2f(mrow[hr] - mx[hr]) : expf(mrow[hr] - mx[hr]);
            mrow[hr] = mx[hr];
        }
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int nj = 0; nj < NJ; nj++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int hr = e >> 1;
                float pv = FAST ? ex2f(fmaf(s[nj][e], sl, -mx[hr])) : expf(s[nj][e] - mx[hr]);
                s[nj][e] = pv;
                rs[hr] += pv;
            }
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            rs[hr] += __shfl_xor_sync(0xffffffffu, rs[hr], 1);
            rs[hr] += __shfl_xor_sync(0xffffffffu, rs[hr], 2);
            lrow[hr] = lrow[hr] * alpha[hr] + rs[hr];
        }
        if (!FAST || __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int i = 0; i < 32; i++) {
                o[i][0] *= alpha[0];
                o[i][1] *= alpha[0];
                o[i][2] *= alpha[1];
                o[i][3] *= alpha[1];
            }
        }
#pragma unroll
        for (int ks = 0; ks < BK / 16; ks++) {
            uint32_t a[4];
            a[0] = pack_bf16x2(s[2 * ks][0], s[2 * ks][1]);
            a[1] = pack_bf16x2(s[2 * ks][2], s[2 * ks][3]);
            a[2] = pack_bf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
            a[3] = pack_bf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
            for (int dj = 0; dj < 32; dj += 2) {
                uint32_t b0[2], b1[2];
                int r = ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
                int c = dj + (lane >> 4);
                ldsm_x4_t(sv + vswz(r, c), b0[0], b0[1], b1[0], b1[1]);
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
        uint16_t *dst = p.out + ((size_t)t * p.q_heads + hw) * V_D;
        const uint16_t *gate = p.qg ? p.qg + ((size_t)t * p.q_heads + hw) * 2 * V_D + V_D : nullptr;
#pragma unroll
        for (int dj = 0; dj < 32; dj++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int d = dj * 8 + tq * 2 + e;
                float v = rbf(o[dj][hr * 2 + e] / lrow[hr]);
                if (gate) v = v * rbf(sigmoid_f(bf2f(gate[d])));
                dst[d] = f2bf(v);
            }
    }
}
