//! Launchers of moe.cu and moe_prefill.cu: router top-k, the counting sort by expert, SwiGLU +
//! requantisation (decode and compressed-tensors forms) and the two combines; and the whole
//! prefill MoE block on buffers ([`CudaContext::moe_prefill`], the kernel tests' composition of
//! the launchers the CUDA backend's prefill MoE calls).
//!
//! One launcher per kernel (see [`super`]): device addresses and shapes (or the kernel's parameter
//! struct) in, the kernel's assumptions checked, grid, block, shared memory and bytes computed,
//! launched through [`CudaContext::launch`]; the CUDA backend calls these. After them, the
//! slice-based wrappers the kernel tests call, which check buffer lengths (and device-held
//! tables and slots) and convert slices to addresses. The math is in
//! `kernels/include/ornith_kernels.h`; bf16 tensors are `CudaSlice<u16>` (bit patterns), FP8
//! E4M3 codes `CudaSlice<u8>`.
use super::gemm::tile_offsets_len;
use super::{aligned, i32of, need, CudaContext, Launch, Ptr};
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use ornith_kernels::bindings::*;

/// The largest expert row (`moe_intermediate_size`) `swiglu_quant` and the down product's SwiGLU
/// prologue take (the header's `ORNITH_SWIGLU_MAX_INTER`).
pub(crate) const SWIGLU_MAX_INTER: usize = ORNITH_SWIGLU_MAX_INTER as usize;

type Bf = CudaSlice<u16>;

/// `moe_combine`'s parameters (`OrnithMoeCombineParams`): the expert outputs `ys [t, top_k + 1,
/// hidden]`, the routing weights, the shared-expert gate logits (stride `gate_stride`), the output
/// rows and the residual fold. Also the per-slot down products' combine epilogue
/// (`OrnithMoeGemvParams::combine`, `ys` their own output).
#[allow(clippy::too_many_arguments)]
pub(crate) fn combine_params(
    ys: Ptr,
    weight: Ptr,
    gate: Ptr,
    out: Ptr,
    t: usize,
    top_k: usize,
    hidden: usize,
    gate_stride: usize,
    fold: Option<Ptr>,
) -> Result<OrnithMoeCombineParams> {
    ensure!(t > 0 && hidden > 0 && top_k > 0, "moe_combine: empty");
    Ok(OrnithMoeCombineParams {
        fold: fold.map_or(std::ptr::null_mut(), |f| f as _),
        ys: ys as _,
        weight: weight as _,
        gate_logit: gate as _,
        out: out as _,
        tokens: i32of("tokens", t)?,
        top_k: top_k as i32,
        hidden: i32of("hidden", hidden)?,
        gate_stride: i32of("gate stride", gate_stride)?,
    })
}

/// The bytes a combine moves: the expert outputs, weights and gate logits read, the output
/// written, and with a fold the residual read and written and the old output read.
pub(crate) fn combine_bytes(p: &OrnithMoeCombineParams) -> usize {
    let (t, k, h) = (p.tokens.max(0) as usize, p.top_k.max(0) as usize, p.hidden.max(0) as usize);
    t * ((k + 2) * h * 2 + k * 4 + 2) + if p.fold.is_null() { 0 } else { t * h * 6 }
}

/// `moe_sort`'s outputs for [`CudaContext::moe_gemv_grouped`].
pub struct MoeGroups {
    pub group_offsets: CudaSlice<i32>,
    pub tile_offsets: CudaSlice<i32>,
    pub row_token: CudaSlice<i32>,
    pub row_of: CudaSlice<i32>,
    pub row_assign: CudaSlice<i32>,
    pub row_info: CudaSlice<i32>,
}

