// Prefill GEMMs on tensor cores (mma.sync, ldmatrix, cp.async): FP8 W8A8 and BF16, plain or
// grouped by MoE expert (see OrnithGemmParams).
//
// Tile: BM rows x 128 outputs x 128 bytes of K per stage (128 E4M3 codes or 64 bf16), 3 stages of
// cp.async, 8 warps as 2 (rows) x 4 (outputs), each warp BM/2 x 32 = BM/32 x 4 mma tiles.
// BM = 128 for the plain GEMMs (3 x 32 KiB = 96 KiB dynamic shared memory); BM = 64 for the grouped
// MoE GEMM (72 KiB), where a 2,048-token chunk gives each of 256 experts ~64 rows, so 128-row
// tiles would run half empty. FP8 uses m16n8k32.e4m3 and BF16 m16n8k16.bf16: both consume 32
// bytes of K per mma with the same byte layout of fragments, so one kernel body serves both.
//
// Shared memory rows are 128 bytes = 8 chunks of 16 bytes; chunk c of row r is stored at chunk
// c ^ (r & 7), so the 8 rows an ldmatrix reads hit 8 distinct bank groups.
//
// NVFP4A16 (FP4): A is bf16 and the weight tile is dequantised into shared memory in the BF16 layout
// (fp4.cuh, bit-identical to the CPU's dequantisation), then the BF16 mma as above. Each thread
// fetches its 2 groups of 16 weights (8 code bytes and a scale byte each) for stage kt + 2 before
// the mma of stage kt and dequantises and stores them after it, so the loads land under the mma.
//
// FP8 accumulation: each stage's 128-byte K slice is accumulated in a fresh fp32 fragment, then
// added to the running fp32 sum (promotion every 128 codes), so the result does not depend on the
// tensor core's internal accumulator width over long K.
#include "common.cuh"
#include "fp4.cuh"
#include "mma.cuh"

#define GB_N 128
#define GB_K 128  // bytes
#define GB_STAGES 3
#define GB_THREADS 256
#define GB_GROUPED_M 64  // rows per tile of the grouped GEMM (MS_TILE in moe_prefill.cu)

template <bool FP8> __device__ __forceinline__ void mma32(float *c, const uint32_t *a, const uint32_t *b) {
    if (FP8) mma_e4m3(c, a, b); else mma_bf16(c, a, b);
}

__device__ __forceinline__ uint32_t swz(int row, int chunk) { return (uint32_t)(row * GB_K + ((chunk ^ (row & 7)) << 4)); }

// Element size in bytes: 1 (E4M3) or 2 (bf16; FP4 weights are dequantised to bf16).
template <bool FP8, int BM, bool FP4 = false> __device__ __forceinline__ void gemm_body(const OrnithGemmParams &p) {
    static_assert(!(FP8 && FP4), "NVFP4A16 runs bf16 activations");
    constexpr int ES = FP8 ? 1 : 2;
    constexpr int MI = BM / 32;  // mma row tiles per warp, and A chunks per thread per stage
    constexpr int STAGE_BYTES = (BM + GB_N) * GB_K;
    extern __shared__ __align__(128) uint8_t smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;

    // Which rows: plain (one group) or grouped (tile -> expert via tile_offsets).
    int g = 0, row0, row_end;
    if (p.group_offsets) {
        const int tile = blockIdx.y;
        if (tile >= p.tile_offsets[p.groups]) return;
        int lo = 0, hi = p.groups - 1;  // largest g with tile_offsets[g] <= tile
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (p.tile_offsets[mid] <= tile) lo = mid; else hi = mid - 1;
        }
        g = lo;
        row0 = p.group_offsets[g] + (tile - p.tile_offsets[g]) * BM;
        row_end = p.group_offsets[g + 1];
    } else {
        row0 = blockIdx.y * BM;
        row_end = p.rows;
    }
    const int n0 = blockIdx.x * GB_N;
    const uint8_t *A = (const uint8_t *)p.a;
    const uint8_t *W = (const uint8_t *)p.w + (size_t)g * p.out * p.in * ES;
    const size_t a_pitch = (size_t)p.a_stride * ES, w_pitch = (size_t)p.in * ES;
    const int kbytes = p.in * ES;
    const int ktiles = (kbytes + GB_K - 1) / GB_K;

    // Each thread copies MI chunks of A and 4 of B per stage: chunk id = tid + 256 * i,
    // row = id / 8, chunk = id % 8. Source rows are fixed over K, so resolve them once.
    const uint8_t *a_src[MI];
    const uint8_t *w_src[4];
    bool a_ok[MI], w_ok[4];
