// NVFP4 (E2M1 codes with an f32 group scale) to bf16 in registers, exactly as the CPU reference
// dequantises (model_spec::nvfp4):  wd = bf16( e2m1(code) * s )  with the product one IEEE f32
// multiplication and one round to nearest even. Included by the kernels that read NVFP4 weights
// (gemv.cu's decode products, gemm.cu's prefill GEMMs), never compiled alone.
//
// A group scale has 256 possible bytes and a code 8 possible magnitudes |e2m1| in {0, 0.5, 1,
// 1.5, 2, 3, 4, 6}: the loader rounds the 8 products v_m = bf16(m * s) of every scale byte once
// (cuda::nvfp4::fp4_table, from model_spec::nvfp4) and stores them as one 16-byte entry of the
// matrix's dequantisation table, the low and the high bytes of v_0..v_7 as two 8-byte planes, so
// that a group's entry is one 16-byte load and a byte permute (prmt) looks 4 codes up at once. A
// negative code (bit 3) is the same product with its sign flipped, (-a) * s = -(a * s) in IEEE
// arithmetic and rounding to nearest even is symmetric, so its sign bit is XORed in after the
// lookup. (Computing the 8 products per group in the kernel instead — 7 multiplications, 4
// conversions, 4 permutes per 16 weights — kept the NVFP4 MoE products issue-bound on the ALU
// pipe: H200, Nsight Compute, 57% of issue slots busy at 32 sequences.)
#pragma once
#include <stdint.h>
#include "../include/ornith_kernels.h"

// One table entry (OrnithFp4Entry): lo0 = lo(v0..v3), lo1 = lo(v4..v7), hi0 = hi(v0..v3), hi1 = hi(v4..v7).
struct Fp4Lut {
    uint32_t lo0, lo1, hi0, hi1;
};

// Entry b of a dequantisation table (16-byte aligned, read through the read-only cache).
__device__ __forceinline__ Fp4Lut fp4_entry(const OrnithFp4Entry *tab, uint32_t b) {
    const uint4 v = __ldg(reinterpret_cast<const uint4 *>(tab) + b);
    return Fp4Lut{v.x, v.y, v.z, v.w};
}

// 8 weights of one group as 4 bf16x2 registers, register j = {column 2j (low half), column 2j + 1}.
// w is a u32 of codes in the order the loader uploads them (cuda::nvfp4::fp4_device_codes):
// nibble n holds column n's magnitude in bits 4n .. 4n + 2, column j < 4's sign sits at bit 8j + 7
// and column 4 + j's at bit 8j + 3. The magnitudes index the entry's byte planes (prmt reads 3 bits
// of each selector nibble and bit 3 clear selects rather than replicating a sign); the signs land
// on bit 7 of the high bytes, byte j of hi_a being column j's and of hi_b column 4 + j's, with one
// mask and XOR each (the checkpoint's order, signs at bit 4n + 3, took two more permutes).
__device__ __forceinline__ void fp4_word(uint32_t w, const Fp4Lut &l, uint32_t (&r)[4]) {
    const uint32_t m = w & 0x77777777u;
    const uint32_t lo_a = __byte_perm(l.lo0, l.lo1, m), lo_b = __byte_perm(l.lo0, l.lo1, m >> 16);
    const uint32_t hi_a = __byte_perm(l.hi0, l.hi1, m) ^ (w & 0x80808080u);
    const uint32_t hi_b = __byte_perm(l.hi0, l.hi1, m >> 16) ^ ((w << 4) & 0x80808080u);
    r[0] = __byte_perm(lo_a, hi_a, 0x5140);
    r[1] = __byte_perm(lo_a, hi_a, 0x7362);
    r[2] = __byte_perm(lo_b, hi_b, 0x5140);
    r[3] = __byte_perm(lo_b, hi_b, 0x7362);
}
