// Prefill GEMMs on tensor cores (mma.sync, ldmatrix, cp.async): FP8 W8A8 and BF16, plain or
// grouped by MoE expert (see OrnithGemmParams).
//
// Tile: BM rows x 128 outputs x 128 bytes of K per stage (128 E4M3 codes or 64 bf16), 3 stages of
// cp.async, 8 warps as 2 (rows) x 4 (outputs), each warp BM/2 x 32 = BM/32 x 4 mma tiles
// (gemm_body; gemm_bf16, gemm_fp8_grouped and gemm_nvfp4_grouped_96 / _128 have bodies of their
// own in 4 warps of 64 x 64, 64 x 32 and 48 x 64 / 64 x 64: gemm_bf16_body, gemm_fp8_grouped_body
// and gemm_nvfp4_body below).
// BM = 128 for the plain GEMMs (3 x 32 KiB = 96 KiB dynamic shared memory, one block per SM);
// BM = 64 (72 KiB, two blocks per SM) for the grouped MoE GEMMs, where a 2,048-token chunk gives
// each of 256 experts ~64 rows, so 128-row tiles would run half empty. The NVFP4 MoE also has
// 96- and 128-row tiles (gemm_nvfp4_grouped_96 / _128, tile offsets of each height from moe_sort;
// cuda::gemm::grouped_tile_rows picks the height from the rows per expert): a weight is
// dequantised once per tile, so per HMMA the stage issues ~3/5 of the 64-row form's instructions
// (sm_90 SASS); at 8,192 tokens x top-8 of 256 the gate|up product took 1,559 against 1,735 us in
// gemm_body's form (H100), and at 2,048 tokens 487 us in 96-row tiles against 554 in 64-row ones.
// The 128-row form for FP8 ran slower than two 64-row blocks per SM at 8,192 tokens too (the MoE
// block 2.68 against 2.50 ms, H100), so FP8 keeps 64-row tiles. A row's sums do not depend on the
// tile height (the same stages in the same order), so every NVFP4 form gives the same bits
// (gemm_nvfp4_matches_reference). (BF16 ran 64-row tiles at
// two blocks per SM until the harness's run 4, tests/peer/gemm_variants: 128-row tiles at one
// block took the GDN input projection from 430 to 373 us, out_proj 140 -> 121, the router 48 -> 37.) FP8 uses m16n8k32.e4m3 and BF16 m16n8k16.bf16: both consume 32
// bytes of K per mma with the same byte layout of fragments, so one kernel body serves both.
//
// Persistent blocks: the grid is what the GPU holds at once (CudaContext::gemm_blocks), and block b
// takes tiles b, b + grid, b + 2 grid, ... through ONE cp.async pipeline over the sequence of
// (tile, k-tile) pairs, so the next tile's first stages load under the current tile's last mma and
// its epilogue instead of the pipeline filling and draining once per tile (2 of 18 stage times at
// K = 2048, 2 of 6 at K = 512). Plain tiles walk rows first (tile t: rows (t % row tiles), outputs
// (t / row tiles)), so a wave shares a few weight column tiles and all of A in L2; grouped tiles
// walk outputs first (tile t: outputs (t % column tiles), row tile t / column tiles), so an
// expert's rows are read from L2 by the blocks of one wave. Each output's sums are the same
// whatever the grid: a tile's rows and K order do not depend on which block runs it.
// Measured on the H200 (tests/peer/gemm_variants, 2,048-row chunks): FP8 2048 x 2048 -> 8192
// 299 -> 275 us, grouped FP8 down (K = 512) 392 -> 307 us.
//
// Shared memory rows are 128 bytes = 8 chunks of 16 bytes; chunk c of row r is stored at chunk
// c ^ (r & 7), so the 8 rows an ldmatrix reads hit 8 distinct bank groups.
//
// NVFP4A16 (FP4): A is bf16 and the weight tile is dequantised into shared memory in the BF16 layout
// (fp4.cuh, bit-identical to the CPU's dequantisation), then the BF16 mma as above. Each thread
// fetches its 2 groups of 16 weights (8 code bytes and a scale byte each) for the stage it issues
// before the mma of the current stage and dequantises and stores them after it, so the loads land
// under the mma (gemm_body; gemm_nvfp4_body stages the raw bytes in shared memory instead).
//
// Accumulation: each stage's 128-byte K slice (128 E4M3 codes or 64 bf16) is accumulated in a
// fresh fp32 fragment, then added to the running fp32 sum (IEEE, round to nearest). The tensor
// core adds into its accumulator with a narrower alignment (on sm_90 the e4m3 mma.sync runs as
// f16 HMMA after conversion, with the same accumulator), so accumulating straight into the running
// sum drifts over long K: in the harness (tests/peer/gemm_variants, run 3) 0.1% of BF16 outputs
// then rounded away from the correctly rounded bf16 of the exact sum (0.01% with the promotion,
// none beyond the output rounding), enough to break the bit-exact router weights of
// moe_prefill_matches_reference and row 0 of cuda_ops_vs_cpu (H200, 75521aa); with the
// promotion every form gives the bits of the one-tile-per-block kernels it replaced.
// FP8 on sm_90 (no E4M3 tensor-core path) goes through mma_e4m3_split (mma.cuh): the operands
// unpacked to f16 and both halves' f16 mma accumulated straight into the stage's fragment, so a
// stage is 8 chained mma per fragment (as a BF16 stage is 4) promoted once. mma_e4m3 as ptxas
// lowers it added every 32 products into the fragment with an fadd of its own (4 per mma): a
// grouped stage's loop body (sm_90 SASS, barrier to branch) was 793 instructions, 160 of them
// FADD, and 617 with 32; that kernel was bound by instruction issue (ncu, H200: 2.5 instructions
// per cycle per SM, stalls "not selected" and "math pipe throttle" first), later by the ALU's
// E4M3 unpacks (2 per HMMA in its 32 x 32 warp tiles), hence gemm_fp8_grouped_body below.
// On sm_121 (native E4M3) mma_e4m3_split is mma_e4m3.
//
// Not kept, three times: skipping the ldmatrix and mma of a tile's 16-row fragments past its last
// row (an expert's tail tile holds a few rows). A warp-uniform break per fragment (GEMM harness, run 3)
// and, in this kernel, a count of live fragments per warp with the stage's loop skipped or the
// fragments' mma predicated (thirty-eighth session, H100: moe_prefill 0.826 -> 0.888 ms, plain
// gemm_nvfp4 319 -> 345 us with no tail at all) both lost: the loop is issue-bound and the control
// flow costs ptxas the overlap of one k-step's ldmatrix with the previous one's mma. The third form,
// the tail tile as a second, separately scheduled loop body over half the warp's fragments (no
// predicate in either body; thirty-ninth session, H100, two alternating runs), was mixed: the
// grouped NVFP4 gate|up at 2,048 tokens 557 -> 580 us in 64-row tiles, 627 -> 587 in 128-row
// tiles, at 8,192 1,722 -> 1,811 / 1,549 -> 1,564; moe_prefill 0.825 -> 0.824 ms (2,048) and
// 2.49 -> 2.55 (8,192) — no gain where the model runs it (64-row tiles for FP8, 128-row NVFP4
// tiles only at 8,192 rows). Not kept (tests/peer/results/h100-2026-12-06-f/next_tail_body.patch).
#include "common.cuh"
#include "fp4.cuh"
#include "mma.cuh"

