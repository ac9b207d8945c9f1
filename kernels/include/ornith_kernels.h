/* Ornith kernels: parameter structs shared by the CUDA C sources and the Rust launchers.
 *
 * Plain C (no CUDA headers) so that bindgen can bind it. Element types:
 *   bf16 values travel as uint16_t bit patterns, FP8 E4M3 codes as uint8_t,
 *   scales and recurrent states as float, indices as int32_t.
 * Every kernel takes exactly one of these structs by value. Matrices are row-major;
 * a Linear weight is [out, in] as in the checkpoint.
 */
#ifndef ORNITH_KERNELS_H
#define ORNITH_KERNELS_H
#include <stdint.h>

/* FP8 E4M3 largest finite value: per-token activation scale = amax / 448. */
#define ORNITH_FP8_MAX 448.0f

/* Paged K/V: a cache is [blocks][ORNITH_KV_BLOCK][kv_heads][head_dim] bf16 and a sequence's
 * block table `table` (int32) maps position p to cache row table[p / ORNITH_KV_BLOCK] *
 * ORNITH_KV_BLOCK + p % ORNITH_KV_BLOCK (ornith-runtime's graph::KV_BLOCK). */
#define ORNITH_KV_BLOCK 256

/* out[t, :] = table[ids[t], :]  (bf16 rows of width `hidden`). */
typedef struct OrnithEmbedParams {
    const int32_t *ids;
    const uint16_t *table;
    uint16_t *out;
    int32_t tokens;
    int32_t hidden;
    int32_t vocab;
} OrnithEmbedParams;

/* Fused residual add + zero-centred RMSNorm (+ optional per-token FP8 quantisation).
 *   if add != NULL:  residual[t] = bf16(residual[t] + add[t])       (in place)
 *   y[t]  = bf16( r * rsqrt(mean(r^2) + eps) * (1 + w) ),  r = float(residual[t]), fp32 inside
 *   if out != NULL:  out[t] = y[t]
 *   if q8  != NULL:  scale[t] = amax|y[t]| / 448;  q8[t, i] = e4m3(y[t, i] / scale[t])  (RNE, saturating) */
typedef struct OrnithRmsNormParams {
    uint16_t *residual;
    const uint16_t *add;
    const uint16_t *weight;
    uint16_t *out;
    uint8_t *q8;
    float *scale;
    int32_t tokens;
    int32_t hidden;
    float eps;
} OrnithRmsNormParams;

/* Per-token FP8 quantisation of bf16 rows: scale[t] = amax/448, q8 = e4m3(x / scale). */
typedef struct OrnithQuantParams {
    const uint16_t *x;
    uint8_t *q8;
    float *scale;
    int32_t tokens;
    int32_t cols;
} OrnithQuantParams;

/* Decode products for any number of tokens (gemv.cu; a prefill chunk of up to
 * ORNITH_GEMV_MAX_TOKENS rows also takes them, a longer one the prefill GEMM).
 * BF16:  y[t, o] = bf16( sum_i x[t, i] * w[o, i] ), fp32 accumulation.
 * FP8:   y[t, o] = bf16( (sum_i e4m3(xq[t, i]) * e4m3(w[o, i])) * xs[t] * ws[o] ).
 * `x_stride`/`y_stride` are row strides in elements; `in` must be a multiple of 16. */
#define ORNITH_GEMV_MAX_TOKENS 8
/* The staged build's tokens per launch (a larger group takes several launches) and its workspace:
 * ks * out <= ORNITH_WIDE_SPLIT_ROWS for every split product (ks > 1; gemv_tc_ksplit stops at
 * 2 * TC_TARGET_WARPS warps of 16 rows), so the partials of one launch fit
 * ORNITH_WIDE_SPLIT_ROWS * ORNITH_WIDE_TOKENS floats; at most ORNITH_WIDE_TICKETS row tiles of
 * 128 rows carry a counter. */
#define ORNITH_WIDE_TOKENS 64
/* Activation bytes per token of one shared-memory chunk of the staged build; two chunks at a row
 * stride of ORNITH_WIDE_XC + 64 bytes make its dynamic shared memory (ORNITH_WIDE_SMEM). */
#define ORNITH_WIDE_XC 512
#define ORNITH_WIDE_SMEM (2 * ORNITH_WIDE_TOKENS * (ORNITH_WIDE_XC + 64))
#define ORNITH_WIDE_SPLIT_ROWS 65536
#define ORNITH_WIDE_TICKETS 1024
/* The norm prologue of a decode product (weight != NULL; one decode row, ORNITH_NORM_ROWS):
 * instead of reading x (BF16) or xq / xs (FP8), every block computes its input row as
 * rmsnorm_residual would write it (out, or q8 / scale), from the residual row `res` plus the
 * pending delta `add` (NULL: none), into shared memory, with rmsnorm_residual's arithmetic
 * (common.cuh's rms_* steps in the same order: the same bits). Nothing is written to `res`:
 * the layer's writer of the next delta folds `add` into it (`fold` below, moe_combine's). */
