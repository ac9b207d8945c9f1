// Gated DeltaNet prefill: the chunked gated delta rule (chunk 64), fp32 throughout.
//
// Same inputs, gates, q/k preparation and state as gdn_recurrent (OrnithGdnParams); per v-head,
// per chunk of L <= 64 tokens with G = inclusive cumsum of g inside the chunk (docs/ARCHITECTURE.md §4):
//   M_rs = beta_r (k_r . k_s) e^{G_r - G_s}  (s < r),      QK_rs = (q_r . k_s) e^{G_r - G_s}  (s <= r)
//   Vn   = (I + M)^{-1} (beta . (V - e^{G} . (K S)))        (forward substitution)
//   O_r  = e^{G_r} q_r S + sum_{s <= r} QK_rs Vn_s
//   S'   = e^{G_{L-1}} S + sum_r e^{G_{L-1} - G_r} k_r Vn_r^T
// (Vn is the CPU reference's U - W S with U = A(beta V), W = A(beta e^G K), A = (I + M)^{-1}: A is
// linear, so U - W S = A(beta V - beta e^G K S), which needs no [64, dk] W buffer.)
//
// It runs in two phases (below): the state-independent work of every chunk in parallel, then one
// sequential pass per (head, 16 value columns) that carries the state. (A one-kernel form, grid
// (v_heads, 4) with everything sequential over the chunks, measured 2.7x slower on the H200 and
// was removed once this form passed the same test.)
#include "common.cuh"

#define GC_L 64
#define GC_D 128
#define GC_PK 129
#define GC_PM 65

__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// ---------------------------------------------------------------------------------------------
// The two phases (the WY / "UT" split of the chunked rule): the state-independent work of every
// chunk runs in parallel first, then one sequential pass per (head, 16 value columns) carries S.
//
// Phase 1, gdn_chunk_prep, grid (chunks, v_heads), 256 threads, per chunk of L <= 64 rows:
//   G = inclusive cumsum of g (sequential, as the reference), M as above,
//   A  = (I + M)^{-1}: unit lower triangular, by 16-row blocks: the four diagonal blocks
//        D_I = (I + M_II)^{-1} by forward substitution at once (column j: A_rj = [r == j] -
//        sum_{s<r} M_rs A_sj; 4 lanes per column split the sum), then block rows I = 1..3 in turn:
//        A_IJ = -D_I sum_{J<=K<I} M_IK A_KJ (J < I) — 15 + 6 dependent steps, not 63,
//   A' = A diag(beta),  QKd_rs = (q_r . k_s) e^{G_r - G_s} (s <= r, else 0),
//   eg_r = e^{G_r},  cg_r = e^{G_{L-1} - G_r};  rows/columns >= L are zero (A' rows there: beta = 0).
// Workspace p.work, per (head, chunk) GW_STRIDE floats: A' [64][68], QKd [64][68], eg [64], cg [64]
// (pitch 68 = 4 mod 32: float4 reads of 8 rows at one column hit 8 different 16-byte bank groups).
//
// Phase 2, gdn_chunk_scan, grid (v_heads, 8), 256 threads: block owns 16 value columns of one head,
// S [128][16] in shared memory, and per chunk (A' (V - e^G (K S)) = U - W S as in the reference):
//   X = K S, Y = Q S                      [64,128] x [128,16], 2 rows x 4 columns per thread
//   R = V - eg . X,  Vn = A' R,  O = eg . Y + QKd Vn          (A', QKd lower triangular)
//   S' = eg_{L-1} S + sum_r k_r (cg_r Vn_r)^T
// q/k are re-normalised from the bf16 input in both phases (same code, same fp32 values).
// Shared memory of the scan: K [64][132] + Q|A'QKd [8704] + S + R, Vn, Vc, Yo [64][16] + gates
// = 93,696 bytes (<= 99 KiB; two blocks per H200 SM, so all 256 blocks are resident at once).
#define GW_P 68
#define GW_STRIDE (2 * GC_L * GW_P + 2 * GC_L)
static_assert(GW_STRIDE == ORNITH_GDN_WORK_PER_CHUNK, "workspace stride");
#define GS_PK 132
#define GS_C 16
#define GS_QA 8704  // max(64 * 132, 2 * 64 * 68)