impl MoeGroups {
    /// `moe_sort`'s parameters writing every output into these buffers.
    pub(crate) fn sort_params(
        &self,
        cx: &CudaContext,
        idx: &CudaSlice<i32>,
        tokens: usize,
        top_k: usize,
        experts: usize,
    ) -> Result<OrnithMoeSortParams> {
        need("moe_sort group_offsets", &self.group_offsets, experts + 1)?;
        need("moe_sort tile_offsets (a prefix per tile height)", &self.tile_offsets, tile_offsets_len(experts))?;
        Ok(OrnithMoeSortParams {
            idx: cx.addr(idx) as _,
            group_offsets: cx.addr(&self.group_offsets) as _,
            tile_offsets: cx.addr(&self.tile_offsets) as _,
            row_token: cx.addr(&self.row_token) as _,
            row_of: cx.addr(&self.row_of) as _,
            row_assign: cx.addr(&self.row_assign) as _,
            row_info: cx.addr(&self.row_info) as _,
            tokens: i32of("tokens", tokens)?,
            top_k: i32of("top_k", top_k)?,
            experts: i32of("experts", experts)?,
        })
    }

    /// The lists the grouped decode products read (`moe_gemv_grouped`, `moe_gemv_nvfp4_grouped`),
    /// checked to cover `experts` experts and `assignments` (token, slot) pairs: the block rows'
    /// `row_info` and the row assignments.
    pub(crate) fn lists(&self, cx: &CudaContext, what: &str, experts: usize, assignments: usize) -> Result<[Ptr; 2]> {
        need(&format!("{what} row_info"), &self.row_info, 4 * experts.min(assignments))?;
        need(&format!("{what} row_assign"), &self.row_assign, assignments)?;
        Ok([cx.addr(&self.row_info), cx.addr(&self.row_assign)])
    }
}

/// Weights and dims of [`CudaContext::moe_prefill`]. FP8 weights are `[.., out, in]` E4M3 codes with
/// per-output-channel f32 scales; an expert's gate_up is its gate rows then its up rows.
pub struct MoePrefillArgs<'a> {
    /// `[tokens, hidden]` bf16 (post-attention norm output).
    pub x: &'a Bf,
    /// `[experts + 1, hidden]` bf16: the router rows, then `shared_expert_gate`.
    pub router: &'a Bf,
    pub w_gate_up: &'a CudaSlice<u8>,
    pub ws_gate_up: &'a CudaSlice<f32>,
    pub w_down: &'a CudaSlice<u8>,
    pub ws_down: &'a CudaSlice<f32>,
    pub shared_gate_up: &'a CudaSlice<u8>,
    pub shared_gate_up_scale: &'a CudaSlice<f32>,
    pub shared_down: &'a CudaSlice<u8>,
    pub shared_down_scale: &'a CudaSlice<f32>,
    pub tokens: usize,
    pub hidden: usize,
    pub experts: usize,
    pub top_k: usize,
    pub inter: usize,
    pub shared_inter: usize,
}

/// Device scratch of [`CudaContext::moe_prefill`] for up to `tokens` rows.
pub struct MoePrefillScratch {
    tokens: usize,
    hidden: usize,
    experts: usize,
    top_k: usize,
    inter: usize,
    shared_inter: usize,
    pub logits: Bf,
    pub idx: CudaSlice<i32>,
    pub weight: CudaSlice<f32>,
    xq: CudaSlice<u8>,
    xs: CudaSlice<f32>,
    group_offsets: CudaSlice<i32>,
    tile_offsets: CudaSlice<i32>,
    row_token: CudaSlice<i32>,
    row_of: CudaSlice<i32>,
    gate_up: Bf,
    aq: CudaSlice<u8>,
    as_: CudaSlice<f32>,
    down: Bf,
    shared_gu: Bf,
    saq: CudaSlice<u8>,
    sas: CudaSlice<f32>,
    shared_y: Bf,
}

