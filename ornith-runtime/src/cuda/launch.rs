//! The decode kernels' launchers (norm.cu, gemv.cu, moe.cu, gdn.cu, attention.cu, `argmax_bf16`
//! of sample.cu; their math in `kernels/include/ornith_kernels.h`), one per kernel: each takes
//! device addresses and shapes (or the kernel's parameter struct), checks what the kernel
//! assumes, computes grid, block and the bytes it moves, and launches through
//! [`CudaContext::launch`]. The CUDA backend calls them; after them, the slice-based wrappers the
//! kernel tests call, which check buffer lengths (and device-held tables and slots) and convert
//! slices to addresses. bf16 tensors are `CudaSlice<u16>` (bit patterns), FP8 E4M3 codes
//! `CudaSlice<u8>`.
use super::{i32of, need, CudaContext, Launch, Ptr};
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use ornith_kernels::bindings::*;

type Bf = CudaSlice<u16>;

/// Positions per K/V block (`ORNITH_KV_BLOCK`, = `graph::KV_BLOCK`).
const KVB: usize = ORNITH_KV_BLOCK as usize;

/// Dynamic shared memory of `attn_decode_split` (`ATT_SMEM` in attention.cu): two stages of a
/// 16-key K and V tile of two kv heads (2 x 32 KiB) and two slots of an item's 16 query rows
/// (2 x 8 KiB).
pub(crate) const ATT_SPLIT_SMEM: u32 = 2 * 2 * 2 * 16 * 512 + 2 * 16 * 512;
/// Rows (query tokens) of one decode attention launch (`ATT_MAX_ROWS` in attention.cu).
pub const ATT_MAX_ROWS: usize = 8;
/// Most splits the combine merges (`ATT_MAX_SPLITS` in attention.cu).
const ATT_MAX_SPLITS: usize = 1024;
/// Resident `attn_decode_split` blocks per SM its grid is sized for (fewer where the shared
/// memory allows fewer): at long context one row is 256 work items of equal length (a split of
/// both kv heads), which 2 per SM on the H200's 132 SMs take in one round.
pub(crate) const ATT_BLOCKS_PER_SM: u32 = 2;

/// Whether `a` is a multiple of `n` bytes (a kernel's vector loads).
fn aligned(a: Ptr, n: u64) -> bool {
    a.is_multiple_of(n)
}

impl CudaContext {
    /// `out[t] = table[ids[t]]`: rows of `hidden` bf16 (`hidden % 8 == 0`, 16-byte copies).
    pub(crate) fn k_embed(&self, ids: Ptr, table: Ptr, out: Ptr, t: usize, hidden: usize, vocab: usize) -> Result<()> {
        ensure!(t > 0 && hidden > 0 && hidden.is_multiple_of(8), "embed: tokens {t} > 0 and hidden {hidden} % 8 == 0");
        ensure!(aligned(table, 16) && aligned(out, 16), "embed: table and out must be 16-byte aligned");
        let p = OrnithEmbedParams {
            ids: ids as _,
            table: table as _,
            out: out as _,
            tokens: i32of("tokens", t)?,
            hidden: i32of("hidden", hidden)?,
            vocab: i32of("vocab", vocab)?,
        };
        self.launch(Launch::new("embed_gather", (t as u32, 1, 1), 256, (t * hidden * 4 + t * 4) as u64), p)
    }

