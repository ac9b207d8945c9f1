// Causal flash attention for prefill (head_dim 256, GQA), bf16 mma.sync m16n8k16 with fp32
// online softmax (see OrnithFlashAttnParams).
//
// Block = 64 queries of one q head, 4 warps x 16 query rows; keys in tiles of 64. Shared memory:
// Q [64][256], K [64][256], V [64][256] bf16 = 96 KiB (two blocks per SM on sm_90). K and V are
// single-buffered and staggered: V(j) is loaded (cp.async) while S(j) = Q K(j)^T runs, K(j + 1)
// while the softmax and P V(j) run. Rows are 512 bytes = 32 chunks of 16 bytes; chunk c of row r
// lives at c ^ (r & 7) (conflict-free ldmatrix).
// Per tile, in base 2 with c = scale * log2(e) folded in: S = Q K^T (fp32), m' = max(m, c rowmax S),
// P = 2^{c S - m'}, l = l 2^{m - m'} + rowsum P, O = O 2^{m - m'} + bf16(P) V; at the end o = O / l
// (= the softmax of scale * S: 2^{c s - c m} = e^{scale (s - m)}).
// Tiles wholly at or below a warp's first query need no causal mask; tiles wholly after its last
// query contribute nothing and the warp skips their mma (it still joins the block's barriers);
// O is rescaled only when some row's max moved (a factor of exactly 1 otherwise).
#include "common.cuh"
#include "mma.cuh"

#define FA_D 256
#define FA_BQ 64
#define FA_BK 64
#define FA_NJ (FA_BK / 8)  // n-tiles of 8 keys per tile
#define FA_ROW 512         // bytes per row
static_assert(ORNITH_KV_BLOCK % FA_BK == 0, "a key tile must lie inside one K/V block");

__device__ __forceinline__ uint32_t fswz(int row, int chunk) {
    return (uint32_t)(row * FA_ROW + ((chunk ^ (row & 7)) << 4));
}
// 2^x (MUFU.EX2; 2^-inf = 0).
__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