#pragma unroll
    for (int i = 0; i < MI; i++) {
        int id = tid + GB_THREADS * i, r = id >> 3;
        int gr = row0 + r;
        a_ok[i] = gr < row_end;
        int ar = a_ok[i] ? (p.a_rows ? p.a_rows[gr] : gr) : 0;
        a_src[i] = A + (size_t)ar * a_pitch + ((id & 7) << 4);
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int id = tid + GB_THREADS * i, r = id >> 3;
        int gn = n0 + r;
        w_ok[i] = gn < p.out;
        w_src[i] = W + (size_t)(w_ok[i] ? gn : 0) * w_pitch + ((id & 7) << 4);
    }
    // FP4: this thread's weights per stage: one group of 16 (chunks 2q, 2q + 1 of a stage's 8,
    // q = tid % 4: 8 code bytes and one scale byte) in each of rows tid / 4 and tid / 4 + 64, so a
    // group's table lookup serves both its chunks; their codes and scales of the stage in flight.
    const uint2 *fc_src[2];
    const uint8_t *fs_src[2];
    const float *ft[2];
    bool f_ok[2];
    uint2 fcode[2];
    uint32_t fscale[2];
    if (FP4) {
        const uint8_t *codes = (const uint8_t *)p.w + (size_t)g * p.out * (p.in / 2);
        const uint8_t *scales = p.w_group_scale + (size_t)g * p.out * (p.in / 16);
        const float *tab = p.w_tab + (size_t)g * (p.out / p.tab_rows) * 256;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int gn = n0 + (tid >> 2) + 64 * h;
            f_ok[h] = gn < p.out;
            const int row = f_ok[h] ? gn : 0;
            fc_src[h] = reinterpret_cast<const uint2 *>(codes + (size_t)row * (p.in / 2)) + (tid & 3);
            fs_src[h] = scales + (size_t)row * (p.in / 16) + (tid & 3);
            ft[h] = tab + (size_t)(row / p.tab_rows) * 256;
        }
    }
    // Codes and scale bytes of stage kt (zeros past the row or the matrix: weight 0, tab[0] = 0).
    auto fp4_fetch = [&](int kt) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const bool ok = f_ok[h] && kt * 64 + 16 * (tid & 3) < p.in;
            fcode[h] = ok ? __ldg(fc_src[h] + kt * 4) : make_uint2(0u, 0u);
            fscale[h] = ok ? __ldg(fs_src[h] + kt * 4) : 0u;
        }
    };
    const uint32_t sbase = smem_u32(smem);
    auto fp4_store = [&](int stage) {
        uint8_t *sb = smem + stage * STAGE_BYTES + BM * GB_K;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const Fp4Lut l = fp4_lut(__ldg(ft[h] + fscale[h]));
            const int r = (tid >> 2) + 64 * h, c = 2 * (tid & 3);
            uint32_t q[4];
            fp4_word(fcode[h].x, l, q);
            *reinterpret_cast<uint4 *>(sb + swz(r, c)) = make_uint4(q[0], q[1], q[2], q[3]);
            fp4_word(fcode[h].y, l, q);
            *reinterpret_cast<uint4 *>(sb + swz(r, c + 1)) = make_uint4(q[0], q[1], q[2], q[3]);
        }
    };
    auto load_stage = [&](int stage, int kt) {
        const uint32_t sa = sbase + stage * STAGE_BYTES, sb = sa + BM * GB_K;
        const int kb = kt * GB_K;
#pragma unroll
        for (int i = 0; i < MI; i++) {
            int id = tid + GB_THREADS * i, r = id >> 3, c = id & 7;
            bool kin = kb + (c << 4) < kbytes;  // in % 16 == 0 elements: chunks are all-in or all-out
            cp_async16(sa + swz(r, c), a_ok[i] && kin ? a_src[i] + kb : A, a_ok[i] && kin ? 16 : 0);
        }
        if (!FP4)  // FP4's weight chunks: fp4_fetch, fp4_store
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int id = tid + GB_THREADS * i, r = id >> 3, c = id & 7;
                bool kin = kb + (c << 4) < kbytes;
                cp_async16(sb + swz(r, c), w_ok[i] && kin ? w_src[i] + kb : W, w_ok[i] && kin ? 16 : 0);
            }
    };

    float acc[MI][4][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

#pragma unroll
    for (int s = 0; s < GB_STAGES - 1; s++) {
        if (s < ktiles) {
            load_stage(s, s);
            if (FP4) {
                fp4_fetch(s);
                fp4_store(s);
            }
        }
        cp_commit();
    }
    for (int kt = 0; kt < ktiles; kt++) {
        cp_wait<GB_STAGES - 2>();
        __syncthreads();
        const int nk = kt + GB_STAGES - 1;
        if (nk < ktiles) {
            load_stage(nk % GB_STAGES, nk);
            if (FP4) fp4_fetch(nk);
        }
        cp_commit();
        const uint32_t sa = sbase + (kt % GB_STAGES) * STAGE_BYTES, sb = sa + BM * GB_K;
        float part[MI][4][4];
#pragma unroll
        for (int i = 0; i < MI; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) part[i][j][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < GB_K / 32; ks++) {
            uint32_t af[MI][4], bfr[4][2];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                int r = wm * (BM / 2) + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                int c = 2 * ks + (lane >> 4);
                ldsm_x4(sa + swz(r, c), af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
            }
#pragma unroll
            for (int nj = 0; nj < 4; nj += 2) {
                int r = wn * 32 + nj * 8 + (lane >> 4) * 8 + (lane & 7);
                int c = 2 * ks + ((lane >> 3) & 1);
                ldsm_x4(sb + swz(r, c), bfr[nj][0], bfr[nj][1], bfr[nj + 1][0], bfr[nj + 1][1]);
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int nj = 0; nj < 4; nj++) mma32<FP8>(part[mi][nj], af[mi], bfr[nj]);
        }
#pragma unroll
        for (int i = 0; i < MI; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[i][j][e] += part[i][j][e];
        // Stage nk's buffer was last read in iteration kt - 1, before this iteration's barrier.
        if (FP4 && nk < ktiles) fp4_store(nk % GB_STAGES);
    }
    cp_wait<0>();

    // Epilogue: y = bf16(acc * as[a_row] * ws[o]) (FP8) or bf16(acc) (BF16).
    const float *ws = FP8 ? p.w_scale + (size_t)g * p.out : nullptr;
    const int gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int mi = 0; mi < MI; mi++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = row0 + wm * (BM / 2) + mi * 16 + gq + h * 8;
            if (r >= row_end) continue;
            float sx = 1.f;
            if (FP8) sx = p.a_scale[p.a_rows ? p.a_rows[r] : r];
            uint16_t *yr = p.y + (size_t)r * p.y_stride;
#pragma unroll
            for (int nj = 0; nj < 4; nj++) {
                int o = n0 + wn * 32 + nj * 8 + tq * 2;
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    if (o + e < p.out) {
                        float v = acc[mi][nj][h * 2 + e];
                        if (FP8) v = v * sx * ws[o + e];
                        yr[o + e] = f2bf(v);
                    }
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(GB_THREADS) gemm_fp8(const OrnithGemmParams p) { pdl_entry(); gemm_body<true, 128>(p); }
extern "C" __global__ void __launch_bounds__(GB_THREADS) gemm_bf16(const OrnithGemmParams p) { pdl_entry(); gemm_body<false, 128>(p); }
// The grouped MoE GEMM (p.group_offsets set; tiles of GB_GROUPED_M rows, see moe_sort).
extern "C" __global__ void __launch_bounds__(GB_THREADS) gemm_fp8_grouped(const OrnithGemmParams p) { pdl_entry(); gemm_body<true, GB_GROUPED_M>(p); }
// NVFP4A16 weights, bf16 activations: plain and grouped (the same tiles as gemm_bf16 / gemm_fp8_grouped).
extern "C" __global__ void __launch_bounds__(GB_THREADS) gemm_nvfp4(const OrnithGemmParams p) { pdl_entry(); gemm_body<false, 128, true>(p); }
extern "C" __global__ void __launch_bounds__(GB_THREADS) gemm_nvfp4_grouped(const OrnithGemmParams p) { pdl_entry(); gemm_body<false, GB_GROUPED_M, true>(p); }

// Per-row FP8 activation quantisation with compressed-tensors semantics (the CPU reference
// `cpu::fp8::quantize_act_row`), the input of gemm_fp8 in prefill:
//   scale = bf16(amax / 448), 2^-7 if that is 0;  q = e4m3(clamp(bf16(x / scale) + 0, -448, 448))
// (x / scale rounded to bf16 before E4M3; -0 -> +0). A NaN in the row: scale NaN, every code 0x7F.
// Shared by gemm.cu's users and moe_prefill.cu (swiglu_quant_ct).
extern "C" __global__ void __launch_bounds__(256) quantize_fp8_ct(const OrnithQuantParams p) {
    pdl_entry();
    __shared__ float sh[32];
    const int t = blockIdx.x;
    const uint16_t *x = p.x + (size_t)t * p.cols;
    float amax = 0.f, nan = 0.f;
    for (int i = threadIdx.x; i < p.cols; i += blockDim.x) {
        float v = bf2f(x[i]);
        if (v != v) nan = 1.f;
        amax = fmaxf(amax, fabsf(v));
    }
    amax = block_max(amax, sh);
    nan = block_max(nan, sh);
    float scale = act_scale(amax);
    if (nan > 0.f) scale = __int_as_float(0x7fc00000);
    if (threadIdx.x == 0) p.scale[t] = scale;
    for (int i = threadIdx.x; i < p.cols; i += blockDim.x) p.q8[(size_t)t * p.cols + i] = nan > 0.f ? (uint8_t)0x7F : quant_e4m3(bf2f(x[i]), scale);
}