    /// `residual += add` (if any), then zero-centred RMSNorm of `t` rows of `hidden`
    /// (`0 < hidden <= 8192`) into bf16 `out` and/or FP8 `q8 = (codes, per-row scales)`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_rmsnorm(
        &self,
        residual: Ptr,
        add: Option<Ptr>,
        w: Ptr,
        out: Option<Ptr>,
        q8: Option<(Ptr, Ptr)>,
        t: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        ensure!(t > 0 && hidden > 0 && hidden <= 8192, "rmsnorm: 0 < hidden {hidden} <= 8192");
        ensure!(out.is_some() || q8.is_some(), "rmsnorm: no output requested");
        let mut p = OrnithRmsNormParams {
            residual: residual as _,
            weight: w as _,
            tokens: i32of("tokens", t)?,
            hidden: hidden as i32,
            eps,
            ..Default::default()
        };
        let mut bytes = t * hidden * 4 + hidden * 2;
        if let Some(a) = add {
            p.add = a as _;
            bytes += t * hidden * 4;
        }
        if let Some(o) = out {
            p.out = o as _;
        }
        if let Some((q, s)) = q8 {
            p.q8 = q as _;
            p.scale = s as _;
            bytes += t * (hidden + 4);
        }
        self.launch(Launch::new("rmsnorm_residual", (t as u32, 1, 1), 256, bytes as u64), p)
    }

    /// Per-row FP8 quantisation of `rows` contiguous rows of `cols`, compressed-tensors' form
    /// (`act_scale` / `quant_e4m3` of common.cuh): scale = bf16(amax / 448) (2^-7 if 0),
    /// q8 = e4m3(bf16(x / scale)).
    pub(crate) fn k_quant(&self, x: Ptr, q8: Ptr, scale: Ptr, rows: usize, cols: usize) -> Result<()> {
        ensure!(rows > 0 && cols > 0, "quantize: empty");
        let p = OrnithQuantParams {
            x: x as _,
            q8: q8 as _,
            scale: scale as _,
            tokens: i32of("rows", rows)?,
            cols: i32of("cols", cols)?,
        };
        self.launch(Launch::new("quantize_fp8_rows", (rows as u32, 1, 1), 256, (rows * cols * 3 + rows * 4) as u64), p)
    }

    /// What both tensor-core decode products assume: `in % 16 == 0`, strides covering the rows and
    /// keeping them 16-byte aligned (`align` elements), offsets inside int32.
    #[allow(clippy::too_many_arguments)]
    fn gemv_checks(
        x: Ptr,
        w: Ptr,
        tokens: usize,
        in_: usize,
        out: usize,
        xs: usize,
        ys: usize,
        align: usize,
    ) -> Result<()> {
        // The kernel forms activation offsets as i32 (token * x_stride * element bytes).
        ensure!(tokens >= 1 && tokens * xs * (16 / align) <= i32::MAX as usize, "gemv: {tokens} tokens of stride {xs}");
        ensure!(in_ > 0 && in_.is_multiple_of(16), "gemv: in {in_} must be a positive multiple of 16");
        ensure!(out > 0 && xs >= in_ && ys >= out, "gemv: strides x {xs} >= in {in_}, y {ys} >= out {out}");
        ensure!(xs.is_multiple_of(align), "gemv: x stride {xs} must keep rows 16-byte aligned");
        ensure!(aligned(x, 16) && aligned(w, 16), "gemv: x and w must be 16-byte aligned");
        i32of("gemv out", out)?;
        i32of("gemv y_stride", ys)?;
        Ok(())
    }

    /// `y[t, o] = bf16(Σ_i x[t, i] w[o, i])` for any number of rows (`w` BF16 `[out, in]`; rows of
    /// `x` and `y` at strides `xs`, `ys` elements): the tensor-core decode product, whose K
    /// split depends on the weight's shape only (`gemv_tc_ksplit`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gemv_bf16(
        &self,
        x: Ptr,
        w: Ptr,
        y: Ptr,
        t: usize,
        in_: usize,
        out: usize,
        xs: usize,
        ys: usize,
    ) -> Result<()> {
        Self::gemv_checks(x, w, t, in_, out, xs, ys, 8)?;
        let p = OrnithGemvBf16Params {
            x: x as _,
            w: w as _,
            y: y as _,
            tokens: t as i32,
            in_: in_ as i32,
            out: out as i32,
            x_stride: xs as i32,
            y_stride: ys as i32,
        };
        let bytes = (out * in_ * 2 + t * (in_ + out) * 2) as u64;
        let name = super::gemv_tc_kernel(false, t);
        self.launch(Launch::new(name, (super::gemv_tc_blocks(in_ * 2, out), 1, 1), 256, bytes), p)
    }

    /// FP8 W8A8 decode product for any number of rows:
    /// `y[t, o] = bf16((Σ_i xq[t, i] w[o, i]) · xsc[t] · ws[o])`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gemv_fp8(
        &self,
        xq: Ptr,
        xsc: Ptr,
        w: Ptr,
        ws: Ptr,
        y: Ptr,
        t: usize,
        in_: usize,
        out: usize,
        xs: usize,
        ys: usize,
    ) -> Result<()> {
        Self::gemv_checks(xq, w, t, in_, out, xs, ys, 16)?;
        let p = OrnithGemvFp8Params {
            xq: xq as _,
            xs: xsc as _,
            w: w as _,
            ws: ws as _,
            y: y as _,
            tokens: t as i32,
            in_: in_ as i32,
            out: out as i32,
            x_stride: xs as i32,
            y_stride: ys as i32,
        };
        let bytes = (out * in_ + out * 4 + t * (in_ + 4 + out * 2)) as u64;
        let name = super::gemv_tc_kernel(true, t);
        self.launch(Launch::new(name, (super::gemv_tc_blocks(in_, out), 1, 1), 256, bytes), p)
    }

    /// Router: softmax over `experts` logits (row stride `stride`), top-k, renormalised weights.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_router(
        &self,
        logits: Ptr,
        idx: Ptr,
        weight: Ptr,
        t: usize,
        experts: usize,
        top_k: usize,
        stride: usize,
    ) -> Result<()> {
        ensure!(
            t > 0 && experts <= 256 && (1..=32).contains(&top_k) && top_k <= experts && stride >= experts,
            "router: experts {experts} <= 256, 1 <= top_k {top_k} <= min(32, experts), stride {stride}"
        );
        let p = OrnithRouterParams {
            logits: logits as _,
            idx: idx as _,
            weight: weight as _,
            tokens: i32of("tokens", t)?,
            experts: experts as i32,
            top_k: top_k as i32,
            logit_stride: i32of("router stride", stride)?,
        };
        self.launch(Launch::new("moe_router_topk", (t as u32, 1, 1), 32, (t * (experts * 2 + top_k * 8)) as u64), p)
    }

    /// The expert GEMVs of a decode group (see `OrnithMoeGemvParams`): per (token, slot)
    /// (`moe_gemv_fp8`: grid (tiles, top_k + 1, tokens)), or `grouped` by expert over
    /// `moe_sort`'s groups (`moe_gemv_grouped`, the same bits; one block row per possible active
    /// expert, `min(experts, tokens · top_k)`, plus the shared expert). Bytes count each
    /// (token, slot)'s weight rows once per pair, or each touched expert's once when grouped.
    pub(crate) fn k_moe_gemv(&self, p: OrnithMoeGemvParams, grouped: bool) -> Result<()> {
        ensure!(p.tokens > 0 && p.top_k >= 1 && p.experts >= 1, "moe_gemv: {} tokens, top_k {}", p.tokens, p.top_k);
        let (t, in_, out, k) = (p.tokens as usize, p.in_ as usize, p.out as usize, p.top_k as usize);
        let slots = k + 1;
        ensure!(in_ > 0 && in_.is_multiple_of(16) && out > 0, "moe_gemv: in {in_} % 16, out {out}");
        let (xt, xsl) = (p.x_tok_stride as usize, p.x_slot_stride as usize);
        ensure!(
            p.x_tok_stride >= 0 && p.x_slot_stride >= 0 && xt.is_multiple_of(16) && xsl.is_multiple_of(16),
            "moe_gemv: activation strides must keep 16-byte alignment"
        );
        // The kernel forms activation offsets as i32 (token * x_tok_stride + slot * x_slot_stride).
        ensure!(t * xt + k * xsl <= i32::MAX as usize, "moe_gemv: {t} tokens of stride {xt}");
        let tiles = super::moe_tc_blocks(in_, out);
        if grouped {
            ensure!(
                !p.active_list.is_null()
                    && !p.active_count.is_null()
                    && !p.group_offsets.is_null()
                    && !p.row_assign.is_null(),
                "moe_gemv_grouped needs moe_sort's groups"
            );
            let active = (p.experts as usize).min(t * k);
            let bytes = (active + 1) * (out * in_ + out * 4) + t * slots * (in_ + 4 + out * 2);
            return self.launch(Launch::new("moe_gemv_grouped", (tiles, active as u32 + 1, 1), 256, bytes as u64), p);
        }
        let bytes = t * slots * (out * in_ + out * 4 + in_ + 4 + out * 2);
        self.launch(Launch::new("moe_gemv_fp8", (tiles, slots as u32, t as u32), 256, bytes as u64), p)
    }

    /// `moe_sort` (one block): counting sort of the `tokens · top_k` assignments of `p.idx` by
    /// expert (see `OrnithMoeSortParams`).
    pub(crate) fn k_moe_sort(&self, p: OrnithMoeSortParams) -> Result<()> {
        ensure!(
            p.tokens > 0 && p.top_k > 0 && (1..=1024).contains(&p.experts),
            "moe_sort: {} tokens, top_k {}, {} experts",
            p.tokens,
            p.top_k,
            p.experts
        );
        let n = (p.tokens * p.top_k) as usize;
        self.launch(Launch::new("moe_sort", (1, 1, 1), 1024, (n * 12 + (p.experts as usize + 1) * 8) as u64), p)
    }

    /// `a = bf16(bf16(silu(g)) · u)` per row of `gate_up [rows, 2·inter]`, then FP8 per row
    /// (`inter <= 1024`).
    pub(crate) fn k_swiglu(&self, gu: Ptr, q8: Ptr, scale: Ptr, rows: usize, inter: usize) -> Result<()> {
        ensure!(rows > 0 && inter > 0 && inter <= 1024, "swiglu: 0 < inter {inter} <= 1024");
        let p = OrnithSwigluQuantParams {
            gate_up: gu as _,
            q8: q8 as _,
            scale: scale as _,
            rows: i32of("rows", rows)?,
            inter: inter as i32,
        };
        self.launch(Launch::new("swiglu_quant", (rows as u32, 1, 1), 256, (rows * (inter * 5 + 4)) as u64), p)
    }

    /// `out = bf16(routed + sigmoid-gated shared)`, see `OrnithMoeCombineParams`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_combine(
        &self,
        ys: Ptr,
        weight: Ptr,
        gate: Ptr,
        out: Ptr,
        t: usize,
        top_k: usize,
        hidden: usize,
        gate_stride: usize,
    ) -> Result<()> {
        ensure!(t > 0 && hidden > 0 && top_k > 0, "moe_combine: empty");
        let p = OrnithMoeCombineParams {
            ys: ys as _,
            weight: weight as _,
            gate_logit: gate as _,
            out: out as _,
            tokens: i32of("tokens", t)?,
            top_k: top_k as i32,
            hidden: i32of("hidden", hidden)?,
            gate_stride: i32of("gate stride", gate_stride)?,
        };
        let bytes = t * ((top_k + 2) * hidden * 2 + top_k * 4 + 2);
        self.launch(Launch::new("moe_combine", (hidden.div_ceil(256) as u32, t as u32, 1), 256, bytes as u64), p)
    }

    /// Causal depthwise conv (kernel 4) + SiLU of `t` tokens of one sequence in order (state
    /// `[3, channels]` at `state`), or with `slots = Some((slot, stride))` one token of each of
    /// `t` sequences, token i continuing the state at `state + slot[i] · stride` (one grid row
    /// per token).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_conv(
        &self,
        x: Ptr,
        w: Ptr,
        state: Ptr,
        y: Ptr,
        t: usize,
        channels: usize,
        x_stride: usize,
        slots: Option<(Ptr, usize)>,
    ) -> Result<()> {
        ensure!(
            t > 0 && channels > 0 && x_stride >= channels,
            "conv: tokens {t}, channels {channels}, stride {x_stride}"
        );
        i32of("conv channels * 4", channels * 4)?;
        let p = OrnithConvParams {
            x: x as _,
            w: w as _,
            state: state as _,
            y: y as _,
            tokens: i32of("tokens", t)?,
            channels: channels as i32,
            x_stride: i32of("x_stride", x_stride)?,
            slot: slots.map_or(std::ptr::null(), |s| s.0 as _),
            state_stride: slots.map_or(Ok(0), |s| i32of("conv state stride", s.1))?,
        };
        let rows = if slots.is_some() { t as u32 } else { 1 };
        let bytes = channels * (8 + 12) + t * channels * 4;
        self.launch(Launch::new("conv1d_silu", (channels.div_ceil(256) as u32, rows, 1), 256, bytes as u64), p)
    }

    /// The shape checks of both gated delta rule forms (dk = dv = 128): `p.v_heads` a multiple
    /// of `p.k_heads`, the q|k|v row inside its stride, b then a (`a_offset` after b) inside theirs.
    pub(crate) fn gdn_checks(p: &OrnithGdnParams) -> Result<()> {
        ensure!(
            p.tokens > 0 && p.k_heads > 0 && p.v_heads > 0 && p.v_heads % p.k_heads == 0 && p.v_heads <= 65535,
            "gdn: v_heads {} must be a multiple of k_heads {}",
            p.v_heads,
            p.k_heads
        );
        let width = (2 * p.k_heads + p.v_heads) * 128;
        ensure!(p.qkv_stride >= width, "gdn: qkv stride {} < {width}", p.qkv_stride);
        ensure!(
            p.ba_stride >= p.a_offset + p.v_heads && p.a_offset >= p.v_heads,
            "gdn: b/a layout (a_offset {}, stride {})",
            p.a_offset,
            p.ba_stride
        );
        Ok(())
    }

    /// Recurrent gated delta rule (see `OrnithGdnParams`): `p.tokens` tokens of one sequence, or
    /// with `p.slot` one token of each of `p.tokens` sequences (grid z = tokens; every state is
    /// read and written once).
    pub(crate) fn k_gdn(&self, p: OrnithGdnParams) -> Result<()> {
        Self::gdn_checks(&p)?;
        ensure!(p.slot.is_null() || p.state_stride > 0, "gdn: per-row slots need the state stride");
        let (t, hv, hk) = (p.tokens as usize, p.v_heads as usize, p.k_heads as usize);
        let states = if p.slot.is_null() { 1 } else { t };
        let bytes = states * hv * 128 * 128 * 4 * 2 + t * ((2 * hk * 128 + hv * 128) * 2 + 4 * hv + hv * 128 * 2);
        self.launch(Launch::new("gdn_recurrent", (hv as u32, 4, states as u32), 128, bytes as u64), p)
    }

    /// Gated RMSNorm per (token, head) over `dim <= 128`: `y = rmsnorm(o) · w · silu(z)`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn k_gated_norm(
        &self,
        o: Ptr,
        z: Ptr,
        w: Ptr,
        y: Ptr,
        t: usize,
        heads: usize,
        dim: usize,
        z_stride: usize,
        eps: f32,
    ) -> Result<()> {
        ensure!(
            t > 0 && heads > 0 && dim > 0 && dim <= 128 && z_stride >= heads * dim,
            "gated_rmsnorm: dim {dim} <= 128, z stride {z_stride} >= heads {heads} x dim"
        );
        let p = OrnithGatedNormParams {
            o: o as _,
            z: z as _,
            weight: w as _,
            y: y as _,
            tokens: i32of("tokens", t)?,
            heads: heads as i32,
            dim: dim as i32,
            z_stride: i32of("z stride", z_stride)?,
            eps,
        };
        let bytes = t * heads * dim * 6 + dim * 2;
        self.launch(Launch::new("gated_rmsnorm", ((t * heads) as u32, 1, 1), 128, bytes as u64), p)
    }

    /// q/k norm + partial RoPE + paged K/V write, see `OrnithQkRopeParams` (`head_dim` a
    /// multiple of 32, at most 256; `rot` even, at most `head_dim`).
    pub(crate) fn k_qk_rope(&self, p: OrnithQkRopeParams) -> Result<()> {
        let (t, qh, kvh, d) = (p.tokens as usize, p.q_heads as usize, p.kv_heads as usize, p.head_dim as usize);
        ensure!(
            p.tokens > 0 && p.q_heads > 0 && p.kv_heads > 0 && d.is_multiple_of(32) && d <= 256,
            "qk_rope: head_dim {d} (multiple of 32, <= 256)"
        );
        ensure!(p.rot >= 0 && p.rot % 2 == 0 && p.rot as usize <= d, "qk_rope: rot {} (even, <= head_dim)", p.rot);
        let bytes = t * (qh * d * 2 * 2 + kvh * d * 2 * 4);
        self.launch(Launch::new("qk_norm_rope", ((qh + kvh) as u32, t as u32, 1), d as u32, bytes as u64), p)
    }

    /// The decode attention (`attn_decode_split` then `attn_decode_combine`, see
    /// `OrnithAttnParams` and attention.cu): checks the shape, sizes the split kernel's grid to
    /// the GPU ([`CudaContext::attn_blocks`] blocks at most, each taking every grid-th work
    /// item; the grid never changes a result) and launches both. `keys`: the K/V positions the
    /// rows read in all (the bytes of the profile).
    pub(crate) fn k_attention(&self, p: OrnithAttnParams, keys: usize) -> Result<()> {
        let (t, qh, kvh, splits) = (p.tokens as usize, p.q_heads as usize, p.kv_heads as usize, p.splits as usize);
        ensure!(p.head_dim == 256, "attention: head_dim {} (kernel is written for 256)", p.head_dim);
        ensure!(
            kvh > 0 && qh.is_multiple_of(kvh) && qh / kvh <= 8,
            "attention: q_heads/kv_heads must be an integer <= 8"
        );
        ensure!((1..=ATT_MAX_ROWS).contains(&t), "attention: {t} rows (1..={ATT_MAX_ROWS} per launch)");
        ensure!(
            (1..=ATT_MAX_SPLITS).contains(&splits),
            "attention: {splits} splits (the combine kernel holds at most {ATT_MAX_SPLITS} split weights)"
        );
        // Work items (row, kv-head pair, split): exact in the host form, at most `splits` per row
        // and pair in the device-position form.
        let items = if p.pos_dev.is_null() {
            let sl = p.split_len as usize;
            ensure!(sl > 0, "attention: split length 0");
            let last = p.pos0 as usize + t;
            ensure!(last.div_ceil(sl) <= splits, "attention: {last} keys in {splits} splits of {sl}");
            (1..=t).map(|r| (p.pos0 as usize + r).div_ceil(sl)).sum::<usize>() * kvh.div_ceil(2)
        } else {
            ensure!(p.min_split > 0, "attention: {splits} splits of at least {} keys", p.min_split);
            t * kvh.div_ceil(2) * splits
        };
        let blocks = self.attn_blocks.min(items as u32);
        let kv_bytes = keys * kvh * 256 * 2 * 2;
        self.launch(Launch::new("attn_decode_split", (blocks, 1, 1), 64, kv_bytes as u64).smem(ATT_SPLIT_SMEM), p)?;
        let part = t * qh * splits * (256 + 2) * 4 + t * qh * 256 * 4; // at most
        self.launch(Launch::new("attn_decode_combine", (qh as u32, t as u32, 1), 256, part as u64), p)
    }

    /// Greedy sampling: the argmax of the first `n` columns of `rows` logits rows (row stride
    /// `stride`): row i of `logit_row` (device int32) when given, else row i.
    pub(crate) fn k_argmax(
        &self,
        logits: Ptr,
        idx: Ptr,
        rows: usize,
        n: usize,
        stride: usize,
        logit_row: Option<Ptr>,
    ) -> Result<()> {
        ensure!(rows > 0 && n > 0 && stride >= n, "argmax: n {n}, stride {stride}");
        let p = OrnithArgmaxParams {
            logits: logits as _,
            idx: idx as _,
            tokens: i32of("rows", rows)?,
            n: i32of("n", n)?,
            stride: i32of("stride", stride)?,
            logit_row: logit_row.map_or(std::ptr::null(), |r| r as _),
        };
        self.launch(Launch::new("argmax_bf16", (rows as u32, 1, 1), 1024, (rows * n * 2) as u64), p)
    }
}

