// Full attention, decode path: q/k RMSNorm + partial RoPE + KV-cache write, split-sequence attention
// (flash-decoding, tensor cores) and the combine with the sigmoid output gate.
#include "common.cuh"
#include "mma.cuh"

// Cache row of position `pos` through a block table (ORNITH_KV_BLOCK positions per block).
__device__ __forceinline__ size_t kv_row(const int32_t *table, int pos) {
    return (size_t)__ldg(table + pos / ORNITH_KV_BLOCK) * ORNITH_KV_BLOCK + (size_t)(pos % ORNITH_KV_BLOCK);
}

// grid (q_heads + kv_heads, tokens), block head_dim threads (head_dim <= 256, multiple of 32).
extern "C" __global__ void __launch_bounds__(256) qk_norm_rope(const OrnithQkRopeParams p) {
    pdl_entry();
    __shared__ float xs[256];
    __shared__ float sh[32];
    const int hh = blockIdx.x, t = blockIdx.y, i = threadIdx.x, D = p.head_dim;
    // per-row sequences: own position and block table; one sequence: pos0 + t through `table`
    const int pos = p.pos_dev ? p.pos_dev[t] : p.pos0 + t;
    const int32_t *table = p.table + (p.pos_dev ? (size_t)t * p.table_stride : 0);
    const bool is_q = hh < p.q_heads;
    const int kvh = hh - p.q_heads;
    const uint16_t *src = is_q ? p.qg + ((size_t)t * p.q_heads + hh) * 2 * D
                               : p.k + ((size_t)t * p.kv_heads + kvh) * D;
    const uint16_t *w = is_q ? p.q_norm : p.k_norm;
    // every input is loaded before the reduction and before any store
    float x = bf2f(src[i]);
    const float wi = bf2f(w[i]);
    const uint16_t vi = is_q ? (uint16_t)0 : p.v[((size_t)t * p.kv_heads + kvh) * D + i];
    float ss = block_sum(x * x, sh);
    // zero-centred RMSNorm, fp32 inside, one rounding
    float y = rbf(x * rsqrtf(ss / (float)D + p.eps) * (1.f + wi));
    xs[i] = y;
    __syncthreads();
    if (i < p.rot) {
        const int half = p.rot / 2, fi = i % half;
        const float inv_freq = 1.f / powf(p.theta, (float)(2 * fi) / (float)p.rot);
        const float f = (float)pos * inv_freq;
        const float c = rbf(cosf(f)), s = rbf(sinf(f));
        const float r = i < half ? -xs[i + half] : xs[i - half];  // rotate_half
        y = rbf(rbf(y * c) + rbf(r * s));
    }
    if (is_q) {
        p.q_out[((size_t)t * p.q_heads + hh) * D + i] = f2bf(y);
    } else {
        size_t off = (kv_row(table, pos) * p.kv_heads + kvh) * D + i;
        p.k_cache[off] = f2bf(y);
        p.v_cache[off] = vi;
    }
}

// ---------------------------------------------------------------------------------------------
// Decode attention (flash-decoding over the paged cache, see OrnithAttnParams).
//
// Work item = (row t, kv-head pair, split s): the keys k0 = s * split_len .. k1 = min(k0 +
// split_len, len) of row t (len = its position + 1) against the query heads of kv heads 2 pair
// and 2 pair + 1 (`group` <= 8 each), written as one partial per query head: m = max of the
// scaled scores, l = sum e^{score - m}, o = sum e^{score - m} v (fp32, unnormalised). A row's split
// length comes from its own length (att_split_len), so its items, and their bits, never depend
// on the other rows of the launch or on the grid: block b takes items b, b + gridDim.x, ...
// (the launcher sizes the grid to the GPU), streaming their K/V tiles through one cp.async
// pipeline that runs on from one item into the next.
//
// Block = 2 warps, warp w = kv head 2 pair + w. A cache position's K (and V) rows of the two kv
// heads are 1 KiB contiguous; each is loaded once per item into shared memory for all query heads
// of the group: tiles of 16 keys (K and V of both heads, 32 KiB), double buffered. Per warp and
// tile, with the keys as the mma's M and the (padded) query heads as N:
//   S^T [16 keys x 8 heads] = K [16 x 256] Q^T [256 x 8]      (bf16 mma.sync, fp32 accumulators)
//   s = S^T * scale (key >= k1: -inf);  m' = max(m, max_keys s);  P = e^{s - m'}  (fp32)
//   l = l e^{m - m'} + sum_keys P;  O^T [256 x 8] = O^T e^{m - m'} + V^T [256 x 16] P^T [16 x 8],
// the last product as two bf16 mma (P = bf16(P) + bf16(P - bf16(P)), 16 significant bits).
// The S^T accumulators turn into P^T's B fragments with movmatrix (an 8x8 transpose in registers),
// V^T's A fragments come from the V tile with ldmatrix.trans. Rows are 512 bytes = 32 chunks of 16;
// chunk c of row r lives at c ^ (r & 7) (conflict-free ldmatrix).