impl MoePrefillScratch {
    pub fn new(
        c: &CudaContext,
        tokens: usize,
        hidden: usize,
        experts: usize,
        top_k: usize,
        inter: usize,
        shared_inter: usize,
    ) -> Result<Self> {
        let n = tokens * top_k;
        Ok(Self {
            tokens,
            hidden,
            experts,
            top_k,
            inter,
            shared_inter,
            logits: c.alloc(tokens * (experts + 1))?,
            idx: c.alloc(n)?,
            weight: c.alloc(n)?,
            xq: c.alloc(tokens * hidden)?,
            xs: c.alloc(tokens)?,
            group_offsets: c.alloc(experts + 1)?,
            tile_offsets: c.alloc(tile_offsets_len(experts))?,
            row_token: c.alloc(n)?,
            row_of: c.alloc(n)?,
            gate_up: c.alloc(n * 2 * inter)?,
            aq: c.alloc(n * inter)?,
            as_: c.alloc(n)?,
            down: c.alloc(n * hidden)?,
            shared_gu: c.alloc(tokens * 2 * shared_inter)?,
            saq: c.alloc(tokens * shared_inter)?,
            sas: c.alloc(tokens)?,
            shared_y: c.alloc(tokens * hidden)?,
        })
    }
}

/// Most tokens of one `moe_route_sort` launch: one warp of its 1,024-thread block each.
pub(crate) const ROUTE_SORT_MAX: usize = 32;

/// `moe_router_topk`'s parameters (its assumptions are checked by `router_bytes`, in the launchers).
pub(crate) fn router_params(
    logits: Ptr,
    idx: Ptr,
    weight: Ptr,
    t: usize,
    experts: usize,
    top_k: usize,
    stride: usize,
) -> Result<OrnithRouterParams> {
    Ok(OrnithRouterParams {
        logits: logits as _,
        idx: idx as _,
        weight: weight as _,
        tokens: i32of("tokens", t)?,
        experts: i32of("experts", experts)?,
        top_k: i32of("top_k", top_k)?,
        logit_stride: i32of("router stride", stride)?,
    })
}
/// The router top-k's assumptions checked; its bytes (the logits read, idx and weights written).
fn router_bytes(p: &OrnithRouterParams) -> Result<u64> {
    let (t, experts, top_k, stride) = (p.tokens, p.experts, p.top_k, p.logit_stride);
    ensure!(
        t > 0 && experts <= 256 && (1..=32).contains(&top_k) && top_k <= experts && stride >= experts,
        "router: experts {experts} <= 256, 1 <= top_k {top_k} <= min(32, experts), stride {stride}"
    );
    Ok((t as usize * (experts as usize * 2 + top_k as usize * 8)) as u64)
}
/// `moe_sort`'s assumptions checked; its bytes (idx read, the sorted lists and offsets written).
fn sort_bytes(p: &OrnithMoeSortParams) -> Result<u64> {
    ensure!(
        p.tokens > 0 && p.top_k > 0 && (1..=1024).contains(&p.experts),
        "moe_sort: {} tokens, top_k {}, {} experts",
        p.tokens,
        p.top_k,
        p.experts
    );
    ensure!(
        (p.row_info as Ptr).is_multiple_of(16),
        "moe_sort: row_info must be 16-byte aligned (one int4 per block row)"
    );
    let n = p.tokens as usize * p.top_k as usize;
    // The 96- and 128-row tile counts share one 32-bit scan, 16 bits each (moe_prefill.cu): below
    // 2^21 assignments over at most 1,024 experts neither sum reaches its field's sign bit.
    ensure!(n < 1 << 21, "moe_sort: {n} assignments (fewer than 2^21)");
    let rows = if p.row_info.is_null() { 0 } else { (p.experts as usize).min(n) * 16 };
    Ok((n * 12 + (p.experts as usize + 1) * 16 + rows) as u64)
}

