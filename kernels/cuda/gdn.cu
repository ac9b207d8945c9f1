// Gated DeltaNet decode path: causal conv1d + SiLU with state, recurrent gated delta rule, gated RMSNorm.
#include "common.cuh"

// One thread per channel; tokens in order, so the same kernel serves decode (1 token) and prefill.
extern "C" __global__ void __launch_bounds__(256) conv1d_silu(const OrnithConvParams p) {
    const int c = blockIdx.x * 256 + threadIdx.x;
    if (c >= p.channels) return;
    const float w0 = bf2f(p.w[c * 4 + 0]), w1 = bf2f(p.w[c * 4 + 1]), w2 = bf2f(p.w[c * 4 + 2]),
                w3 = bf2f(p.w[c * 4 + 3]);
    float s0 = bf2f(p.state[c]), s1 = bf2f(p.state[p.channels + c]), s2 = bf2f(p.state[2 * p.channels + c]);
    for (int t = 0; t < p.tokens; t++) {
        float x = bf2f(p.x[(size_t)t * p.x_stride + c]);
        // w[c,3] multiplies the current token, w[c,0] the token 3 steps back (no flip)
        float acc = w0 * s0;
        acc = fmaf(w1, s1, acc);
        acc = fmaf(w2, s2, acc);
        acc = fmaf(w3, x, acc);
        p.y[(size_t)t * p.channels + c] = f2bf(silu_f(rbf(acc)));
        s0 = s1; s1 = s2; s2 = x;
    }
    p.state[c] = f2bf(s0);
    p.state[p.channels + c] = f2bf(s1);
    p.state[2 * p.channels + c] = f2bf(s2);
}

#define GDN_D 128    // dk = dv
#define GDN_VC 32    // value columns per block
#define GDN_THREADS 128

// grid (v_heads, GDN_D / GDN_VC). Thread (warp kg, lane v) keeps state rows kg*32..kg*32+31 of column v.
extern "C" __global__ void __launch_bounds__(GDN_THREADS) gdn_recurrent(const OrnithGdnParams p) {
    __shared__ float qs[GDN_D], ks[GDN_D];
    __shared__ float red[4][GDN_VC];
    __shared__ float sh[32];
    const int h = blockIdx.x, vc = blockIdx.y;
    const int lane = threadIdx.x & 31, kg = threadIdx.x >> 5;
    const int hk = h / (p.v_heads / p.k_heads);  // repeat_interleave: v-head h uses k-head h / ratio
    const int col = vc * GDN_VC + lane;
    float *S = p.state + (size_t)h * GDN_D * GDN_D;
    float s[32];
#pragma unroll
    for (int i = 0; i < 32; i++) s[i] = S[(size_t)(kg * 32 + i) * GDN_D + col];
    const float A = expf(p.a_log[h]);
    const float dtb = bf2f(p.dt_bias[h]);
    const int kdim = p.k_heads * GDN_D;
    for (int t = 0; t < p.tokens; t++) {
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

// One block of 128 threads per (t, head); dim <= 128.
extern "C" __global__ void __launch_bounds__(128) gated_rmsnorm(const OrnithGatedNormParams p) {
    __shared__ float sh[32];
    const int t = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
    const int i = threadIdx.x;
    const size_t off = ((size_t)t * p.heads + h) * p.dim;
    float x = i < p.dim ? bf2f(p.o[off + i]) : 0.f;
    float ss = block_sum(x * x, sh);
    if (i >= p.dim) return;
    float n = rbf(x * rsqrtf(ss / (float)p.dim + p.eps));
    n = rbf(bf2f(p.weight[i]) * n);  // weight is plain (not 1 + w), product in bf16
    float z = bf2f(p.z[(size_t)t * p.z_stride + h * p.dim + i]);
    p.y[off + i] = f2bf(n * silu_f(z));
}