#define GB_N ORNITH_GEMM_N
#define GB_K ORNITH_GEMM_K  // bytes
#define GB_STAGES ORNITH_GEMM_STAGES
#define GB_THREADS 256
#define GB_GROUPED_M ORNITH_GROUPED_ROWS  // rows per tile of the 64-row grouped GEMMs (moe_sort's first prefix)
#define GB_BF16_M ORNITH_GEMM_N  // rows per tile of gemm_bf16 (cuda::gemm::gemm_rows)

__device__ __forceinline__ uint32_t swz(int row, int chunk) { return (uint32_t)(row * GB_K + ((chunk ^ (row & 7)) << 4)); }

// A warp's accumulator fragments (MI row tiles x NJ column tiles x 4 floats) set to 0.
template <int MI, int NJ> __device__ __forceinline__ void zero_frags(float (&f)[MI][NJ][4]) {
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) f[i][j][e] = 0.f;
}

// Grouped tile t (outputs first: column tile t % col_tiles of row tile t / col_tiles) -> its
// expert g (the largest with tile_offsets[g] <= its row tile), rows [row0, row_end) of the
// expert-sorted rows, first output n0; BM rows per tile (see moe_sort).
template <int BM>
__device__ __forceinline__ void grouped_tile(const OrnithGemmParams &p, int col_tiles, int t, int &g, int &row0,
                                             int &row_end, int &n0) {
    const int tile = t / col_tiles;
    n0 = (t % col_tiles) * GB_N;
    int lo = 0, hi = p.groups - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (p.tile_offsets[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    g = lo;
    row0 = p.group_offsets[g] + (tile - p.tile_offsets[g]) * BM;
    row_end = p.group_offsets[g + 1];
}

// Outputs o and o + 1 of row yr as bf16: one 32-bit store where `pairs` (y's stride and address
// allow it) and both are inside `out`, else each one inside `out` alone.
__device__ __forceinline__ void store_bf16_pair(uint16_t *yr, int o, int out, bool pairs, float v0, float v1) {
    if (pairs && o + 1 < out) {
        *reinterpret_cast<uint32_t *>(yr + o) = (uint32_t)f2bf(v0) | ((uint32_t)f2bf(v1) << 16);
    } else {
        if (o < out) yr[o] = f2bf(v0);
        if (o + 1 < out) yr[o + 1] = f2bf(v1);
    }
}

// Element size in bytes: 1 (E4M3) or 2 (bf16; FP4 weights are dequantised to bf16).
template <bool FP8, int BM, bool FP4 = false> __device__ __forceinline__ void gemm_body(const OrnithGemmParams &p) {
    static_assert(!(FP8 && FP4), "NVFP4A16 runs bf16 activations");
    constexpr int ES = FP8 ? 1 : 2;
    constexpr int MI = BM / 32;  // mma row tiles per warp, and A chunks per thread per stage
    constexpr int STAGE_BYTES = (BM + GB_N) * GB_K;
    extern __shared__ __align__(128) uint8_t smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;

    const bool grouped = p.group_offsets != nullptr;
    const int col_tiles = (p.out + GB_N - 1) / GB_N;
    const int row_tiles = grouped ? p.tile_offsets[p.groups] : (p.rows + BM - 1) / BM;
    const int total = row_tiles * col_tiles;
    const uint8_t *A = (const uint8_t *)p.a;
    const size_t a_pitch = (size_t)p.a_stride * ES, w_pitch = (size_t)p.in * ES;
    const int kbytes = p.in * ES;
    const int ktiles = (kbytes + GB_K - 1) / GB_K;

    // Tile t -> group g, output rows [row0, row_end), first output n0 (see the header comment).
    auto resolve = [&](int t, int &g, int &row0, int &row_end, int &n0) {
        if (grouped) {
            grouped_tile<BM>(p, col_tiles, t, g, row0, row_end, n0);
        } else {
            g = 0;
            row0 = (t % row_tiles) * BM;
            n0 = (t / row_tiles) * GB_N;
            row_end = p.rows;
        }
    };

    // The load cursor: tile lt, k-tile lk, and this thread's source rows of tile lt. Each thread
    // copies MI chunks of A and 4 of B per stage: chunk i is 16-byte chunk tid % 8 of row
    // tid / 8 + 32 i. Rows 32 apart share row & 7, so every chunk of the thread has the same
    // swizzled column: its shared address is ld_off + 32 i rows into the stage's A or B tile. A
    // chunk is copied while kb + ld_kc < its limit (kbytes, or 0 for a row past the tile's end),
    // from its row's start + kb (the row's start itself, zero-filled, otherwise).
    int lt = blockIdx.x, lk = 0;
    const int ld_row = tid >> 3, ld_kc = (tid & 7) << 4;
    const uint32_t ld_off = swz(ld_row, tid & 7);
    const uint8_t *W = nullptr;
    const uint8_t *a_src[MI];
    const uint8_t *w_src[4];
    int a_lim[MI], w_lim[4];
    // FP4: this thread's weights per stage: one group of 16 (chunks 2q, 2q + 1 of a stage's 8,
    // q = tid % 4: 8 code bytes and one scale byte) in each of rows tid / 4 and tid / 4 + 64, so a
    // group's table lookup serves both its chunks; their codes, scales and table of the stage in
    // flight (the table is kept with them: the cursor may move to the next tile before they are stored).
    const uint2 *fc_src[2];
    const uint8_t *fs_src[2];
    const OrnithFp4Entry *ft[2], *ft_fetched[2];
    bool f_ok[2];
    uint2 fcode[2];
    uint32_t fscale[2];
    auto set_load_tile = [&](int t) {
        int g, row0, row_end, n0;
        resolve(t, g, row0, row_end, n0);
        W = (const uint8_t *)p.w + (size_t)g * p.out * p.in * ES;
#pragma unroll
        for (int i = 0; i < MI; i++) {
            const int gr = row0 + ld_row + 32 * i;
            const bool ok = gr < row_end;
            const int ar = ok ? (p.a_rows ? p.a_rows[gr] : gr) : 0;
            a_src[i] = A + (size_t)ar * a_pitch + ld_kc;
            a_lim[i] = ok ? kbytes : 0;
        }
        if (!FP4)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int gn = n0 + ld_row + 32 * i;
                const bool ok = gn < p.out;
                w_src[i] = W + (size_t)(ok ? gn : 0) * w_pitch + ld_kc;
                w_lim[i] = ok ? kbytes : 0;
            }
        if (FP4) {
            const uint8_t *codes = (const uint8_t *)p.w + (size_t)g * p.out * (p.in / 2);
            const uint8_t *scales = p.w_group_scale + (size_t)g * p.out * (p.in / 16);
            const OrnithFp4Entry *tab = p.w_tab + (size_t)g * (p.out / p.tab_rows) * 256;
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
    };
    if (lt < total) set_load_tile(lt);
    const uint32_t sbase = smem_u32(smem);
    // Issues the cursor's stage into buffer `stage` (one commit group, empty past the last tile) and
    // advances the cursor; returns whether FP4 codes were fetched (to be stored by fp4_store).
    auto issue = [&](int stage) -> bool {
        bool fetched = false;
        if (lt < total) {
            const uint32_t sa = sbase + stage * STAGE_BYTES + ld_off, sb = sa + BM * GB_K;
            const int kb = lk * GB_K, kc = kb + ld_kc;  // in % 16 == 0 elements: chunks are all-in or all-out
#pragma unroll
            for (int i = 0; i < MI; i++) {
                const bool in = kc < a_lim[i];
                cp_async16(sa + 32 * GB_K * i, a_src[i] + (in ? kb : 0), in ? 16 : 0);
            }
            if (!FP4)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const bool in = kc < w_lim[i];
                    cp_async16(sb + 32 * GB_K * i, w_src[i] + (in ? kb : 0), in ? 16 : 0);
                }
            if (FP4) {  // codes and scale bytes of k-tile lk (zeros past the row or the matrix: weight 0: entry 0 is all zeros)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const bool ok = f_ok[h] && lk * 64 + 16 * (tid & 3) < p.in;
                    fcode[h] = ok ? __ldg(fc_src[h] + lk * 4) : make_uint2(0u, 0u);
                    fscale[h] = ok ? __ldg(fs_src[h] + lk * 4) : 0u;
                    ft_fetched[h] = ft[h];
                }
                fetched = true;
            }
            if (++lk == ktiles) {
                lk = 0;
                lt += gridDim.x;
                if (lt < total) set_load_tile(lt);
            }
        }
        cp_commit();
        return fetched;
    };
    auto fp4_store = [&](int stage) {
        uint8_t *sb = smem + stage * STAGE_BYTES + BM * GB_K;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const Fp4Lut l = fp4_entry(ft_fetched[h], fscale[h]);
            const int r = (tid >> 2) + 64 * h, c = 2 * (tid & 3);
            uint32_t q[4];
            fp4_word(fcode[h].x, l, q);
            *reinterpret_cast<uint4 *>(sb + swz(r, c)) = make_uint4(q[0], q[1], q[2], q[3]);
            fp4_word(fcode[h].y, l, q);
            *reinterpret_cast<uint4 *>(sb + swz(r, c + 1)) = make_uint4(q[0], q[1], q[2], q[3]);
        }
    };

    float acc[MI][4][4];
    zero_frags(acc);