#define ATT_D 256
#define ATT_ROW 512                              // bytes per K, V or Q row of one head
#define ATT_G 8                                  // query heads per kv head as the mma's N
#define ATT_TILE 16                              // keys per pipeline stage
#define ATT_STAGE (2 * 2 * ATT_TILE * ATT_ROW)   // K then V of 2 kv heads: 32 KiB
#define ATT_QSLOT (2 * ATT_G * ATT_ROW)          // the Q rows of one item: 8 KiB
#define ATT_MAX_ROWS ORNITH_ATT_MAX_ROWS          // rows per launch (launcher-checked; one per thread)
static_assert(ATT_MAX_ROWS <= 64, "the split kernel sets up one row per thread of its 64");
#define ATT_MAX_SPLITS 1024                      // launcher-checked (the combine's split weights)
// Dynamic shared memory: 2 stages of K/V, then 2 Q slots (80 KiB; = ATT_SPLIT_SMEM of the launcher).
#define ATT_SMEM (2 * ATT_STAGE + 2 * ATT_QSLOT)

__device__ __forceinline__ uint32_t aswz(int row, int chunk) {
    return (uint32_t)(row * ATT_ROW + ((chunk ^ (row & 7)) << 4));
}
// Row t's length (keys 0..pos, causal) and split length: given (host form), or the host's
// split_for formula over `splits` from the row's own length (device-position form).
__device__ __forceinline__ int att_len(const OrnithAttnParams &p, int t) {
    return (p.pos_dev ? p.pos_dev[t] : p.pos0 + t) + 1;
}
__device__ __forceinline__ int att_split_len(const OrnithAttnParams &p, int len) {
    return p.pos_dev ? max((len + p.splits - 1) / p.splits, p.min_split) : p.split_len;
}