// Rows r = warp + 8m of the chunk: q, k l2-normalised in fp32 (q also * dk^-0.5) into qd/kd
// (pitch `pitch`), zero rows from L on. A warp issues the loads of QK_RB rows before the first
// row's sums (one memory latency per QK_RB rows: this runs on the scan's sequential path once
// per chunk); each row's arithmetic is unchanged.
#define QK_RB 8
__device__ __forceinline__ void gdn_load_qk(const OrnithGdnParams &p, int t0, int L, int kh, float *qd, float *kd, int pitch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kdim = p.k_heads * GC_D;
    const float qscale = 0.08838834764831845f;  // dk^-0.5 = 128^-0.5, rounded to f32
    static_assert(GC_L % (8 * QK_RB) == 0, "rows per warp a whole number of batches");
    for (int r0 = warp; r0 < GC_L; r0 += 8 * QK_RB) {
        uint16_t qb[QK_RB][4], kb[QK_RB][4];
#pragma unroll
        for (int b = 0; b < QK_RB; b++) {
            const int r = r0 + 8 * b;
            const uint16_t *row = p.qkv + (size_t)(t0 + min(r, L - 1)) * p.qkv_stride;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                qb[b][j] = row[kh * GC_D + lane + 32 * j];
                kb[b][j] = row[kdim + kh * GC_D + lane + 32 * j];
            }
        }
#pragma unroll
        for (int b = 0; b < QK_RB; b++) {
            const int r = r0 + 8 * b;
            if (r < L) {
                float qv[4], kv[4], sq = 0.f, sk = 0.f;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    qv[j] = bf2f(qb[b][j]);
                    kv[j] = bf2f(kb[b][j]);
                    sq += qv[j] * qv[j];
                    sk += kv[j] * kv[j];
                }
                sq = warp_sum(sq);
                sk = warp_sum(sk);
                const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    qd[r * pitch + lane + 32 * j] = (qv[j] * iq) * qscale;
                    kd[r * pitch + lane + 32 * j] = kv[j] * ik;
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; j++) qd[r * pitch + lane + 32 * j] = kd[r * pitch + lane + 32 * j] = 0.f;
            }
        }
    }
}

struct GdnPrepSmem {
    union {
        struct {
            float k[GC_L][GC_PK];
            float q[GC_L][GC_PK];
        } qk;
        struct {
            float m[GC_L][GC_PM];
            float a[GC_L][72];  // pitch 72: the 4 rows x 8 columns a warp reads per step hit 32 banks
        } inv;
    } u;
    float g[GC_L];
    float beta[GC_L];
};