#define ORNITH_NORM_ROWS 1
/* The largest row the prologue normalises (8 elements per thread of its 256). */
#define ORNITH_NORM_MAX_HIDDEN 2048
typedef struct OrnithNormIn {
    const uint16_t *res;
    const uint16_t *add;
    const uint16_t *weight;
    float eps;
} OrnithNormIn;
typedef struct OrnithGemvBf16Params {
    const uint16_t *x;
    const uint16_t *w;
    uint16_t *y;
    int32_t tokens;
    int32_t in;
    int32_t out;
    int32_t x_stride;
    int32_t y_stride;
    /* Rows the K split is chosen for (gemv_tc_ksplit): the whole stored matrix when this launch
     * covers some of its rows (attention's q, k, v parts of the fused [q; k; v]), so each part's
     * bits are those of the one launch over the whole matrix; 0 means `out`. */
    int32_t split_out;
    OrnithNormIn norm;
    /* Residual fold (non-NULL; y is the pending delta): before writing y[t, o] the kernel sets
     * fold[t * y_stride + o] = bf16(fold + y_old[t, o]), rmsnorm_residual's add. */
    uint16_t *fold;
    /* The staged build only (gemv_*_staged, up to ORNITH_WIDE_TOKENS tokens, grid (row tiles,
     * ks)): the K slices' fp32 partial sums [ks][tokens][out] and one arrival counter per row
     * tile (zero between launches: the last block of a tile resets it). See gemv.cu. */
    float *wide_part;
    uint32_t *wide_ticket;
} OrnithGemvBf16Params;

typedef struct OrnithGemvFp8Params {
    const uint8_t *xq;
    const float *xs;
    const uint8_t *w;
    const float *ws;
    uint16_t *y;
    int32_t tokens;
    int32_t in;
    int32_t out;
    int32_t x_stride;
    int32_t y_stride;
    /* Rows the K split is chosen for (gemv_tc_ksplit): the whole stored matrix when this launch
     * covers some of its rows (attention's q, k, v parts of the fused [q; k; v]), so each part's
     * bits are those of the one launch over the whole matrix; 0 means `out`. */
    int32_t split_out;
    OrnithNormIn norm; /* as OrnithGemvBf16Params (FP8: the quantised row, per-row scale) */
    uint16_t *fold;
    float *wide_part; /* as OrnithGemvBf16Params */
    uint32_t *wide_ticket;
    /* gemv_fp8_quant: the one bf16 row (in elements) every block quantises itself as
     * quantize_fp8_rows does (xq, xs and norm unused). */
    const uint16_t *xb;
} OrnithGemvFp8Params;

/* MoE router: logits [tokens, logit_stride] bf16 (first `experts` columns are the router).
 *   p = softmax(float(logits)); top-`top_k` (descending, ties to the lower index);
 *   w = bf16(p_j / sum_top p)  stored as float;  idx [tokens, top_k]. */
typedef struct OrnithRouterParams {
    const uint16_t *logits;
    int32_t *idx;
    float *weight;
    int32_t tokens;
    int32_t experts;
    int32_t top_k;
    int32_t logit_stride;
} OrnithRouterParams;

/* MoE combine for each token t (ys = expert outputs [tokens, top_k + 1, hidden] bf16):
 *   routed = bf16( sum_j float(bf16(ys[t, j] * bf16(w[t, j]))) )       (fp32 sum, one rounding)
 *   shared = bf16( bf16(sigmoid(gate_logit[t * gate_stride])) * ys[t, top_k] )
 *   moe    = bf16( routed + shared )
 *   out[t] = moe  (the residual add is done by the next RMSNorm kernel). */
typedef struct OrnithMoeCombineParams {
    const uint16_t *ys;
    const float *weight;
    const uint16_t *gate_logit;
    uint16_t *out;
    int32_t tokens;
    int32_t top_k;
    int32_t hidden;
    int32_t gate_stride;
    /* Residual fold (non-NULL): before writing out[t, c], fold[t * hidden + c] =
     * bf16(fold + out_old[t, c]), as OrnithGemvBf16Params.fold. */
    uint16_t *fold;
} OrnithMoeCombineParams;

/* MoE expert GEMV over `slots` = top_k routed slots + 1 shared slot, per token.
 * Slot j < top_k uses expert e = idx[t, j]: weights w + e * out * in, scales ws + e * out;
 * slot top_k uses the shared expert (shared_w, shared_ws).
 * Activation of (t, j): xq + t * x_tok_stride + j * x_slot_stride (x_slot_stride 0: shared input),
 * scale xs[t * xs_tok_stride + j * xs_slot_stride].  y[(t * slots + j) * out + o] bf16. */
