// Greedy sampling on the device.
#include "common.cuh"

// One block of 1024 threads per row: argmax, first index among equal maxima, NaN skipped.
extern "C" __global__ void __launch_bounds__(1024) argmax_bf16(const OrnithArgmaxParams p) {
    pdl_entry();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int t = blockIdx.x, lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const uint16_t *row = p.logits + (size_t)t * p.stride;
    float bv = -INFINITY;
    int bi = -1;
    // Each thread scans its indices in increasing order (so it keeps the first of equal maxima);
    // 16-byte loads of 8 logits when the row is aligned (the 248K-entry lm_head row: 30 loads
    // per thread instead of 243 dependent 2-byte ones), the remainder one by one.
    int head = 0;
    if ((reinterpret_cast<uintptr_t>(row) & 15) == 0) {
        head = p.n & ~7;
        for (int i8 = threadIdx.x * 8; i8 < head; i8 += blockDim.x * 8) {
            const uint4 u = *reinterpret_cast<const uint4 *>(row + i8);
            const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const float v = __uint_as_float(e & 1 ? (w[e >> 1] & 0xffff0000u) : (w[e >> 1] << 16));
                if (v > bv || (bi < 0 && v == bv)) { bv = v; bi = i8 + e; }  // NaN compares false
            }
        }
    }
    for (int i = head + threadIdx.x; i < p.n; i += blockDim.x) {
        float v = bf2f(row[i]);
        if (v > bv || (bi < 0 && v == bv)) { bv = v; bi = i; }  // NaN compares false: never taken
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
    }
    if (lane == 0) { sv[wid] = bv; si[wid] = bi; }
    __syncthreads();
    if (wid == 0) {
        const int nw = blockDim.x >> 5;
        bv = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : -1;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
        }
        if (lane == 0) p.idx[t] = bi;
    }
}
