// CPU stand-in for the CUDA header (tests/emu/README.md): E4M3 encode (to nearest even, saturating
// to +-448 with __NV_SATFINITE, NaN -> 0x7F) and decode of two codes to halves (as floats).
#pragma once
#include <cmath>
#include <cstdint>
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
typedef uint8_t __nv_fp8_storage_t;
typedef uint16_t __nv_fp8x2_storage_t;
struct __half2_raw {
    float x, y;  // the decoded values (every E4M3 value is exact as a float)
};
struct __half2 {
    float x, y;
};
struct float2;
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float f, __nv_saturation_t, __nv_fp8_interpretation_t) {
    if (f != f) return 0x7F;
    const uint8_t sign = std::signbit(f) ? 0x80 : 0;
    double a = std::fabs((double)f);
    if (a >= 464.0) return sign | 0x7E;  // beyond the rounding midpoint above 448: saturate
    int e;
    std::frexp(a, &e);                   // a = m 2^e, m in [0.5, 1)
    int ex = e - 1;                      // a = 1.f 2^ex
    if (ex < -6) ex = -6;                // subnormals share 2^-6's spacing
    const double step = std::ldexp(1.0, ex - 3);
    double q = std::nearbyint(a / step);  // to nearest even (default rounding mode)
    double v = q * step;
    if (v == 0) return sign;
    int e2;
    std::frexp(v, &e2);
    int vex = e2 - 1;
    if (vex < -6) return sign | (uint8_t)(v / std::ldexp(1.0, -9));  // subnormal: mantissa units of 2^-9
    if (v > 448.0) return sign | 0x7E;
    const int mant = (int)(v / std::ldexp(1.0, vex - 3)) - 8;
    return sign | (uint8_t)(((vex + 7) << 3) | mant);
}
inline float e4m3_decode(uint8_t c) {
    const int s = c >> 7, ex = (c >> 3) & 15, m = c & 7;
    if (ex == 15 && m == 7) return NAN;
    const float v = ex == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.f + m / 8.f, ex - 7);
    return s ? -v : v;
}
inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t two, __nv_fp8_interpretation_t) {
    return {e4m3_decode((uint8_t)(two & 0xff)), e4m3_decode((uint8_t)(two >> 8))};
}