#pragma unroll
    for (int s = 0; s < GB_STAGES - 1; s++)
        if (issue(s) && FP4) fp4_store(s);

    int ct = blockIdx.x, ck = 0, stage = 0;  // the compute cursor: tile, k-tile, buffer
    while (ct < total) {
        cp_wait<GB_STAGES - 2>();
        __syncthreads();
        // Buffer stage - 1 was last read in the previous iteration, before this barrier.
        const int next = stage == 0 ? GB_STAGES - 1 : stage - 1;
        const bool fetched = issue(next);
        const uint32_t sa = sbase + stage * STAGE_BYTES, sb = sa + BM * GB_K;
        float part[MI][4][4];
        zero_frags(part);
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
            if constexpr (FP8) {  // the stage's sums in the tensor core's accumulator (see Accumulation)
                E4m3A ea[MI];
#pragma unroll
                for (int mi = 0; mi < MI; mi++) ea[mi] = e4m3_a(af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
#pragma unroll
                for (int mi = 0; mi < MI; mi++)
#pragma unroll
                    for (int nj = 0; nj < 4; nj++) mma_e4m3_split(part[mi][nj], ea[mi], bfr[nj][0], bfr[nj][1]);
            } else {
#pragma unroll
                for (int mi = 0; mi < MI; mi++)
#pragma unroll
                    for (int nj = 0; nj < 4; nj++) mma_bf16(part[mi][nj], af[mi], bfr[nj]);
            }
        }
#pragma unroll
        for (int i = 0; i < MI; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[i][j][e] += part[i][j][e];
        if (FP4 && fetched) fp4_store(next);
        stage = stage + 1 == GB_STAGES ? 0 : stage + 1;
        if (++ck < ktiles) continue;

        // Epilogue of tile ct: y = bf16(acc * as[a_row] * ws[o]) (FP8) or bf16(acc) (BF16, FP4),
        // bf16 pairs stored as one word where y allows it.
        int g, row0, row_end, n0;
        resolve(ct, g, row0, row_end, n0);
        const float *ws = FP8 ? p.w_scale + (size_t)g * p.out : nullptr;
        const int gq = lane >> 2, tq = lane & 3;
        const bool pairs = (p.y_stride & 1) == 0 && ((uintptr_t)p.y & 3) == 0;
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
                    float v0 = acc[mi][nj][h * 2], v1 = acc[mi][nj][h * 2 + 1];
                    if (FP8) {
                        if (o < p.out) v0 = v0 * sx * ws[o];
                        if (o + 1 < p.out) v1 = v1 * sx * ws[o + 1];
                    }
                    store_bf16_pair(yr, o, p.out, pairs, v0, v1);
                }
            }
        }
        zero_frags(acc);
        ck = 0;
        ct += gridDim.x;
    }
    cp_wait<0>();
}

