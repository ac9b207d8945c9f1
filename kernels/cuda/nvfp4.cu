// NVFP4A16 dequantisation to bf16 through fp4.cuh, the register path the decode products
// (gemv.cu) and the prefill GEMMs (gemm.cu) use on their weight tiles: this kernel exists so that
// path is tested bit for bit against the CPU reference on every code and scale byte
// (cuda::nvfp4 tests). The math (ornith_kernels.h, model_spec::nvfp4):
//   wd[o, i] = bf16( e2m1(code[o, i]) * s(ws[o, i / 16]) ), its magnitude the entry
//   tab[(o / tab_rows) * 256 + ws[o, i / 16]] holds (cuda::nvfp4::fp4_table) and its sign code bit 3
#include "common.cuh"
#include "fp4.cuh"

// y = wd as bf16 [out, in]: one thread per 8 weights (4 code bytes, one group scale).
// Grid ceil(out * in / 8 / 256); in % 16 == 0.
extern "C" __global__ void __launch_bounds__(256) nvfp4_dequant(const OrnithGemvNvfp4Params p) {
    pdl_entry();
    const size_t n = (size_t)p.out * p.in / 8;
    const size_t b = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n) return;
    const size_t i = 8 * b;  // first element: 8 | in, so one row and one group
    const size_t o = i / p.in, col = i % p.in;
    const Fp4Lut l = fp4_entry(p.tab + (o / p.tab_rows) * 256, p.ws[o * (p.in / 16) + col / 16]);
    uint32_t r[4];
    fp4_word(reinterpret_cast<const uint32_t *>(p.w)[b], l, r);
    reinterpret_cast<uint4 *>(p.y)[b] = make_uint4(r[0], r[1], r[2], r[3]);
}
