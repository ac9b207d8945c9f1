// Tensor-core helpers of the prefill kernels and the decode attention: cp.async, ldmatrix,
// movmatrix, mma.sync (no wgmma/tcgen05, so the same PTX runs on sm_90 and sm_121). Included,
// never compiled alone.
#pragma once
#include <stdint.h>

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16-byte global -> shared copy; bytes beyond src_bytes (0 or 16) are zero-filled.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// 4-byte global -> shared copy (both addresses 4-byte aligned); bytes beyond src_bytes (0..4) are zero-filled.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// D = A B + D, fp32 accumulators; A 16x32 bytes (row), B 32 bytes x 8 (col).
__device__ __forceinline__ void mma_e4m3(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// The decode products' E4M3 mma (gemv.cu). sm_90 has no E4M3 tensor-core path: ptxas lowers
// mma_e4m3 to F2FP.F16.E4M3 unpacks of both operands (the low 16 bits of each register to one
// f16x2, the high 16 to another), an HMMA.16816.F32 of the low halves from zero, one of the high
// halves accumulating onto it, and an fadd of that pair's sum into the accumulator (cuobjdump
// -sass, nvcc 13.0): 12 conversions, 2 HMMA and 4 FADD per mma. mma_e4m3_split does the same
// unpacks but accumulates both HMMA straight into c (no zero start, no fadd): the same K
// permutation, one rounding fewer per 32 products, and 4 fewer instructions per mma — at 64 tokens
// the wide FP8 product is issue-bound (H200: gemv_fp8_wide 1.10 -> 0.84 ms per 64-sequence step).
// Its bits differ from mma_e4m3's, so every FP8 decode form (narrow, wide, staged, MoE) uses it and
// they agree with each other; the prefill GEMM uses it too, within each 128-byte stage (gemm.cu;
// no bit relation to decode: its stages are promoted into fp32 sums of their own). On
// sm_121 (native E4M3 mma) mma_e4m3_split is mma_e4m3. E4m3A holds A (the weights) converted
// once, for every N tile of a step.
struct E4m3A {
    uint32_t raw[4];
#if __CUDA_ARCH__ == 900
    uint32_t lo[4], hi[4];
#endif
};
__device__ __forceinline__ void e4m3_split(uint32_t v, uint32_t &lo, uint32_t &hi) {
    asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
        : "=r"(lo), "=r"(hi)
        : "r"(v));
}
__device__ __forceinline__ E4m3A e4m3_a(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3) {
    E4m3A a;
    a.raw[0] = a0, a.raw[1] = a1, a.raw[2] = a2, a.raw[3] = a3;
#if __CUDA_ARCH__ == 900
#pragma unroll
    for (int i = 0; i < 4; i++) e4m3_split(a.raw[i], a.lo[i], a.hi[i]);
#endif
    return a;
}
__device__ __forceinline__ void mma_f16(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// c += A B: on sm_90 the unpacks above and two f16 mma straight into c (not mma_e4m3's bits);
// elsewhere mma_e4m3 itself.
__device__ __forceinline__ void mma_e4m3_split(float *c, const E4m3A &a, uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ == 900
    uint32_t bl[2], bh[2];
    e4m3_split(b0, bl[0], bh[0]);
    e4m3_split(b1, bl[1], bh[1]);
    mma_f16(c, a.lo, bl);
    mma_f16(c, a.hi, bh);
#else
    const uint32_t b[2] = {b0, b1};
    mma_e4m3(c, a.raw, b);
#endif
}
// B (the other operand of mma_e4m3_split) unpacked once, for every row tile of a stage, and
// c += A B in mma_e4m3_split's order from both operands unpacked (the same sums).
struct E4m3B {
#if __CUDA_ARCH__ == 900
    uint32_t lo[2], hi[2];
#else
    uint32_t raw[2];
#endif
};
__device__ __forceinline__ E4m3B e4m3_b(uint32_t b0, uint32_t b1) {
    E4m3B b;
#if __CUDA_ARCH__ == 900
    e4m3_split(b0, b.lo[0], b.hi[0]);
    e4m3_split(b1, b.lo[1], b.hi[1]);
#else
    b.raw[0] = b0, b.raw[1] = b1;
#endif
    return b;
}
// c += A B in mma_e4m3_split's order (sm_90: the low halves' f16 mma, then the high halves').
__device__ __forceinline__ void mma_e4m3_pre(float *c, const E4m3A &a, const E4m3B &b) {
#if __CUDA_ARCH__ == 900
    mma_f16(c, a.lo, b.lo);
    mma_f16(c, a.hi, b.hi);
#else
    mma_e4m3(c, a.raw, b.raw);
#endif
}
__device__ __forceinline__ void mma_bf16(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Two floats -> packed bf16x2 (low half = first), round to nearest even.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
// Transpose of an 8x8 b16 matrix held as mma fragments: lane 4i + j holds row i, columns 2j and
// 2j + 1 of `a`, and gets the same positions of the transpose in `d`.
__device__ __forceinline__ void movmatrix_t(uint32_t &d, uint32_t a) {
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
}
