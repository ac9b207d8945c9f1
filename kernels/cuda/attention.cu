// Full attention, decode path: q/k RMSNorm + partial RoPE + KV-cache write, split-sequence attention
// (flash-decoding) and the combine with the sigmoid output gate.
#include "common.cuh"

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

#define ATT_D 256
#define ATT_KEYS 4  // keys whose loads are in flight together

// grid (splits, kv_heads, tokens), block 32 * (q_heads / kv_heads) threads: warp g handles q head
// kvh * group + g. Lane l holds dims 8l..8l+7. Online softmax in fp32.
extern "C" __global__ void __launch_bounds__(256) attn_decode_split(const OrnithAttnParams p) {
    pdl_entry();
    const int split = blockIdx.x, kvh = blockIdx.y, t = blockIdx.z;
    const int group = p.q_heads / p.kv_heads;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp >= group) return;
    const int h = kvh * group + warp;
    const int pos = p.pos_dev ? p.pos_dev[t] : p.pos0 + t;
    const int32_t *table = p.table + (p.pos_dev ? (size_t)t * p.table_stride : 0);
    const int len = pos + 1;  // causal: keys 0..pos
    int split_len = p.split_len;
    if (p.pos_dev) {  // device-position form: the host's split_for formula over `splits` blocks,
        // from this row's own length only (a row's bits do not depend on the other rows)
        split_len = max((len + p.splits - 1) / p.splits, p.min_split);
    }
    const int k0 = split * split_len;
    const int k1 = min(k0 + split_len, len);
    float q[8], o[8];
    {
        uint4 qv = *reinterpret_cast<const uint4 *>(p.q + ((size_t)t * p.q_heads + h) * ATT_D + lane * 8);
        const uint32_t qa[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            q[2 * e] = __uint_as_float(qa[e] << 16) * p.scale;
            q[2 * e + 1] = __uint_as_float(qa[e] & 0xffff0000u) * p.scale;
        }
    }
#pragma unroll
    for (int e = 0; e < 8; e++) o[e] = 0.f;
    float m = -INFINITY, l = 0.f;
    const size_t kstride = (size_t)p.kv_heads * ATT_D;
    const uint16_t *kb = p.k_cache + (size_t)kvh * ATT_D + lane * 8;
    const uint16_t *vb = p.v_cache + (size_t)kvh * ATT_D + lane * 8;
    for (int j0 = k0; j0 < k1; j0 += ATT_KEYS) {
        uint4 kv[ATT_KEYS], vv[ATT_KEYS];
#pragma unroll
        for (int u = 0; u < ATT_KEYS; u++) {
            const size_t r = kv_row(table, min(j0 + u, k1 - 1));
            kv[u] = *reinterpret_cast<const uint4 *>(kb + r * kstride);
            vv[u] = *reinterpret_cast<const uint4 *>(vb + r * kstride);
        }
        float sc[ATT_KEYS];
#pragma unroll
        for (int u = 0; u < ATT_KEYS; u++) {
            const uint32_t ka[4] = {kv[u].x, kv[u].y, kv[u].z, kv[u].w};
            float d = 0.f;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                d = fmaf(q[2 * e], __uint_as_float(ka[e] << 16), d);
                d = fmaf(q[2 * e + 1], __uint_as_float(ka[e] & 0xffff0000u), d);
            }
            sc[u] = d;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
#pragma unroll
            for (int u = 0; u < ATT_KEYS; u++) sc[u] += __shfl_xor_sync(0xffffffffu, sc[u], off);
#pragma unroll
        for (int u = 0; u < ATT_KEYS; u++) {
            if (j0 + u >= k1) break;
            const float mn = fmaxf(m, sc[u]);
            const float corr = expf(m - mn);  // exp(-inf) = 0 on the first key
            const float pr = expf(sc[u] - mn);
            l = l * corr + pr;
            const uint32_t va[4] = {vv[u].x, vv[u].y, vv[u].z, vv[u].w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                o[2 * e] = fmaf(pr, __uint_as_float(va[e] << 16), o[2 * e] * corr);
                o[2 * e + 1] = fmaf(pr, __uint_as_float(va[e] & 0xffff0000u), o[2 * e + 1] * corr);
            }
            m = mn;
        }
    }
    const size_t part = ((size_t)t * p.q_heads + h) * p.splits + split;
    float4 *po = reinterpret_cast<float4 *>(p.part_o + part * ATT_D + lane * 8);
    po[0] = make_float4(o[0], o[1], o[2], o[3]);
    po[1] = make_float4(o[4], o[5], o[6], o[7]);
    if (lane == 0) {
        p.part_ml[part * 2] = m;  // -inf with l = 0 for a split past the causal end
        p.part_ml[part * 2 + 1] = l;
    }
}

