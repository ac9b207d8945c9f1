// Greedy sampling on the device.
#include "common.cuh"

// One block of 1024 threads per row: argmax, first index among equal maxima, NaN skipped.
extern "C" __global__ void __launch_bounds__(1024) argmax_bf16(const OrnithArgmaxParams p) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int t = blockIdx.x, lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const uint16_t *row = p.logits + (size_t)t * p.stride;
    float bv = -INFINITY;
    int bi = -1;
    for (int i = threadIdx.x; i < p.n; i += blockDim.x) {
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