// grid (any, 1, 1), block 64 threads, ATT_SMEM bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(64) attn_decode_split(const OrnithAttnParams p) {
    pdl_entry();
    extern __shared__ __align__(128) uint8_t smem[];
    __shared__ int r_len[ATT_MAX_ROWS], r_sl[ATT_MAX_ROWS], r_start[ATT_MAX_ROWS + 1];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int group = p.q_heads / p.kv_heads, pairs = (p.kv_heads + 1) / 2;
    // Items of row t: [r_start[t], r_start[t + 1]), kv-head pair major. Thread t takes row t (the
    // rows' positions are read at once, not one after another) and the starts are an exclusive
    // scan of the counts over the block's two warps.
    {
        int cnt = 0;
        if (tid < p.tokens) {
            const int len = att_len(p, tid), sl = att_split_len(p, len);
            r_len[tid] = len;
            r_sl[tid] = sl;
            cnt = (len + sl - 1) / sl * pairs;
        }
        int inc = cnt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int u = __shfl_up_sync(0xffffffffu, inc, o);
            if (lane >= o) inc += u;
        }
        if (tid == 31) r_start[ATT_MAX_ROWS] = inc;  // warp 0's total, read once below
        __syncthreads();
        const int before = warp ? r_start[ATT_MAX_ROWS] : 0;
        __syncthreads();
        if (tid < p.tokens) r_start[tid] = before + inc - cnt;
        if (tid == p.tokens - 1) r_start[p.tokens] = before + inc;
        __syncthreads();
    }
    const int total = r_start[p.tokens];
    if ((int)blockIdx.x >= total) return;
    const uint32_t s0 = smem_u32(smem), sq0 = s0 + 2 * ATT_STAGE;
    struct Item {
        int t, pair, s, k0, k1;
    };
    auto item = [&](int i) {
        Item it;
        int lo = 0, hi = p.tokens - 1;  // the row whose range holds i (every row has items)
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (r_start[mid] <= i) lo = mid;
            else hi = mid - 1;
        }
        it.t = lo;
        const int j = i - r_start[it.t], used = (r_start[it.t + 1] - r_start[it.t]) / pairs;
        it.pair = j / used;
        it.s = j % used;
        it.k0 = it.s * r_sl[it.t];
        it.k1 = min(it.k0 + r_sl[it.t], r_len[it.t]);
        return it;
    };
    // cp.async of keys k0 + 16 tile .. of item `it` into stage `stg` (keys >= k1 and a missing
    // second kv head zero-filled): thread tid copies 16-byte chunk tid of each key's 1 KiB K and V
    // rows of the pair (warp w: kv head 2 pair + w, to rows 16 w .. of the stage's K and V); with
    // the item's first tile also its Q rows (row 8 w + i: query head i of kv head 2 pair + w).
    auto load = [&](int stg, const Item &it, int tile, int qslot) {
        const int32_t *table = p.table + (p.pos_dev ? (size_t)it.t * p.table_stride : 0);
        const int kv = 2 * it.pair + warp;
        const bool head = kv < p.kv_heads;
        const size_t col = (size_t)(head ? kv : 0) * ATT_D + lane * 8;
        const uint32_t dk = s0 + stg * ATT_STAGE + warp * ATT_TILE * ATT_ROW, dv = dk + 2 * ATT_TILE * ATT_ROW;
        const size_t pitch = (size_t)p.kv_heads * ATT_D;
        const int j0 = it.k0 + tile * ATT_TILE;
#pragma unroll 4
        for (int r = 0; r < ATT_TILE; r++) {
            const int j = j0 + r;
            const bool ok = j < it.k1;
            const size_t off = kv_row(table, ok ? j : it.k0) * pitch + col;
            const int n = ok && head ? 16 : 0;
            cp_async16(dk + aswz(r, lane), p.k_cache + off, n);
            cp_async16(dv + aswz(r, lane), p.v_cache + off, n);
        }
        if (tile == 0) {
#pragma unroll
            for (int id = tid; id < 2 * ATT_G * 32; id += 64) {
                const int w = id >> 8, i = (id >> 5) & 7, c = id & 31, kq = 2 * it.pair + w;
                const bool ok = kq < p.kv_heads && i < group;
                const uint16_t *src = p.q + ((size_t)it.t * p.q_heads + (ok ? kq * group + i : 0)) * ATT_D + c * 8;
                cp_async16(sq0 + qslot * ATT_QSLOT + aswz(w * ATT_G + i, c), src, ok ? 16 : 0);
            }
        }
    };

    const int g = lane >> 2, qd = lane & 3;  // fragment row / column pair of this lane
    float o[16][4];                           // O^T: o[i] = dims 16i + g (+8) x heads 2qd, 2qd + 1
    float m[2], l[2];                         // heads 2qd, 2qd + 1 (l: this lane's keys only)
    uint32_t qf[16][2];                       // Q^T B fragments, k-steps of 16 dims
    auto reset = [&]() {
#pragma unroll
        for (int i = 0; i < 16; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
        m[0] = m[1] = -INFINITY;
        l[0] = l[1] = 0.f;
    };
    reset();
    int ci = blockIdx.x, ct = 0, nq = 0, stage = 0;  // item, its tile, items begun, stage of `ct`
    Item cur = item(ci);
    load(0, cur, 0, 0);
    cp_commit();
    for (;;) {
        const bool last = (ct + 1) * ATT_TILE >= cur.k1 - cur.k0;  // the item's last tile
        const int ni = last ? ci + (int)gridDim.x : ci;
        const bool more = ni < total;
        const Item nxt = last && more ? item(ni) : cur;
        cp_wait<0>();
        __syncthreads();  // stage `stage` has landed for every thread; stage ^ 1 is free
        if (more) load(stage ^ 1, nxt, last ? 0 : ct + 1, (nq + 1) & 1);
        cp_commit();
        const int kv = 2 * cur.pair + warp;  // this warp's kv head (none: idle)
        if (kv < p.kv_heads) {
            if (ct == 0) {  // the item's Q^T B fragments: ldmatrix of the Q rows (row = head)
                const uint32_t sq = sq0 + (nq & 1) * ATT_QSLOT + warp * ATT_G * ATT_ROW;
#pragma unroll
                for (int c4 = 0; c4 < 8; c4++)
                    ldsm_x4(sq + aswz(lane & 7, 4 * c4 + (lane >> 3)), qf[2 * c4][0], qf[2 * c4][1],
                            qf[2 * c4 + 1][0], qf[2 * c4 + 1][1]);
            }
            const int key0 = cur.k0 + ct * ATT_TILE;  // key0 < k1: every head sees a finite score
            const uint32_t sk = s0 + stage * ATT_STAGE + warp * ATT_TILE * ATT_ROW;
            const uint32_t sv = sk + 2 * ATT_TILE * ATT_ROW;
            // S^T = K Q^T over 16 k-steps, two accumulator chains (even / odd k-steps)
            float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
            const int ar = (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int kk = 0; kk < 16; kk += 2) {
                uint32_t a[4], b[4];
                ldsm_x4(sk + aswz(ar, 2 * kk + (lane >> 4)), a[0], a[1], a[2], a[3]);
                ldsm_x4(sk + aswz(ar, 2 * kk + 2 + (lane >> 4)), b[0], b[1], b[2], b[3]);
                mma_bf16(sa, a, qf[kk]);
                mma_bf16(sb, b, qf[kk + 1]);
            }
            // c[e]: key key0 + g + 8 (e >> 1), head 2 qd + (e & 1)
            float sc[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = key0 + g + (e >> 1) * 8;
                sc[e] = key < cur.k1 ? (sa[e] + sb[e]) * p.scale : -INFINITY;
            }
            // online softmax per head: the max over the tile's 16 keys (the 8 lanes sharing qd)
            float mx[2] = {fmaxf(sc[0], sc[2]), fmaxf(sc[1], sc[3])}, alpha[2];
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
#pragma unroll
                for (int off = 4; off < 32; off <<= 1) mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], off));
                const float mn = fmaxf(m[hh], mx[hh]);  // finite
                alpha[hh] = expf(m[hh] - mn);           // m = -inf before the first key: 0
                m[hh] = mn;
            }
            float pr[4], lo[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                pr[e] = expf(sc[e] - m[e & 1]);  // masked keys: 0
                lo[e] = pr[e] - rbf(pr[e]);
            }
            l[0] = l[0] * alpha[0] + (pr[0] + pr[2]);
            l[1] = l[1] * alpha[1] + (pr[1] + pr[3]);