// The slice-based wrappers of the launchers above (the kernel tests' entry points): buffer
// lengths against the shapes, device-held positions, tables and slots read back and checked.
impl CudaContext {
    /// Checks a paged K/V launch on the host: row t at `positions[t]` reads blocks
    /// `0 ..= positions[t] / KV_BLOCK` of its table row `table[t · stride ..]` (stride 0: one
    /// table for every row), each inside a cache of `cache_len` elements, `row` per position.
    pub(crate) fn check_paged(
        &self,
        what: &str,
        cache_len: usize,
        row: usize,
        table: &CudaSlice<i32>,
        stride: usize,
        positions: &[usize],
    ) -> Result<()> {
        let blocks = cache_len / (KVB * row);
        let host = self.download(table)?;
        for (t, &p) in positions.iter().enumerate() {
            let (base, need) = (t * stride, p / KVB + 1);
            ensure!(
                base + need <= host.len() && (stride == 0 || need <= stride),
                "{what}: the block table of row {t} holds no block for position {p}"
            );
            if let Some(b) = host[base..base + need].iter().find(|&&b| b < 0 || b as usize >= blocks) {
                anyhow::bail!("{what}: K/V block {b} outside the cache of {blocks} blocks");
            }
        }
        Ok(())
    }

    /// Per-row state slots (host copy of `slots`, `tokens` distinct values inside a pool of
    /// `pool` slots).
    fn check_slots(&self, what: &str, slots: &CudaSlice<i32>, tokens: usize, pool: usize) -> Result<()> {
        need(what, slots, tokens)?;
        let host = self.download(slots)?;
        let mut seen = std::collections::HashSet::new();
        for &s in &host[..tokens] {
            ensure!(
                s >= 0 && (s as usize) < pool && seen.insert(s),
                "{what}: slot {s} repeated or outside the pool of {pool}"
            );
        }
        Ok(())
    }

