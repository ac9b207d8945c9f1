// Variants of the wide decode products (kernels/cuda/gemv.cu's gemv_tc pass) for the harness in
// main.cu. Same placement (tc_place), same K order per warp, same slice reduction (tc_reduce) and
// stores (tc_store) as the shipped kernels; what changes is how the weights reach the mma:
//  * SMEM: each warp streams its 16 rows through a private ring of S shared-memory stages of
//    16 rows x 64U bytes, filled with cp.async S - 1 rounds ahead (the shipped wide pass loads a
//    round into registers only after the previous round's mma: few bytes in flight). The 16-byte
//    chunk q of row r sits at chunk q ^ 4(r & 1) (rows of 128 bytes or more; 64-byte rows pair up in one bank width as they are), so that a lane's ld.shared.v4 of chunk 4u + c of
//    rows g, g + 8 and the cp.async writes are free of bank conflicts.
//  * CVT (FP8 only): the e4m3 weights of a round converted to f16 once and the m16n8k16 f16 mma
//    (sm_90 emulates the e4m3 mma.sync by converting both operands for every mma, so the weights
//    were converted once per N tile). Lane (g, c)'s word h of its 16 bytes feeds f16 mma h:
//    a0/a2 = bytes 4h, 4h + 1 / 4h + 2, 4h + 3 of row g (a1/a3 of row g + 8), b0/b1 the token's
//    same bytes: the k slots 2c, 2c + 1 / 2c + 8, 2c + 9 pair the same bytes of both operands.
//    Products of e4m3 values are exact in f16 x f16 -> fp32; the sums' order is the mma's.
#pragma once

__device__ __forceinline__ uint32_t wv_cvt_lo(uint32_t w) {
    uint32_t r;
    const uint16_t h = (uint16_t)(w & 0xffffu);
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(h));
    return r;
}
__device__ __forceinline__ uint32_t wv_cvt_hi(uint32_t w) {
    uint32_t r;
    const uint16_t h = (uint16_t)(w >> 16);
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(h));
    return r;
}
__device__ __forceinline__ void wv_mma_f16(float *c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The mma of one round (as tc_mma), CVT: FP8 through f16.
template <bool FP8, bool CVT, int NT, int U>
__device__ __forceinline__ void wv_mma(const uint8_t *x, const uint32_t (&xoff)[NT], int kb, int k1, const uint4 (&wa)[U],
                                       const uint4 (&wb)[U], float (&acc)[NT][4]) {
    if constexpr (!(FP8 && CVT)) {
        tc_mma<FP8, NT, U, false>(x, xoff, kb, k1, wa, wb, acc);
    } else {
        const int c = threadIdx.x & 3;
        const uint4 z = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (kb + u * 64 >= k1) break;
            const int off = kb + u * 64;
            const bool ok = off + 16 * c < k1;
            const uint32_t wa4[4] = {wa[u].x, wa[u].y, wa[u].z, wa[u].w}, wb4[4] = {wb[u].x, wb[u].y, wb[u].z, wb[u].w};
            uint32_t A[4][4];
#pragma unroll
            for (int h = 0; h < 4; h++) {
                A[h][0] = wv_cvt_lo(wa4[h]);
                A[h][1] = wv_cvt_lo(wb4[h]);
                A[h][2] = wv_cvt_hi(wa4[h]);
                A[h][3] = wv_cvt_hi(wb4[h]);
            }
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const uint4 xv = ok ? *reinterpret_cast<const uint4 *>(x + xoff[j] + off) : z;
                const uint32_t x4[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
                for (int h = 0; h < 4; h++) wv_mma_f16(acc[j], A[h][0], A[h][1], A[h][2], A[h][3], wv_cvt_lo(x4[h]), wv_cvt_hi(x4[h]));
            }
        }
    }
}

// One stage of a warp's ring: rows 0..15 of the tile (clamped to nrows - 1) x R bytes from kb.
template <int U>
__device__ __forceinline__ void wv_fill(uint32_t st, const uint8_t *w, size_t row_bytes, int nrows, int kb, int k1) {
    constexpr int R = 64 * U, CH = R / 16;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < 16 * CH / 32; i++) {
        const int q = lane + 32 * i, row = q / CH, ch = q % CH, off = kb + 16 * ch;
        const bool ok = off < k1;
        const uint8_t *src = w + (size_t)min(row, nrows - 1) * row_bytes + (ok ? off : 0);
        cp_async16(st + row * R + 16 * (ch ^ (CH >= 8 ? (row & 1) << 2 : 0)), src, ok ? 16 : 0);
    }
}
template <int U>
__device__ __forceinline__ void wv_read(uint32_t st, uint4 (&wa)[U], uint4 (&wb)[U]) {
    constexpr int R = 64 * U;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, sw = R >= 128 ? (g & 1) << 2 : 0;
#pragma unroll
    for (int u = 0; u < U; u++) {
        const uint32_t o = 16 * ((4 * u + c) ^ sw);
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(wa[u].x), "=r"(wa[u].y), "=r"(wa[u].z), "=r"(wa[u].w) : "r"(st + g * R + o));
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(wb[u].x), "=r"(wb[u].y), "=r"(wb[u].z), "=r"(wb[u].w) : "r"(st + (g + 8) * R + o));
    }
}