/// Rows per block of `swiglu_quant_ct`, one warp each (`SQ_ROWS` in moe_prefill.cu).
const SWIGLU_CT_ROWS: usize = 8;
impl CudaContext {
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
        let p = router_params(logits, idx, weight, t, experts, top_k, stride)?;
        let bytes = router_bytes(&p)?;
        self.launch(Launch::new("moe_router_topk", (t as u32, 1, 1), 32, bytes), p)
    }

    /// `moe_sort` (one block): counting sort of the `tokens · top_k` assignments of `p.idx` by
    /// expert (see `OrnithMoeSortParams`).
    pub(crate) fn k_moe_sort(&self, p: OrnithMoeSortParams) -> Result<()> {
        let bytes = sort_bytes(&p)?;
        // The one place that decides the staged write-out: the kernel stages its sorted rows in
        // windows of as many rows as the shared memory passed here holds, and scatters them
        // directly when it gets none.
        let n = p.tokens as u32 * p.top_k as u32;
        let staged = (ORNITH_MOE_SORT_STAGE_MIN..=ORNITH_MOE_SORT_STAGE_MAX).contains(&n);
        let smem = if staged { 2 * n.min(ORNITH_MOE_SORT_WINDOW) } else { 0 };
        self.launch(Launch::new("moe_sort", (1, 1, 1), 1024, bytes).smem(smem), p)
    }

    /// `moe_route_sort` (one block): [`Self::k_router`]'s top-k of at most [`ROUTE_SORT_MAX`]
    /// tokens, then [`Self::k_moe_sort`] of the idx it wrote, in one launch (the same bits as the
    /// two). `p.sort.idx` must be `p.router.idx` and the shapes agree.
    pub(crate) fn k_route_sort(&self, p: OrnithMoeRouteParams) -> Result<()> {
        let (r, s) = (&p.router, &p.sort);
        ensure!(
            (1..=ROUTE_SORT_MAX as i32).contains(&r.tokens),
            "moe_route_sort: {} tokens (one warp each, at most {ROUTE_SORT_MAX})",
            r.tokens
        );
        ensure!(
            std::ptr::eq(s.idx, r.idx) && (s.tokens, s.top_k, s.experts) == (r.tokens, r.top_k, r.experts),
            "moe_route_sort: the sort must read the router's idx with its shape"
        );
        let bytes = router_bytes(r)? + sort_bytes(s)?;
        self.launch(Launch::new("moe_route_sort", (1, 1, 1), 1024, bytes), p)
    }

    /// `a = bf16(bf16(silu(g)) · u)` per row of `gate_up [rows, 2·inter]`, then FP8 per row
    /// (`inter <= 1024`).
    pub(crate) fn k_swiglu(&self, gu: Ptr, q8: Ptr, scale: Ptr, rows: usize, inter: usize) -> Result<()> {
        ensure!(rows > 0 && inter > 0 && inter <= SWIGLU_MAX_INTER, "swiglu: 0 < inter {inter} <= {SWIGLU_MAX_INTER}");
        let p = OrnithSwigluQuantParams {
            gate_up: gu as _,
            q8: q8 as _,
            scale: scale as _,
            rows: i32of("rows", rows)?,
            inter: inter as i32,
        };
        self.launch(Launch::new("swiglu_quant", (rows as u32, 1, 1), 256, (rows * (inter * 5 + 4)) as u64), p)
    }

    /// SwiGLU of `rows` gate|up rows into bf16 rows of `inter` (`OrnithSwigluParams`; the
    /// NVFP4A16 experts' input, decode and prefill alike).
    pub(crate) fn k_swiglu_bf16(&self, gu: Ptr, out: Ptr, rows: usize, inter: usize) -> Result<()> {
        ensure!(rows > 0 && inter > 0, "swiglu_bf16: {rows} rows of {inter}");
        let blocks = (rows * inter).div_ceil(256);
        ensure!(blocks <= i32::MAX as usize, "swiglu_bf16: {rows} rows of {inter} need {blocks} blocks");
        let p = OrnithSwigluParams {
            gate_up: gu as _,
            out: out as _,
            rows: i32of("rows", rows)?,
            inter: i32of("inter", inter)?,
        };
        let grid = (blocks as u32, 1, 1);
        self.launch(Launch::new("swiglu_bf16", grid, 256, (rows * inter * 6) as u64), p)
    }

    /// `out = bf16(routed + sigmoid-gated shared)`, see `OrnithMoeCombineParams` ([`combine_params`]).
    pub(crate) fn k_combine_with(&self, p: OrnithMoeCombineParams) -> Result<()> {
        ensure!(p.tokens > 0 && p.hidden > 0 && p.top_k > 0, "moe_combine: empty");
        let grid = ((p.hidden as u32).div_ceil(256), p.tokens as u32, 1);
        self.launch(Launch::new("moe_combine", grid, 256, combine_bytes(&p) as u64), p)
    }

    /// The combine epilogue `c` of a per-slot down product (`moe_gemv_fp8_swiglu`,
    /// `moe_gemv_nvfp4_swiglu`) writing `y` (`tokens` x `top_k + 1` rows of `out`) over `tiles`
    /// block columns: checks that the combine reads that output with the product's shapes and
    /// returns the counters (one per (token, column), `wide_ticket`: one launch's at a time, and
    /// zero again when it ends) and the combine's bytes; null and 0 without an epilogue.
    pub(crate) fn combine_epilogue(
        &self,
        c: &OrnithMoeCombineParams,
        y: Ptr,
        tokens: i32,
        top_k: i32,
        out: i32,
        tiles: u32,
    ) -> Result<(*mut u32, usize)> {
        if c.out.is_null() {
            return Ok((std::ptr::null_mut(), 0));
        }
        ensure!(
            c.ys as Ptr == y && c.tokens == tokens && c.top_k == top_k && c.hidden == out && !c.weight.is_null(),
            "moe combine epilogue: the combine must read the product's own output ({tokens} tokens, top_k {top_k}, {out} rows)"
        );
        ensure!(
            tokens as usize * tiles as usize <= super::WIDE_TICKETS as usize,
            "moe combine epilogue: {tokens} tokens x {tiles} columns exceed {} counters",
            super::WIDE_TICKETS
        );
        Ok((self.addr(&self.wide_ticket) as _, combine_bytes(c)))
    }

    /// SwiGLU + compressed-tensors FP8 requantisation of `rows` gate|up rows (`inter <= 2048`, a
    /// multiple of 8; gate|up 16-byte and the codes 8-byte aligned), one warp per row.
    pub(crate) fn k_swiglu_ct(&self, gu: Ptr, q8: Ptr, scale: Ptr, rows: usize, inter: usize) -> Result<()> {
        ensure!(
            rows > 0 && inter > 0 && inter <= 2048 && inter.is_multiple_of(8),
            "swiglu_quant_ct: 0 < inter {inter} <= 2048, a multiple of 8"
        );
        ensure!(aligned(gu, 16) && aligned(q8, 8), "swiglu_quant_ct: gate|up rows 16-byte, codes 8-byte aligned");
        let p = OrnithSwigluQuantParams {
            gate_up: gu as _,
            q8: q8 as _,
            scale: scale as _,
            rows: i32of("rows", rows)?,
            inter: inter as i32,
        };
        let blocks = rows.div_ceil(SWIGLU_CT_ROWS) as u32;
        self.launch(
            Launch::new("swiglu_quant_ct", (blocks, 1, 1), 32 * SWIGLU_CT_ROWS as u32, (rows * (inter * 5 + 4)) as u64),
            p,
        )
    }

    /// The MoE combine of a prefill chunk over the expert-sorted rows (see
    /// `OrnithMoeCombinePrefillParams`).
    pub(crate) fn k_combine_prefill(&self, p: OrnithMoeCombinePrefillParams) -> Result<()> {
        ensure!(p.tokens > 0 && p.top_k > 0 && p.hidden > 0, "moe_combine_prefill: empty");
        let (t, k, h) = (p.tokens as usize, p.top_k as usize, p.hidden as usize);
        let bytes = t * ((k + 2) * h * 2 + k * 8 + 2);
        // 8 columns per thread where whole rows of 16-byte groups allow (the kernel takes its form
        // from the grid: fewer than hidden / 256 blocks per token), else one column per thread.
        let wide =
            h.is_multiple_of(8) && [p.ys as Ptr, p.shared_y as Ptr, p.out as Ptr].iter().all(|&a| aligned(a, 16));
        let blocks = if wide { h.div_ceil(8 * 256) } else { h.div_ceil(256) };
        self.launch(Launch::new("moe_combine_prefill", (blocks as u32, t as u32, 1), 256, bytes as u64), p)
    }
}