#pragma unroll
            for (int i = 0; i < 16; i++) {
                o[i][0] *= alpha[0];
                o[i][1] *= alpha[1];
                o[i][2] *= alpha[0];
                o[i][3] *= alpha[1];
            }
            // P = P_hi + P_lo, both bf16 (P_hi = bf16(P), P_lo = bf16(P - P_hi)): P V keeps P to
            // 2^-17 relative, as the CPU reference's fp32 P. P^T as B fragments (k = key,
            // n = head): the transposes of the two 8x8 blocks [keys g | g + 8][heads 2qd, 2qd + 1]
            // this lane holds.
            uint32_t ph[2], pl[2];
            movmatrix_t(ph[0], pack_bf16x2(pr[0], pr[1]));
            movmatrix_t(ph[1], pack_bf16x2(pr[2], pr[3]));
            movmatrix_t(pl[0], pack_bf16x2(lo[0], lo[1]));
            movmatrix_t(pl[1], pack_bf16x2(lo[2], lo[3]));
            // O^T += V^T P_hi^T + V^T P_lo^T: 16 m-tiles of 16 dims; A = V^T via ldmatrix.trans
            const int j = lane >> 3, vr = (lane & 7) + (j >> 1) * 8;
#pragma unroll
            for (int i = 0; i < 16; i++) {
                uint32_t a[4];
                ldsm_x4_t(sv + aswz(vr, 2 * i + (j & 1)), a[0], a[1], a[2], a[3]);
                mma_bf16(o[i], a, ph);
                mma_bf16(o[i], a, pl);
            }
            if (last) {  // the item's partials for this warp's query heads 2qd, 2qd + 1
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
#pragma unroll
                    for (int off = 4; off < 32; off <<= 1) l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], off);
                    const int n = 2 * qd + hh;
                    if (n >= group) continue;
                    const size_t part = ((size_t)cur.t * p.q_heads + (size_t)kv * group + n) * p.splits + cur.s;
                    float *po = p.part_o + part * ATT_D + g;
#pragma unroll
                    for (int i = 0; i < 16; i++) {
                        po[16 * i] = o[i][hh];
                        po[16 * i + 8] = o[i][2 + hh];
                    }
                    if (g == 0) {
                        p.part_ml[part * 2] = m[hh];
                        p.part_ml[part * 2 + 1] = l[hh];
                    }
                }
                reset();
            }
        }
        if (last) nq++;
        if (!more) break;
        ci = ni;
        cur = nxt;
        ct = last ? 0 : ct + 1;
        stage ^= 1;
    }
    cp_wait<0>();
}

