// NVFP4 (E2M1 codes with an f32 group scale) to bf16 in registers, exactly as the CPU reference
// dequantises (model_spec::nvfp4):  wd = bf16( e2m1(code) * s )  with the product one IEEE f32
// multiplication and one round to nearest even. Included by the kernels that read NVFP4 weights
// (gemv.cu's decode products, gemm.cu's prefill GEMMs), never compiled alone.
//
// A group scale has 8 possible magnitudes |e2m1| in {0, 0.5, 1, 1.5, 2, 3, 4, 6}: fp4_lut rounds
// the 8 products m * s once (7 multiplications, 4 conversions) and keeps their low and high bytes
// as two 8-byte tables, so that a byte permute (prmt) looks up 4 codes at once. A negative code
// (bit 3) is the same product with its sign flipped, (-a) * s = -(a * s) in IEEE arithmetic and
// rounding to nearest even is symmetric, so its sign bit is XORed in after the lookup.
#pragma once
#include <stdint.h>

// Low and high bytes of v_m = bf16(e2m1(m) * s), m = 0..7: lo0 = lo(v0..v3), lo1 = lo(v4..v7), etc.
struct Fp4Lut {
    uint32_t lo0, lo1, hi0, hi1;
};

// cvt.rn.bf16x2.f32: {low half bf16(lo), high half bf16(hi)}, round to nearest even (NaN kept).
__device__ __forceinline__ uint32_t fp4_pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ Fp4Lut fp4_lut(float s) {
    const uint32_t p0 = fp4_pack(__fmul_rn(0.f, s), __fmul_rn(0.5f, s));
    const uint32_t p1 = fp4_pack(s, __fmul_rn(1.5f, s));  // 1 * s = s exactly
    const uint32_t p2 = fp4_pack(__fmul_rn(2.f, s), __fmul_rn(3.f, s));
    const uint32_t p3 = fp4_pack(__fmul_rn(4.f, s), __fmul_rn(6.f, s));
    // p_k bytes: lo(v_2k), hi(v_2k), lo(v_2k+1), hi(v_2k+1).
    return Fp4Lut{__byte_perm(p0, p1, 0x6420), __byte_perm(p2, p3, 0x6420), __byte_perm(p0, p1, 0x7531),
                  __byte_perm(p2, p3, 0x7531)};
}

// prmt.b32 in its default mode (a selector nibble's bit 3 replicates the sign of the selected byte),
// spelled out so that the mode never depends on how an intrinsic treats that bit.
__device__ __forceinline__ uint32_t fp4_prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// 8 weights of one group (a u32 of codes: byte j holds columns 2j (low nibble) and 2j + 1) as 4
// bf16x2 registers, register j = {column 2j (low half), column 2j + 1}.
__device__ __forceinline__ void fp4_word(uint32_t w, const Fp4Lut &l, uint32_t (&r)[4]) {
    const uint32_t m = w & 0x77777777u;  // magnitude indices (prmt uses 3 bits of each selector nibble)
    const uint32_t lo_a = __byte_perm(l.lo0, l.lo1, m), lo_b = __byte_perm(l.lo0, l.lo1, m >> 16);
    uint32_t hi_a = __byte_perm(l.hi0, l.hi1, m), hi_b = __byte_perm(l.hi0, l.hi1, m >> 16);
    // Sign of code n (bit 4n + 3 of w) onto bit 7 of high byte n. Code 2j's sign is bit 7 of byte
    // j of w << 4, code 2j + 1's bit 7 of byte j of w: prmt with a selector nibble's bit 3 set
    // replicates the selected byte's bit 7 over the result byte, so one prmt gives the 4 codes'
    // signs as 0x00 / 0xff bytes (bytes w4.b0, w.b0, w4.b1, w.b1 for codes 0..3).
    const uint32_t w4 = w << 4;
    hi_a ^= fp4_prmt(w4, w, 0xD9C8u) & 0x80808080u;
    hi_b ^= fp4_prmt(w4, w, 0xFBEAu) & 0x80808080u;
    r[0] = __byte_perm(lo_a, hi_a, 0x5140);
    r[1] = __byte_perm(lo_a, hi_a, 0x7362);
    r[2] = __byte_perm(lo_b, hi_b, 0x5140);
    r[3] = __byte_perm(lo_b, hi_b, 0x7362);
}