// One stage of a 4-warp bf16 tile in 16 MI x 64 warp tiles (gemm_bf16_body, gemm_nvfp4_body<128>:
// MI = 4, 64 x 64; gemm_nvfp4_body<96>: MI = 3), A at sa and B at sb (GB_K-byte swizzled rows):
// warp (wm, wn)'s B fragments of the stage's 4 k-steps x 8 column tiles, then per row tile its A
// fragments and, per column tile, the 4 chained mma from a zero start and the add into acc (the
// promotion, see Accumulation).
template <int MI>
__device__ __forceinline__ void bf16_stage_x64(uint32_t sa, uint32_t sb, int wm, int wn, int lane, float (&acc)[MI][8][4]) {
    uint32_t bfr[4][8][2];
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int nj = 0; nj < 8; nj += 2) {
            int r = wn * 64 + nj * 8 + (lane >> 4) * 8 + (lane & 7);
            ldsm_x4(sb + swz(r, 2 * ks + ((lane >> 3) & 1)), bfr[ks][nj][0], bfr[ks][nj][1], bfr[ks][nj + 1][0], bfr[ks][nj + 1][1]);
        }
#pragma unroll
    for (int mi = 0; mi < MI; mi++) {
        uint32_t af[4][4];
#pragma unroll
        for (int ks = 0; ks < 4; ks++) {
            int r = wm * (16 * MI) + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            ldsm_x4(sa + swz(r, 2 * ks + (lane >> 4)), af[ks][0], af[ks][1], af[ks][2], af[ks][3]);
        }
#pragma unroll
        for (int nj = 0; nj < 8; nj++) {
            float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int ks = 0; ks < 4; ks++) mma_bf16(part, af[ks], bfr[ks][nj]);
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mi][nj][e] += part[e];
        }
    }
}

// Epilogue of a 16 MI x 64 warp tile: y = bf16(acc) for rows row0 + 16 MI wm .. (those before
// row_end) and outputs n0 + 64 wn .., pairs as one word where y allows it.
template <int MI>
__device__ __forceinline__ void store_x64(const OrnithGemmParams &p, const float (&acc)[MI][8][4], int row0, int row_end, int n0,
                                          int wm, int wn, int lane) {
    const int gq = lane >> 2, tq = lane & 3;
    const bool pairs = (p.y_stride & 1) == 0 && ((uintptr_t)p.y & 3) == 0;
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = row0 + wm * (16 * MI) + mi * 16 + gq + h * 8;
            if (r >= row_end) continue;
            uint16_t *yr = p.y + (size_t)r * p.y_stride;
#pragma unroll
            for (int nj = 0; nj < 8; nj++) {
                const int o = n0 + wn * 64 + nj * 8 + tq * 2;
                store_bf16_pair(yr, o, p.out, pairs, acc[mi][nj][h * 2], acc[mi][nj][h * 2 + 1]);
            }
        }
}

// gemm_bf16: 128 x 128 tiles, 4 warps as 2 x 2, each 64 x 64 (4 x 8 mma tiles), 3 stages of
// 128 bytes of K (96 KiB: two blocks per SM on sm_90, one on sm_121). A stage's 64-element K slice
// is consumed fragment by fragment: its 4 chained mma from a zero start, then added to the running
// sum — per fragment the same operations in the same order as gemm_body's per-stage promotion
// (Accumulation, above), so the same bits; with one fragment's partial live at a time instead of
// the warp's 16, the warp's B fragments of the whole stage fit in registers beside 64 x 64
// accumulators (255 registers, no spills, sm_90 and sm_121). Per HMMA a stage issues 0.25
// ldmatrix (0.375 in gemm_body's 64 x 32 warp tiles) and ~4.3 instructions (~7). H200, kernel
// tests: 2048 x 2048 -> 8192 234.4 -> 197.6 us, -> 32768 909 -> 770 us (the router's -> 257,
// 48 tiles, 38.2 -> 41.5 us); the same body in 128 x 256 tiles (8 warps, 2 stages, one block per
// SM) gained nothing (237.6 us; the router 70.7). Under ncu the loop's first stall is the fixed
// latency of the chained HMMA ("wait", 1.8 of 5.1 cycles per instruction), with 1.9 warps per
// scheduler; HEAD's form was not L2-bound (31% of L2 throughput, 35% of issue slots).
#define GBB_THREADS 128
__device__ __forceinline__ void gemm_bf16_body(const OrnithGemmParams &p) {
    constexpr int RS = GBB_THREADS / 8;  // rows between a thread's copied chunks
    constexpr int CH = GB_BF16_M / RS;   // a thread's A (and B) chunks per stage
    constexpr int STAGE_BYTES = 2 * GB_BF16_M * GB_K;
    extern __shared__ __align__(128) uint8_t smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    const int col_tiles = (p.out + GB_N - 1) / GB_N, row_tiles = (p.rows + GB_BF16_M - 1) / GB_BF16_M;
    const int total = row_tiles * col_tiles;
    const size_t a_pitch = (size_t)p.a_stride * 2, w_pitch = (size_t)p.in * 2;
    const int kbytes = p.in * 2, ktiles = (kbytes + GB_K - 1) / GB_K;
    const int ld_row = tid >> 3, ld_kc = (tid & 7) << 4;
    const uint32_t ld_off = swz(ld_row, tid & 7);
    // The load cursor (tile lt, k-tile lk) as in gemm_body; this thread copies chunk tid % 8 of
    // rows tid / 8 + 16 i (i < 8) of A and of W per stage: all in one swizzled column, at ld_off.
    int lt = blockIdx.x, lk = 0;
    const uint8_t *a_src = nullptr, *w_src = nullptr;
    uint32_t a_ok = 0, w_ok = 0;  // bit i: chunk i's row is inside the matrix
    auto set_load_tile = [&](int t) {
        const int row0 = (t % row_tiles) * GB_BF16_M, n0 = (t / row_tiles) * GB_N;
        a_src = (const uint8_t *)p.a + (size_t)(row0 + ld_row) * a_pitch + ld_kc;
        w_src = (const uint8_t *)p.w + (size_t)(n0 + ld_row) * w_pitch + ld_kc;
        a_ok = w_ok = 0;
#pragma unroll
        for (int i = 0; i < CH; i++) {
            a_ok |= (uint32_t)(row0 + ld_row + RS * i < p.rows) << i;
            w_ok |= (uint32_t)(n0 + ld_row + RS * i < p.out) << i;
        }
    };
    if (lt < total) set_load_tile(lt);
    const uint32_t sbase = smem_u32(smem);
    auto issue = [&](int stage) {
        if (lt < total) {
            const uint32_t sa = sbase + stage * STAGE_BYTES + ld_off, sb = sa + GB_BF16_M * GB_K;
            const int kb = lk * GB_K;
            const bool kin = kb + ld_kc < kbytes;  // in % 8 == 0: chunks are all-in or all-out
#pragma unroll
            for (int i = 0; i < CH; i++) {
                const bool in = kin && ((a_ok >> i) & 1);
                cp_async16(sa + RS * GB_K * i, in ? a_src + RS * i * a_pitch + kb : p.a, in ? 16 : 0);
            }
#pragma unroll
            for (int i = 0; i < CH; i++) {
                const bool in = kin && ((w_ok >> i) & 1);
                cp_async16(sb + RS * GB_K * i, in ? w_src + RS * i * w_pitch + kb : p.w, in ? 16 : 0);
            }
            if (++lk == ktiles) {
                lk = 0;
                lt += gridDim.x;
                if (lt < total) set_load_tile(lt);
            }
        }
        cp_commit();
    };
    float acc[4][8][4];
    zero_frags(acc);
#pragma unroll
    for (int s = 0; s < GB_STAGES - 1; s++) issue(s);
    int ct = blockIdx.x, ck = 0, stage = 0;  // the compute cursor: tile, k-tile, buffer
    while (ct < total) {
        cp_wait<GB_STAGES - 2>();
        __syncthreads();
        issue(stage == 0 ? GB_STAGES - 1 : stage - 1);  // last read before this barrier
        const uint32_t sa = sbase + stage * STAGE_BYTES, sb = sa + GB_BF16_M * GB_K;
        bf16_stage_x64(sa, sb, wm, wn, lane, acc);
        stage = stage + 1 == GB_STAGES ? 0 : stage + 1;
        if (++ck < ktiles) continue;
        store_x64(p, acc, (ct % row_tiles) * GB_BF16_M, p.rows, (ct / row_tiles) * GB_N, wm, wn, lane);
        zero_frags(acc);
        ck = 0;
        ct += gridDim.x;
    }
    cp_wait<0>();
}