// grid (q_heads, tokens, ORNITH_ATT_COMBINE_CHUNKS), block ATT_D threads: merge the splits of row t,
// head h, normalise, gate, for head dims [ATT_COMBINE_DIMS z, + ATT_COMBINE_DIMS):
//   M = max_s m_s,  f_s = e^{m_s - M},  L = sum_s l_s f_s,  o_i = (sum_s f_s o_{s,i}) / L,
//   out = bf16( bf16(o) * bf16(sigmoid(gate)) ).
// Only the row's `used` = ceil(len / split_len) splits are read (each holds at least one key), so
// the grid's split count (the partials' stride) never enters the sums: the host form (exact split
// count) and the fixed-grid device form of the same split length give the same bits. Every block
// computes M and L over all 256 threads (thread j takes splits j, j + 256, ...; the weights f_s
// kept in shared memory), so each chunk sees the same M, L; then dim i of the chunk sums split s
// into accumulator s % 4, accumulator a in warps 2a, 2a + 1 (coalesced rows of partials), and
// o_i = ((a0 + a1) + (a2 + a3)) / L (the 4 accumulators are the 4 warp pairs of the block, so
// ATT_COMBINE_DIMS = 64 dims per chunk). Four chunks put 4x the blocks on the partials (16 blocks of
// 256 threads per row left a long-context step's combine latency-bound).
#define ATT_COMBINE_DIMS (ATT_D / ORNITH_ATT_COMBINE_CHUNKS)
static_assert(ORNITH_ATT_COMBINE_CHUNKS == 4, "the 4 split accumulators are the block's 4 warp pairs");
static_assert(ATT_D == 256, "the combine's blocks quantise a row as quant_row_256: 256 threads");
extern "C" __global__ void __launch_bounds__(ATT_D) attn_decode_combine(const OrnithAttnParams p) {
    pdl_entry();
    __shared__ float f[ATT_MAX_SPLITS];
    __shared__ float sh[32];
    __shared__ float part[4][ATT_COMBINE_DIMS];
    const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
    const int len = att_len(p, t), sl = att_split_len(p, len);
    const int used = (len + sl - 1) / sl;
    const size_t base = ((size_t)t * p.q_heads + h) * p.splits;
    float mx = -INFINITY;
    for (int s = tid; s < used; s += ATT_D) mx = fmaxf(mx, p.part_ml[(base + s) * 2]);
    const float M = block_max(mx, sh);
    float lsum = 0.f;
    for (int s = tid; s < used; s += ATT_D) {
        const float w = expf(p.part_ml[(base + s) * 2] - M);
        f[s] = w;
        lsum = fmaf(p.part_ml[(base + s) * 2 + 1], w, lsum);
    }
    const float L = block_sum(lsum, sh);  // block_sum ends with a barrier: f[] is complete
    const int a = tid / ATT_COMBINE_DIMS, di = tid % ATT_COMBINE_DIMS, i = blockIdx.z * ATT_COMBINE_DIMS + di;
    const float *po = p.part_o + base * ATT_D + i;
    float acc = 0.f;
    for (int s = a; s < used; s += 4) acc = fmaf(po[(size_t)s * ATT_D], f[s], acc);
    part[a][di] = acc;
    __syncthreads();
    if (a == 0) {
        const float o = rbf(((part[0][di] + part[1][di]) + (part[2][di] + part[3][di])) / L);
        const float gate = bf2f(p.qg[((size_t)t * p.q_heads + h) * 2 * ATT_D + ATT_D + i]);
        p.out[((size_t)t * p.q_heads + h) * ATT_D + i] = f2bf(o * rbf(sigmoid_f(gate)));
    }
    // The FP8 o_proj's input: the row's last block quantises it with quantize_fp8_rows' code
    // (common.cuh's quant_row_256), so the same bits, without that launch.
    if (p.out_q8 == nullptr || !last_to_arrive(p.ticket + t, (uint32_t)(p.q_heads * gridDim.z))) return;
    const int cols = p.q_heads * ATT_D;
    quant_row_256<0>(p.out + (size_t)t * cols, cols, p.out_q8 + (size_t)t * cols, p.out_scale + t, sh);
}
