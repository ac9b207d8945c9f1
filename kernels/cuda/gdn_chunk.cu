// Gated DeltaNet prefill: the chunked gated delta rule (chunk 64), fp32 throughout.
//
// Same inputs, gates, q/k preparation and state as gdn_recurrent (OrnithGdnParams); per v-head,
// per chunk of L <= 64 tokens with G = inclusive cumsum of g inside the chunk (architecture.md §4):
//   M_rs = beta_r (k_r . k_s) e^{G_r - G_s}  (s < r),      QK_rs = (q_r . k_s) e^{G_r - G_s}  (s <= r)
//   Vn   = (I + M)^{-1} (beta . (V - e^{G} . (K S)))        (forward substitution)
//   O_r  = e^{G_r} q_r S + sum_{s <= r} QK_rs Vn_s
//   S'   = e^{G_{L-1}} S + sum_r e^{G_{L-1} - G_r} k_r Vn_r^T
// (Vn is the CPU reference's U - W S with U = A(beta V), W = A(beta e^G K), A = (I + M)^{-1}: A is
// linear, so U - W S = A(beta V - beta e^G K S), which needs no [64, dk] W buffer.)
//
// The dv columns of the state evolve independently, so each block owns one head and 32 of its 128
// value columns: grid (v_heads, 4), 256 threads; the [64, 64] chunk matrices are recomputed by the
// 4 blocks of a head. Shared memory (fp32): K and Q [64][129] (odd pitch: no bank conflicts on
// column reads), M|QK packed in one [64][65] (M below the diagonal, QK^T above, QK diagonal apart),
// the state slice S [128][32], gates. About 98 KiB: within the 99 KiB of sm_121.
#include "common.cuh"

#define GC_L 64
#define GC_D 128
#define GC_COLS 32
#define GC_PK 129
#define GC_PM 65

struct GdnSmem {
    float k[GC_L][GC_PK];
    float q[GC_L][GC_PK];  // after the K S / Q S products: R and Vn [64][32]
    float mq[GC_L][GC_PM];
    float s[GC_D][GC_COLS];
    float g[GC_L];     // inclusive cumsum G
    float beta[GC_L];
    float qkd[GC_L];   // QK diagonal
    float c[GC_L];     // e^{G_last - G_r}
};

__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }

extern "C" __global__ void __launch_bounds__(256) gdn_chunked(const OrnithGdnParams p) {
    extern __shared__ __align__(16) uint8_t smem_raw[];
    GdnSmem &sm = *reinterpret_cast<GdnSmem *>(smem_raw);
    const int h = blockIdx.x, c0 = blockIdx.y * GC_COLS;
    const int kh = h / (p.v_heads / p.k_heads);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kdim = p.k_heads * GC_D;
    float *state = p.state + (size_t)h * GC_D * GC_D;
    float(*vn)[GC_COLS] = reinterpret_cast<float(*)[GC_COLS]>(&sm.q[0][0]);

    for (int e = tid; e < GC_D * GC_COLS; e += 256) sm.s[e / GC_COLS][e % GC_COLS] = state[(e / GC_COLS) * GC_D + c0 + e % GC_COLS];
    const float neg_a = -expf(p.a_log[h]);
    const float dt = bf2f(p.dt_bias[h]);
    const float qscale = 0.08838834764831845f;  // dk^-0.5 = 128^-0.5, rounded to f32

    for (int t0 = 0; t0 < p.tokens; t0 += GC_L) {
        const int L = min(GC_L, p.tokens - t0);
        // 0. q, k rows (l2norm in fp32, q also * dk^-0.5), gates.
        for (int r = warp; r < GC_L; r += 8) {
            float qv[4], kv[4];
            float sq = 0.f, sk = 0.f;
            if (r < L) {
                const uint16_t *row = p.qkv + (size_t)(t0 + r) * p.qkv_stride;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    qv[j] = bf2f(row[kh * GC_D + lane + 32 * j]);
                    kv[j] = bf2f(row[kdim + kh * GC_D + lane + 32 * j]);
                    sq += qv[j] * qv[j];
                    sk += kv[j] * kv[j];
                }
                sq = warp_sum(sq);
                sk = warp_sum(sk);
                const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    sm.q[r][lane + 32 * j] = (qv[j] * iq) * qscale;
                    sm.k[r][lane + 32 * j] = kv[j] * ik;
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; j++) sm.q[r][lane + 32 * j] = sm.k[r][lane + 32 * j] = 0.f;
            }
        }
        if (tid < GC_L) {
            float bt = 0.f, gg = 0.f;
            if (tid < L) {
                const uint16_t *ba = p.ba + (size_t)(t0 + tid) * p.ba_stride;
                bt = rbf(sigmoid_f(bf2f(ba[h])));
                gg = neg_a * softplus_f(bf2f(ba[p.a_offset + h]) + dt);
            }
            sm.beta[tid] = bt;
            sm.g[tid] = gg;
        }
        __syncthreads();
        if (tid == 0) {  // sequential fp32 cumsum, as the reference
            float acc = 0.f;
            for (int r = 0; r < GC_L; r++) { acc += sm.g[r]; sm.g[r] = acc; }
        }
        // 1. X = K S, Y = Q S for rows r = warp + 8m, column lane (S is the chunk-start state).
        float X[8], Y[8];