typedef struct OrnithMoeGemvParams {
    const uint8_t *xq;
    const float *xs;
    const int32_t *idx;
    const uint8_t *w;
    const float *ws;
    const uint8_t *shared_w;
    const float *shared_ws;
    uint16_t *y;
    int32_t tokens;
    int32_t top_k;
    int32_t experts;
    int32_t in;
    int32_t out;
    int32_t x_tok_stride;
    int32_t x_slot_stride;
    int32_t xs_tok_stride;
    int32_t xs_slot_stride;
    /* moe_gemv_grouped only (moe_sort's outputs): each block row's expert and range of row_assign
     * (row_info), and the assignment (token * top_k + slot) of each sorted row. */
    const int32_t *row_info;
    const int32_t *row_assign;
    /* moe_gemv_fp8 only: token t's quantised input computed in the prologue (OrnithNormIn; the
     * grid's z is the token), instead of read from xq / xs. */
    OrnithNormIn norm;
    /* The down product's per-slot form only (moe_gemv_fp8_swiglu): (token t, slot)'s input
     * computed in the prologue from its gate|up row gate_up[(t * (top_k + 1) + slot) * 2 * in ..]
     * (SwiGLU + per-row FP8 exactly as swiglu_quant), instead of read from xq / xs. */
    const uint16_t *gate_up;
    /* The per-slot down product with the SwiGLU prologue only: with combine.out non-NULL the
     * block also runs moe_combine's epilogue (OrnithMoeCombineParams, combine.ys = y): the last
     * of the top_k + 1 slot blocks of token t and block column x to finish (a counter per pair at
     * ticket[t * gridDim.x + x], zero between launches; the launcher sets it) combines the
     * column's rows of token t, the same arithmetic as moe_combine. */
    OrnithMoeCombineParams combine;
    uint32_t *ticket;
} OrnithMoeGemvParams;

/* SwiGLU of gate_up rows + FP8 quantisation, one row of `inter` per (t, slot):
 *   g = gu[r, 0:inter], u = gu[r, inter:2*inter]
 *   a = bf16( bf16(silu(g)) * u );  scale[r] = amax|a| / 448;  q8[r] = e4m3(a / scale[r]) */
/* The largest expert row swiglu_quant and the SwiGLU prologue take (4 elements per thread of 256). */
#define ORNITH_SWIGLU_MAX_INTER 1024
typedef struct OrnithSwigluQuantParams {
    const uint16_t *gate_up;
    uint8_t *q8;
    float *scale;
    int32_t rows;
    int32_t inter;
} OrnithSwigluQuantParams;

/* Causal depthwise conv1d (kernel 4) + SiLU with state, tokens processed in order.
 *   x [tokens, x_stride] bf16 (first `channels` columns), w [channels, 4] bf16,
 *   state [3, channels] bf16: the last 3 pre-conv inputs, oldest first (zeros at sequence start).
 *   y[t, c] = bf16(silu(float(bf16( sum_j w[c, j] * win[j] )))),  win = (state[0..3], x[t])
 * Per-row sequences (conv1d_silu only, slot != NULL, grid y = tokens): token t is the next token
 * of its own sequence, whose state is state + slot[t] * state_stride (slots distinct). */
typedef struct OrnithConvParams {
    const uint16_t *x;
    const uint16_t *w;
    uint16_t *state;
    uint16_t *y;
    int32_t tokens;
    int32_t channels;
    int32_t x_stride;
    const int32_t *slot;
    int32_t state_stride;
} OrnithConvParams;

/* Gated delta rule, recurrent form, tokens processed in order (decode: tokens = 1).
 * qkv [tokens, qkv_stride] bf16 = conv output: q heads at 0, k heads at k_heads*dk, v at 2*k_heads*dk.
 * b, a [tokens, ba_stride] bf16 (v_heads columns each, a at column offset a_offset).
 * beta = bf16(sigmoid(b)),  g = -exp(A_log) * softplus(float(a) + float(dt_bias)).
 * q = l2norm(q) * dk^-0.5, k = l2norm(k) (fp32, eps 1e-6 inside the sqrt); v-head h uses k-head h / (v_heads/k_heads).
 * state [v_heads, dk, dv] fp32 updated in place; o [tokens, v_heads, dv] bf16. dk = dv = 128.
 * work: fp32 workspace of the two-phase chunked form (gdn_chunk_prep writes, gdn_chunk_scan reads):
 * v_heads * ceil(tokens / 64) * ORNITH_GDN_WORK_PER_CHUNK floats; unused (may be null) elsewhere.
 * Per-row sequences (gdn_recurrent only, slot != NULL, grid z = tokens): token t is the next token
 * of its own sequence, whose state is state + slot[t] * state_stride (slots distinct). */
#define ORNITH_GDN_WORK_PER_CHUNK 8832
typedef struct OrnithGdnParams {
    const uint16_t *qkv;
    const uint16_t *ba;
    const float *a_log;
    const uint16_t *dt_bias;
    float *state;
    uint16_t *o;
    int32_t tokens;
    int32_t k_heads;
    int32_t v_heads;
    int32_t qkv_stride;
    int32_t ba_stride;
    int32_t a_offset;
    float *work;
    const int32_t *slot;
    int32_t state_stride;
} OrnithGdnParams;

/* Gated RMSNorm per (t, head) over `dim`:
 *   n = bf16(float(o) * rsqrt(mean(float(o)^2) + eps));  n = bf16(w * n);
 *   y = bf16(float(n) * silu(float(z)))    (z [tokens, z_stride]) */
typedef struct OrnithGatedNormParams {
    const uint16_t *o;
    const uint16_t *z;
    const uint16_t *weight;
    uint16_t *y;
    int32_t tokens;
    int32_t heads;
    int32_t dim;
    int32_t z_stride;
    float eps;
} OrnithGatedNormParams;

