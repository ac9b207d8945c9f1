// Gated DeltaNet: causal conv1d + SiLU with state (decode and token-parallel prefill forms), recurrent
// gated delta rule, gated RMSNorm.
#include "common.cuh"

// One thread per channel; tokens in order, so the same kernel serves decode (1 token) and prefill;
// with per-row slots (a decode group, grid y = tokens), block row t runs token t of its own sequence.
extern "C" __global__ void __launch_bounds__(256) conv1d_silu(const OrnithConvParams p) {
    pdl_launch_dependents();
    const int c = blockIdx.x * 256 + threadIdx.x;
    if (c >= p.channels) {
        pdl_wait();
        return;
    }
    const float w0 = bf2f(p.w[c * 4 + 0]), w1 = bf2f(p.w[c * 4 + 1]), w2 = bf2f(p.w[c * 4 + 2]),
                w3 = bf2f(p.w[c * 4 + 3]);
    // one sequence: every token in order; per-row sequences: token blockIdx.y with its slot's state
    int t0 = 0, t1 = p.tokens;
    uint16_t *state = p.state;
    if (p.slot) {
        t0 = blockIdx.y;
        t1 = t0 + 1;
        state += (size_t)p.slot[t0] * p.state_stride;
    }
    float s0 = bf2f(state[c]), s1 = bf2f(state[p.channels + c]), s2 = bf2f(state[2 * p.channels + c]);
    // The weights, the slot and the state before the wait: in a decode step nothing before this
    // kernel writes them (the state's writer is this kernel one step back, the slots the host's
    // copy before the step); x is the previous kernel's output.
    pdl_wait();
    for (int t = t0; t < t1; t++) {
        float x = bf2f(p.x[(size_t)t * p.x_stride + c]);
        // w[c,3] multiplies the current token, w[c,0] the token 3 steps back (no flip)
        float acc = w0 * s0;
        acc = fmaf(w1, s1, acc);
        acc = fmaf(w2, s2, acc);
        acc = fmaf(w3, x, acc);
        p.y[(size_t)t * p.channels + c] = f2bf(silu_f(rbf(acc)));
        s0 = s1; s1 = s2; s2 = x;
    }
    state[c] = f2bf(s0);
    state[p.channels + c] = f2bf(s1);
    state[2 * p.channels + c] = f2bf(s2);
}

