// CPU stand-in for the CUDA header (tests/emu/README.md): the bf16 type and conversion the kernels
// use, rounding as the device does (to nearest even, NaN kept quiet).
#pragma once
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 {
    uint16_t bits;
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return {(uint16_t)(u >> 16)};
}