extern "C" __global__ void __launch_bounds__(256) gdn_chunk_prep(const OrnithGdnParams p) {
    pdl_entry();
    extern __shared__ __align__(16) uint8_t smem_raw[];
    GdnPrepSmem &sm = *reinterpret_cast<GdnPrepSmem *>(smem_raw);
    const int ci = blockIdx.x, h = blockIdx.y, nchunks = gridDim.x;
    const int kh = h / (p.v_heads / p.k_heads);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t0 = ci * GC_L, L = min(GC_L, p.tokens - t0);
    float *ws = p.work + ((size_t)h * nchunks + ci) * GW_STRIDE;
    float *wa = ws, *wq = ws + GC_L * GW_P, *weg = ws + 2 * GC_L * GW_P, *wcg = weg + GC_L;

    gdn_load_qk(p, t0, L, kh, &sm.u.qk.q[0][0], &sm.u.qk.k[0][0], GC_PK);
    if (tid < GC_L) {
        float bt = 0.f, gg = 0.f;
        if (tid < L) {
            const uint16_t *ba = p.ba + (size_t)(t0 + tid) * p.ba_stride;
            bt = rbf(sigmoid_f(bf2f(ba[h])));
            gg = -expf(p.a_log[h]) * softplus_f(bf2f(ba[p.a_offset + h]) + bf2f(p.dt_bias[h]));
        }
        sm.beta[tid] = bt;
        sm.g[tid] = gg;
    }
    __syncthreads();
    if (tid == 0) {  // sequential fp32 cumsum, as the reference
        float acc = 0.f;
        for (int r = 0; r < GC_L; r++) { acc += sm.g[r]; sm.g[r] = acc; }
    }
    // K K^T and Q K^T: rows r = a + 16m, columns s = b + 16n.
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
            kr[m] = sm.u.qk.k[a + 16 * m][i];
            qr[m] = sm.u.qk.q[a + 16 * m][i];
            ks[m] = sm.u.qk.k[b + 16 * m][i];
        }
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int n = 0; n < 4; n++) {
                kk[m][n] += kr[m] * ks[n];
                qk[m][n] += qr[m] * ks[n];
            }
    }
    __syncthreads();  // Q, K reads done (the region becomes M, A); G ready
#pragma unroll
    for (int m = 0; m < 4; m++)
#pragma unroll
        for (int n = 0; n < 4; n++) {
            const int r = a + 16 * m, s = b + 16 * n;
            const bool in = r < L && s < L && s <= r;
            const float decay = in ? expf(sm.g[r] - sm.g[s]) : 0.f;
            sm.u.inv.m[r][s] = (in && s < r) ? (sm.beta[r] * kk[m][n]) * decay : 0.f;
            wq[r * GW_P + s] = in ? qk[m][n] * decay : 0.f;
        }
    if (tid < GC_L) {
        const float gl = sm.g[L - 1];
        weg[tid] = expf(sm.g[tid]);
        wcg[tid] = expf(gl - sm.g[tid]);
    }
    __syncthreads();
    // A = (I + M)^{-1}. (1) The diagonal blocks D_I: block I = warp / 2, its column j (8 per
    // warp), lane part pp sums s = pp, pp + 4, ... (A_sj = 0 for s < j makes the loop uniform:
    // rows r <= j of the block come out as [r == j]); the rows above the block are zero.
    {
        const int bi = 16 * (warp >> 1), j = bi + 8 * (warp & 1) + (lane >> 2), pp = lane & 3;
        for (int r = pp; r < bi; r += 4) sm.u.inv.a[r][j] = 0.f;
        if (pp == 0) sm.u.inv.a[bi][j] = bi == j ? 1.f : 0.f;
        __syncwarp();
        for (int r = 1; r < 16; r++) {
            float acc = 0.f;
            for (int s = pp; s < r; s += 4) acc += sm.u.inv.m[bi + r][bi + s] * sm.u.inv.a[bi + s][j];
            acc += __shfl_xor_sync(0xffffffffu, acc, 1);
            acc += __shfl_xor_sync(0xffffffffu, acc, 2);
            if (pp == 0) sm.u.inv.a[bi + r][j] = (bi + r == j ? 1.f : 0.f) - acc;
            __syncwarp();
        }
    }
    __syncthreads();
    // (2) Block rows I = 1..3 below the diagonal, in turn: T_IJ = sum_{16J <= s < 16I} M_{.s} A_{s.}
    // (A_KJ = 0 for K < J), then A_IJ = -D_I T_IJ = -(T_r + sum_{q<r} D_rq T_q) (D unit lower
    // triangular). Thread: row r, column c of each 16 x 16 block (I, J < I).
    {
        const int r = tid >> 4, c = tid & 15;
        for (int I = 1; I < 4; I++) {
            const int ri = 16 * I + r;
#pragma unroll
            for (int J = 0; J < 3; J++)
                if (J < I) {
                    float acc = 0.f;
                    for (int s = 16 * J; s < 16 * I; s++) acc += sm.u.inv.m[ri][s] * sm.u.inv.a[s][16 * J + c];
                    sm.u.inv.a[ri][16 * J + c] = acc;  // T, where A_IJ goes (rows >= 16I are not read above)
                }
            __syncthreads();
            float nv[3];
#pragma unroll
            for (int J = 0; J < 3; J++)
                if (J < I) {
                    float acc = sm.u.inv.a[ri][16 * J + c];
                    for (int q = 0; q < r; q++) acc += sm.u.inv.a[ri][16 * I + q] * sm.u.inv.a[16 * I + q][16 * J + c];
                    nv[J] = -acc;
                }
            __syncthreads();
#pragma unroll
            for (int J = 0; J < 3; J++)
                if (J < I) sm.u.inv.a[ri][16 * J + c] = nv[J];
            __syncthreads();
        }
    }
    for (int e = tid; e < GC_L * GC_L; e += 256) {
        const int r = e >> 6, j = e & 63;
        wa[r * GW_P + j] = sm.u.inv.a[r][j] * sm.beta[j];
    }
}