extern "C" __global__ void __launch_bounds__(128) flash_attn_prefill(const OrnithFlashAttnParams p) {
    pdl_entry();
    extern __shared__ __align__(128) uint8_t smem[];
    const uint32_t sq = smem_u32(smem);
    const uint32_t sk = sq + FA_BQ * FA_ROW;  // K: 64 rows
    const uint32_t sv = sk + FA_BK * FA_ROW;  // V: 64 rows
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int qb = gridDim.x - 1 - blockIdx.x;  // longest blocks first
    const int h = blockIdx.y, kvh = h / (p.q_heads / p.kv_heads);
    const int q0 = qb * FA_BQ;
    const int qend = min(q0 + FA_BQ, p.tokens);
    const int nkeys = p.pos0 + qend;  // keys 0..nkeys-1 are visible to some query of the block
    const int ntiles = (nkeys + FA_BK - 1) / FA_BK;
    const size_t kv_pitch = (size_t)p.kv_heads * FA_D;  // elements between cache rows

    // Q tile: 64 rows x 32 chunks = 2048 chunks, 16 per thread.
    for (int id = tid; id < FA_BQ * 32; id += 128) {
        int r = id >> 5, c = id & 31, t = q0 + r;
        const uint16_t *src = p.q + ((size_t)t * p.q_heads + h) * FA_D + c * 8;
        cp_async16(sq + fswz(r, c), t < p.tokens ? (const void *)src : (const void *)p.q, t < p.tokens ? 16 : 0);
    }
    // One K or V tile (64 rows x 32 chunks; this thread: chunk tid % 32 of rows tid / 32 + 4i) into
    // `dst`; rows past nkeys zero-filled. Paged: position j lives in cache row
    // table[j / ORNITH_KV_BLOCK] * ORNITH_KV_BLOCK + j % ORNITH_KV_BLOCK, and a 64-aligned tile lies
    // inside one block, so its rows are consecutive from one table entry.
    auto load_tile = [&](const uint16_t *cache, uint32_t dst, int tile) {
        const int j0 = tile * FA_BK, c = tid & 31, r0 = tid >> 5;  // j0 < nkeys
        const size_t row0 = (size_t)__ldg(p.table + j0 / ORNITH_KV_BLOCK) * ORNITH_KV_BLOCK + j0 % ORNITH_KV_BLOCK;
        const uint16_t *src = cache + (row0 + r0) * kv_pitch + (size_t)kvh * FA_D + c * 8;
#pragma unroll 4
        for (int r = r0; r < FA_BK; r += 4, src += 4 * kv_pitch) {
            const bool ok = j0 + r < nkeys;
            cp_async16(dst + fswz(r, c), ok ? (const void *)src : (const void *)cache, ok ? 16 : 0);
        }
    };
    load_tile(p.k_cache, sk, 0);
    cp_commit();

    const int gq = lane >> 2, tq = lane & 3;
    // This thread's two query rows (gq and gq + 8 of the warp's 16) and their positions; the
    // warp's first and last query positions.
    const int qrow0 = warp * 16 + gq;
    const int qpos[2] = {p.pos0 + q0 + qrow0, p.pos0 + q0 + qrow0 + 8};
    const int wfirst = p.pos0 + q0 + warp * 16, wlast = wfirst + 15;
    const float c2 = p.scale * 1.4426950408889634f;  // scale * log2(e)
    float o[32][4];
#pragma unroll
    for (int i = 0; i < 32; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};  // m in base-2 units (c2 s)

    for (int tile = 0; tile < ntiles; tile++) {
        cp_wait<0>();
        __syncthreads();  // K(tile) is in; every warp is done with V(tile - 1)
        load_tile(p.v_cache, sv, tile);
        cp_commit();
        const int kbase = tile * FA_BK;
        const bool active = kbase <= wlast;  // warp-uniform
        // S = Q K^T: 16 rows x 64 keys per warp (8 n-tiles of 8 keys), 16 k-steps of 16 dims.
        float s[FA_NJ][4];
        if (active) {
#pragma unroll
            for (int j = 0; j < FA_NJ; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < FA_D / 16; ks++) {
                uint32_t a[4], b[FA_NJ][2];
                {
                    int r = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    ldsm_x4(sq + fswz(r, 2 * ks + (lane >> 4)), a[0], a[1], a[2], a[3]);
                }
#pragma unroll
                for (int nj = 0; nj < FA_NJ; nj += 2) {
                    int r = nj * 8 + (lane >> 4) * 8 + (lane & 7);
                    ldsm_x4(sk + fswz(r, 2 * ks + ((lane >> 3) & 1)), b[nj][0], b[nj][1], b[nj + 1][0], b[nj + 1][1]);
                }
#pragma unroll
                for (int nj = 0; nj < FA_NJ; nj++) mma_bf16(s[nj], a, b[nj]);
            }
        }
        cp_wait<0>();
        __syncthreads();  // V(tile) is in; every warp is done with K(tile)
        if (tile + 1 < ntiles) load_tile(p.k_cache, sk, tile + 1);
        cp_commit();
        if (!active) continue;
        // Causal mask (only on tiles reaching past the warp's first query), row max of the raw
        // scores (c2 > 0 commutes with max) over the quad of 4 lanes sharing a row.
        const bool masked = kbase + FA_BK - 1 > wfirst;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nj = 0; nj < FA_NJ; nj++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int hr = e >> 1;
                if (masked) {
                    int key = kbase + nj * 8 + tq * 2 + (e & 1);
                    s[nj][e] = key <= qpos[hr] ? s[nj][e] : -INFINITY;
                }
                mx[hr] = fmaxf(mx[hr], s[nj][e]);
            }
        float alpha[2];
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
            mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
            mx[hr] = fmaxf(mrow[hr], mx[hr] * c2);  // finite: key 0 is in every row's first tile
            alpha[hr] = fa_exp2(mrow[hr] - mx[hr]);  // mrow = -inf at first: alpha = 0
            mrow[hr] = mx[hr];
        }
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int nj = 0; nj < FA_NJ; nj++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int hr = e >> 1;
                float pv = fa_exp2(fmaf(s[nj][e], c2, -mx[hr]));
                s[nj][e] = pv;
                rs[hr] += pv;
            }
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            rs[hr] += __shfl_xor_sync(0xffffffffu, rs[hr], 1);
            rs[hr] += __shfl_xor_sync(0xffffffffu, rs[hr], 2);
            lrow[hr] = lrow[hr] * alpha[hr] + rs[hr];
        }
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int i = 0; i < 32; i++) {
                o[i][0] *= alpha[0];
                o[i][1] *= alpha[0];
                o[i][2] *= alpha[1];
                o[i][3] *= alpha[1];
            }
        }
        // O += P V: P as bf16 A fragments (4 k-steps of 16 keys), V via ldmatrix.trans.
#pragma unroll
        for (int ks = 0; ks < FA_BK / 16; ks++) {
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
                ldsm_x4_t(sv + fswz(r, c), b0[0], b0[1], b1[0], b1[1]);
                mma_bf16(o[dj], a, b0);
                mma_bf16(o[dj + 1], a, b1);
            }
        }
    }
    cp_wait<0>();

    // o = O / l, bf16; optional sigmoid output gate.
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int t = q0 + qrow0 + hr * 8;
        if (t >= p.tokens) continue;
        uint16_t *dst = p.out + ((size_t)t * p.q_heads + h) * FA_D;
        const uint16_t *gate = p.qg ? p.qg + ((size_t)t * p.q_heads + h) * 2 * FA_D + FA_D : nullptr;
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