    /// [`Self::k_embed`] on buffers.
    pub fn embed(
        &self,
        ids: &CudaSlice<i32>,
        table: &Bf,
        out: &mut Bf,
        tokens: usize,
        hidden: usize,
        vocab: usize,
    ) -> Result<()> {
        need("embed ids", ids, tokens)?;
        need("embed table", table, vocab * hidden)?;
        need("embed out", out, tokens * hidden)?;
        self.k_embed(self.addr(ids), self.addr(table), self.addr(out), tokens, hidden, vocab)
    }

    /// [`Self::k_rmsnorm`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_residual(
        &self,
        residual: &mut Bf,
        add: Option<&Bf>,
        weight: &Bf,
        out: Option<&mut Bf>,
        q8: Option<(&mut CudaSlice<u8>, &mut CudaSlice<f32>)>,
        tokens: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        let n = tokens * hidden;
        need("rmsnorm residual", residual, n)?;
        need("rmsnorm weight", weight, hidden)?;
        if let Some(a) = add {
            need("rmsnorm add", a, n)?;
        }
        if let Some(o) = &out {
            need("rmsnorm out", o, n)?;
        }
        if let Some((q, s)) = &q8 {
            need("rmsnorm q8", q, n)?;
            need("rmsnorm scale", s, tokens)?;
        }
        self.k_rmsnorm(
            self.addr(residual),
            add.map(|a| self.addr(a)),
            self.addr(weight),
            out.map(|o| self.addr(o)),
            q8.map(|(q, s)| (self.addr(q), self.addr(s))),
            tokens,
            hidden,
            eps,
        )
    }

    /// [`Self::k_quant`] on buffers.
    pub fn quantize_fp8(
        &self,
        x: &Bf,
        q8: &mut CudaSlice<u8>,
        scale: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        need("quantize x", x, rows * cols)?;
        need("quantize q8", q8, rows * cols)?;
        need("quantize scale", scale, rows)?;
        self.k_quant(self.addr(x), self.addr(q8), self.addr(scale), rows, cols)
    }

    /// [`Self::k_gemv_bf16`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_bf16(
        &self,
        x: &Bf,
        w: &Bf,
        y: &mut Bf,
        tokens: usize,
        in_: usize,
        out: usize,
        x_stride: usize,
        y_stride: usize,
    ) -> Result<()> {
        ensure!(tokens >= 1, "gemv: no tokens");
        need("gemv x", x, (tokens - 1) * x_stride + in_)?;
        need("gemv w", w, out * in_)?;
        need("gemv y", y, (tokens - 1) * y_stride + out)?;
        self.k_gemv_bf16(self.addr(x), self.addr(w), self.addr(y), tokens, in_, out, x_stride, y_stride)
    }

    /// [`Self::k_gemv_fp8`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_fp8(
        &self,
        xq: &CudaSlice<u8>,
        xs: &CudaSlice<f32>,
        w: &CudaSlice<u8>,
        ws: &CudaSlice<f32>,
        y: &mut Bf,
        tokens: usize,
        in_: usize,
        out: usize,
        x_stride: usize,
        y_stride: usize,
    ) -> Result<()> {
        ensure!(tokens >= 1, "gemv_fp8: no tokens");
        need("gemv_fp8 x", xq, (tokens - 1) * x_stride + in_)?;
        need("gemv_fp8 xs", xs, tokens)?;
        need("gemv_fp8 w", w, out * in_)?;
        need("gemv_fp8 ws", ws, out)?;
        need("gemv_fp8 y", y, (tokens - 1) * y_stride + out)?;
        let (a, b, c, d, e) = (self.addr(xq), self.addr(xs), self.addr(w), self.addr(ws), self.addr(y));
        self.k_gemv_fp8(a, b, c, d, e, tokens, in_, out, x_stride, y_stride)
    }

    /// [`Self::k_router`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_router(
        &self,
        logits: &Bf,
        idx: &mut CudaSlice<i32>,
        weight: &mut CudaSlice<f32>,
        tokens: usize,
        experts: usize,
        top_k: usize,
        stride: usize,
    ) -> Result<()> {
        ensure!(tokens > 0, "router: no tokens");
        need("router logits", logits, (tokens - 1) * stride + experts)?;
        need("router idx", idx, tokens * top_k)?;
        need("router weight", weight, tokens * top_k)?;
        self.k_router(self.addr(logits), self.addr(idx), self.addr(weight), tokens, experts, top_k, stride)
    }

    /// Expert GEMV for top_k routed slots + the shared slot ([`Self::k_moe_gemv`] per pair).
    pub fn moe_gemv(&self, a: &MoeGemvArgs, y: &mut Bf) -> Result<()> {
        let p = self.moe_gemv_params(a, y)?;
        self.k_moe_gemv(p, false)
    }

    fn moe_gemv_params(&self, a: &MoeGemvArgs, y: &Bf) -> Result<OrnithMoeGemvParams> {
        let slots = a.top_k + 1;
        ensure!(a.tokens > 0, "moe_gemv: no tokens");
        need("moe_gemv idx", a.idx, a.tokens * a.top_k)?;
        need("moe_gemv w", a.w, a.experts * a.out * a.in_)?;
        need("moe_gemv ws", a.ws, a.experts * a.out)?;
        need("moe_gemv shared w", a.shared_w, a.out * a.in_)?;
        need("moe_gemv shared ws", a.shared_ws, a.out)?;
        need("moe_gemv x", a.xq, (a.tokens - 1) * a.x_tok_stride + a.top_k * a.x_slot_stride + a.in_)?;
        need("moe_gemv xs", a.xs, (a.tokens - 1) * a.xs_tok_stride + a.top_k * a.xs_slot_stride + 1)?;
        need("moe_gemv y", y, a.tokens * slots * a.out)?;
        Ok(OrnithMoeGemvParams {
            xq: self.addr(a.xq) as _,
            xs: self.addr(a.xs) as _,
            idx: self.addr(a.idx) as _,
            w: self.addr(a.w) as _,
            ws: self.addr(a.ws) as _,
            shared_w: self.addr(a.shared_w) as _,
            shared_ws: self.addr(a.shared_ws) as _,
            y: self.addr(y) as _,
            tokens: i32of("tokens", a.tokens)?,
            top_k: a.top_k as i32,
            experts: i32of("experts", a.experts)?,
            in_: i32of("in", a.in_)?,
            out: i32of("out", a.out)?,
            x_tok_stride: i32of("x_tok_stride", a.x_tok_stride)?,
            x_slot_stride: i32of("x_slot_stride", a.x_slot_stride)?,
            xs_tok_stride: i32of("xs_tok_stride", a.xs_tok_stride)?,
            xs_slot_stride: i32of("xs_slot_stride", a.xs_slot_stride)?,
            active_list: std::ptr::null(),
            active_count: std::ptr::null(),
            group_offsets: std::ptr::null(),
            row_assign: std::ptr::null(),
        })
    }

    /// `moe_sort` ([`Self::k_moe_sort`]) of a decode group's router output `idx [tokens, top_k]`
    /// for [`CudaContext::moe_gemv_grouped`], into new buffers: each expert's range of sorted
    /// rows, the assignment (`token · top_k + slot`) of each sorted row, the experts with
    /// assignments and their count.
    pub fn moe_groups(&self, idx: &CudaSlice<i32>, tokens: usize, top_k: usize, experts: usize) -> Result<MoeGroups> {
        need("moe_groups idx", idx, tokens * top_k)?;
        ensure!((1..=1024).contains(&experts), "moe_groups: {experts} experts");
        let n = tokens * top_k;
        let g = MoeGroups {
            group_offsets: self.alloc(experts + 1)?,
            tile_offsets: self.alloc(experts + 1)?,
            row_token: self.alloc(n)?,
            row_of: self.alloc(n)?,
            row_assign: self.alloc(n)?,
            active_list: self.alloc(experts)?,
            active_count: self.alloc(1)?,
        };
        self.k_moe_sort(OrnithMoeSortParams {
            idx: self.addr(idx) as _,
            group_offsets: self.addr(&g.group_offsets) as _,
            tile_offsets: self.addr(&g.tile_offsets) as _,
            row_token: self.addr(&g.row_token) as _,
            row_of: self.addr(&g.row_of) as _,
            row_assign: self.addr(&g.row_assign) as _,
            active_list: self.addr(&g.active_list) as _,
            active_count: self.addr(&g.active_count) as _,
            tokens: i32of("tokens", tokens)?,
            top_k: top_k as i32,
            experts: experts as i32,
        })?;
        Ok(g)
    }

    /// [`CudaContext::moe_gemv`] grouped by expert over `g` (see `moe_gemv_grouped`): the same
    /// outputs, bit for bit.
    pub fn moe_gemv_grouped(&self, a: &MoeGemvArgs, g: &MoeGroups, y: &mut Bf) -> Result<()> {
        let mut p = self.moe_gemv_params(a, y)?;
        need("moe_gemv_grouped active_list", &g.active_list, a.experts)?;
        need("moe_gemv_grouped group_offsets", &g.group_offsets, a.experts + 1)?;
        need("moe_gemv_grouped row_assign", &g.row_assign, a.tokens * a.top_k)?;
        p.active_list = self.addr(&g.active_list) as _;
        p.active_count = self.addr(&g.active_count) as _;
        p.group_offsets = self.addr(&g.group_offsets) as _;
        p.row_assign = self.addr(&g.row_assign) as _;
        self.k_moe_gemv(p, true)
    }

    /// [`Self::k_swiglu`] on buffers.
    pub fn swiglu_quant(
        &self,
        gate_up: &Bf,
        q8: &mut CudaSlice<u8>,
        scale: &mut CudaSlice<f32>,
        rows: usize,
        inter: usize,
    ) -> Result<()> {
        need("swiglu gate_up", gate_up, rows * 2 * inter)?;
        need("swiglu q8", q8, rows * inter)?;
        need("swiglu scale", scale, rows)?;
        self.k_swiglu(self.addr(gate_up), self.addr(q8), self.addr(scale), rows, inter)
    }

    /// [`Self::k_combine`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine(
        &self,
        ys: &Bf,
        weight: &CudaSlice<f32>,
        gate_logit: &Bf,
        out: &mut Bf,
        tokens: usize,
        top_k: usize,
        hidden: usize,
        gate_stride: usize,
    ) -> Result<()> {
        ensure!(tokens > 0, "moe_combine: empty");
        need("combine ys", ys, tokens * (top_k + 1) * hidden)?;
        need("combine weight", weight, tokens * top_k)?;
        need("combine gate", gate_logit, (tokens - 1) * gate_stride + 1)?;
        need("combine out", out, tokens * hidden)?;
        let (a, b, c, d) = (self.addr(ys), self.addr(weight), self.addr(gate_logit), self.addr(out));
        self.k_combine(a, b, c, d, tokens, top_k, hidden, gate_stride)
    }

    /// [`Self::k_conv`] on buffers: `tokens` in order, updating `state` [3, channels]; or, with
    /// `slots`, token t the next one of its own sequence, whose state is slot `slots[t]` of
    /// `state` [pool, 3, channels].
    #[allow(clippy::too_many_arguments)]
    pub fn conv1d_silu(
        &self,
        x: &Bf,
        w: &Bf,
        state: &mut Bf,
        y: &mut Bf,
        tokens: usize,
        channels: usize,
        x_stride: usize,
        slots: Option<&CudaSlice<i32>>,
    ) -> Result<()> {
        ensure!(tokens > 0 && channels > 0, "conv: tokens {tokens}, channels {channels}");
        need("conv x", x, (tokens - 1) * x_stride + channels)?;
        need("conv w", w, channels * 4)?;
        need("conv state", state, 3 * channels)?;
        need("conv y", y, tokens * channels)?;
        if let Some(s) = slots {
            self.check_slots("conv slots", s, tokens, state.len() / (3 * channels))?;
        }
        let slots = slots.map(|s| (self.addr(s), 3 * channels));
        let (a, b, c, d) = (self.addr(x), self.addr(w), self.addr(state), self.addr(y));
        self.k_conv(a, b, c, d, tokens, channels, x_stride, slots)
    }

    /// The parameters of both gated delta rule forms from buffers: lengths checked, `work` null.
    /// With `a.slots` (recurrent form only), token t's state is slot `slots[t]` of `state`.
    pub(crate) fn gdn_params(&self, a: &GdnArgs, state: &mut CudaSlice<f32>, o: &mut Bf) -> Result<OrnithGdnParams> {
        ensure!(a.tokens > 0 && a.k_heads > 0, "gdn: {} tokens, {} k heads", a.tokens, a.k_heads);
        let width = (2 * a.k_heads + a.v_heads) * 128;
        need("gdn qkv", a.qkv, (a.tokens - 1) * a.qkv_stride + width)?;
        need("gdn ba", a.ba, (a.tokens - 1) * a.ba_stride + a.a_offset + a.v_heads)?;
        need("gdn a_log", a.a_log, a.v_heads)?;
        need("gdn dt_bias", a.dt_bias, a.v_heads)?;
        let per = a.v_heads * 128 * 128;
        need("gdn state", state, per)?;
        need("gdn o", o, a.tokens * a.v_heads * 128)?;
        if let Some(s) = a.slots {
            self.check_slots("gdn slots", s, a.tokens, state.len() / per)?;
        }
        Ok(OrnithGdnParams {
            qkv: self.addr(a.qkv) as _,
            ba: self.addr(a.ba) as _,
            a_log: self.addr(a.a_log) as _,
            dt_bias: self.addr(a.dt_bias) as _,
            state: self.addr(state) as _,
            o: self.addr(o) as _,
            tokens: i32of("tokens", a.tokens)?,
            k_heads: i32of("k_heads", a.k_heads)?,
            v_heads: i32of("v_heads", a.v_heads)?,
            qkv_stride: i32of("qkv_stride", a.qkv_stride)?,
            ba_stride: i32of("ba_stride", a.ba_stride)?,
            a_offset: i32of("a_offset", a.a_offset)?,
            work: std::ptr::null_mut(),
            slot: a.slots.map_or(std::ptr::null(), |s| self.addr(s) as _),
            state_stride: if a.slots.is_some() { i32of("gdn state stride", per)? } else { 0 },
        })
    }

    /// [`Self::k_gdn`] on buffers: `a.tokens` tokens of one sequence (state
    /// `[v_heads, 128, 128]`), or with `a.slots` one token of each of `a.tokens` sequences,
    /// token t's state slot `slots[t]` of `state [pool, v_heads, 128, 128]`.
    pub fn gdn_recurrent(&self, a: &GdnArgs, state: &mut CudaSlice<f32>, o: &mut Bf) -> Result<()> {
        let p = self.gdn_params(a, state, o)?;
        self.k_gdn(p)
    }

    /// [`Self::k_gated_norm`] on buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_rmsnorm(
        &self,
        o: &Bf,
        z: &Bf,
        w: &Bf,
        y: &mut Bf,
        tokens: usize,
        heads: usize,
        dim: usize,
        z_stride: usize,
        eps: f32,
    ) -> Result<()> {
        ensure!(tokens > 0, "gated_rmsnorm: no tokens");
        need("gated o", o, tokens * heads * dim)?;
        need("gated z", z, (tokens - 1) * z_stride + heads * dim)?;
        need("gated w", w, dim)?;
        need("gated y", y, tokens * heads * dim)?;
        let (a, b, c, d) = (self.addr(o), self.addr(z), self.addr(w), self.addr(y));
        self.k_gated_norm(a, b, c, d, tokens, heads, dim, z_stride, eps)
    }

    /// [`Self::k_qk_rope`] on buffers. Caches are `[blocks, KV_BLOCK, kv_heads, head_dim]`.
    pub fn qk_norm_rope(&self, a: &QkRopeArgs, q_out: &mut Bf, k_cache: &mut Bf, v_cache: &mut Bf) -> Result<()> {
        let d = a.head_dim;
        ensure!(a.tokens > 0, "qk_rope: no tokens");
        let (positions, stride) = a.positions(self)?;
        self.check_paged("qk_rope", k_cache.len().min(v_cache.len()), a.kv_heads * d, a.table, stride, &positions)?;
        need("qk qg", a.qg, a.tokens * a.q_heads * 2 * d)?;
        need("qk k", a.k, a.tokens * a.kv_heads * d)?;
        need("qk v", a.v, a.tokens * a.kv_heads * d)?;
        need("qk q_norm", a.q_norm, d)?;
        need("qk k_norm", a.k_norm, d)?;
        need("qk q_out", q_out, a.tokens * a.q_heads * d)?;
        self.k_qk_rope(OrnithQkRopeParams {
            qg: self.addr(a.qg) as _,
            k: self.addr(a.k) as _,
            v: self.addr(a.v) as _,
            q_norm: self.addr(a.q_norm) as _,
            k_norm: self.addr(a.k_norm) as _,
            q_out: self.addr(q_out) as _,
            k_cache: self.addr(k_cache) as _,
            v_cache: self.addr(v_cache) as _,
            tokens: i32of("tokens", a.tokens)?,
            pos0: i32of("pos0", a.pos0)?,
            q_heads: i32of("q_heads", a.q_heads)?,
            kv_heads: i32of("kv_heads", a.kv_heads)?,
            head_dim: i32of("head_dim", d)?,
            rot: i32of("rot", a.rot)?,
            theta: a.theta,
            eps: a.eps,
            pos_dev: a.pos_dev.map_or(std::ptr::null(), |d| self.addr(d) as _),
            table: self.addr(a.table) as _,
            table_stride: i32of("table stride", a.table_stride)?,
        })
    }

    /// Split-sequence causal attention (head_dim 256) over the paged cache + sigmoid output gate,
    /// from buffers ([`Self::attention_params`], then [`Self::k_attention`]).
    /// Scratch buffers `part_o` [tokens*q_heads*splits*256] and `part_ml` [tokens*q_heads*splits*2]
    /// with splits = ceil((pos0 + tokens) / split_len), or, in the device-position form
    /// (`a.pos_dev` = (per-row positions, splits, min_split), per-row block tables), the given
    /// number of splits.
    pub fn attention_decode(
        &self,
        a: &AttnArgs,
        part_o: &mut CudaSlice<f32>,
        part_ml: &mut CudaSlice<f32>,
        out: &mut Bf,
    ) -> Result<()> {
        let (p, keys) = self.attention_params(a, part_o, part_ml, out)?;
        self.k_attention(p, keys)
    }

    /// The buffer-checked kernel parameters of [`Self::attention_decode`] and the K/V positions
    /// its rows read (to time the launches alone).
    pub(crate) fn attention_params(
        &self,
        a: &AttnArgs,
        part_o: &mut CudaSlice<f32>,
        part_ml: &mut CudaSlice<f32>,
        out: &mut Bf,
    ) -> Result<(OrnithAttnParams, usize)> {
        ensure!(a.tokens > 0, "attention: empty");
        let (positions, stride) = match a.pos_dev {
            Some((p, _, _)) => {
                need("attn positions", p, a.tokens)?;
                (self.download(p)?[..a.tokens].iter().map(|&x| x.max(0) as usize).collect::<Vec<_>>(), a.table_stride)
            }
            None => ((a.pos0..a.pos0 + a.tokens).collect(), 0),
        };
        let splits = match a.pos_dev {
            Some((_, n, _)) => n,
            None => (a.pos0 + a.tokens).div_ceil(a.split_len.max(1)),
        };
        need("attn q", a.q, a.tokens * a.q_heads * 256)?;
        need("attn qg", a.qg, a.tokens * a.q_heads * 512)?;
        self.check_paged(
            "attention",
            a.k_cache.len().min(a.v_cache.len()),
            a.kv_heads * 256,
            a.table,
            stride,
            &positions,
        )?;
        need("attn part_o", part_o, a.tokens * a.q_heads * splits * 256)?;
        need("attn part_ml", part_ml, a.tokens * a.q_heads * splits * 2)?;
        need("attn out", out, a.tokens * a.q_heads * 256)?;
        let p = OrnithAttnParams {
            q: self.addr(a.q) as _,
            k_cache: self.addr(a.k_cache) as _,
            v_cache: self.addr(a.v_cache) as _,
            qg: self.addr(a.qg) as _,
            part_o: self.addr(part_o) as _,
            part_ml: self.addr(part_ml) as _,
            out: self.addr(out) as _,
            tokens: i32of("tokens", a.tokens)?,
            pos0: i32of("pos0", a.pos0)?,
            q_heads: i32of("q_heads", a.q_heads)?,
            kv_heads: i32of("kv_heads", a.kv_heads)?,
            head_dim: i32of("head_dim", a.head_dim)?,
            split_len: i32of("split_len", a.split_len)?,
            splits: i32of("attention splits", splits)?,
            scale: 1.0 / (a.head_dim as f32).sqrt(),
            pos_dev: a.pos_dev.map_or(std::ptr::null(), |d| self.addr(d.0) as _),
            min_split: a.pos_dev.map_or(Ok(0), |d| i32of("min_split", d.2))?,
            table: self.addr(a.table) as _,
            table_stride: i32of("table stride", a.table_stride)?,
        };
        Ok((p, positions.iter().map(|&x| x + 1).sum()))
    }

    /// [`Self::k_argmax`] on buffers (row i of the logits for row i).
    pub fn argmax(&self, logits: &Bf, idx: &mut CudaSlice<i32>, tokens: usize, n: usize, stride: usize) -> Result<()> {
        ensure!(tokens > 0, "argmax: no rows");
        need("argmax logits", logits, (tokens - 1) * stride + n)?;
        need("argmax idx", idx, tokens)?;
        self.k_argmax(self.addr(logits), self.addr(idx), tokens, n, stride, None)
    }
}