/* The GDN output projection of a decode group with its gated RMSNorm (gemv.cu: gdn_out_proj and
 * gdn_out_reduce), for heads of ORNITH_GDN_OUT_DIM values (in = heads * ORNITH_GDN_OUT_DIM):
 *   g[t, h, :] = the gated RMSNorm of o[t, h, :] with z[t, h, :] and norm_w, exactly as
 *                OrnithGatedNormParams (the same bits);
 *   part[h][t][r] = sum_i g[t, h, i] * w[r, h * dim + i]   (fp32, one K slice per head);
 *   y[t, r] = bf16(((part[0] + part[1]) + part[2]) + ...)  (heads in order; `fold` as
 *             OrnithGemvBf16Params: fold = bf16(fold + y_old) first).
 * Grid (ceil(out / 128), heads), tokens <= ORNITH_WIDE_TOKENS per launch; part holds
 * heads * tokens * out floats (the staged build's partials). With `ticket` (one zeroed counter per
 * 128-row tile; tokens <= ORNITH_GDN_OUT_TICKET_TOKENS) the last block of each tile to arrive adds
 * the heads and stores; without (NULL), gdn_out_reduce does, one thread per (t, r): the same adds
 * in the same order either way. */
#define ORNITH_GDN_OUT_DIM 128
#define ORNITH_GDN_OUT_TICKET_TOKENS 2
typedef struct OrnithGdnOutParams {
    const uint16_t *o;
    const uint16_t *z;
    const uint16_t *norm_w;
    const uint16_t *w;
    uint16_t *y;
    uint16_t *fold;
    float *part;
    uint32_t *ticket;
    int32_t tokens;
    int32_t heads;
    int32_t out;
    int32_t o_stride;
    int32_t z_stride;
    int32_t y_stride;
    float eps;
} OrnithGdnOutParams;

/* q/k RMSNorm (zero-centred, fp32 inside) + partial rotate-half RoPE, and paged KV-cache write.
 * qg [tokens, q_heads, 2*head_dim] (query | gate per head), k, v [tokens, kv_heads * head_dim].
 * Token t sits at position pos = pos0 + t of the sequence whose block table is `table`, or, when
 * pos_dev is non-null (per-row sequences: a decode group, positions on the device so that a
 * captured graph replays without re-capture), at pos = pos_dev[t] with block table
 * table + t * table_stride.  cos/sin = bf16(cos/sin(float(pos) * inv_freq[i % (rot/2)])),
 * inv_freq[i] = 1 / theta^(2i/rot); x' = bf16(bf16(x*cos) + bf16(rot_half(x)*sin)) on the first `rot` dims.
 * Writes q_out [tokens, q_heads, head_dim]; k_cache/v_cache (paged, ORNITH_KV_BLOCK) at pos. */
typedef struct OrnithQkRopeParams {
    const uint16_t *qg;
    const uint16_t *k;
    const uint16_t *v;
    const uint16_t *q_norm;
    const uint16_t *k_norm;
    uint16_t *q_out;
    uint16_t *k_cache;
    uint16_t *v_cache;
    int32_t tokens;
    int32_t pos0;
    int32_t q_heads;
    int32_t kv_heads;
    int32_t head_dim;
    int32_t rot;
    float theta;
    float eps;
    const int32_t *pos_dev;
    const int32_t *table;
    int32_t table_stride;
} OrnithQkRopeParams;

/* Causal attention over the paged bf16 KV cache, split along the sequence (flash-decoding).
 * Token t at position pos (pos0 + t through `table`, or pos_dev[t] through table + t * table_stride
 * as in OrnithQkRopeParams) attends keys 0..pos. q [tokens, q_heads, head_dim] (head_dim 256).
 * Pass 1 (split): each work item (t, pair of kv heads, split) writes, for every q head of the two
 * kv heads' groups, m, l and unnormalised o[head_dim] (fp32) to part_* (index
 * (t * q_heads + h) * splits + s).
 * Pass 2 (combine): o = sum of rescaled partials / l;  out = bf16( bf16(o) * bf16(sigmoid(gate)) ),
 * gate = qg[t, h, head_dim:2*head_dim]. out [tokens, q_heads * head_dim]. tokens <= ORNITH_ATT_MAX_ROWS
 * (one per thread of the split kernel's per-row set-up).
 * Split layout: split s covers keys s*split_len .. (s+1)*split_len; row t has
 * ceil((pos_t + 1) / split_len) of them (`splits` is the partials' stride, at least that many).
 * Device-position form (pos_dev non-null, per-row sequences, for captured decode graphs): row t's
 * split_len = max(ceil((pos_dev[t] + 1) / splits), min_split) is computed on the device from that
 * row's own position only (the host's `split_for` formula). The split kernel's grid is any size
 * (block b takes items b, b + gridDim.x, ...), so neither the grid nor the other rows change a
 * row's bits.
 * The combine's grid is (q_heads, tokens, ORNITH_ATT_COMBINE_CHUNKS): each block merges one chunk of
 * head_dim / ORNITH_ATT_COMBINE_CHUNKS dimensions of one (row, head). */