// The slice-based wrappers (the kernel tests' entry points).
impl CudaContext {
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
        let (l, i, w) = self.router_buffers(logits, idx, weight, tokens, experts, top_k, stride)?;
        self.k_router(l, i, w, tokens, experts, top_k, stride)
    }

    /// The router's buffers checked against its shape: the addresses of logits, idx and weight.
    #[allow(clippy::too_many_arguments)]
    fn router_buffers(
        &self,
        logits: &Bf,
        idx: &CudaSlice<i32>,
        weight: &CudaSlice<f32>,
        tokens: usize,
        experts: usize,
        top_k: usize,
        stride: usize,
    ) -> Result<(Ptr, Ptr, Ptr)> {
        ensure!(tokens > 0, "router: no tokens");
        need("router logits", logits, (tokens - 1) * stride + experts)?;
        need("router idx", idx, tokens * top_k)?;
        need("router weight", weight, tokens * top_k)?;
        Ok((self.addr(logits), self.addr(idx), self.addr(weight)))
    }

    /// `moe_sort` ([`Self::k_moe_sort`]) of a decode group's router output `idx [tokens, top_k]`
    /// for [`CudaContext::moe_gemv_grouped`], into new buffers: each expert's range of sorted
    /// rows, the assignment (`token · top_k + slot`) of each sorted row, and each grouped block
    /// row's expert and range (`row_info`).
    pub fn moe_groups(&self, idx: &CudaSlice<i32>, tokens: usize, top_k: usize, experts: usize) -> Result<MoeGroups> {
        need("moe_groups idx", idx, tokens * top_k)?;
        let g = self.groups_for(tokens * top_k, experts)?;
        self.k_moe_sort(g.sort_params(self, idx, tokens, top_k, experts)?)?;
        Ok(g)
    }

    /// [`Self::k_route_sort`] on buffers: the router's top-k of `tokens` rows of `logits` (row
    /// stride `stride`) into `idx` and `weight`, and their expert groups as [`Self::moe_groups`]
    /// makes them, in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route_groups(
        &self,
        logits: &Bf,
        idx: &mut CudaSlice<i32>,
        weight: &mut CudaSlice<f32>,
        tokens: usize,
        experts: usize,
        top_k: usize,
        stride: usize,
    ) -> Result<MoeGroups> {
        let (l, i, w) = self.router_buffers(logits, idx, weight, tokens, experts, top_k, stride)?;
        let g = self.groups_for(tokens * top_k, experts)?;
        self.k_route_sort(OrnithMoeRouteParams {
            router: router_params(l, i, w, tokens, experts, top_k, stride)?,
            sort: g.sort_params(self, idx, tokens, top_k, experts)?,
        })?;
        Ok(g)
    }

    /// New buffers for the expert groups of `n` assignments over `experts` experts.
    fn groups_for(&self, n: usize, experts: usize) -> Result<MoeGroups> {
        ensure!((1..=1024).contains(&experts), "moe_groups: {experts} experts");
        Ok(MoeGroups {
            group_offsets: self.alloc(experts + 1)?,
            tile_offsets: self.alloc(tile_offsets_len(experts))?,
            row_token: self.alloc(n)?,
            row_of: self.alloc(n)?,
            row_assign: self.alloc(n)?,
            row_info: self.alloc(4 * experts.min(n))?,
        })
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

    /// [`Self::k_swiglu_bf16`] on buffers.
    pub fn swiglu_bf16(&self, gate_up: &Bf, out: &mut Bf, rows: usize, inter: usize) -> Result<()> {
        need("swiglu_bf16 gate_up", gate_up, rows * 2 * inter)?;
        need("swiglu_bf16 out", out, rows * inter)?;
        self.k_swiglu_bf16(self.addr(gate_up), self.addr(out), rows, inter)
    }

    /// [`Self::k_combine_with`] on buffers.
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
        self.k_combine_with(combine_params(a, b, c, d, tokens, top_k, hidden, gate_stride, None)?)
    }

    /// The MoE block for `tokens` rows of `x` (see `cpu::moe::moe`) on buffers, through the
    /// launchers the CUDA backend's prefill MoE calls: router (BF16 GEMM over the
    /// `[experts + 1, hidden]` router | shared-gate weight) and top-k, per-token FP8 quantisation,
    /// counting sort by expert, grouped FP8 gate_up GEMM, SwiGLU + requantisation, grouped down
    /// GEMM, the shared expert, and the weighted combine into `out [tokens, hidden]`.
    pub fn moe_prefill(&self, a: &MoePrefillArgs, s: &mut MoePrefillScratch, out: &mut Bf) -> Result<()> {
        let tiles = super::gemm::grouped_fp8_tile_rows(a.tokens * a.top_k, a.experts);
        self.moe_prefill_tiles(a, s, out, tiles)
    }

    /// [`Self::moe_prefill`] with the grouped GEMMs in `tiles`-row tiles (64 or 96; the same bits).
    pub fn moe_prefill_tiles(
        &self,
        a: &MoePrefillArgs,
        s: &mut MoePrefillScratch,
        out: &mut Bf,
        tiles: usize,
    ) -> Result<()> {
        let (t, d, e, k, i, si) = (a.tokens, a.hidden, a.experts, a.top_k, a.inter, a.shared_inter);
        ensure!(t > 0 && t <= s.tokens, "moe_prefill: tokens {t} must be in 1..={} (scratch size)", s.tokens);
        ensure!(
            (d, e, k, i, si) == (s.hidden, s.experts, s.top_k, s.inter, s.shared_inter),
            "moe_prefill: scratch was made for other dims"
        );
        need("moe router", a.router, (e + 1) * d)?;
        need("moe w_gate_up", a.w_gate_up, e * 2 * i * d)?;
        need("moe ws_gate_up", a.ws_gate_up, e * 2 * i)?;
        need("moe w_down", a.w_down, e * d * i)?;
        need("moe ws_down", a.ws_down, e * d)?;
        need("moe shared gate_up", a.shared_gate_up, 2 * si * d)?;
        need("moe shared gate_up scale", a.shared_gate_up_scale, 2 * si)?;
        need("moe shared down", a.shared_down, d * si)?;
        need("moe shared down scale", a.shared_down_scale, d)?;
        need("moe x", a.x, t * d)?;
        need("moe out", out, t * d)?;
        let n = t * k;
        let at = |b: &CudaSlice<_>| -> Ptr { self.addr(b) };
        // Router logits (router | shared gate) and top-k.
        let logits = self.addr(&s.logits);
        self.k_gemm_bf16(self.addr(a.x), self.addr(a.router), logits, t, d, e + 1, d, e + 1)?;
        self.k_router(logits, self.addr(&s.idx), self.addr(&s.weight), t, e, k, e + 1)?;
        let (xq, xs) = (self.addr(&s.xq), self.addr(&s.xs));
        self.k_quant_ct(self.addr(a.x), xq, xs, t, d)?;
        let (go, to, rt, ro) = (at(&s.group_offsets), at(&s.tile_offsets), at(&s.row_token), at(&s.row_of));
        self.k_moe_sort(OrnithMoeSortParams {
            idx: self.addr(&s.idx) as _,
            group_offsets: go as _,
            tile_offsets: to as _,
            row_token: rt as _,
            row_of: ro as _,
            row_assign: std::ptr::null_mut(),
            row_info: std::ptr::null_mut(),
            tokens: i32of("tokens", t)?,
            top_k: k as i32,
            experts: e as i32,
        })?;
        // Grouped gate_up (row r, expert-sorted, reads token row_token[r] of xq), SwiGLU, down.
        self.k_experts_fp8(
            &Fp8ExpertFfn {
                x: xq,
                x_scale: xs,
                row_token: rt,
                w_gate_up: self.addr(a.w_gate_up),
                ws_gate_up: self.addr(a.ws_gate_up),
                w_down: self.addr(a.w_down),
                ws_down: self.addr(a.ws_down),
                gate_up: self.addr(&s.gate_up),
                aq: self.addr(&s.aq),
                a_scale: self.addr(&s.as_),
                y: self.addr(&s.down),
                group_offsets: go,
                tile_offsets: to,
                rows: n,
                hidden: d,
                inter: i,
                experts: e,
            },
            tiles,
        )?;
        // Shared expert on every token.
        let (sgu, saq, sas, sy) =
            (self.addr(&s.shared_gu), self.addr(&s.saq), self.addr(&s.sas), self.addr(&s.shared_y));
        let (w1, s1) = (self.addr(a.shared_gate_up), self.addr(a.shared_gate_up_scale));
        self.k_gemm_fp8(xq, xs, w1, s1, sgu, t, d, 2 * si, d, 2 * si)?;
        self.k_swiglu_ct(sgu, saq, sas, t, si)?;
        let (w2, s2) = (self.addr(a.shared_down), self.addr(a.shared_down_scale));
        self.k_gemm_fp8(saq, sas, w2, s2, sy, t, si, d, si, d)?;
        self.k_combine_prefill(OrnithMoeCombinePrefillParams {
            ys: self.addr(&s.down) as _,
            row_of: ro as _,
            weight: self.addr(&s.weight) as _,
            shared_y: sy as _,
            gate_logit: (logits + 2 * e as u64) as _,
            out: self.addr(out) as _,
            tokens: t as i32,
            top_k: k as i32,
            hidden: d as i32,
            gate_stride: (e + 1) as i32,
        })
    }
}