/// Inputs of [`CudaContext::moe_gemv`].
pub struct MoeGemvArgs<'a> {
    pub xq: &'a CudaSlice<u8>,
    pub xs: &'a CudaSlice<f32>,
    pub idx: &'a CudaSlice<i32>,
    pub w: &'a CudaSlice<u8>,
    pub ws: &'a CudaSlice<f32>,
    pub shared_w: &'a CudaSlice<u8>,
    pub shared_ws: &'a CudaSlice<f32>,
    pub tokens: usize,
    pub top_k: usize,
    pub experts: usize,
    pub in_: usize,
    pub out: usize,
    pub x_tok_stride: usize,
    pub x_slot_stride: usize,
    pub xs_tok_stride: usize,
    pub xs_slot_stride: usize,
}

/// `moe_sort`'s outputs for [`CudaContext::moe_gemv_grouped`].
pub struct MoeGroups {
    pub group_offsets: CudaSlice<i32>,
    pub tile_offsets: CudaSlice<i32>,
    pub row_token: CudaSlice<i32>,
    pub row_of: CudaSlice<i32>,
    pub row_assign: CudaSlice<i32>,
    pub active_list: CudaSlice<i32>,
    pub active_count: CudaSlice<i32>,
}

/// Inputs of [`CudaContext::gdn_recurrent`].
pub struct GdnArgs<'a> {
    pub qkv: &'a Bf,
    pub ba: &'a Bf,
    pub a_log: &'a CudaSlice<f32>,
    pub dt_bias: &'a Bf,
    pub tokens: usize,
    pub k_heads: usize,
    pub v_heads: usize,
    pub qkv_stride: usize,
    pub ba_stride: usize,
    pub a_offset: usize,
    /// Per-row sequences (`gdn_recurrent` only): token t's state slot.
    pub slots: Option<&'a CudaSlice<i32>>,
}