struct GdnScanSmem {
    float k[GC_L][GS_PK];
    float qa[GS_QA];  // Q [64][132]; after X, Y: A' [64][68] then QKd [64][68]
    float s[GC_D][GS_C];
    float r[GC_L][GS_C];
    float vn[GC_L][GS_C];
    float vc[GC_L][GS_C];  // cg_r Vn_r
    float yo[GC_L][GS_C];  // eg_r (q_r S)
    float eg[GC_L];
    float cg[GC_L];
};

__device__ __forceinline__ void fma4(float (&acc)[4], float a, float4 b) {
    acc[0] += a * b.x;
    acc[1] += a * b.y;
    acc[2] += a * b.z;
    acc[3] += a * b.w;
}

extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_scan(const OrnithGdnParams p) {
    pdl_entry();
    extern __shared__ __align__(16) uint8_t smem_raw[];
    GdnScanSmem &sm = *reinterpret_cast<GdnScanSmem *>(smem_raw);
    const int h = blockIdx.x, c0 = blockIdx.y * GS_C;
    const int kh = h / (p.v_heads / p.k_heads);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kdim = p.k_heads * GC_D;
    const int nchunks = (p.tokens + GC_L - 1) / GC_L;
    float *state = p.state + (size_t)h * GC_D * GC_D;
    const float *wsh = p.work + (size_t)h * nchunks * GW_STRIDE;
    // Thread tiles. X|Y and S': row group rg (lane bits 0, 3, 4), column quad cq (lane bits 1, 2:
    // columns 4cq..4cq+3). The scan is bound by shared memory's return bandwidth (one register
    // per lane per cycle: an LDS.128 takes 4 cycles), which an LDS halves when lanes n and n ^ 1,
    // or n and n ^ 2, read the same address. Every operand here is indexed by rg alone or by cq
    // alone, and this split of the lane's bits makes lanes n, n ^ 1 share cq and n, n ^ 2 share
    // rg, so each LDS is a pair-uniform one (with rg = lane / 4, cq = lane % 4 the cq-indexed
    // loads of S, R, Vn and Vc were not). Which lane computes an output changes, not its sums.
    const int rg = (lane & 1) | ((lane >> 2) & 6), cq = (lane >> 1) & 3;
    // Vn and O: row tr = 8 warp + rg (warp w holds rows 8w..8w+7), columns 4cq.
    const int tr = 8 * warp + rg;

    for (int e = tid; e < GC_D * GS_C; e += 256) sm.s[e / GS_C][e % GS_C] = state[(e / GS_C) * GC_D + c0 + e % GS_C];

    for (int ci = 0; ci < nchunks; ci++) {
        const int t0 = ci * GC_L, L = min(GC_L, p.tokens - t0);
        const float *ws = wsh + (size_t)ci * GW_STRIDE;
        // (a) q, k rows; gates; this thread's V values (rows of its X tile).
        gdn_load_qk(p, t0, L, kh, sm.qa, &sm.k[0][0], GS_PK);
        if (tid < 2 * GC_L) sm.eg[tid] = ws[2 * GC_L * GW_P + tid];  // eg then cg
        const int xr0 = 16 * (warp & 3) + rg, xr1 = xr0 + 8;
        float v[2][4];
#pragma unroll
        for (int m = 0; m < 2; m++) {
            const int rr = m ? xr1 : xr0;
#pragma unroll
            for (int j = 0; j < 4; j++)
                v[m][j] = (warp < 4 && rr < L) ? bf2f(p.qkv[(size_t)(t0 + rr) * p.qkv_stride + 2 * kdim + h * GC_D + c0 + 4 * cq + j]) : 0.f;
        }
        __syncthreads();
        // A' and QKd of this chunk into registers (stored to shared memory once Q is consumed).
        float4 pre[9];
        {
            const float4 *src = reinterpret_cast<const float4 *>(ws);
#pragma unroll
            for (int k = 0; k < 9; k++) {
                const int e = tid + 256 * k;
                pre[k] = e < GS_QA / 4 ? src[e] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
        // (b) X = K S (warps 0-3) / Y = Q S (warps 4-7): rows xr0, xr1, columns 4cq..4cq+3.
        {
            const float *mat = warp < 4 ? &sm.k[0][0] : sm.qa;
            float acc[2][4];
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[m][j] = 0.f;
#pragma unroll 4
            for (int i = 0; i < GC_D; i += 4) {
                const float4 a0 = *reinterpret_cast<const float4 *>(mat + xr0 * GS_PK + i);
                const float4 a1 = *reinterpret_cast<const float4 *>(mat + xr1 * GS_PK + i);
                const float4 s0 = *reinterpret_cast<const float4 *>(&sm.s[i][4 * cq]);
                const float4 s1 = *reinterpret_cast<const float4 *>(&sm.s[i + 1][4 * cq]);
                const float4 s2 = *reinterpret_cast<const float4 *>(&sm.s[i + 2][4 * cq]);
                const float4 s3 = *reinterpret_cast<const float4 *>(&sm.s[i + 3][4 * cq]);
                fma4(acc[0], a0.x, s0); fma4(acc[0], a0.y, s1); fma4(acc[0], a0.z, s2); fma4(acc[0], a0.w, s3);
                fma4(acc[1], a1.x, s0); fma4(acc[1], a1.y, s1); fma4(acc[1], a1.z, s2); fma4(acc[1], a1.w, s3);
            }
#pragma unroll
            for (int m = 0; m < 2; m++) {
                const int rr = m ? xr1 : xr0;
                const float e = sm.eg[rr];
                float4 out;
                if (warp < 4)  // R = V - e^{G} (K S)
                    out = make_float4(v[m][0] - e * acc[m][0], v[m][1] - e * acc[m][1], v[m][2] - e * acc[m][2], v[m][3] - e * acc[m][3]);
                else
                    out = make_float4(e * acc[m][0], e * acc[m][1], e * acc[m][2], e * acc[m][3]);
                *reinterpret_cast<float4 *>(warp < 4 ? &sm.r[rr][4 * cq] : &sm.yo[rr][4 * cq]) = out;
            }
        }
        __syncthreads();  // Q consumed; R, Yo written
        {
            float4 *dst = reinterpret_cast<float4 *>(sm.qa);
#pragma unroll
            for (int k = 0; k < 9; k++) {
                const int e = tid + 256 * k;
                if (e < GS_QA / 4) dst[e] = pre[k];
            }
        }
        __syncthreads();
        const float *ap = sm.qa, *qkd = sm.qa + GC_L * GW_P;
        const int send = 8 * warp + 8;  // A', QKd are zero right of the diagonal: s < 8w + 8 suffices
        // (d) Vn = A' R (row tr, columns 4cq); Vc = cg . Vn.
        {
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
            for (int s = 0; s < send; s += 4) {
                const float4 a4 = *reinterpret_cast<const float4 *>(ap + tr * GW_P + s);
                fma4(acc, a4.x, *reinterpret_cast<const float4 *>(&sm.r[s][4 * cq]));
                fma4(acc, a4.y, *reinterpret_cast<const float4 *>(&sm.r[s + 1][4 * cq]));
                fma4(acc, a4.z, *reinterpret_cast<const float4 *>(&sm.r[s + 2][4 * cq]));
                fma4(acc, a4.w, *reinterpret_cast<const float4 *>(&sm.r[s + 3][4 * cq]));
            }
            const float c = sm.cg[tr];
            *reinterpret_cast<float4 *>(&sm.vn[tr][4 * cq]) = make_float4(acc[0], acc[1], acc[2], acc[3]);
            *reinterpret_cast<float4 *>(&sm.vc[tr][4 * cq]) = make_float4(c * acc[0], c * acc[1], c * acc[2], c * acc[3]);
        }
        __syncthreads();
        // (e) O = Yo + QKd Vn (row tr), bf16 out.
        {
            const float4 y = *reinterpret_cast<const float4 *>(&sm.yo[tr][4 * cq]);
            float acc[4] = {y.x, y.y, y.z, y.w};
            for (int s = 0; s < send; s += 4) {
                const float4 a4 = *reinterpret_cast<const float4 *>(qkd + tr * GW_P + s);
                fma4(acc, a4.x, *reinterpret_cast<const float4 *>(&sm.vn[s][4 * cq]));
                fma4(acc, a4.y, *reinterpret_cast<const float4 *>(&sm.vn[s + 1][4 * cq]));
                fma4(acc, a4.z, *reinterpret_cast<const float4 *>(&sm.vn[s + 2][4 * cq]));
                fma4(acc, a4.w, *reinterpret_cast<const float4 *>(&sm.vn[s + 3][4 * cq]));
            }
            if (tr < L) {
                uint2 pk;
                pk.x = (uint32_t)f2bf(acc[0]) | ((uint32_t)f2bf(acc[1]) << 16);
                pk.y = (uint32_t)f2bf(acc[2]) | ((uint32_t)f2bf(acc[3]) << 16);
                *reinterpret_cast<uint2 *>(p.o + ((size_t)(t0 + tr) * p.v_heads + h) * GC_D + c0 + 4 * cq) = pk;
            }
        }
        // S' = e^{G_{L-1}} S + sum_{r<L} k_r Vc_r^T: state rows i0 = 16w + 2rg, i0 + 1, columns 4cq.
        {
            const int i0 = 16 * warp + 2 * rg;
            const float el = sm.eg[L - 1];
            float4 s0 = *reinterpret_cast<const float4 *>(&sm.s[i0][4 * cq]);
            float4 s1 = *reinterpret_cast<const float4 *>(&sm.s[i0 + 1][4 * cq]);
            float acc0[4] = {el * s0.x, el * s0.y, el * s0.z, el * s0.w};
            float acc1[4] = {el * s1.x, el * s1.y, el * s1.z, el * s1.w};
#pragma unroll 4
            for (int r = 0; r < L; r++) {
                const float2 k2 = *reinterpret_cast<const float2 *>(&sm.k[r][i0]);
                const float4 vv = *reinterpret_cast<const float4 *>(&sm.vc[r][4 * cq]);
                fma4(acc0, k2.x, vv);
                fma4(acc1, k2.y, vv);
            }
            *reinterpret_cast<float4 *>(&sm.s[i0][4 * cq]) = make_float4(acc0[0], acc0[1], acc0[2], acc0[3]);
            *reinterpret_cast<float4 *>(&sm.s[i0 + 1][4 * cq]) = make_float4(acc1[0], acc1[1], acc1[2], acc1[3]);
        }
        __syncthreads();
    }
    for (int e = tid; e < GC_D * GS_C; e += 256) state[(e / GS_C) * GC_D + c0 + e % GS_C] = sm.s[e / GS_C][e % GS_C];
}