template <bool FP8, bool CVT, int NT, int U, int S>
__device__ __forceinline__ void wv_tile_smem(uint32_t ring, const uint8_t *w, size_t row_bytes, int nrows, const uint8_t *x,
                                             const uint32_t (&xoff)[NT], int k0, int k1, float (&acc)[NT][4]) {
    constexpr int R = 64 * U, SB = 16 * R;
    x += 16 * (threadIdx.x & 3);
    const int nr = (k1 - k0 + R - 1) / R;
#pragma unroll
    for (int s = 0; s < S - 1; s++) {
        if (s < nr) wv_fill<U>(ring + s * SB, w, row_bytes, nrows, k0 + s * R, k1);
        cp_commit();
    }
    for (int r = 0; r < nr; r++) {
        cp_wait<S - 2>();
        __syncwarp();
        uint4 wa[U], wb[U];
        wv_read<U>(ring + (r % S) * SB, wa, wb);
        if (r + S - 1 < nr) wv_fill<U>(ring + ((r + S - 1) % S) * SB, w, row_bytes, nrows, k0 + (r + S - 1) * R, k1);
        cp_commit();
        wv_mma<FP8, CVT, NT, U>(x, xoff, k0 + r * R, k1, wa, wb, acc);
    }
    cp_wait<0>();
    __syncwarp();
}

// The dense pass of gemv_tc_pass with the tile variant chosen by SMEM / CVT (not SMEM: registers
// as the shipped wide pass, one round at a time).
template <bool FP8, bool SMEM, bool CVT, int NT, int U, int S>
__device__ __forceinline__ void wv_pass(const uint8_t *w, const float *ws, const uint8_t *x, const float *xs, uint16_t *y, int tokens,
                                        int t0, int in, int out, const TcPlace &pl, float *red, uint32_t ring) {
    constexpr int ES = FP8 ? 1 : 2;
    const int g = (threadIdx.x & 31) >> 2;
    const size_t row_bytes = (size_t)in * ES;
    uint32_t xoff[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) xoff[j] = (uint32_t)(min(t0 + 8 * j + g, tokens - 1) * in * ES);
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.f;
    const int nrows = max(1, min(16, out - pl.row0));
    if (pl.row0 < out) {
        const uint8_t *wt = w + (size_t)pl.row0 * row_bytes;
        if constexpr (SMEM) {
            wv_tile_smem<FP8, CVT, NT, U, S>(ring, wt, row_bytes, nrows, x, xoff, pl.k0, pl.k1, acc);
        } else {
            uint32_t og, og8;
            tc_rows(row_bytes, nrows, og, og8);
            const uint8_t *xl = x + 16 * (threadIdx.x & 3);
            for (int kb = pl.k0; kb < pl.k1; kb += 64 * U) {
                uint4 wa[U], wb[U];
                tc_load<U>(wt, og, og8, kb, pl.k1, wa, wb);
                wv_mma<FP8, CVT, NT, U>(xl, xoff, kb, pl.k1, wa, wb, acc);
            }
        }
    }
    tc_reduce<NT>(acc, pl.ks, red);
    if (!pl.lead || pl.row0 >= out) return;
    tc_store<FP8, NT>(acc, pl.row0, t0, tokens, out, y, out, ws, xs, nullptr);
}

// y[t * out + o]; x rows of `in` elements. Dynamic shared memory: 8 warps x S x 16 x 64U bytes.
template <bool FP8, bool SMEM, bool CVT, int U, int S, int MINB>
__global__ void __launch_bounds__(256, MINB) wv_gemv(const OrnithGemvFp8Params p) {
    __shared__ float red[TC_WARPS * 4 * 32];
    extern __shared__ __align__(16) uint8_t ring_mem[];
    constexpr int ES = FP8 ? 1 : 2;
    const TcPlace pl = tc_place(p.in * ES, p.out);
    const uint32_t ring = smem_u32(ring_mem) + (threadIdx.x >> 5) * S * 16 * 64 * U;
    for (int t0 = 0; t0 < p.tokens; t0 += 64) {
        const int nt = (min(p.tokens - t0, 64) + 7) / 8;
        switch (nt) {
            case 1:
            case 2: wv_pass<FP8, SMEM, CVT, 2, U, S>(p.w, p.ws, p.xq, p.xs, p.y, p.tokens, t0, p.in, p.out, pl, red, ring); break;
            case 3:
            case 4: wv_pass<FP8, SMEM, CVT, 4, U, S>(p.w, p.ws, p.xq, p.xs, p.y, p.tokens, t0, p.in, p.out, pl, red, ring); break;
            default: wv_pass<FP8, SMEM, CVT, 8, U, S>(p.w, p.ws, p.xq, p.xs, p.y, p.tokens, t0, p.in, p.out, pl, red, ring); break;
        }
    }
}