/// Inputs of [`CudaContext::qk_norm_rope`].
pub struct QkRopeArgs<'a> {
    pub qg: &'a Bf,
    pub k: &'a Bf,
    pub v: &'a Bf,
    pub q_norm: &'a Bf,
    pub k_norm: &'a Bf,
    pub tokens: usize,
    pub pos0: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rot: usize,
    pub theta: f32,
    pub eps: f32,
    /// Per-row form: token t at position `pos_dev[t]` with block table row t (`pos0` ignored);
    /// else token t at `pos0 + t` with table row 0.
    pub pos_dev: Option<&'a CudaSlice<i32>>,
    /// Block tables `[rows, table_stride]` (one row without `pos_dev`).
    pub table: &'a CudaSlice<i32>,
    pub table_stride: usize,
}

impl QkRopeArgs<'_> {
    /// Each row's position and the table stride the kernel uses (0: one table).
    fn positions(&self, c: &CudaContext) -> Result<(Vec<usize>, usize)> {
        Ok(match self.pos_dev {
            Some(p) => {
                need("qk positions", p, self.tokens)?;
                (c.download(p)?[..self.tokens].iter().map(|&x| x.max(0) as usize).collect(), self.table_stride)
            }
            None => ((self.pos0..self.pos0 + self.tokens).collect(), 0),
        })
    }
}

/// Inputs of [`CudaContext::attention_decode`].
pub struct AttnArgs<'a> {
    pub q: &'a Bf,
    pub qg: &'a Bf,
    pub k_cache: &'a Bf,
    pub v_cache: &'a Bf,
    pub tokens: usize,
    pub pos0: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub split_len: usize,
    /// Device-position form: (per-row positions `[tokens]`, grid splits, minimum split length);
    /// the kernel then derives each row's split length from its own position, reads row t's
    /// block table at `table[t · table_stride]`, and `pos0`, `split_len` are ignored.
    pub pos_dev: Option<(&'a CudaSlice<i32>, usize, usize)>,
    /// Block tables (one row without `pos_dev`).
    pub table: &'a CudaSlice<i32>,
    pub table_stride: usize,
}