#define ORNITH_ATT_COMBINE_CHUNKS 4
#define ORNITH_ATT_MAX_ROWS 64
typedef struct OrnithAttnParams {
    const uint16_t *q;
    const uint16_t *k_cache;
    const uint16_t *v_cache;
    const uint16_t *qg;
    float *part_o;
    float *part_ml;
    uint16_t *out;
    int32_t tokens;
    int32_t pos0;
    int32_t q_heads;
    int32_t kv_heads;
    int32_t head_dim;
    int32_t split_len;
    int32_t splits;
    float scale;
    const int32_t *pos_dev;
    int32_t min_split;
    const int32_t *table;
    int32_t table_stride;
    /* Non-NULL (an FP8 o_proj): the combine also writes each row's per-token FP8 codes
     * out_q8 [tokens, q_heads * head_dim] and scale out_scale [tokens], as quantize_fp8_rows
     * would from `out` (the same bits): the last of a row's blocks to arrive at ticket[row]
     * (zero between launches; the launcher's) quantises it. */
    uint8_t *out_q8;
    float *out_scale;
    uint32_t *ticket;
} OrnithAttnParams;

/* Greedy sampling: idx[t] = argmax_i float(logits[r, i]) over the first `n` columns of logits row
 * r = logit_row[t] (r = t when logit_row is NULL)
 * (first index among equal maxima, NaN and +-inf never chosen; -1 if no value is finite). */
typedef struct OrnithArgmaxParams {
    const uint16_t *logits;
    int32_t *idx;
    int32_t tokens;
    int32_t n;
    int32_t stride;
    const int32_t *logit_row;
} OrnithArgmaxParams;

/* Sampling one token per row with temperature, min-p, top-k and top-p, exactly as
 * ornith-runtime's `sampling::sample` (integer weights, so the result is bit-identical):
 *   key(v)  16-bit order key of a finite bf16 logit; x = (v - vmax) * inv_t; w = exp_det(x);
 *           W = trunc(w * 2^40) (0 below min-p); a key with W = 0 is never drawn.
 *   top-k   keep keys >= the k-th largest surviving key (with multiplicity);
 *   top-p   keep keys whose surviving mass ranked strictly above them is < top_p * total;
 *   draw    target = mulhi(bits, K), K the kept mass; idx = first kept id (ascending) at which
 *           the running sum of W exceeds target.
 * Four kernels in stream order, grid (blocks, rows) with blocks = ceil(n / ORNITH_SAMPLE_SLICE)
 * except sample_select (grid rows, 1024 threads): sample_prep (zero the row's histogram, block
 * maxima), sample_hist (histogram of surviving keys), sample_select (thresholds), sample_draw
 * (block sums; the last block to finish draws). idx[r] = -1 when row r has no finite logit.
 * When every row has min_p == 0 and 1 <= top_k <= ORNITH_SAMPLE_TOPK_MAX (and blocks *
 * ORNITH_SAMPLE_TOPK_MAX <= ORNITH_SAMPLE_BINS), sample_topk_block (grid (blocks, rows): each
 * block's distinct keys >= its own k-th largest, with counts, in hist; their number in part_max)
 * and sample_select_topk (grid rows, 256 threads) replace the first three: the same sel, drawn
 * the same way (sample.cu states why the lists suffice).
 * Row r reads logits row logit_row[r] (r when logit_row is NULL). */
#define ORNITH_SAMPLE_SLICE 2048
#define ORNITH_SAMPLE_BINS 65536
#define ORNITH_SAMPLE_TOPK_MAX 32
typedef struct OrnithSampleRow {
    float inv_t;   /* 1 / temperature, rounded once on the host */
    float min_p;   /* 0: off */
    float top_p;   /* 1: off */
    uint32_t top_k; /* 0: off */
    uint64_t bits; /* the draw's 64 random bits (sampling::draw_bits(seed, step)) */
} OrnithSampleRow;

typedef struct OrnithSampleParams {
    const uint16_t *logits;     /* [rows, stride] bf16; columns 0..n are candidates */
    const OrnithSampleRow *row; /* [rows] */
    uint32_t *hist;             /* [rows, ORNITH_SAMPLE_BINS] counts (top-k lists: [rows, blocks, TOPK_MAX]) */
    uint32_t *part_max;         /* [rows, blocks] 1 + the block's largest key (0: none); top-k: list lengths */
    uint64_t *part_sum;         /* [rows, blocks] kept mass of each block */
    uint64_t *sel;              /* [rows, 2] kept mass K; threshold key | vmax key << 16 | valid << 32 */
    uint32_t *done;             /* [rows] blocks of sample_draw finished (reset by sample_prep / sample_topk_block) */
    int32_t *idx;               /* [rows] the sampled id, or -1 (no finite logit) */
    int32_t rows;
    int32_t n;
    int32_t stride;
    int32_t blocks;
    const int32_t *logit_row;   /* [rows] logits row of each sampled row, or NULL */
} OrnithSampleParams;

/* Penalties on one logits row before it is sampled, exactly as ornith-runtime's
 * `sampling::penalize`: for entry i (tokens[2i] = id, tokens[2i + 1] = tag: the output count in
 * bits 0..30, bit 31 set when the prompt holds the id) with id < n and a finite logit v:
 *   v = v > 0 ? v * inv_repetition : v * repetition   (when repetition != 1 and the id was seen)
 *   v = v - frequency * count;  v = v - presence      (when count > 0)
 * each one f32 operation, then rounded to bf16 (nearest even) in place. The entries of a row are
 * distinct ids, so no two threads write one logit. Grid ceil(count / 256), 256 threads. */