// gemm_fp8_grouped: 64 x 128 tiles (ORNITH_GROUPED_ROWS rows of one expert), 4 warps side by side, each
// 64 x 32 (4 x 4 mma tiles), 3 stages (72 KiB: two blocks per SM on sm_90 — 206 registers — one
// on sm_121). As in gemm_bf16_body a stage is consumed fragment by fragment: the stage's B
// fragments unpacked once and kept (sm_90: f16 pairs, E4m3B), each row tile's A fragments unpacked
// once, then per fragment the stage's chained mma in mma_e4m3_split's order and the add into the
// running sum — the same operations in the same order as gemm_body<true, 64>, so the same bits.
// E4M3 unpacks per HMMA: 1.5 (2 in gemm_body's 32 x 32 warp tiles, where ncu found the ALU —
// the unpacks — the busiest pipe and "math pipe throttle" the first stall); ~5.7 instructions per
// HMMA against ~8.6 (sm_90 SASS). H100, same call: moe_prefill 2K 0.826 -> 0.807 ms, 8K 2.490 ->
// 2.426; in the model gemm_fp8_grouped per 32K prefill 280.8 -> 268.1 ms.
// gemm_fp8_grouped_96: the same body in 96-row tiles (4 warps of 96 x 32: MI = 6; 84 KiB; 255
// registers, 4 bytes spilled on sm_90 and sm_121), for a 2,048-token chunk's ~64 rows per expert,
// which 64-row tiles cover in ~1.5 tiles (cuda::gemm::grouped_fp8_tile_rows). H100, the MoE
// block's kernel test in 64 / 96-row tiles: 1,024 tokens 0.563 / 0.667 ms, 2,048 0.788 / 0.762,
// 3,072 1.061 / 1.128, 8,192 2.385 / 2.347; FP8 2K prefill 29,234 / 29,492 -> 29,512 / 29,688 tok/s.
#define GBG_THREADS 128
template <int BM> __device__ __forceinline__ void gemm_fp8_grouped_body(const OrnithGemmParams &p) {
    static_assert(BM == ORNITH_GROUPED_ROWS || BM == ORNITH_GROUPED_MID_ROWS, "moe_sort's tile heights");
    constexpr int MI = BM / 16, RS = GBG_THREADS / 8;        // mma row tiles per warp; rows between a thread's chunks
    constexpr int CA = BM / RS, CB = GB_N / RS;              // a thread's A and W chunks per stage
    constexpr int STAGE_BYTES = (BM + GB_N) * GB_K;
    extern __shared__ __align__(128) uint8_t smem[];
    const int tid = threadIdx.x, lane = tid & 31, wn = tid >> 5;
    const int col_tiles = (p.out + GB_N - 1) / GB_N;
    const int total = p.tile_offsets[p.groups] * col_tiles;
    const uint8_t *A = (const uint8_t *)p.a;
    const size_t a_pitch = (size_t)p.a_stride, w_pitch = (size_t)p.in;
    const int kbytes = p.in, ktiles = (kbytes + GB_K - 1) / GB_K;
    const int ld_row = tid >> 3, ld_kc = (tid & 7) << 4;
    const uint32_t ld_off = swz(ld_row, tid & 7);
    int lt = blockIdx.x, lk = 0;
    const uint8_t *a_src[CA];
    const uint8_t *w_src = nullptr;
    uint32_t a_ok = 0, w_ok = 0;
    auto set_load_tile = [&](int t) {
        int g, row0, row_end, n0;
        grouped_tile<BM>(p, col_tiles, t, g, row0, row_end, n0);
        const uint8_t *W = (const uint8_t *)p.w + (size_t)g * p.out * p.in;
        a_ok = w_ok = 0;
#pragma unroll
        for (int i = 0; i < CA; i++) {
            const int gr = row0 + ld_row + RS * i;
            const bool ok = gr < row_end;
            a_src[i] = A + (size_t)(ok ? (p.a_rows ? p.a_rows[gr] : gr) : 0) * a_pitch + ld_kc;
            a_ok |= (uint32_t)ok << i;
        }
        w_src = W + (size_t)(n0 + ld_row) * w_pitch + ld_kc;
#pragma unroll
        for (int i = 0; i < CB; i++) w_ok |= (uint32_t)(n0 + ld_row + RS * i < p.out) << i;
    };
    if (lt < total) set_load_tile(lt);
    const uint32_t sbase = smem_u32(smem);
    auto issue = [&](int stage) {
        if (lt < total) {
            const uint32_t sa = sbase + stage * STAGE_BYTES + ld_off, sb = sa + BM * GB_K;
            const int kb = lk * GB_K;
            const bool kin = kb + ld_kc < kbytes;
#pragma unroll
            for (int i = 0; i < CA; i++) {
                const bool in = kin && ((a_ok >> i) & 1);
                cp_async16(sa + RS * GB_K * i, in ? a_src[i] + kb : p.a, in ? 16 : 0);
            }
#pragma unroll
            for (int i = 0; i < CB; i++) {
                const bool in = kin && ((w_ok >> i) & 1);
                cp_async16(sb + RS * GB_K * i, in ? w_src + RS * i * w_pitch + kb : p.w, in ? 16 : 0);
            }
            if (++lk == ktiles) {
                lk = 0;
                lt += gridDim.x;
                if (lt < total) set_load_tile(lt);
            }
        }
        cp_commit();
    };
    float acc[MI][4][4];
    zero_frags(acc);
#pragma unroll
    for (int s = 0; s < GB_STAGES - 1; s++) issue(s);
    int ct = blockIdx.x, ck = 0, stage = 0;
    while (ct < total) {
        cp_wait<GB_STAGES - 2>();
        __syncthreads();
        issue(stage == 0 ? GB_STAGES - 1 : stage - 1);
        const uint32_t sa = sbase + stage * STAGE_BYTES, sb = sa + BM * GB_K;
        E4m3B bfr[4][4];
#pragma unroll
        for (int ks = 0; ks < 4; ks++)
#pragma unroll
            for (int nj = 0; nj < 4; nj += 2) {
                int r = wn * 32 + nj * 8 + (lane >> 4) * 8 + (lane & 7);
                uint32_t b0, b1, b2, b3;
                ldsm_x4(sb + swz(r, 2 * ks + ((lane >> 3) & 1)), b0, b1, b2, b3);
                bfr[ks][nj] = e4m3_b(b0, b1);
                bfr[ks][nj + 1] = e4m3_b(b2, b3);
            }
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
            E4m3A af[4];
#pragma unroll
            for (int ks = 0; ks < 4; ks++) {
                int r = mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                uint32_t a0, a1, a2, a3;
                ldsm_x4(sa + swz(r, 2 * ks + (lane >> 4)), a0, a1, a2, a3);
                af[ks] = e4m3_a(a0, a1, a2, a3);
            }
#pragma unroll
            for (int nj = 0; nj < 4; nj++) {
                float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int ks = 0; ks < 4; ks++) mma_e4m3_pre(part, af[ks], bfr[ks][nj]);
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mi][nj][e] += part[e];
            }
        }
        stage = stage + 1 == GB_STAGES ? 0 : stage + 1;
        if (++ck < ktiles) continue;
        int g, row0, row_end, n0;
        grouped_tile<BM>(p, col_tiles, ct, g, row0, row_end, n0);
        const float *ws = p.w_scale + (size_t)g * p.out;
        const int gq = lane >> 2, tq = lane & 3;
        const bool pairs = (p.y_stride & 1) == 0 && ((uintptr_t)p.y & 3) == 0;
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = row0 + mi * 16 + gq + h * 8;
                if (r >= row_end) continue;
                const float sx = p.a_scale[p.a_rows ? p.a_rows[r] : r];
                uint16_t *yr = p.y + (size_t)r * p.y_stride;
