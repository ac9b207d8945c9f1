// Embedding gather, fused residual-add + zero-centred RMSNorm (+ per-token FP8), FP8 row quantisation.
#include "common.cuh"

// One block per token; 16-byte copies of the embedding row.
extern "C" __global__ void embed_gather(const OrnithEmbedParams p) {
    pdl_entry();
    int t = blockIdx.x;
    int id = p.ids[t];
    uint16_t *dst = p.out + (size_t)t * p.hidden;
    if (id < 0 || id >= p.vocab) {  // out-of-range id: NaN row, so the error cannot pass silently
        for (int i = threadIdx.x; i < p.hidden; i += blockDim.x) dst[i] = 0x7fc0;
        return;
    }
    const uint4 *src = reinterpret_cast<const uint4 *>(p.table + (size_t)id * p.hidden);
    uint4 *d4 = reinterpret_cast<uint4 *>(dst);
    for (int i = threadIdx.x; i < p.hidden / 8; i += blockDim.x) d4[i] = src[i];
}

// One block of 256 threads per token; the row is kept in registers, PT per thread (element
// i = threadIdx.x + 256 j, j < PT: hidden <= 256 PT). Every global load (residual, add, weight) is
// issued before the first store: the pointers are not __restrict__, so a load placed after a store
// must wait for it, and a store waits for the loads it depends on; interleaved, each of the up to
// PT element groups would cost a full memory round trip in turn.
// Two instances with the same arithmetic in the same order (elements past `hidden` add nothing and
// are skipped), hence the same bits: rmsnorm_residual (PT 32, hidden <= 8192) and
// rmsnorm_residual_2k (PT 8, hidden <= 2048: a quarter of the registers, so an SM holds ~3x the
// blocks and ~3x the loads in flight — the prefill norm over 2,048 rows ran at 0.9 TB/s with 32).
// gemv.cu's norm prologue uses the same mapping and steps (the same bits again).
#define RMS_THREADS 256
template <int PT> __device__ __forceinline__ void rmsnorm_body(const OrnithRmsNormParams &p) {
    __shared__ float sh[32];
    int t = blockIdx.x;
    uint16_t *res = p.residual + (size_t)t * p.hidden;
    const uint16_t *add = p.add ? p.add + (size_t)t * p.hidden : nullptr;
    uint16_t rv[PT], av[PT], wv[PT];
#pragma unroll
    for (int j = 0; j < PT; j++) {
        const int i = threadIdx.x + j * RMS_THREADS;
        const bool in = i < p.hidden;
        rv[j] = in ? res[i] : (uint16_t)0;
        av[j] = in && add ? add[i] : (uint16_t)0;
        wv[j] = in ? p.weight[i] : (uint16_t)0;
    }
    float r[PT];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < PT; j++) {
        int i = threadIdx.x + j * RMS_THREADS;
        r[j] = 0.f;
        if (i < p.hidden) {
            float v = bf2f(rv[j]);
            if (add) {
                v = rms_add(v, av[j]);  // h = bf16(r + x): the residual stream is bf16
                res[i] = f2bf(v);
            }
            r[j] = v;
            ss = fmaf(v, v, ss);
        }
    }
    ss = block_sum(ss, sh);
    float inv = rms_inv(ss, p.hidden, p.eps);
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < PT; j++) {
        int i = threadIdx.x + j * RMS_THREADS;
        if (i < p.hidden) {
            float y = rms_out(r[j], inv, wv[j]);
            r[j] = y;
            amax = amax_add(amax, y);
            if (p.out) p.out[(size_t)t * p.hidden + i] = f2bf(y);
        }
    }
    if (!p.q8) return;
    amax = block_max_nan(amax, sh);
    float scale = act_scale(amax);
    if (threadIdx.x == 0) p.scale[t] = scale;
#pragma unroll
    for (int j = 0; j < PT; j++) {
        int i = threadIdx.x + j * RMS_THREADS;
        if (i < p.hidden) p.q8[(size_t)t * p.hidden + i] = quant_e4m3(r[j], scale);
    }
}
extern "C" __global__ void __launch_bounds__(RMS_THREADS, 2) rmsnorm_residual(const OrnithRmsNormParams p) {
    pdl_entry();
    rmsnorm_body<32>(p);
}
extern "C" __global__ void __launch_bounds__(RMS_THREADS, 4) rmsnorm_residual_2k(const OrnithRmsNormParams p) {
    pdl_entry();
    rmsnorm_body<8>(p);
}

// One block of 256 threads per row: per-token FP8 quantisation (common.cuh's quant_row_256).
extern "C" __global__ void __launch_bounds__(256) quantize_fp8_rows(const OrnithQuantParams p) {
    pdl_entry();
    __shared__ float sh[32];
    const int t = blockIdx.x;
    quant_row_256<32>(p.x + (size_t)t * p.cols, p.cols, p.q8 + (size_t)t * p.cols, p.scale + t, sh);
}