typedef struct OrnithPenaltyParams {
    uint16_t *logits;        /* the row: n candidate columns */
    const uint32_t *tokens;  /* [count, 2] */
    int32_t count;
    int32_t n;
    float presence;
    float frequency;
    float repetition;
    float inv_repetition;    /* 1 / repetition, rounded once on the host */
} OrnithPenaltyParams;

/* ---- Prefill (many tokens) ---- */

/* One entry of an NVFP4 dequantisation table (see OrnithGemvNvfp4Params): for one E4M3 group
 * scale byte b under the matrix's global scale, the 8 magnitudes v_m = bf16(e2m1(m) * s(b)),
 * m = 0..7, as byte planes: lo0 bytes j = low byte of v_j, lo1 of v_(4+j), hi0 / hi1 the high
 * bytes. 16 bytes, the table 16-byte aligned. */
typedef struct OrnithFp4Entry {
    uint32_t lo0;
    uint32_t lo1;
    uint32_t hi0;
    uint32_t hi1;
} OrnithFp4Entry;


/* Prefill GEMM on tensor cores (mma.sync), tiles of 128 rows x 128 outputs (gemm_fp8, gemm_bf16)
 * or, for the grouped MoE GEMMs (gemm_fp8_grouped, gemm_nvfp4_grouped), 64 rows x 128 outputs.
 *   FP8  (gemm_fp8):  y[r, o] = bf16( (sum_i e4m3(A[r, i]) * e4m3(w[o, i])) * a_scale[A row of r] * w_scale[o] )
 *   BF16 (gemm_bf16): y[r, o] = bf16( sum_i A[r, i] * w[o, i] )          (a_scale, w_scale unused)
 *   NVFP4A16 (gemm_nvfp4, gemm_nvfp4_grouped): y[r, o] = bf16( sum_i A[r, i] * wd[o, i] ), bf16 A and
 *        wd the dequantised weight (OrnithGemvNvfp4Params; w_group_scale, w_tab, tab_rows), dequantised
 *        into the shared-memory tile; in % 16 == 0.
 * fp32 accumulation. A row of output row r: a_rows[r] if a_rows != NULL (gather), else r; A rows
 * are `a_stride` elements apart (16-byte aligned), y rows `y_stride`. `in` % 16 == 0 (FP8) or
 * % 8 == 0 (BF16). w [groups, out, in], w_scale [groups, out].
 * Persistent blocks (1-D grid, any size): block b computes tiles b, b + gridDim.x, ...
 * Plain: group_offsets == NULL, rows 0..rows, ceil(rows/128) x ceil(out/128) tiles.
 * Grouped (MoE experts, gemm_fp8_grouped and the others named _grouped): output rows
 * group_offsets[g]..group_offsets[g+1] use group g's weights; tile_offsets[g] = sum_{g' < g}
 * ceil(count_g' / BM) row tiles of the kernel's BM rows (64; 96 for gemm_nvfp4_grouped_96: pass
 * moe_sort's tile_offsets + groups + 1; 128 for gemm_nvfp4_grouped_128: tile_offsets + 2 (groups + 1)),
 * times ceil(out/128) column tiles. Both arrays have
 * groups + 1 entries and live on the device. A row's sums are the same in either tile height. */
/* Prefill GEMM geometry (gemm.cu): tiles of ORNITH_GEMM_N outputs (and rows, in the plain GEMMs)
 * by ORNITH_GEMM_K bytes of K per stage, ORNITH_GEMM_STAGES cp.async stages of A and weight tiles;
 * the grouped NVFP4 forms' raw weight stage holds ORNITH_GEMM_FP4_RAW_ROW bytes per output row (32
 * code bytes, two scale words, a table word). Their dynamic shared memory is the stages of A and
 * weights (gemm_body, gemm_bf16, gemm_fp8_grouped), or of A, two dequantised weight tiles and the raw
 * stages (gemm_nvfp4_grouped_96 / _128); cuda::gemm::gemm_smem computes it from these. */
#define ORNITH_GEMM_N 128
#define ORNITH_GEMM_K 128
#define ORNITH_GEMM_STAGES 3
#define ORNITH_GEMM_FP4_RAW_ROW (32 + 12)
/* Rows per tile of the grouped GEMMs (moe_sort writes one tile-offset prefix per height):
 * ORNITH_GROUPED_ROWS for gemm_fp8_grouped and gemm_nvfp4_grouped, ORNITH_GROUPED_MID_ROWS for
 * gemm_nvfp4_grouped_96, ORNITH_GROUPED_WIDE_ROWS for gemm_nvfp4_grouped_128. */
#define ORNITH_GROUPED_ROWS 64
#define ORNITH_GROUPED_MID_ROWS 96
#define ORNITH_GROUPED_WIDE_ROWS 128
typedef struct OrnithGemmParams {
    const void *a;
    const float *a_scale;
    const int32_t *a_rows;
    const void *w;
    const float *w_scale;
    uint16_t *y;
    const int32_t *group_offsets;
    const int32_t *tile_offsets;
    int32_t rows;
    int32_t in;
    int32_t out;
    int32_t a_stride;
    int32_t y_stride;
    int32_t groups;
    /* gemm_nvfp4 / gemm_nvfp4_grouped only: `w` holds E2M1 codes [out, in/2] per group, these the
     * E4M3 group scales [out, in/16] per group and the dequantisation tables (OrnithGemvNvfp4Params),
     * group g's at w_tab + g * (out / tab_rows) * 256. */
    const uint8_t *w_group_scale;
    const OrnithFp4Entry *w_tab;
    int32_t tab_rows;
} OrnithGemmParams;