// Prefill form of conv1d_silu: token-parallel, bit-identical to it (y and the final state).
//   grid  (ceil(channels / (256 cpt)), ceil(tokens / CONV_TT)), block 256, cpt channels per thread:
//   2 where channels and x_stride are even and x, y, state 4-byte aligned (the launcher's choice,
//   read back here as gridDim.x * 256 < channels), else 1.
//   x [tokens, x_stride] bf16 (first `channels` columns), w [channels, 4], state [3, channels]
//   (oldest first), y [tokens, channels]; OrnithConvParams as conv1d_silu.
// Thread (channels c.., token block b) computes tokens t0 = b*CONV_TT .. t0+CONV_TT-1 (clipped to
// `tokens`) with ext = [state ; x] (ext[i] = state[i] for i < 3, x[i-3] after):
//   acc     = w0*ext[t] ; acc = fma(w1, ext[t+1], acc) ; fma(w2, ext[t+2], .) ; fma(w3, ext[t+3] = x[t], .)
//   y[t, c] = bf16(silu(bf16(acc)))
// the same fp32 operations in the same order as conv1d_silu (every bf16 x bf16 product is exact in
// fp32, so the sums are the sequential kernel's bit for bit). Its window starts at x rows t0-3..t0-1
// (b > 0; CONV_TT >= 3 so these are inside x) or at the old state (b = 0). All CONV_TT x rows are
// loaded into registers before the first y store (without __restrict__ the compiler may not move
// loads past stores), so each thread has CONV_TT loads in flight; a warp reads 32 cpt consecutive
// channels of a row (coalesced: with 2 a warp's load is a whole 128-byte line, with 1 half of one,
// and a 2,048-token chunk's conv streamed at ~1.4 TB/s, H200). x is read once, plus 3 rows per
// block for the window (L2 hits). State: only the b = 0 blocks read the old state, and the same
// thread (same channels) writes the new one after reading it: state' = ext[tokens .. tokens+2] (x
// rows tokens-3..tokens-1, or old state rows for chunks shorter than 3 tokens). No other block
// touches the state, so no race.
#define CONV_TT 32
template <int CPT> struct ConvVec;
template <> struct ConvVec<1> {
    typedef uint16_t T;
    __device__ static float get(T v, int) { return bf2f(v); }
    __device__ static T make(const uint16_t (&h)[1]) { return h[0]; }
};
template <> struct ConvVec<2> {
    typedef uint32_t T;
    __device__ static float get(T v, int k) { return bf2f((uint16_t)(v >> (16 * k))); }
    __device__ static T make(const uint16_t (&h)[2]) { return (uint32_t)h[0] | (uint32_t)h[1] << 16; }
};
template <int CPT> __device__ __forceinline__ void conv_chunk_body(const OrnithConvParams &p) {
    typedef typename ConvVec<CPT>::T V;
    const int c = (blockIdx.x * 256 + threadIdx.x) * CPT;  // first of this thread's channels
    if (c >= p.channels) return;
    const int t0 = blockIdx.y * CONV_TT;
    const int n = min(CONV_TT, p.tokens - t0);  // same for the whole block: the guards below do not diverge
    const size_t xs = (size_t)p.x_stride / CPT, ch = (size_t)p.channels / CPT;  // in units of V
    const V *xc = reinterpret_cast<const V *>(p.x) + c / CPT;
    V *yc = reinterpret_cast<V *>(p.y) + c / CPT;
    V *sc = reinterpret_cast<V *>(p.state) + c / CPT;
    float w[CPT][4], s[CPT][3];
#pragma unroll
    for (int k = 0; k < CPT; k++)
#pragma unroll
        for (int j = 0; j < 4; j++) w[k][j] = bf2f(p.w[(c + k) * 4 + j]);
    V old[3] = {0, 0, 0};
#pragma unroll
    for (int j = 0; j < 3; j++) {
        V v;
        if (blockIdx.y == 0) {
            v = old[j] = sc[j * ch];
        } else {
            v = xc[(size_t)(t0 - 3 + j) * xs];
        }
#pragma unroll
        for (int k = 0; k < CPT; k++) s[k][j] = ConvVec<CPT>::get(v, k);
    }
    V xv[CONV_TT];
#pragma unroll
    for (int i = 0; i < CONV_TT; i++) xv[i] = i < n ? xc[(size_t)(t0 + i) * xs] : (V)0;
#pragma unroll
    for (int i = 0; i < CONV_TT; i++) {
        if (i < n) {
            uint16_t out[CPT];
#pragma unroll
            for (int k = 0; k < CPT; k++) {
                const float x = ConvVec<CPT>::get(xv[i], k);
                float acc = w[k][0] * s[k][0];
                acc = fmaf(w[k][1], s[k][1], acc);
                acc = fmaf(w[k][2], s[k][2], acc);
                acc = fmaf(w[k][3], x, acc);
                out[k] = f2bf(silu_f(rbf(acc)));
                s[k][0] = s[k][1]; s[k][1] = s[k][2]; s[k][2] = x;
            }
            yc[(size_t)(t0 + i) * ch] = ConvVec<CPT>::make(out);
        }
    }
    if (blockIdx.y == 0) {
#pragma unroll
        for (int j = 0; j < 3; j++) {
            const int e = p.tokens + j;  // ext index of new state row j
            const V v = e == 0 ? old[0] : e == 1 ? old[1] : e == 2 ? old[2] : xc[(size_t)(e - 3) * xs];
            uint16_t h[CPT];
#pragma unroll
            for (int k = 0; k < CPT; k++) h[k] = f2bf(ConvVec<CPT>::get(v, k));  // conv1d_silu's float -> bf16 store (identity, NaN as it does)
            sc[j * ch] = ConvVec<CPT>::make(h);
        }
    }
}
extern "C" __global__ void __launch_bounds__(256) conv1d_silu_chunk(const OrnithConvParams p) {
    pdl_entry();
    if ((int)gridDim.x * 256 < p.channels) conv_chunk_body<2>(p);
    else conv_chunk_body<1>(p);
}

#define GDN_D 128    // dk = dv
#define GDN_VC 32    // value columns per block
#define GDN_THREADS 128