#pragma unroll
                for (int nj = 0; nj < 4; nj++) {
                    const int o = n0 + wn * 32 + nj * 8 + tq * 2;
                    float v0 = acc[mi][nj][h * 2], v1 = acc[mi][nj][h * 2 + 1];
                    if (o < p.out) v0 = v0 * sx * ws[o];
                    if (o + 1 < p.out) v1 = v1 * sx * ws[o + 1];
                    store_bf16_pair(yr, o, p.out, pairs, v0, v1);
                }
            }
        zero_frags(acc);
        ck = 0;
        ct += gridDim.x;
    }
    cp_wait<0>();
}

// gemm_nvfp4_grouped_128 / _96: the grouped NVFP4 GEMM in 128- or 96-row tiles (BM rows of one
// expert: ORNITH_GROUPED_WIDE_ROWS, ORNITH_GROUPED_MID_ROWS), 4 warps as 2 x 2, each 64 x 64 as in
// gemm_bf16_body (48 x 64 in 96-row tiles), a stage consumed fragment by
// fragment (4 chained bf16 mma from zero, then the add: the same operations in the same order as
// gemm_body's promotion, so the same bits as gemm_body<false, 128, true>, which this kernel ran,
// and as the 64-row gemm_nvfp4_grouped). The weight stage goes through shared memory twice: its raw
// bytes (thread t's output row t of the tile: 32 code bytes, 4 scale bytes) arrive by cp.async one
// stage ahead of A's, and the thread dequantises stage kt + 1 from shared memory after the mma of
// stage kt (fp4.cuh; its own copies, visible to it after the wait) into the other of two bf16 B
// buffers, so no code or scale register lives across the mma loop: that leaves the registers to
// the 64 x 64 warp tiles (255, no spills on sm_90; sm_121 spills 48 bytes). Shared memory: A 3 x 16
// KiB, B 2 x 16 KiB, raw 3 x 5.5 KiB (96.5 KiB: two blocks per SM on sm_90, one on sm_121; in
// 96-row tiles A is 3 x 12 KiB, 84.5 KiB in all, 255 registers and no spills on sm_90 and sm_121).
// Why 96 rows: a 2,048-token chunk gives each expert ~64 rows, spread (Poisson-like) so that about
// half the experts take a second, mostly empty 64-row tile, whose weights are dequantised again;
// in 96-row tiles nearly every expert takes one (cuda::gemm::grouped_tile_rows).
// H100, kernel tests, 8,192 tokens top-8 of 256 (2048 -> 1024): 1,532 -> 1,487 us (same call;
// 1,551 -> 1,429 / 1,471 in an earlier one); in the model, NVFP4A16 prefill of 32K prompts in
// 8,192-token steps 22,491 -> 22,790 tok/s (two runs each). Not kept for the 64-row and plain NVFP4
// GEMMs (forty-third session): in 64 x 32 warp tiles (4 warps, 230 registers, 8 warps per SM against
// gemm_body's 16) the 64-row grouped form ran 570-582 against 566 us with the dequantisation after
// the mma and 594 with it between the row tiles' mma; the plain form won with many tiles (2048 x
// 2048 -> 8192: 314 -> 295 us) and lost with few (512 x 4096 -> 2048, 64 tiles: 79 -> 105 us).
// A stage's scale bytes start at row * in / 16 + 4 kt, which `in % 32 == 0` aligns to 2 bytes only:
// one or two 4-byte copies from the aligned word below them (zero-filled past the K extent), recombined.
#define GBF_THREADS 128
#define GBF_RAW (GB_N * ORNITH_GEMM_FP4_RAW_ROW)  // one raw stage: per row 32 code bytes, 2 scale words, a table word
#define GBF_SMEM(BM) (GB_STAGES * (BM) * GB_K + 2 * GB_N * GB_K + GB_STAGES * GBF_RAW)
template <int BM> __device__ __forceinline__ void gemm_nvfp4_body(const OrnithGemmParams &p) {
    static_assert(BM == ORNITH_GROUPED_MID_ROWS || BM == ORNITH_GROUPED_WIDE_ROWS, "moe_sort's tile heights");
    constexpr int MI = BM / 32, RS = GBF_THREADS / 8, CA = BM / RS;  // mma row tiles per warp; rows between a thread's A chunks; chunks
    constexpr int A_BYTES = BM * GB_K, B_BYTES = GB_N * GB_K;
    constexpr int B_OFF = GB_STAGES * A_BYTES, RAW_OFF = B_OFF + 2 * B_BYTES;
    // A raw stage, each part row after row (consecutive threads, consecutive words: no bank
    // conflicts): codes of groups 0-1 and of groups 2-3 (16 bytes each), the two scale words, the
    // table word (table index << 1 | the scale bytes' offset / 2 in the first word).
    constexpr int RAW_SC0 = GB_N * 32, RAW_SC1 = RAW_SC0 + GB_N * 4, RAW_TAB = RAW_SC1 + GB_N * 4;
    static_assert(RAW_TAB + GB_N * 4 == GBF_RAW, "the raw stage's parts fill ORNITH_GEMM_FP4_RAW_ROW bytes per row");
    static_assert(GBF_SMEM(BM) == RAW_OFF + GB_STAGES * GBF_RAW && GBF_SMEM(BM) <= 99 * 1024, "shared memory");
    extern __shared__ __align__(128) uint8_t smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    const int col_tiles = (p.out + GB_N - 1) / GB_N;
    const int total = p.tile_offsets[p.groups] * col_tiles;
    const size_t a_pitch = (size_t)p.a_stride * 2;
    const int kbytes = p.in * 2, ktiles = (kbytes + GB_K - 1) / GB_K;  // 64 weights per stage
    const uint32_t sbase = smem_u32(smem);

    // A's cursor (tile lt, k-tile lk): chunk tid % 8 of rows tid / 8 + RS i, as in gemm_bf16_body,
    // from the source rows (a_rows) of the tile's expert-sorted rows.
    const int ld_row = tid >> 3, ld_kc = (tid & 7) << 4;
    const uint32_t ld_off = swz(ld_row, tid & 7);
    int lt = blockIdx.x, lk = 0;
    uint32_t a_row[CA];  // chunk i's source row
    uint32_t a_ok = 0;   // bit i: chunk i's row is inside the tile's group
    auto set_a_tile = [&](int t) {
        int g, row0, row_end, n0;
        grouped_tile<BM>(p, col_tiles, t, g, row0, row_end, n0);
        a_ok = 0;
#pragma unroll
        for (int i = 0; i < CA; i++) {
            const int gr = row0 + ld_row + RS * i;
            const bool ok = gr < row_end;
            a_ok |= (uint32_t)ok << i;
            a_row[i] = ok ? (p.a_rows ? p.a_rows[gr] : gr) : 0;
        }
    };
    auto issue_a = [&](int stage) {
        if (lt >= total) return;
        const uint32_t sa = sbase + stage * A_BYTES + ld_off;
        const int kb = lk * GB_K;
        const bool kin = kb + ld_kc < kbytes;
#pragma unroll
        for (int i = 0; i < CA; i++) {
            const bool in = kin && ((a_ok >> i) & 1);
            cp_async16(sa + RS * GB_K * i, in ? (const uint8_t *)p.a + (size_t)a_row[i] * a_pitch + ld_kc + kb : p.a, in ? 16 : 0);
        }
        if (++lk == ktiles) {
            lk = 0;
            lt += gridDim.x;
            if (lt < total) set_a_tile(lt);
        }
    };

    // The raw cursor (tile rt, k-tile rk), one (tile, k-tile) pair ahead of A's: this thread's
    // output row n0 + tid of the tile — its codes, scale bytes and scale table.
    int rt = blockIdx.x, rk = 0;
    const uint8_t *c_src = nullptr, *s_src = nullptr;
    uint32_t r_tab = 0;
    bool r_ok = false;
    auto set_raw_tile = [&](int t) {
        int g, row0, row_end, n0;
        grouped_tile<BM>(p, col_tiles, t, g, row0, row_end, n0);
        const int o = n0 + tid;
        r_ok = o < p.out;
        const size_t row = (size_t)g * p.out + (r_ok ? o : 0);
        c_src = (const uint8_t *)p.w + row * (p.in / 2);
        s_src = p.w_group_scale + row * (p.in / 16);
        r_tab = (uint32_t)(g * (p.out / p.tab_rows) + (r_ok ? o : 0) / p.tab_rows);
    };
    auto raw_word = [&](int buf, int part) -> uint32_t & {
        return *reinterpret_cast<uint32_t *>(smem + RAW_OFF + buf * GBF_RAW + part + tid * 4);
    };
    auto issue_raw = [&](int buf) {
        if (rt >= total) {  // table 0 for the dequantisation past the last pair (its result unread)
            raw_word(buf, RAW_TAB) = 0u;
            return;
        }
        const uint32_t dr = sbase + RAW_OFF + buf * GBF_RAW;
        const int k0 = rk * 64;                              // the stage's first weight
        const int nb = r_ok ? min(4, (p.in - k0) >> 4) : 0;  // its groups inside the row: 4, 2 or 0
#pragma unroll
        for (int j = 0; j < 2; j++) {  // codes of groups 2j, 2j + 1; zeros past K (code 0, scale 0: weight 0)
            const bool in = nb > 2 * j;
            cp_async16(dr + j * GB_N * 16 + tid * 16, in ? c_src + k0 / 2 + 16 * j : p.w, in ? 16 : 0);
        }
        const uint8_t *sa = s_src + rk * 4;
        const int off = (int)((uintptr_t)sa & 3);  // 0 or 2
        cp_async4(dr + RAW_SC0 + tid * 4, sa - off, nb ? min(4, off + nb) : 0);
        // With off = 2 the second word's bytes 0-1 are groups 2-3: zeros when they are past K (a
        // stale byte could be a NaN scale, and NaN x 0 would reach the sums).
        if (off) cp_async4(dr + RAW_SC1 + tid * 4, off + nb > 4 ? sa - off + 4 : sa - off, max(0, off + nb - 4));
        raw_word(buf, RAW_TAB) = r_tab << 1 | (uint32_t)(off >> 1);
        if (++rk == ktiles) {
            rk = 0;
            rt += gridDim.x;
            if (rt < total) set_raw_tile(rt);
        }
    };
    // Raw stage buf -> B buffer bb: row tid's 64 weights as bf16, chunk i (8 weights) from code
    // word i, group i / 2's scale byte and the row's table.
    auto dequant = [&](int buf, int bb) {
        const uint32_t t = raw_word(buf, RAW_TAB), s0 = raw_word(buf, RAW_SC0);
        const uint32_t sc = (t & 1) ? __byte_perm(s0, raw_word(buf, RAW_SC1), 0x5432) : s0;  // group 0 lowest
        uint8_t *sb = smem + B_OFF + bb * B_BYTES;
#pragma unroll
        for (int jp = 0; jp < 2; jp++) {
            const uint4 c = *reinterpret_cast<const uint4 *>(smem + RAW_OFF + buf * GBF_RAW + jp * GB_N * 16 + tid * 16);
            const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int j = 2 * jp + h;
                const Fp4Lut l = fp4_entry(p.w_tab, (t >> 1) * 256 + ((sc >> (8 * j)) & 0xFFu));
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    uint32_t q[4];
                    fp4_word(w[2 * h + e], l, q);
                    *reinterpret_cast<uint4 *>(sb + swz(tid, 2 * j + e)) = make_uint4(q[0], q[1], q[2], q[3]);
                }
            }
        }
    };

    float acc[MI][8][4];
    zero_frags(acc);
    if (blockIdx.x >= total) return;
    set_a_tile(lt);
    set_raw_tile(rt);
    // Commit group j: A of pair j and the raw bytes of pair j + 1 (group 0 also pair 0's).
    issue_a(0);
    issue_raw(0);
    issue_raw(1);
    cp_commit();
    issue_a(1);
    issue_raw(2);
    cp_commit();
    cp_wait<1>();
    __syncthreads();  // (orders the wait before dequant's loads for the compiler: cp_wait has no memory clobber)
    dequant(0, 0);
    int ct = blockIdx.x, ck = 0, stage = 0, bb = 0;  // the compute cursor: tile, k-tile, A and raw buffer, B buffer
    while (ct < total) {
        cp_wait<GB_STAGES - 2>();  // group of this pair: its A, the next pair's raw bytes
        __syncthreads();           // B[bb] stored by every thread; A, B and raw buffers read before are free
        issue_a(stage == 0 ? GB_STAGES - 1 : stage - 1);
        issue_raw(stage);  // pair + 3 into the buffer of pair, dequantised in the previous iteration
        cp_commit();
        const uint32_t sa = sbase + stage * A_BYTES, sb = sbase + B_OFF + bb * B_BYTES;
        bf16_stage_x64(sa, sb, wm, wn, lane, acc);
        // The next pair's weights (landed with this pair's group) into the other B buffer; past the
        // block's last pair this writes a buffer nobody reads (issue_raw left a valid table).
        stage = stage == GB_STAGES - 1 ? 0 : stage + 1;
        bb ^= 1;
        dequant(stage, bb);
        if (++ck < ktiles) continue;
        int g, row0, row_end, n0;
        grouped_tile<BM>(p, col_tiles, ct, g, row0, row_end, n0);
        store_x64(p, acc, row0, row_end, n0, wm, wn, lane);
        zero_frags(acc);
        ck = 0;
        ct += gridDim.x;
    }
    cp_wait<0>();
}