#define ATT_MAX_SPLITS 1024  // launcher-checked

// grid (q_heads, tokens), block ATT_D threads: merge the splits, normalise, gate.
//   M = max_s m_s,  f_s = e^{m_s - M} (0 for an empty split, m_s = -inf),  L = sum_s l_s f_s,
//   o_i = (sum_s f_s o_{s,i}) / L.
// The split statistics are read in parallel (thread j takes splits j, j + 256, ...) and the
// weights f_s kept in shared memory, so the per-dimension loop over the splits is only
// independent loads and FMAs.
extern "C" __global__ void __launch_bounds__(ATT_D) attn_decode_combine(const OrnithAttnParams p) {
    pdl_entry();
    __shared__ float f[ATT_MAX_SPLITS];
    __shared__ float sh[32];
    const int h = blockIdx.x, t = blockIdx.y, i = threadIdx.x;
    const size_t base = ((size_t)t * p.q_heads + h) * p.splits;
    float mx = -INFINITY;
    for (int s = i; s < p.splits; s += ATT_D) mx = fmaxf(mx, p.part_ml[(base + s) * 2]);
    const float M = block_max(mx, sh);
    float lsum = 0.f;
    int last = -1;  // the last split with a non-zero weight
    for (int s = i; s < p.splits; s += ATT_D) {
        const float ms = p.part_ml[(base + s) * 2];
        const float w = ms == -INFINITY ? 0.f : expf(ms - M);
        f[s] = w;
        if (w != 0.f) last = s;
        lsum = fmaf(p.part_ml[(base + s) * 2 + 1], w, lsum);
    }
    // Splits past `used` have weight 0 (empty: past the causal end, as most of the fixed grid of a
    // decode graph is) and finite partials, so they add exactly 0: the loop stops at `used`
    // rounded up to the 4-way grouping, which leaves every sum as the full loop forms it. Split s
    // always goes to accumulator s % 4, also when `p.splits` is not a multiple of 4 (the host
    // form's exact split count; missing splits add 0), so the host form and the fixed-grid device
    // form of the same split length give the same bits.
    const int used = (int)block_max((float)(last + 1), sh);
    const float L = block_sum(lsum, sh);  // block_sum ends with a barrier: f[] is complete
    const int lim = (used + 3) & ~3;
    float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f, acc3 = 0.f;
    const float *po = p.part_o + base * ATT_D + i;
    for (int s = 0; s < lim; s += 4) {
        const bool h1 = s + 1 < p.splits, h2 = s + 2 < p.splits, h3 = s + 3 < p.splits;
        acc0 = fmaf(po[(size_t)(s + 0) * ATT_D], f[s + 0], acc0);  // s < used <= splits
        acc1 = fmaf(h1 ? po[(size_t)(s + 1) * ATT_D] : 0.f, h1 ? f[s + 1] : 0.f, acc1);
        acc2 = fmaf(h2 ? po[(size_t)(s + 2) * ATT_D] : 0.f, h2 ? f[s + 2] : 0.f, acc2);
        acc3 = fmaf(h3 ? po[(size_t)(s + 3) * ATT_D] : 0.f, h3 ? f[s + 3] : 0.f, acc3);
    }
    const float o = rbf(((acc0 + acc1) + (acc2 + acc3)) / L);
    const float gate = bf2f(p.qg[((size_t)t * p.q_heads + h) * 2 * ATT_D + ATT_D + i]);
    p.out[((size_t)t * p.q_heads + h) * ATT_D + i] = f2bf(o * rbf(sigmoid_f(gate)));
}