/// Addresses of the routed experts' FFN over `rows` expert-sorted rows (moe_sort's
/// `group_offsets` / `tile_offsets` for `experts` groups): row r reads row `row_token[r]` of the
/// FP8 activations `x` (per-row scales `x_scale`); gate|up `[E, 2I, H]` and down `[E, H, I]` E4M3
/// with per-channel scales; `gate_up [rows, 2I]` bf16, `aq` / `a_scale` its requantised SwiGLU,
/// `y [rows, H]` bf16.
pub(crate) struct Fp8ExpertFfn {
    pub x: Ptr,
    pub x_scale: Ptr,
    pub row_token: Ptr,
    pub w_gate_up: Ptr,
    pub ws_gate_up: Ptr,
    pub w_down: Ptr,
    pub ws_down: Ptr,
    pub gate_up: Ptr,
    pub aq: Ptr,
    pub a_scale: Ptr,
    pub y: Ptr,
    pub group_offsets: Ptr,
    pub tile_offsets: Ptr,
    pub rows: usize,
    pub hidden: usize,
    pub inter: usize,
    pub experts: usize,
}

impl CudaContext {
    /// The routed experts of a prefill step (FP8): the grouped gate|up GEMM, SwiGLU +
    /// requantisation, the grouped down GEMM, both GEMMs in `tiles`-row tiles (64 or 96,
    /// [`super::gemm::grouped_fp8_tile_rows`]; the same bits). Shared by the engine's MoE
    /// (`backend_cuda::moe`) and [`Self::moe_prefill`].
    pub(crate) fn k_experts_fp8(&self, f: &Fp8ExpertFfn, tiles: usize) -> Result<()> {
        let grouped = |a: Ptr, a_scale: Ptr, a_rows: Ptr, w: Ptr, w_scale: Ptr, y: Ptr, in_: usize, out: usize| {
            self.k_gemm_grouped(
                OrnithGemmParams {
                    a: a as _,
                    a_scale: a_scale as _,
                    a_rows: a_rows as _,
                    w: w as _,
                    w_scale: w_scale as _,
                    y: y as _,
                    group_offsets: f.group_offsets as _,
                    tile_offsets: f.tile_offsets as _,
                    rows: i32of("rows", f.rows)?,
                    in_: i32of("in", in_)?,
                    out: i32of("out", out)?,
                    a_stride: in_ as i32,
                    y_stride: out as i32,
                    groups: i32of("experts", f.experts)?,
                    ..Default::default()
                },
                tiles,
            )
        };
        let (h, i) = (f.hidden, f.inter);
        grouped(f.x, f.x_scale, f.row_token, f.w_gate_up, f.ws_gate_up, f.gate_up, h, 2 * i)?;
        self.k_swiglu_ct(f.gate_up, f.aq, f.a_scale, f.rows, i)?;
        grouped(f.aq, f.a_scale, 0, f.w_down, f.ws_down, f.y, i, h)
    }
}