#pragma unroll
        for (int m = 0; m < 8; m++) X[m] = Y[m] = 0.f;
        for (int i = 0; i < GC_D; i++) {
            const float sv = sm.s[i][lane];
#pragma unroll
            for (int m = 0; m < 8; m++) {
                X[m] += sm.k[warp + 8 * m][i] * sv;
                Y[m] += sm.q[warp + 8 * m][i] * sv;
            }
        }
        __syncthreads();  // G ready
        // 2. M and QK: rows r = a + 16m, columns s = b + 16n.
        {
            const int a = tid >> 4, b = tid & 15;
            float kk[4][4], qk[4][4];
#pragma unroll
            for (int m = 0; m < 4; m++)
#pragma unroll
                for (int n = 0; n < 4; n++) kk[m][n] = qk[m][n] = 0.f;
            for (int i = 0; i < GC_D; i++) {
                float kr[4], qr[4], ks[4];
#pragma unroll
                for (int m = 0; m < 4; m++) {
                    kr[m] = sm.k[a + 16 * m][i];
                    qr[m] = sm.q[a + 16 * m][i];
                    ks[m] = sm.k[b + 16 * m][i];
                }
#pragma unroll
                for (int m = 0; m < 4; m++)
#pragma unroll
                    for (int n = 0; n < 4; n++) {
                        kk[m][n] += kr[m] * ks[n];
                        qk[m][n] += qr[m] * ks[n];
                    }
            }
            __syncthreads();  // every read of Q is done before step 3 overwrites it
#pragma unroll
            for (int m = 0; m < 4; m++)
#pragma unroll
                for (int n = 0; n < 4; n++) {
                    const int r = a + 16 * m, s = b + 16 * n;
                    const bool in = r < L && s < L && s <= r;
                    const float decay = in ? expf(sm.g[r] - sm.g[s]) : 0.f;
                    if (s < r) {
                        sm.mq[r][s] = in ? (sm.beta[r] * kk[m][n]) * decay : 0.f;
                        sm.mq[s][r] = in ? qk[m][n] * decay : 0.f;
                    } else if (s == r) {
                        sm.qkd[r] = in ? qk[m][n] * decay : 0.f;
                    }
                }
        }
        // 3. R = beta (V - e^{G} X) into the (now free) Q area.
        {
            const int c = c0 + lane;
#pragma unroll
            for (int m = 0; m < 8; m++) {
                const int r = warp + 8 * m;
                float rv = 0.f;
                if (r < L) {
                    const float v = bf2f(p.qkv[(size_t)(t0 + r) * p.qkv_stride + 2 * kdim + h * GC_D + c]);
                    rv = sm.beta[r] * (v - expf(sm.g[r]) * X[m]);
                }
                vn[r][lane] = rv;
            }
        }
        if (tid < GC_L) sm.c[tid] = expf(sm.g[L - 1] - sm.g[tid]);
        __syncthreads();
        // 4. Forward substitution Vn_r = R_r - sum_{s<r} M_rs Vn_s (each lane owns one column).
        if (warp == 0) {
            for (int r = 1; r < L; r++) {
                float acc = vn[r][lane];
                for (int s = 0; s < r; s++) acc -= sm.mq[r][s] * vn[s][lane];
                vn[r][lane] = acc;
            }
        }
        __syncthreads();
        // 5. O_r = e^{G_r} Y_r + sum_{s<=r} QK_rs Vn_s.
#pragma unroll
        for (int m = 0; m < 8; m++) {
            const int r = warp + 8 * m;
            if (r < L) {
                float o = expf(sm.g[r]) * Y[m];
                for (int s = 0; s < r; s++) o += sm.mq[s][r] * vn[s][lane];
                o += sm.qkd[r] * vn[r][lane];
                p.o[((size_t)(t0 + r) * p.v_heads + h) * GC_D + c0 + lane] = f2bf(o);
            }
        }
        // 6. S' = e^{G_last} S + sum_r (k_r[i] c_r) Vn_r[j]   for i = warp + 8n, j = lane.
        {
            const float el = expf(sm.g[L - 1]);
            float sv[16];
#pragma unroll
            for (int n = 0; n < 16; n++) sv[n] = sm.s[warp + 8 * n][lane] * el;
            for (int r = 0; r < L; r++) {
                const float cr = sm.c[r], v = vn[r][lane];
#pragma unroll
                for (int n = 0; n < 16; n++) sv[n] += (sm.k[r][warp + 8 * n] * cr) * v;
            }
#pragma unroll
            for (int n = 0; n < 16; n++) sm.s[warp + 8 * n][lane] = sv[n];
        }
        __syncthreads();
    }
    for (int e = tid; e < GC_D * GC_COLS; e += 256) state[(e / GC_COLS) * GC_D + c0 + e % GC_COLS] = sm.s[e / GC_COLS][e % GC_COLS];
}