// Blocks per SM each kernel is built for (the second __launch_bounds__ argument; the launcher sizes
// the persistent grid from the occupancy the driver reports): two for the 64-row tiles (within 128
// registers, no spills), one for gemm_body's 128-row tiles, two for the 4-warp blocks of gemm_bf16
// (255 registers), gemm_fp8_grouped (206), gemm_nvfp4_grouped_96 and _128 (255): two fit the
// shared memory of sm_90, one that of sm_121.
extern "C" __global__ void __launch_bounds__(GB_THREADS, 1) gemm_fp8(const OrnithGemmParams p) { pdl_entry(); gemm_body<true, ORNITH_GEMM_N>(p); }
extern "C" __global__ void __launch_bounds__(GBB_THREADS, 2) gemm_bf16(const OrnithGemmParams p) { pdl_entry(); gemm_bf16_body(p); }
// The grouped FP8 MoE GEMM (p.group_offsets set) in 64- and 96-row tiles (p.tile_offsets:
// moe_sort's first or second prefix).
extern "C" __global__ void __launch_bounds__(GBG_THREADS, 2) gemm_fp8_grouped(const OrnithGemmParams p) { pdl_entry(); gemm_fp8_grouped_body<ORNITH_GROUPED_ROWS>(p); }
extern "C" __global__ void __launch_bounds__(GBG_THREADS, 2) gemm_fp8_grouped_96(const OrnithGemmParams p) { pdl_entry(); gemm_fp8_grouped_body<ORNITH_GROUPED_MID_ROWS>(p); }
// NVFP4A16 weights, bf16 activations: plain (128-row tiles) and grouped (64-row tiles) in gemm_body.
extern "C" __global__ void __launch_bounds__(GB_THREADS, 1) gemm_nvfp4(const OrnithGemmParams p) { pdl_entry(); gemm_body<false, ORNITH_GEMM_N, true>(p); }
extern "C" __global__ void __launch_bounds__(GB_THREADS, 2) gemm_nvfp4_grouped(const OrnithGemmParams p) { pdl_entry(); gemm_body<false, GB_GROUPED_M, true>(p); }
// The grouped NVFP4 GEMM in 96- and 128-row tiles (p.tile_offsets: moe_sort's second or third prefix).
extern "C" __global__ void __launch_bounds__(GBF_THREADS, 2) gemm_nvfp4_grouped_96(const OrnithGemmParams p) { pdl_entry(); gemm_nvfp4_body<ORNITH_GROUPED_MID_ROWS>(p); }
extern "C" __global__ void __launch_bounds__(GBF_THREADS, 2) gemm_nvfp4_grouped_128(const OrnithGemmParams p) { pdl_entry(); gemm_nvfp4_body<ORNITH_GROUPED_WIDE_ROWS>(p); }

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
    float amax = 0.f;
    for (int i = threadIdx.x; i < p.cols; i += blockDim.x) amax = amax_add(amax, bf2f(x[i]));
    amax = block_max_nan(amax, sh);  // a NaN in the row: the NaN scale, so every code 0x7F (quant_e4m3)
    const float scale = act_scale(amax);
    if (threadIdx.x == 0) p.scale[t] = scale;
    for (int i = threadIdx.x; i < p.cols; i += blockDim.x) p.q8[(size_t)t * p.cols + i] = quant_e4m3(bf2f(x[i]), scale);
}
