//! One launcher per kernel. Each checks the shape assumptions of its kernel (and the buffer sizes)
//! and returns an error rather than launching on bad input. bf16 tensors are `CudaSlice<u16>`
//! (bit patterns), FP8 E4M3 codes `CudaSlice<u8>`.
use super::CudaContext;
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use ornith_kernels::bindings::*;

type Bf = CudaSlice<u16>;

fn need<T>(what: &str, s: &CudaSlice<T>, n: usize) -> Result<()> {
    ensure!(s.len() >= n, "{what}: buffer has {} elements, the launch needs {n}", s.len());
    Ok(())
}
fn i32of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| anyhow::anyhow!("{what} = {v} does not fit the kernel's int32"))
}

/// Positions per K/V block (`ORNITH_KV_BLOCK`, = `graph::KV_BLOCK`).
const KVB: usize = ORNITH_KV_BLOCK as usize;

/// One kernel launch as [`CudaContext::launch_attention`] hands it out: (kernel, grid, block,
/// dynamic shared bytes, bytes it reads, parameters).
pub(crate) type AttnLaunch<'a> =
    dyn FnMut(&'static str, (u32, u32, u32), u32, u32, u64, OrnithAttnParams) -> Result<()> + 'a;

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

impl CudaContext {
    /// Checks a paged K/V launch on the host (the launchers are the kernels' tested entry
    /// points, so they may read device inputs back): row t at `positions[t]` reads blocks
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

    pub(crate) fn launch<P: crate::cuda::KernelParams>(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        p: P,
    ) -> Result<()> {
        self.launch_with(name, grid, block, 0, p)
    }

    /// out[t] = table[ids[t]] (rows of `hidden` bf16; hidden % 8 == 0 for 16-byte copies).
    pub fn embed(
        &self,
        ids: &CudaSlice<i32>,
        table: &Bf,
        out: &mut Bf,
        tokens: usize,
        hidden: usize,
        vocab: usize,
    ) -> Result<()> {
        ensure!(tokens > 0 && hidden.is_multiple_of(8), "embed: tokens {tokens} > 0 and hidden {hidden} % 8 == 0");
        need("embed ids", ids, tokens)?;
        need("embed table", table, vocab * hidden)?;
        need("embed out", out, tokens * hidden)?;
        let p = OrnithEmbedParams {
            ids: self.addr(ids) as _,
            table: self.addr(table) as _,
            out: self.addr(out) as _,
            tokens: i32of("tokens", tokens)?,
            hidden: i32of("hidden", hidden)?,
            vocab: i32of("vocab", vocab)?,
        };
        self.launch("embed_gather", (tokens as u32, 1, 1), 256, p)
    }

    /// Residual add (optional) + zero-centred RMSNorm, writing bf16 `out` and/or FP8 `(q8, scale)`.
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
        ensure!(tokens > 0 && hidden > 0 && hidden <= 8192, "rmsnorm: 0 < hidden {hidden} <= 8192");
        ensure!(out.is_some() || q8.is_some(), "rmsnorm: no output requested");
        need("rmsnorm residual", residual, tokens * hidden)?;
        need("rmsnorm weight", weight, hidden)?;
        let mut p = OrnithRmsNormParams {
            residual: self.addr(residual) as _,
            weight: self.addr(weight) as _,
            tokens: tokens as i32,
            hidden: hidden as i32,
            eps,
            ..Default::default()
        };
        if let Some(a) = add {
            need("rmsnorm add", a, tokens * hidden)?;
            p.add = self.addr(a) as _;
        }
        if let Some(o) = out {
            need("rmsnorm out", o, tokens * hidden)?;
            p.out = self.addr(o) as _;
        }
        if let Some((q, s)) = q8 {
            need("rmsnorm q8", q, tokens * hidden)?;
            need("rmsnorm scale", s, tokens)?;
            p.q8 = self.addr(q) as _;
            p.scale = self.addr(s) as _;
        }
        self.launch("rmsnorm_residual", (tokens as u32, 1, 1), 256, p)
    }

    /// Per-row FP8 quantisation: scale = amax/448, q8 = e4m3(x / scale).
    pub fn quantize_fp8(
        &self,
        x: &Bf,
        q8: &mut CudaSlice<u8>,
        scale: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        ensure!(rows > 0 && cols > 0, "quantize: empty");
        need("quantize x", x, rows * cols)?;
        need("quantize q8", q8, rows * cols)?;
        need("quantize scale", scale, rows)?;
        let p = OrnithQuantParams {
            x: self.addr(x) as _,
            q8: self.addr(q8) as _,
            scale: self.addr(scale) as _,
            tokens: rows as i32,
            cols: i32of("cols", cols)?,
        };
        self.launch("quantize_fp8_rows", (rows as u32, 1, 1), 256, p)
    }

    fn gemv_checks(tokens: usize, in_: usize, out: usize, xs: usize, ys: usize, align: usize) -> Result<()> {
        // The kernel forms activation offsets as i32 (token * x_stride * element bytes).
        ensure!(tokens >= 1 && tokens * xs * (16 / align) <= i32::MAX as usize, "gemv: {tokens} tokens of stride {xs}");
        ensure!(in_ > 0 && in_.is_multiple_of(16), "gemv: in {in_} must be a positive multiple of 16");
        ensure!(out > 0 && xs >= in_ && ys >= out, "gemv: strides x {xs} >= in {in_}, y {ys} >= out {out}");
        ensure!(xs.is_multiple_of(align), "gemv: x stride {xs} must keep rows 16-byte aligned");
        Ok(())
    }

    /// y[t, o] = bf16(sum_i x[t, i] w[o, i]) for any number of tokens (a decode group).
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
        let p = self.gemv_bf16_params(x, w, y, tokens, in_, out, x_stride, y_stride)?;
        let name = super::gemv_tc_kernel(false, tokens);
        self.launch(name, (super::gemv_tc_blocks(in_ * 2, out), 1, 1), 256, p)
    }

    #[allow(clippy::too_many_arguments)]
    fn gemv_bf16_params(
        &self,
        x: &Bf,
        w: &Bf,
        y: &Bf,
        tokens: usize,
        in_: usize,
        out: usize,
        x_stride: usize,
        y_stride: usize,
    ) -> Result<OrnithGemvBf16Params> {
        Self::gemv_checks(tokens, in_, out, x_stride, y_stride, 8)?;
        need("gemv x", x, (tokens - 1) * x_stride + in_)?;
        need("gemv w", w, out * in_)?;
        need("gemv y", y, (tokens - 1) * y_stride + out)?;
        Ok(OrnithGemvBf16Params {
            x: self.addr(x) as _,
            w: self.addr(w) as _,
            y: self.addr(y) as _,
            tokens: tokens as i32,
            in_: i32of("in", in_)?,
            out: i32of("out", out)?,
            x_stride: x_stride as i32,
            y_stride: i32of("y_stride", y_stride)?,
        })
    }

    /// FP8 W8A8: y[t, o] = bf16((sum_i xq w) * xs[t] * ws[o]).
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
        let p = self.gemv_fp8_params(xq, xs, w, ws, y, tokens, in_, out, x_stride, y_stride)?;
        let name = super::gemv_tc_kernel(true, tokens);
        self.launch(name, (super::gemv_tc_blocks(in_, out), 1, 1), 256, p)
    }

    #[allow(clippy::too_many_arguments)]
    fn gemv_fp8_params(
        &self,
        xq: &CudaSlice<u8>,
        xs: &CudaSlice<f32>,
        w: &CudaSlice<u8>,
        ws: &CudaSlice<f32>,
        y: &Bf,
        tokens: usize,
        in_: usize,
        out: usize,
        x_stride: usize,
        y_stride: usize,
    ) -> Result<OrnithGemvFp8Params> {
        Self::gemv_checks(tokens, in_, out, x_stride, y_stride, 16)?;
        need("gemv_fp8 x", xq, (tokens - 1) * x_stride + in_)?;
        need("gemv_fp8 xs", xs, tokens)?;
        need("gemv_fp8 w", w, out * in_)?;
        need("gemv_fp8 ws", ws, out)?;
        need("gemv_fp8 y", y, (tokens - 1) * y_stride + out)?;
        Ok(OrnithGemvFp8Params {
            xq: self.addr(xq) as _,
            xs: self.addr(xs) as _,
            w: self.addr(w) as _,
            ws: self.addr(ws) as _,
            y: self.addr(y) as _,
            tokens: tokens as i32,
            in_: i32of("in", in_)?,
            out: i32of("out", out)?,
            x_stride: x_stride as i32,
            y_stride: i32of("y_stride", y_stride)?,
        })
    }

    /// Router: softmax over `experts` logits (row stride `stride`), top-k, renormalised bf16 weights.
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
        ensure!(
            tokens > 0 && experts <= 256 && (1..=32).contains(&top_k) && top_k <= experts && stride >= experts,
            "router: experts {experts} <= 256, 1 <= top_k {top_k} <= min(32, experts), stride {stride}"
        );
        need("router logits", logits, (tokens - 1) * stride + experts)?;
        need("router idx", idx, tokens * top_k)?;
        need("router weight", weight, tokens * top_k)?;
        let p = OrnithRouterParams {
            logits: self.addr(logits) as _,
            idx: self.addr(idx) as _,
            weight: self.addr(weight) as _,
            tokens: tokens as i32,
            experts: experts as i32,
            top_k: top_k as i32,
            logit_stride: stride as i32,
        };
        self.launch("moe_router_topk", (tokens as u32, 1, 1), 32, p)
    }

    /// Expert GEMV for top_k routed slots + the shared slot (see `OrnithMoeGemvParams`).
    pub fn moe_gemv(&self, a: &MoeGemvArgs, y: &mut Bf) -> Result<()> {
        let p = self.moe_gemv_params(a, y)?;
        self.launch("moe_gemv_fp8", (super::moe_tc_blocks(a.in_, a.out), (a.top_k + 1) as u32, a.tokens as u32), 256, p)
    }

    fn moe_gemv_params(&self, a: &MoeGemvArgs, y: &Bf) -> Result<OrnithMoeGemvParams> {
        let slots = a.top_k + 1;
        ensure!(
            a.tokens > 0 && a.in_.is_multiple_of(16) && a.in_ > 0 && a.out > 0 && a.top_k >= 1,
            "moe_gemv: in {} % 16, out {}",
            a.in_,
            a.out
        );
        ensure!(
            a.x_tok_stride.is_multiple_of(16) && a.x_slot_stride.is_multiple_of(16),
            "moe_gemv: activation strides must keep 16-byte alignment"
        );
        // The kernel forms activation offsets as i32 (token * x_tok_stride + slot * x_slot_stride).
        ensure!(
            a.tokens * a.x_tok_stride + a.top_k * a.x_slot_stride <= i32::MAX as usize,
            "moe_gemv: {} tokens of stride {}",
            a.tokens,
            a.x_tok_stride
        );
        need("moe_gemv idx", a.idx, a.tokens * a.top_k)?;
        need("moe_gemv w", a.w, a.experts * a.out * a.in_)?;
        need("moe_gemv ws", a.ws, a.experts * a.out)?;
        need("moe_gemv shared w", a.shared_w, a.out * a.in_)?;
        need("moe_gemv shared ws", a.shared_ws, a.out)?;
        need("moe_gemv x", a.xq, (a.tokens - 1) * a.x_tok_stride + a.top_k * a.x_slot_stride + a.in_)?;
        need("moe_gemv xs", a.xs, (a.tokens - 1) * a.xs_tok_stride + a.top_k * a.xs_slot_stride + 1)?;
        need("moe_gemv y", y, a.tokens * slots * a.out)?;
        let p = OrnithMoeGemvParams {
            xq: self.addr(a.xq) as _,
            xs: self.addr(a.xs) as _,
            idx: self.addr(a.idx) as _,
            w: self.addr(a.w) as _,
            ws: self.addr(a.ws) as _,
            shared_w: self.addr(a.shared_w) as _,
            shared_ws: self.addr(a.shared_ws) as _,
            y: self.addr(y) as _,
            tokens: a.tokens as i32,
            top_k: a.top_k as i32,
            experts: a.experts as i32,
            in_: a.in_ as i32,
            out: a.out as i32,
            x_tok_stride: a.x_tok_stride as i32,
            x_slot_stride: a.x_slot_stride as i32,
            xs_tok_stride: a.xs_tok_stride as i32,
            xs_slot_stride: a.xs_slot_stride as i32,
            active_list: std::ptr::null(),
            active_count: std::ptr::null(),
            group_offsets: std::ptr::null(),
            row_assign: std::ptr::null(),
        };
        Ok(p)
    }

    /// `moe_sort` of a decode group's router output `idx [tokens, top_k]` for
    /// [`CudaContext::moe_gemv_grouped`]: each expert's range of sorted rows, the assignment
    /// (`token · top_k + slot`) of each sorted row, the experts with assignments and their count.
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
        let p = OrnithMoeSortParams {
            idx: self.addr(idx) as _,
            group_offsets: self.addr(&g.group_offsets) as _,
            tile_offsets: self.addr(&g.tile_offsets) as _,
            row_token: self.addr(&g.row_token) as _,
            row_of: self.addr(&g.row_of) as _,
            row_assign: self.addr(&g.row_assign) as _,
            active_list: self.addr(&g.active_list) as _,
            active_count: self.addr(&g.active_count) as _,
            tokens: tokens as i32,
            top_k: top_k as i32,
            experts: experts as i32,
        };
        self.launch("moe_sort", (1, 1, 1), 1024, p)?;
        Ok(g)
    }

    /// [`CudaContext::moe_gemv`] grouped by expert over `g` (see `moe_gemv_grouped`): the same
    /// outputs, bit for bit.
    pub fn moe_gemv_grouped(&self, a: &MoeGemvArgs, g: &MoeGroups, y: &mut Bf) -> Result<()> {
        let mut p = self.moe_gemv_params(a, y)?;
        p.active_list = self.addr(&g.active_list) as _;
        p.active_count = self.addr(&g.active_count) as _;
        p.group_offsets = self.addr(&g.group_offsets) as _;
        p.row_assign = self.addr(&g.row_assign) as _;
        let active = a.experts.min(a.tokens * a.top_k) as u32;
        self.launch("moe_gemv_grouped", (super::moe_tc_blocks(a.in_, a.out), active + 1, 1), 256, p)
    }

    /// a = bf16(bf16(silu(g)) * u) per row of gate_up [rows, 2*inter], then FP8 per row.
    pub fn swiglu_quant(
        &self,
        gate_up: &Bf,
        q8: &mut CudaSlice<u8>,
        scale: &mut CudaSlice<f32>,
        rows: usize,
        inter: usize,
    ) -> Result<()> {
        ensure!(rows > 0 && inter > 0 && inter <= 1024, "swiglu: 0 < inter {inter} <= 1024");
        need("swiglu gate_up", gate_up, rows * 2 * inter)?;
        need("swiglu q8", q8, rows * inter)?;
        need("swiglu scale", scale, rows)?;
        let p = OrnithSwigluQuantParams {
            gate_up: self.addr(gate_up) as _,
            q8: self.addr(q8) as _,
            scale: self.addr(scale) as _,
            rows: rows as i32,
            inter: inter as i32,
        };
        self.launch("swiglu_quant", (rows as u32, 1, 1), 256, p)
    }

    /// out = bf16(routed + sigmoid-gated shared), see `OrnithMoeCombineParams`.
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
        ensure!(tokens > 0 && hidden > 0 && top_k > 0, "moe_combine: empty");
        need("combine ys", ys, tokens * (top_k + 1) * hidden)?;
        need("combine weight", weight, tokens * top_k)?;
        need("combine gate", gate_logit, (tokens - 1) * gate_stride + 1)?;
        need("combine out", out, tokens * hidden)?;
        let p = OrnithMoeCombineParams {
            ys: self.addr(ys) as _,
            weight: self.addr(weight) as _,
            gate_logit: self.addr(gate_logit) as _,
            out: self.addr(out) as _,
            tokens: tokens as i32,
            top_k: top_k as i32,
            hidden: hidden as i32,
            gate_stride: gate_stride as i32,
        };
        self.launch("moe_combine", (hidden.div_ceil(256) as u32, tokens as u32, 1), 256, p)
    }

    /// Causal depthwise conv (kernel 4) + SiLU over `tokens` in order, updating `state` [3, channels];
    /// or, with `slots`, token t the next one of its own sequence, whose state is slot `slots[t]` of
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
        ensure!(
            tokens > 0 && channels > 0 && x_stride >= channels,
            "conv: tokens {tokens}, channels {channels}, stride {x_stride}"
        );
        need("conv x", x, (tokens - 1) * x_stride + channels)?;
        need("conv w", w, channels * 4)?;
        need("conv state", state, 3 * channels)?;
        need("conv y", y, tokens * channels)?;
        if let Some(s) = slots {
            self.check_slots("conv slots", s, tokens, state.len() / (3 * channels))?;
        }
        let p = OrnithConvParams {
            x: self.addr(x) as _,
            w: self.addr(w) as _,
            state: self.addr(state) as _,
            y: self.addr(y) as _,
            tokens: tokens as i32,
            channels: channels as i32,
            x_stride: x_stride as i32,
            slot: slots.map_or(std::ptr::null(), |s| self.addr(s) as _),
            state_stride: i32of("conv state stride", 3 * channels)?,
        };
        let rows = if slots.is_some() { tokens as u32 } else { 1 };
        self.launch("conv1d_silu", (channels.div_ceil(256) as u32, rows, 1), 256, p)
    }

    /// Recurrent gated delta rule (dk = dv = 128), see `OrnithGdnParams`: `a.tokens` tokens of
    /// one sequence (state `[v_heads, 128, 128]`), or with `a.slots` one token of each of
    /// `a.tokens` sequences, token t's state slot `slots[t]` of `state [pool, v_heads, 128, 128]`.
    pub fn gdn_recurrent(&self, a: &GdnArgs, state: &mut CudaSlice<f32>, o: &mut Bf) -> Result<()> {
        ensure!(
            a.tokens > 0 && a.k_heads > 0 && a.v_heads.is_multiple_of(a.k_heads),
            "gdn: v_heads {} must be a multiple of k_heads {}",
            a.v_heads,
            a.k_heads
        );
        let kdim = a.k_heads * 128;
        ensure!(a.qkv_stride >= 2 * kdim + a.v_heads * 128, "gdn: qkv stride {} too small", a.qkv_stride);
        ensure!(a.ba_stride >= a.a_offset + a.v_heads && a.a_offset >= a.v_heads, "gdn: b/a layout");
        need("gdn qkv", a.qkv, (a.tokens - 1) * a.qkv_stride + 2 * kdim + a.v_heads * 128)?;
        need("gdn ba", a.ba, (a.tokens - 1) * a.ba_stride + a.a_offset + a.v_heads)?;
        need("gdn a_log", a.a_log, a.v_heads)?;
        need("gdn dt_bias", a.dt_bias, a.v_heads)?;
        let per = a.v_heads * 128 * 128;
        need("gdn state", state, per)?;
        need("gdn o", o, a.tokens * a.v_heads * 128)?;
        if let Some(s) = a.slots {
            self.check_slots("gdn slots", s, a.tokens, state.len() / per)?;
        }
        let p = OrnithGdnParams {
            qkv: self.addr(a.qkv) as _,
            ba: self.addr(a.ba) as _,
            a_log: self.addr(a.a_log) as _,
            dt_bias: self.addr(a.dt_bias) as _,
            state: self.addr(state) as _,
            o: self.addr(o) as _,
            tokens: a.tokens as i32,
            k_heads: a.k_heads as i32,
            v_heads: a.v_heads as i32,
            qkv_stride: a.qkv_stride as i32,
            ba_stride: a.ba_stride as i32,
            a_offset: a.a_offset as i32,
            work: std::ptr::null_mut(),
            slot: a.slots.map_or(std::ptr::null(), |s| self.addr(s) as _),
            state_stride: i32of("gdn state stride", per)?,
        };
        let z = if a.slots.is_some() { a.tokens as u32 } else { 1 };
        self.launch("gdn_recurrent", (a.v_heads as u32, 4, z), 128, p)
    }

    /// Gated RMSNorm per (token, head) over dim <= 128.
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
        ensure!(
            tokens > 0 && heads > 0 && dim > 0 && dim <= 128 && z_stride >= heads * dim,
            "gated_rmsnorm: dim {dim} <= 128"
        );
        need("gated o", o, tokens * heads * dim)?;
        need("gated z", z, (tokens - 1) * z_stride + heads * dim)?;
        need("gated w", w, dim)?;
        need("gated y", y, tokens * heads * dim)?;
        let p = OrnithGatedNormParams {
            o: self.addr(o) as _,
            z: self.addr(z) as _,
            weight: self.addr(w) as _,
            y: self.addr(y) as _,
            tokens: tokens as i32,
            heads: heads as i32,
            dim: dim as i32,
            z_stride: z_stride as i32,
            eps,
        };
        self.launch("gated_rmsnorm", ((tokens * heads) as u32, 1, 1), 128, p)
    }

    /// q/k norm + partial RoPE + paged KV-cache write, see `OrnithQkRopeParams`. Caches are
    /// `[blocks, KV_BLOCK, kv_heads, head_dim]`.
    pub fn qk_norm_rope(&self, a: &QkRopeArgs, q_out: &mut Bf, k_cache: &mut Bf, v_cache: &mut Bf) -> Result<()> {
        let d = a.head_dim;
        ensure!(
            a.tokens > 0 && d.is_multiple_of(32) && d <= 256 && a.rot.is_multiple_of(2) && a.rot <= d,
            "qk_rope: head_dim {d} (multiple of 32, <= 256), rot {}",
            a.rot
        );
        let (positions, stride) = a.positions(self)?;
        self.check_paged("qk_rope", k_cache.len().min(v_cache.len()), a.kv_heads * d, a.table, stride, &positions)?;
        need("qk qg", a.qg, a.tokens * a.q_heads * 2 * d)?;
        need("qk k", a.k, a.tokens * a.kv_heads * d)?;
        need("qk v", a.v, a.tokens * a.kv_heads * d)?;
        need("qk q_norm", a.q_norm, d)?;
        need("qk k_norm", a.k_norm, d)?;
        need("qk q_out", q_out, a.tokens * a.q_heads * d)?;
        let p = OrnithQkRopeParams {
            qg: self.addr(a.qg) as _,
            k: self.addr(a.k) as _,
            v: self.addr(a.v) as _,
            q_norm: self.addr(a.q_norm) as _,
            k_norm: self.addr(a.k_norm) as _,
            q_out: self.addr(q_out) as _,
            k_cache: self.addr(k_cache) as _,
            v_cache: self.addr(v_cache) as _,
            tokens: a.tokens as i32,
            pos0: a.pos0 as i32,
            q_heads: a.q_heads as i32,
            kv_heads: a.kv_heads as i32,
            head_dim: d as i32,
            rot: a.rot as i32,
            theta: a.theta,
            eps: a.eps,
            pos_dev: a.pos_dev.map_or(std::ptr::null(), |d| self.addr(d) as _),
            table: self.addr(a.table) as _,
            table_stride: i32of("table stride", a.table_stride)?,
        };
        self.launch("qk_norm_rope", ((a.q_heads + a.kv_heads) as u32, a.tokens as u32, 1), d as u32, p)
    }

    /// The one launcher of the decode attention (`attn_decode_split` then `attn_decode_combine`,
    /// see `OrnithAttnParams` and attention.cu): checks the shape, sizes the split kernel's grid
    /// to the GPU ([`CudaContext::attn_blocks`] blocks at most, each taking every grid-th work
    /// item; the grid never changes a result) and hands each launch (kernel, grid, block, shared
    /// bytes, bytes it reads, params) to `go`: a plain launch ([`Self::attention_decode`]) or the
    /// CUDA backend's profiled one. `keys`: the K/V positions the rows read in all (the bytes).
    pub(crate) fn launch_attention(&self, p: OrnithAttnParams, keys: usize, go: &mut AttnLaunch) -> Result<()> {
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
        go("attn_decode_split", (blocks, 1, 1), 64, ATT_SPLIT_SMEM, kv_bytes as u64, p)?;
        let part = t * qh * splits * (256 + 2) * 4 + t * qh * 256 * 4; // at most
        go("attn_decode_combine", (qh as u32, t as u32, 1), 256, 0, part as u64, p)
    }

    /// Split-sequence causal attention (head_dim 256) over the paged cache + sigmoid output gate,
    /// from buffers (the kernel tests' entry; checks the buffers, then [`Self::launch_attention`]).
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
        self.launch_attention(p, keys, &mut |name, grid, block, smem, _, p| {
            self.launch_smem(name, grid, block, smem, p)
        })
    }

    /// The checked kernel parameters of [`Self::attention_decode`] and the K/V positions its rows
    /// read (to time the launches alone).
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
            tokens: a.tokens as i32,
            pos0: a.pos0 as i32,
            q_heads: a.q_heads as i32,
            kv_heads: a.kv_heads as i32,
            head_dim: a.head_dim as i32,
            split_len: a.split_len as i32,
            splits: i32of("attention splits", splits)?,
            scale: 1.0 / (a.head_dim as f32).sqrt(),
            pos_dev: a.pos_dev.map_or(std::ptr::null(), |d| self.addr(d.0) as _),
            min_split: a.pos_dev.map_or(0, |d| d.2 as i32),
            table: self.addr(a.table) as _,
            table_stride: i32of("table stride", a.table_stride)?,
        };
        Ok((p, positions.iter().map(|&x| x + 1).sum()))
    }

    /// Greedy sampling: argmax over the first `n` columns of each row.
    pub fn argmax(&self, logits: &Bf, idx: &mut CudaSlice<i32>, tokens: usize, n: usize, stride: usize) -> Result<()> {
        ensure!(tokens > 0 && n > 0 && stride >= n, "argmax: n {n}, stride {stride}");
        need("argmax logits", logits, (tokens - 1) * stride + n)?;
        need("argmax idx", idx, tokens)?;
        let p = OrnithArgmaxParams {
            logits: self.addr(logits) as _,
            idx: self.addr(idx) as _,
            tokens: tokens as i32,
            n: i32of("n", n)?,
            stride: i32of("stride", stride)?,
            logit_row: std::ptr::null(),
        };
        self.launch("argmax_bf16", (tokens as u32, 1, 1), 1024, p)
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