// grid (v_heads, GDN_D / GDN_VC[, tokens with per-row slots]). Thread (warp kg, lane v) keeps state rows kg*32..kg*32+31 of column v.
extern "C" __global__ void __launch_bounds__(GDN_THREADS) gdn_recurrent(const OrnithGdnParams p) {
    pdl_launch_dependents();
    __shared__ float qs[GDN_D], ks[GDN_D];
    __shared__ float red[4][GDN_VC];
    __shared__ float sh[32];
    const int h = blockIdx.x, vc = blockIdx.y;
    const int lane = threadIdx.x & 31, kg = threadIdx.x >> 5;
    const int hk = h / (p.v_heads / p.k_heads);  // repeat_interleave: v-head h uses k-head h / ratio
    const int col = vc * GDN_VC + lane;
    // one sequence: every token in order; per-row sequences: token blockIdx.z with its slot's state
    int t0 = 0, t1 = p.tokens;
    float *S = p.state + (size_t)h * GDN_D * GDN_D;
    if (p.slot) {
        t0 = blockIdx.z;
        t1 = t0 + 1;
        S += (size_t)p.slot[t0] * p.state_stride;
    }
    float s[32];
#pragma unroll
    for (int i = 0; i < 32; i++) s[i] = S[(size_t)(kg * 32 + i) * GDN_D + col];
    const float A = expf(p.a_log[h]);
    const float dtb = bf2f(p.dt_bias[h]);
    // The state, the slot and the constants before the wait (conv1d_silu's rule): only q, k, v
    // and b, a are the previous kernels' outputs.
    pdl_wait();
    const int kdim = p.k_heads * GDN_D;
    for (int t = t0; t < t1; t++) {
        const uint16_t *row = p.qkv + (size_t)t * p.qkv_stride;
        float qv = bf2f(row[hk * GDN_D + threadIdx.x]);
        float kv = bf2f(row[kdim + hk * GDN_D + threadIdx.x]);
        float qn = block_sum(qv * qv, sh);
        float kn = block_sum(kv * kv, sh);
        // l2norm(x) = x * rsqrt(sum x^2 + 1e-6); q additionally scaled by dk^-0.5
        qs[threadIdx.x] = qv * rsqrtf(qn + 1e-6f) * rsqrtf((float)GDN_D);
        ks[threadIdx.x] = kv * rsqrtf(kn + 1e-6f);
        const uint16_t *ba = p.ba + (size_t)t * p.ba_stride;
        const float beta = rbf(sigmoid_f(bf2f(ba[h])));
        const float xa = bf2f(ba[p.a_offset + h]) + dtb;
        const float sp = xa > 20.f ? xa : log1pf(expf(xa));  // softplus, threshold 20
        const float decay = expf(-A * sp);                    // exp(g), g = -exp(A_log) * softplus(a + dt_bias)
        const float vv = bf2f(row[2 * kdim + h * GDN_D + col]);
        __syncthreads();
        float m = 0.f;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            s[i] *= decay;
            m = fmaf(s[i], ks[kg * 32 + i], m);
        }
        red[kg][lane] = m;
        __syncthreads();
        m = red[0][lane] + red[1][lane] + red[2][lane] + red[3][lane];
        const float d = (vv - m) * beta;
        float o = 0.f;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            s[i] = fmaf(ks[kg * 32 + i], d, s[i]);
            o = fmaf(s[i], qs[kg * 32 + i], o);
        }
        __syncthreads();
        red[kg][lane] = o;
        __syncthreads();
        if (kg == 0) {
            o = red[0][lane] + red[1][lane] + red[2][lane] + red[3][lane];
            p.o[((size_t)t * p.v_heads + h) * GDN_D + col] = f2bf(o);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 32; i++) S[(size_t)(kg * 32 + i) * GDN_D + col] = s[i];
}

// One warp per (t, head) row, GN_ROWS rows per block of 256 threads; dim <= 128: common.cuh's
// gated_norm_warp. (One 128-thread block per row ran the 65,536 rows of a 2,048-token prefill
// chunk at ~0.6 TB/s: block launch, not memory, bounded it.) The decode path of a BF16 out_proj
// over heads of 128 folds this norm into the projection's prologue (gemv.cu: gdn_out_proj); the
// prefill path, and a quantised out_proj, run it here.
#define GN_ROWS 8
extern "C" __global__ void __launch_bounds__(32 * GN_ROWS) gated_rmsnorm(const OrnithGatedNormParams p) {
    pdl_entry();
    const int row = blockIdx.x * GN_ROWS + (threadIdx.x >> 5);
    if (row >= p.tokens * p.heads) return;
    const int t = row / p.heads, h = row % p.heads;
    const size_t off = (size_t)row * p.dim;
    gated_norm_warp(p.o + off, p.z + (size_t)t * p.z_stride + h * p.dim, p.weight, p.dim, p.eps,
                    [&](int i, uint16_t v) { p.y[off + i] = v; });
}