/* MoE prefill: counting sort of the (token, slot) assignments by expert, one block.
 * idx [tokens, top_k] expert ids. Writes group_offsets [experts + 1] (exclusive prefix of counts),
 * tile_offsets [3 (experts + 1)] (prefix of ceil(count / 64), gemm_fp8_grouped's row tiles, then
 * from entry experts + 1 the prefix of ceil(count / 96), gemm_nvfp4_grouped_96's, and from entry
 * 2 (experts + 1) that of ceil(count / 128), gemm_nvfp4_grouped_128's; tokens * top_k < 2^21),
 * row_token [tokens * top_k] (token of each
 * expert-sorted row), row_of [tokens * top_k] (sorted row of assignment t * top_k + j).
 * Rows within one expert are in no particular order (each row is computed independently).
 * With ORNITH_MOE_SORT_STAGE_MIN <= n = tokens * top_k <= ORNITH_MOE_SORT_STAGE_MAX the launcher
 * passes 2 * min(n, ORNITH_MOE_SORT_WINDOW) bytes of dynamic shared memory, and the kernel stages
 * the sorted rows in windows of as many rows as that holds, writing row_token / row_assign in row
 * order; given none, it scatters them directly. */
#define ORNITH_MOE_SORT_STAGE_MIN 2048
#define ORNITH_MOE_SORT_STAGE_MAX 65536
#define ORNITH_MOE_SORT_WINDOW 32768
typedef struct OrnithMoeSortParams {
    const int32_t *idx;
    int32_t *group_offsets;
    int32_t *tile_offsets;
    int32_t *row_token;
    int32_t *row_of;
    /* Optional (null to skip; the grouped decode products'): the assignment of each sorted row,
     * and row_info [min(experts, tokens * top_k)][4] (16-byte aligned): row y < the number of
     * experts with assignments holds the y-th of them in ascending order, e, its first sorted row
     * group_offsets[e] and its count, then 0; every later row 0, 0, 0, 0. */
    int32_t *row_assign;
    int32_t *row_info;
    int32_t tokens;
    int32_t top_k;
    int32_t experts;
} OrnithMoeSortParams;

/* A decode group's router top-k (moe_router_topk's, one warp per token) and moe_sort of the idx it
 * writes (sort.idx = router.idx) in one block of 1,024 threads: router.tokens <= 32. */
typedef struct OrnithMoeRouteParams {
    OrnithRouterParams router;
    OrnithMoeSortParams sort;
} OrnithMoeRouteParams;

/* MoE prefill combine, per token t and column c (ys: expert-sorted down outputs [tokens*top_k, hidden]):
 *   routed = bf16( sum_j float(bf16( ys[row_of[t*top_k + j], c] * weight[t, j] )) )   (slot order, fp32 sum)
 *   shared = bf16( bf16(sigmoid(gate_logit[t * gate_stride])) * shared_y[t, c] )
 *   out[t, c] = bf16( routed + shared ) */
typedef struct OrnithMoeCombinePrefillParams {
    const uint16_t *ys;
    const int32_t *row_of;
    const float *weight;
    const uint16_t *shared_y;
    const uint16_t *gate_logit;
    uint16_t *out;
    int32_t tokens;
    int32_t top_k;
    int32_t hidden;
    int32_t gate_stride;
} OrnithMoeCombinePrefillParams;

/* Causal flash attention for prefill (head_dim 256, GQA), over the paged bf16 KV cache of one sequence.
 * q [tokens, q_heads, 256]; k_cache/v_cache [blocks][ORNITH_KV_BLOCK][kv_heads][256] holding
 * positions 0..pos0+tokens through the block table `table` (see ORNITH_KV_BLOCK).
 * Query t (position pos0 + t), head h, kv head h / (q_heads / kv_heads):
 *   s_j = (q . k_j) * scale (fp32), j <= pos0 + t;  o = sum_j softmax(s)_j v_j  (fp32, P rounded to bf16 for the mma)
 *   out = bf16(o), or if qg != NULL:  out = bf16( bf16(o) * bf16(sigmoid(qg[t, h, 256 + d])) )
 * out [tokens, q_heads * 256]. */
typedef struct OrnithFlashAttnParams {
    const uint16_t *q;
    const uint16_t *k_cache;
    const uint16_t *v_cache;
    const uint16_t *qg;
    uint16_t *out;
    int32_t tokens;
    int32_t pos0;
    int32_t q_heads;
    int32_t kv_heads;
    float scale;
    const int32_t *table;
} OrnithFlashAttnParams;


/* NVFP4A16 weights (compressed-tensors nvfp4-pack-quantized), BF16 activations. A Linear [out, in]:
 * `w` U8 [out, in/2], two E2M1 codes per byte (column 2j in the low nibble), `ws` E4M3 [out, in/16]
 * group scales, and `tab` the dequantisation table (OrnithFp4Entry[256]) of each global scale gs_k
 * of the matrix, built from the group scale s_k(b) = f32(e4m3(b)) / gs_k (one f32 division):
 *   tab[k * 256 + b] = the byte planes of bf16(e2m1(m) * s_k(b)), m = 0..7   (cuda::nvfp4::fp4_table)
 * table k serving rows k * tab_rows .. (k + 1) * tab_rows - 1 (one Linear: tab_rows = out; a fused
 * gate|up: tab_rows = inter, table 0 the gate's, 1 the up's). One weight is
 *   wd[o, i] = bf16( e2m1(code[o, i]) * s_k(ws[o, i / 16]) ),  k = o / tab_rows   (f32 product, RNE),
 * its magnitude looked up in tab[k * 256 + ws[o, i / 16]] and its sign (code bit 3) applied,
 * bit-identical to compressed-tensors' decompressor (model_spec::nvfp4).
 * Dequantise (nvfp4_dequant):  y[o, i] = wd[o, i]  (bf16 [out, in]; x, tokens, strides unused).
 * Decode product (gemv_nvfp4, gemv_nvfp4_wide): y[t, o] = bf16( sum_i x[t, i] * wd[o, i] ), fp32
 *   accumulation on tensor cores, any number of tokens; in % 32 == 0, tab_rows % 16 == 0;
 *   x_stride / y_stride row strides in elements (x rows 16-byte aligned). gemv_nvfp4_norm: the
 *   same product of one row whose x is the norm prologue's row (norm below). */
typedef struct OrnithGemvNvfp4Params {
    const uint16_t *x;
    const uint8_t *w;
    const uint8_t *ws;
    const OrnithFp4Entry *tab;
    uint16_t *y;
    int32_t tokens;
    int32_t in;
    int32_t out;
    int32_t x_stride;
    int32_t y_stride;
    int32_t tab_rows;
    /* Rows the K split is chosen for (gemv_tc_ksplit): the whole stored matrix when this launch
     * covers some of its rows (attention's q, k, v parts of the fused [q; k; v]), so each part's
     * bits are those of the one launch over the whole matrix; 0 means `out`. */
    int32_t split_out;
    /* gemv_nvfp4_norm only: the norm prologue (one decode row; x unused), as OrnithGemvBf16Params'. */
    OrnithNormIn norm;
    /* Residual fold (non-NULL; y is the pending delta): before writing y[t, o] the kernel sets
     * fold[t * y_stride + o] = bf16(fold + y_old[t, o]), rmsnorm_residual's add (gemv_nvfp4,
     * gemv_nvfp4_norm). */
    uint16_t *fold;
} OrnithGemvNvfp4Params;

/* MoE expert products over NVFP4A16 experts (moe_gemv_nvfp4: one (token, slot) per block;
 * moe_gemv_nvfp4_grouped: grouped by expert, moe_sort's lists), BF16 activations. Slot j < top_k
 * of token t uses expert e = idx[t * top_k + j]: codes w + e * out * in/2, scales ws + e * out * in/16,
 * tables tab + e * (out / tab_rows) * 256; slot top_k the shared expert (shared_w, shared_ws,
 * shared_tab, the same tab_rows). Activation of (t, j): x + t * x_tok_stride + j * x_slot_stride
 * (bf16 elements; x_slot_stride 0: one input per token).
 *   y[(t * (top_k + 1) + j) * out + o] = bf16( sum_i x(t, j)[i] * wd_e[o, i] )
 * in % 32 == 0; the lists as moe_sort writes them (grouped form only). */
typedef struct OrnithMoeGemvNvfp4Params {
    const uint16_t *x;
    const int32_t *idx;
    const uint8_t *w;
    const uint8_t *ws;
    const OrnithFp4Entry *tab;
    const uint8_t *shared_w;
    const uint8_t *shared_ws;
    const OrnithFp4Entry *shared_tab;
    uint16_t *y;
    int32_t tokens;
    int32_t top_k;
    int32_t experts;
    int32_t in;
    int32_t out;
    int32_t x_tok_stride;
    int32_t x_slot_stride;
    int32_t tab_rows;
    const int32_t *row_info;
    const int32_t *row_assign;
    /* The per-slot forms only (the grid's z is the token), the input row computed in the block's
     * prologue instead of read from x: moe_gemv_nvfp4_norm (norm: token t's normalised row, in =
     * hidden, as rmsnorm_residual's bf16 output) or moe_gemv_nvfp4_swiglu (gate_up: (t, slot)'s
     * row gate_up[(t * (top_k + 1) + slot) * 2 * in ..] through SwiGLU, as swiglu_bf16). */
    OrnithNormIn norm;
    const uint16_t *gate_up;
    /* moe_gemv_nvfp4_swiglu only: the combine epilogue, as OrnithMoeGemvParams.combine. */
    OrnithMoeCombineParams combine;
    uint32_t *ticket;
} OrnithMoeGemvNvfp4Params;

/* SwiGLU of gate|up rows into bf16 (the NVFP4A16 experts' BF16 activations):
 *   out[r, i] = bf16( bf16(silu(gu[r, i])) * gu[r, inter + i] ),  gu rows of 2 * inter, out rows of inter. */
typedef struct OrnithSwigluParams {
    const uint16_t *gate_up;
    uint16_t *out;
    int32_t rows;
    int32_t inter;
} OrnithSwigluParams;

#endif
