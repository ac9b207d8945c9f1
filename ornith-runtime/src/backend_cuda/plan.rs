//! What the CUDA backend will allocate, computed before anything is allocated and checked
//! against the device's free memory (`cuMemGetInfo`): on a unified-memory machine (DGX Spark) an
//! overcommit wedges the whole system instead of failing an allocation.
use crate::engine::{snapshots_for, Capacity, PoolRequest};
use crate::graph::{Dims, KV_BLOCK};
use crate::weights::Checkpoint;
use anyhow::{ensure, Result};
use model_spec::{report, DType, LayerKind, ModelSpec, TensorInfo};

/// Rows of one prefill chunk: a layer runs a sequence's rows in chunks of this many tokens
/// (exact: the conv/recurrent states and the K/V blocks carry across chunks), so scratch does not
/// grow with the prompt. The engine's chunk ([`crate::engine::PREFILL_CHUNK`], one source): 2048
/// rows give the MoE's grouped GEMMs ~64 rows per expert (top-8 of 256), so each chunk reads
/// every expert's weights once for 4x the rows of a 512-row chunk; the scratch is ~0.4 GiB at the
/// 35B shapes. A decode group (at most [`MAX_DECODE_ROWS`] rows) fits the same scratch.
pub const CHUNK: usize = crate::engine::PREFILL_CHUNK;
/// Most sequences at once (state slots): the decode group's static buffers and the sampler are
/// sized for the pool's slots, at most this many (and a group must fit one chunk's scratch).
pub const MAX_DECODE_ROWS: usize = 256;
const _: () = assert!(MAX_DECODE_ROWS <= CHUNK);
const _: () = assert!(MAX_DECODE_ROWS == crate::cli::THROUGHPUT_SEQS);
/// Most prefill rows one MoE block runs at once: a step's prefill chunks (of one sequence or of
/// several, `--max-batch-tokens` rows) go through the router, the grouped expert GEMMs and the
/// combine together, so each expert's 64-row tiles fill up (top-8 of 256: ~64 rows per expert
/// at 2,048 rows, whose tiles run about two-thirds full; ~256 at 8,192, ~90%). A row's bits do
/// not depend on the rows beside it (each output row's sums, its quantisation and its combine
/// are its own), so this changes no token. The MoE scratch grows to ~0.6 GiB at the 35B shapes.
pub const MAX_MOE_ROWS: usize = 4 * CHUNK;
// `run` and `batch` default to steps of this many rows (`cli::THROUGHPUT_STEP_ROWS`).
const _: () = assert!(MAX_MOE_ROWS == crate::cli::THROUGHPUT_STEP_ROWS);

/// The MoE scratch's rows for steps of `max_batch_tokens` rows (a step's prefill rows: at most
/// that, or one chunk), within `CHUNK ..= MAX_MOE_ROWS`.
pub fn moe_rows(max_batch_tokens: usize) -> usize {
    max_batch_tokens.clamp(CHUNK, MAX_MOE_ROWS)
}

/// Rows of one step's residual stream the plan holds (bf16 hidden and delta and a row index
/// each): a step carries at most `max_batch_tokens` prefill rows (one chunk at least) beside one
/// decode row per sequence (the engine does not count those against the prefill rows); never
/// fewer than one longest sequence.
pub fn activation_rows(max_context: usize, max_batch_tokens: usize) -> usize {
    max_context.max(max_batch_tokens.max(CHUNK) + MAX_DECODE_ROWS)
}

/// Element counts of one slot of a Gated DeltaNet pool: conv `[3, conv_dim]` (bf16) and
/// recurrent `[Hv, dk, dv]` (f32).
pub fn gdn_slot_elems(d: &Dims) -> (usize, usize) {
    d.gdn_state_elems() // conv_kernel is 4 (check_dims): conv [3, conv_dim]
}

/// int32 elements of the step description for `rows` slots and tables of `width` blocks:
/// ids, positions, slots `[rows]` each and a table row `[width]` per sequence.
pub fn desc_len(rows: usize, width: usize) -> usize {
    rows * (3 + width)
}
/// Decode groups of at least this many rows run the routed experts grouped by expert
/// (`moe_gemv_grouped`: bit-identical to the per-(token, slot) GEMV, each expert's weights read
/// once per step instead of once per token routed to it).
pub const GROUPED_MOE_ROWS: usize = 4;
/// Grouped decode groups of at most this many rows run their router top-k and expert sort as one
/// launch (`moe_route_sort`, the same bits as `moe_router_topk` then `moe_sort`). H100, 2K, one
/// graph per step (docs/PERF-2026-12-late.md, thirty-third session): at 8 sequences the step went 6,481 ->
/// 6,437 us (decode 1,224.7 -> 1,235.8 tok/s); with the limit at 16, 16 sequences gained nothing
/// measurable (1,659.3 -> 1,663.4); at 32 the one block was slower (14,088 -> 14,237 us: 32
/// top-k warps on one SM against one each on 32 SMs).
pub const ROUTE_SORT_TOKENS: usize = 8;
const _: () = assert!(ROUTE_SORT_TOKENS <= crate::cuda::moe::ROUTE_SORT_MAX);
/// Query rows of one decode attention launch: the kernel's most (the split partials scale with
/// it: 4.2 MiB per row at the 35B shapes). A decode group of up to 64 sequences is one launch: in
/// launches of 8 the 64-sequence step spent 2.4 ms in 160 attention launches at 2K (H200,
/// docs/DESIGN.md).
pub const ATTN_ROWS: usize = crate::cuda::attention::ATT_MAX_ROWS;
/// Most sequence splits of one attention launch, and the shortest split.
pub const MAX_SPLITS: usize = 256;
pub const MIN_SPLIT: usize = 32;
/// Kept free for the driver, module images, allocator granularity and the host side of a
/// unified-memory device.
pub const MARGIN: u64 = 1 << 30;

/// Sequence split of an attention launch whose last query sits at `total - 1`:
/// `splits · split_len >= total`, `splits <= MAX_SPLITS`, `split_len >= MIN_SPLIT`.
pub fn split_for(total: usize) -> (usize, usize) {
    let len = total.div_ceil(MAX_SPLITS).max(MIN_SPLIT);
    (len, total.div_ceil(len))
}

/// Refuses models whose shapes the decode kernels were not written for (before any allocation).
pub fn check_dims(d: &Dims) -> Result<()> {
    let fix = "the CUDA kernels are written for the Ornith 35B shapes (shallow/full presets); use --backend cpu for this checkpoint";
    ensure!(
        d.linear_key_head_dim == 128 && d.linear_value_head_dim == 128,
        "Gated DeltaNet head dims {}x{} (kernel: 128x128): {fix}",
        d.linear_key_head_dim,
        d.linear_value_head_dim
    );
    ensure!(
        d.linear_num_value_heads.is_multiple_of(d.linear_num_key_heads),
        "v heads {} not a multiple of k heads {}: {fix}",
        d.linear_num_value_heads,
        d.linear_num_key_heads
    );
    ensure!(d.linear_conv_kernel_dim == 4, "conv kernel {} (kernel: 4): {fix}", d.linear_conv_kernel_dim);
    ensure!(d.head_dim == 256, "attention head_dim {} (kernel: 256): {fix}", d.head_dim);
    ensure!(
        d.num_key_value_heads > 0
            && d.num_attention_heads.is_multiple_of(d.num_key_value_heads)
            && d.num_attention_heads / d.num_key_value_heads <= 8,
        "GQA group {}/{}: {fix}",
        d.num_attention_heads,
        d.num_key_value_heads
    );
    ensure!(d.rotary_dim.is_multiple_of(2) && d.rotary_dim <= d.head_dim, "rotary dim {}: {fix}", d.rotary_dim);
    ensure!(
        d.hidden_size.is_multiple_of(16) && d.hidden_size <= 8192,
        "hidden {} (multiple of 16, <= 8192): {fix}",
        d.hidden_size
    );
    ensure!(
        d.num_experts <= 256
            && d.num_experts_per_tok >= 1
            && d.num_experts_per_tok <= 32
            && d.num_experts_per_tok <= d.num_experts,
        "experts {} / top-k {} (at most 32): {fix}",
        d.num_experts,
        d.num_experts_per_tok
    );
    ensure!(
        d.moe_intermediate_size <= 1024 && d.moe_intermediate_size.is_multiple_of(16),
        "expert width {}: {fix}",
        d.moe_intermediate_size
    );
    ensure!(
        d.shared_expert_intermediate_size == d.moe_intermediate_size,
        "shared expert width {} != routed {} (one MoE launch serves both): {fix}",
        d.shared_expert_intermediate_size,
        d.moe_intermediate_size
    );
    Ok(())
}

/// Element counts of the scratch buffers: one prefill chunk, the MoE's `moe_rows` rows.
#[derive(Debug, Clone, Copy)]
pub struct ScratchSizes {
    /// Rows of the MoE's buffers and of the normalised input rows ([`moe_rows`]).
    pub moe_rows: usize,
    pub xb: usize,
    pub xq: usize,
    pub xs: usize,
    /// SwiGLU output codes `[CHUNK · slots, I]` and their scales.
    pub aq: usize,
    pub asc: usize,
    /// GDN projection row `[qkv | z | b | a]`.
    pub proj_w: usize,
    pub conv: usize,
    pub o: usize,
    pub qg: usize,
    pub kv: usize,
    pub part_o: usize,
    pub part_ml: usize,
    pub rlog_w: usize,
    pub slots: usize,
    /// fp32 workspace of the two-phase chunked gated delta rule (`gdn_work_len(CHUNK, hv)`).
    pub gdn_work: usize,
}

impl ScratchSizes {
    /// The sizes for steps of `max_batch_tokens` rows (the MoE's: [`moe_rows`] of it).
    pub fn new(d: &Dims, max_batch_tokens: usize) -> Self {
        let vdim = d.value_dim().max(d.num_attention_heads * d.head_dim);
        let slots = d.num_experts_per_tok + 1;
        let m = moe_rows(max_batch_tokens);
        ScratchSizes {
            moe_rows: m,
            xb: m * d.hidden_size,
            xq: (m * d.hidden_size).max(CHUNK * vdim),
            xs: m,
            // Bytes: the experts' FP8 inputs, or their bf16 inputs for NVFP4A16 experts (2 per element).
            aq: 2 * m * slots * d.moe_intermediate_size,
            asc: m * slots,
            proj_w: d.conv_dim() + d.value_dim() + 2 * d.linear_num_value_heads,
            conv: CHUNK * d.conv_dim(),
            o: CHUNK * vdim,
            qg: CHUNK * d.num_attention_heads * 2 * d.head_dim,
            kv: CHUNK * d.num_key_value_heads * d.head_dim,
            part_o: ATTN_ROWS * d.num_attention_heads * MAX_SPLITS * d.head_dim,
            part_ml: ATTN_ROWS * d.num_attention_heads * MAX_SPLITS * 2,
            rlog_w: d.num_experts + 1,
            slots,
            gdn_work: crate::cuda::gdn::gdn_work_len(CHUNK, d.linear_num_value_heads),
        }
    }

    /// Bytes of all scratch buffers (see `Scratch::new` for the list).
    pub fn bytes(&self, d: &Dims) -> u64 {
        let (c, m) = (CHUNK, self.moe_rows);
        let bf = 2
            * (self.xb
                + c * self.proj_w
                + self.conv
                + 2 * self.o
                + self.qg
                + 2 * self.kv
                + c * d.num_attention_heads * d.head_dim
                + m * self.rlog_w
                + m * self.slots * 2 * d.moe_intermediate_size
                + m * self.slots * d.hidden_size);
        // idx + wt, the MoE's group offsets and tile offsets (a prefix per tile height),
        // row_token, row_of, row_assign and the grouped block rows' row_info (4 per expert).
        // (gdn_work: fp32, counted below; the greedy sampler's rows: per slot, `step_bytes_per_slot`.)
        let f4 = 4
            * (self.xs
                + self.asc
                + self.part_o
                + self.part_ml
                + m * d.num_experts_per_tok * 2
                + (d.num_experts + 1)
                + crate::cuda::gemm::tile_offsets_len(d.num_experts)
                + 3 * m * d.num_experts_per_tok
                + 4 * d.num_experts);
        (bf + self.xq + self.aq + f4 + 4 * self.gdn_work) as u64
    }
}

/// Device bytes of the step buffers per slot (the decode group has at most one row per slot):
/// the description row (`desc_len`), the residual and delta rows, a logits row, the sampler's
/// row and the greedy sampler's two ints.
pub fn step_bytes_per_slot(d: &Dims, table_width: usize) -> u64 {
    (4 * desc_len(1, table_width) + 2 * 2 * d.hidden_size + 2 * d.vocab_size + 8) as u64
        + crate::cuda::sample::SampleScratch::row_bytes(d.vocab_size)
}

/// What the pools cost: `fixed` bytes whatever their size (weights, scratch, prompt
/// activations, margin), `per_slot` per state slot (recurrent state of every GDN layer + step
/// buffers), `per_snapshot` per prefix-cache snapshot (the recurrent state alone), `per_block`
/// per K/V block (every attention layer), and the blocks one sequence of the longest context
/// needs.
#[derive(Debug, Clone, Copy)]
pub struct PoolCosts {
    pub fixed: u64,
    pub per_slot: u64,
    pub per_snapshot: u64,
    pub per_block: u64,
    pub seq_blocks: usize,
}

/// Sizes the pools within `free` bytes: slots = `--max-seqs`, or as many as fit up to
/// `req.default_seqs` beside the fixed part and a K/V pool of `--kv-budget` (or of one
/// longest sequence); blocks = `--kv-budget` / block bytes, or what is left after the slots,
/// between one longest sequence and `slots` of them, after the prefix cache's snapshots
/// (`--prefix-cache-bytes`, default up to 4 GiB and a quarter of what the rest leaves). Refuses,
/// naming the flag, what cannot hold
/// one sequence of `max_context` tokens. (The total is checked by [`MemoryPlan::check`].)
pub fn size_pools(c: &PoolCosts, req: &PoolRequest, free: u64) -> Result<Capacity> {
    let g = |b: u64| b as f64 / (1u64 << 30) as f64;
    let (sb, ctx) = (c.seq_blocks, req.max_context);
    let one_seq = c.fixed + c.per_slot + sb as u64 * c.per_block;
    ensure!(
        one_seq <= free,
        "not enough GPU memory for one sequence of --max-context {ctx} tokens: it needs {:.2} GiB (weights, scratch and \
         margin {:.2}, one state slot {:.2}, {sb} K/V blocks {:.2}) but {:.2} GiB is free. Fix: lower --max-context, \
         free GPU memory, or use --backend cpu.",
        g(one_seq), g(c.fixed), g(c.per_slot), g(sb as u64 * c.per_block), g(free)
    );
    // no attention layer: K/V blocks cost nothing
    let blocks_of = |bytes: u64| bytes.checked_div(c.per_block).map_or(usize::MAX, |n| n as usize);
    if let Some(b) = req.kv_budget {
        let n = blocks_of(b);
        ensure!(
            n >= sb,
            "--kv-budget {b} bytes holds {n} K/V blocks of {KV_BLOCK} tokens; one sequence of --max-context {ctx} \
             needs {sb} ({:.2} GiB). Fix: raise --kv-budget or lower --max-context.",
            g(sb as u64 * c.per_block)
        );
    }
    let slots = match req.max_seqs {
        Some(n) => {
            ensure!(
                (1..=MAX_DECODE_ROWS).contains(&n),
                "--max-seqs {n}: the CUDA backend runs 1 to {MAX_DECODE_ROWS} sequences at once"
            );
            n
        }
        None => {
            let kv = req.kv_budget.map_or(sb as u64 * c.per_block, |b| b.max(sb as u64 * c.per_block));
            let room = free.saturating_sub(c.fixed + kv);
            ((room / c.per_slot.max(1)) as usize).clamp(1, req.default_seqs.clamp(1, MAX_DECODE_ROWS))
        }
    };
    let most = slots.saturating_mul(sb);
    let kv_min = req.kv_budget.unwrap_or(sb as u64 * c.per_block);
    let room = free.saturating_sub(c.fixed + slots as u64 * c.per_slot + kv_min);
    let snapshots = snapshots_for(req.prefix_cache, c.per_snapshot, room);
    let states = slots as u64 * c.per_slot + snapshots as u64 * c.per_snapshot;
    let blocks = match req.kv_budget {
        Some(b) => blocks_of(b).min(most),
        None => blocks_of(free.saturating_sub(c.fixed + states)).clamp(sb, most),
    };
    Ok(Capacity { slots, blocks, snapshots })
}

/// How the CUDA backend holds a checkpoint tensor (`load.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceForm {
    /// FP8 codes and BF16 matrices: the stored bytes.
    AsStored,
    /// An FP8 weight's per-channel `*_scale`: f32 only (4 bytes per element).
    ScaleF32,
    /// An NVFP4 weight's `weight_global_scale`: the dequantisation table it defines, 256
    /// entries of 16 bytes (`cuda::nvfp4::fp4_table`, 4 KiB per element).
    ScaleTable,
    /// A vector (1-D, or a `[C, 1, k]` conv kernel): bf16 and f32 both (6 bytes per element).
    Vector,
}

/// The form of tensor `name` on the device.
pub fn device_form(name: &str, t: &TensorInfo) -> DeviceForm {
    if !matches!(t.dtype, DType::BF16 | DType::F32) {
        DeviceForm::AsStored
    } else if name.ends_with("_global_scale") {
        DeviceForm::ScaleTable
    } else if name.ends_with("_scale") {
        DeviceForm::ScaleF32
    } else if t.shape.len() == 1 || (t.shape.len() == 3 && t.shape[1] == 1) {
        DeviceForm::Vector
    } else {
        DeviceForm::AsStored
    }
}

/// Device bytes of tensor `name` as the backend holds it ([`device_form`]).
pub fn device_bytes(name: &str, t: &TensorInfo) -> u64 {
    match device_form(name, t) {
        DeviceForm::AsStored => t.nbytes(),
        DeviceForm::ScaleF32 => 4 * t.numel() as u64,
        DeviceForm::ScaleTable => crate::cuda::nvfp4::TAB_BYTES as u64 * t.numel() as u64,
        DeviceForm::Vector => 6 * t.numel() as u64,
    }
}

/// Device bytes of every weight the backend uploads (the text model: no `visual.*`, no `mtp.*`).
pub fn device_weight_bytes(spec: &ModelSpec) -> u64 {
    spec.tensors
        .iter()
        .filter(|(n, _)| !report::is_visual(n) && !n.starts_with("mtp."))
        .map(|(n, t)| device_bytes(n, t))
        .sum()
}

/// The device memory the backend will hold, by purpose, for pools of `slots` and `blocks`.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct MemoryPlan {
    pub weights: u64,
    pub kv_cache: u64,
    pub recurrent_state: u64,
    pub scratch: u64,
    /// The static step buffers (description, decode rows, logits, sampler) for `slots` rows.
    pub step_buffers: u64,
    /// Hidden states of one step (two `[T, hidden]` bf16 buffers and a row index) for
    /// `activation_rows` rows ([`activation_rows`]).
    pub activations: u64,
    /// Rows `activations` holds: the larger of one step's and one longest sequence's.
    pub activation_rows: usize,
    pub margin: u64,
    pub max_context: usize,
    pub slots: usize,
    /// Prefix-cache snapshots (counted in `recurrent_state`).
    pub snapshots: usize,
    pub blocks: usize,
    pub attention_layers: usize,
    pub gdn_layers: usize,
}

impl MemoryPlan {
    /// Sizes the pools for `req` within `free` bytes ([`size_pools`]; `source` names where
    /// `free` came from) and returns the plan and the pools' capacity.
    pub fn new(ck: &Checkpoint, d: &Dims, req: &PoolRequest, free: u64, source: &str) -> Result<(Self, Capacity)> {
        let spec = &ck.spec;
        let weights = device_weight_bytes(spec);
        let attention_layers = spec.layers.iter().filter(|l| l.kind == LayerKind::FullAttention).count();
        let gdn_layers = spec.layers.len() - attention_layers;
        let max_context = req.max_context;
        let width = max_context.div_ceil(KV_BLOCK);
        let (conv, ssm) = gdn_slot_elems(d);
        let state_per_slot = (gdn_layers * (conv * 2 + ssm * 4)) as u64;
        let step_per_slot = step_bytes_per_slot(d, width);
        let per_block = (attention_layers * KV_BLOCK * d.num_key_value_heads * d.head_dim * 2 * 2) as u64;
        let scratch = ScratchSizes::new(d, req.max_batch_tokens).bytes(d)
            + crate::cuda::sample::SampleScratch::fixed_bytes(d.vocab_size);
        let activation_rows = activation_rows(max_context, req.max_batch_tokens);
        let activations = (activation_rows * (d.hidden_size * 4 + 4)) as u64;
        let costs = PoolCosts {
            fixed: weights + scratch + activations + MARGIN,
            per_slot: state_per_slot + step_per_slot,
            per_snapshot: state_per_slot,
            per_block,
            seq_blocks: width,
        };
        let cap = size_pools(&costs, req, free).map_err(|e| e.context(format!("sizing the state pools ({source})")))?;
        let plan = MemoryPlan {
            weights,
            kv_cache: cap.blocks as u64 * per_block,
            recurrent_state: (cap.slots + cap.snapshots) as u64 * state_per_slot,
            scratch,
            step_buffers: cap.slots as u64 * step_per_slot,
            activations,
            activation_rows,
            margin: MARGIN,
            max_context,
            slots: cap.slots,
            snapshots: cap.snapshots,
            blocks: cap.blocks,
            attention_layers,
            gdn_layers,
        };
        Ok((plan, cap))
    }

    /// Blocks of one block table row: enough for the planned context.
    pub fn table_width(&self) -> usize {
        self.max_context.div_ceil(KV_BLOCK)
    }

    pub fn total(&self) -> u64 {
        self.weights
            + self.kv_cache
            + self.recurrent_state
            + self.scratch
            + self.step_buffers
            + self.activations
            + self.margin
    }

    /// Errors with the numbers when the plan does not fit `free` bytes (`source`: where that
    /// number came from, see [`usable_free`]).
    pub fn check(&self, free: u64, source: &str, total_mem: u64, device: &str) -> Result<()> {
        let g = |b: u64| b as f64 / (1u64 << 30) as f64;
        ensure!(
            self.total() <= free,
            "not enough GPU memory on '{device}': the CUDA backend needs {:.2} GiB (weights {:.2}, K/V cache {:.2} in {} blocks, \
             recurrent state {:.2} for {} sequences and {} prefix-cache snapshots, scratch {:.2}, step buffers {:.2}, \
             activations {:.2} for {} tokens, margin {:.2}) but only {:.2} GiB of {:.2} GiB is free ({source}). \
             Fix: lower --max-context, --max-seqs, --kv-budget or --prefix-cache-bytes, free GPU memory, or use --backend cpu.",
            g(self.total()), g(self.weights), g(self.kv_cache), self.blocks, g(self.recurrent_state), self.slots, self.snapshots,
            g(self.scratch), g(self.step_buffers), g(self.activations), self.activation_rows, g(self.margin), g(free),
            g(total_mem)
        );
        Ok(())
    }
}

/// The memory the plan may use, and where the number comes from. `driver_free` is
/// `cuMemGetInfo`'s free bytes. On an integrated GPU (unified memory: the DGX Spark's GB10) that
/// number is the kernel's `MemFree`, which counts the page cache — the checkpoint's own mmapped
/// shards among it — as used although the kernel reclaims it on demand (NVIDIA's DGX Spark known
/// issue "memory reporting differences with unified memory architecture"): a Spark that has just
/// read the 35 GB checkpoint would be refused. There the usable amount is `/proc/meminfo`'s
/// `MemAvailable`. Swap is not counted: weights paged out to swap are the wedge this check is for.
pub fn usable_free(driver_free: u64, integrated: bool, meminfo: Option<&str>) -> (u64, &'static str) {
    if integrated {
        if let Some(avail) = meminfo.and_then(mem_available) {
            return (avail, "MemAvailable of /proc/meminfo: unified memory");
        }
    }
    (driver_free, "cuMemGetInfo")
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes (None when absent or malformed).
pub fn mem_available(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|l| {
        let mut it = l.strip_prefix("MemAvailable:")?.split_whitespace();
        let v: u64 = it.next()?.parse().ok()?;
        match (it.next(), it.next()) {
            (Some("kB"), None) => v.checked_mul(1024),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       127603508 kB\nMemFree:         4194304 kB\nMemAvailable:   115855360 kB\nBuffers:           12345 kB\nCached:         72640000 kB\nSwapFree:        8388604 kB\n";

    #[test]
    fn unified_memory_counts_reclaimable_page_cache() {
        assert_eq!(mem_available(MEMINFO), Some(115855360 * 1024));
        // A discrete GPU: the driver's number, whatever the host has.
        assert_eq!(usable_free(10 << 30, false, Some(MEMINFO)), (10 << 30, "cuMemGetInfo"));
        // Integrated (GB10): MemFree (4 GiB, what cuMemGetInfo reports there) is not the limit;
        // MemAvailable (page cache included, swap not) is.
        let (free, src) = usable_free(4 << 30, true, Some(MEMINFO));
        assert_eq!(free, 115855360 * 1024);
        assert!(src.contains("MemAvailable"), "{src}");
        // No readable /proc/meminfo: fall back to the driver.
        assert_eq!(usable_free(4 << 30, true, None).0, 4 << 30);
        assert_eq!(usable_free(4 << 30, true, Some("MemTotal: 1 kB\n")).0, 4 << 30);
        // Malformed values are not guessed at.
        for bad in ["MemAvailable: x kB\n", "MemAvailable: 12 MB\n", "MemAvailable: 12 kB 3\n"] {
            assert_eq!(mem_available(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn plan_refused_with_the_numbers_and_the_source() {
        let gib = 1u64 << 30;
        let p = MemoryPlan {
            weights: 37 * gib,
            kv_cache: 5 * gib,
            recurrent_state: 0,
            scratch: gib,
            step_buffers: 0,
            activations: 0,
            activation_rows: 262144,
            margin: MARGIN,
            max_context: 262144,
            slots: 4,
            snapshots: 0,
            blocks: 20,
            attention_layers: 10,
            gdn_layers: 30,
        };
        assert_eq!(p.total(), 44 * gib);
        assert!(p.check(44 * gib, "cuMemGetInfo", 48 * gib, "GB10").is_ok());
        let e = p
            .check(44 * gib - 1, "MemAvailable of /proc/meminfo: unified memory", 120 * gib, "NVIDIA GB10")
            .unwrap_err()
            .to_string();
        for want in [
            "NVIDIA GB10",
            "needs 44.00 GiB",
            "weights 37.00",
            "262144 tokens",
            "4 sequences",
            "--max-seqs",
            "of 120.00 GiB",
            "MemAvailable",
            "--kv-budget",
        ] {
            assert!(e.contains(want), "missing {want:?} in: {e}");
        }
    }

    #[test]
    fn pools_sized_within_free_memory() {
        let mib = 1u64 << 20;
        // 63 MiB per slot, 5 MiB per block, 40 blocks per sequence (max_context 10240).
        let c = PoolCosts {
            fixed: 1000 * mib,
            per_slot: 63 * mib,
            per_snapshot: 60 * mib,
            per_block: 5 * mib,
            seq_blocks: 40,
        };
        let req = |s: Option<usize>, kv: Option<u64>| PoolRequest {
            max_seqs: s,
            default_seqs: 64,
            kv_budget: kv,
            max_context: 10240,
            prefix_cache: Some(0),
            max_batch_tokens: CHUNK,
        };
        // A step's rows: the prefill budget plus a decode row per sequence, or one longest sequence.
        assert_eq!(activation_rows(262_144, 8192), 262_144);
        assert_eq!(activation_rows(4096, 8192), 8192 + MAX_DECODE_ROWS);
        assert_eq!(activation_rows(1000, 96), CHUNK + MAX_DECODE_ROWS);
        // Plenty of memory: 64 slots (serve's cap), the K/V pool capped at 64 full sequences.
        let cap = size_pools(&c, &req(None, None), 1 << 50).unwrap();
        assert_eq!(cap, Capacity { slots: 64, blocks: 64 * 40, snapshots: 0 });
        // The throughput front ends' cap: 256 slots where they fit, as many as fit where not
        // (1000 + 200 + 63 * 100 = 7500 MiB: 100), and never beyond a decode step's rows.
        let wide = |n: usize| PoolRequest { default_seqs: n, ..req(None, None) };
        let cap = size_pools(&c, &wide(crate::cli::THROUGHPUT_SEQS), 1 << 50).unwrap();
        assert_eq!(cap, Capacity { slots: 256, blocks: 256 * 40, snapshots: 0 });
        assert_eq!(size_pools(&c, &wide(256), 7500 * mib).unwrap().slots, 100);
        assert_eq!(size_pools(&c, &wide(10_000), 1 << 50).unwrap().slots, MAX_DECODE_ROWS);
        // The default prefix cache: 4 GiB of 60 MiB snapshots when memory is plentiful.
        let dflt = PoolRequest { prefix_cache: None, ..req(None, None) };
        assert_eq!(size_pools(&c, &dflt, 1 << 50).unwrap().snapshots, 4096 / 60);
        // 1000 + 200 (one sequence's K/V) + 63·10 = 1830 MiB: 10 slots; K/V gets the rest.
        let cap = size_pools(&c, &req(None, None), 1830 * mib).unwrap();
        assert_eq!(cap.slots, 10);
        assert_eq!(cap.blocks, (1830 - 1000 - 630) / 5);
        // Exactly one sequence fits, and no snapshot beside it by default.
        let cap = size_pools(&c, &req(None, None), (1000 + 63 + 200) * mib).unwrap();
        assert_eq!(cap, Capacity { slots: 1, blocks: 40, snapshots: 0 });
        let one = PoolRequest { prefix_cache: None, ..req(None, None) };
        assert_eq!(size_pools(&c, &one, (1000 + 63 + 200) * mib).unwrap().snapshots, 0);
        // Explicit flags.
        let cap = size_pools(&c, &req(Some(3), Some(400 * mib)), 1 << 40).unwrap();
        assert_eq!(cap, Capacity { slots: 3, blocks: 80, snapshots: 0 });
        // Snapshots come before the default K/V pool.
        let snaps = PoolRequest { prefix_cache: Some(600 * mib), ..req(Some(1), None) };
        let cap = size_pools(&c, &snaps, (1000 + 63 + 600 + 400) * mib).unwrap();
        assert_eq!(cap, Capacity { slots: 1, blocks: 40, snapshots: 10 });
        // A budget beyond `slots` full sequences is capped there.
        let cap = size_pools(&c, &req(Some(3), Some(4000 * mib)), 1 << 40).unwrap();
        assert_eq!(cap, Capacity { slots: 3, blocks: 120, snapshots: 0 });
        let e = size_pools(&c, &req(None, Some(10 * mib)), 1 << 40).unwrap_err().to_string();
        assert!(e.contains("--kv-budget") && e.contains("needs 40"), "{e}");
        let e = size_pools(&c, &req(None, None), 1200 * mib).unwrap_err().to_string();
        assert!(e.contains("--max-context 10240"), "{e}");
        let e = size_pools(&c, &req(Some(MAX_DECODE_ROWS + 1), None), 1 << 50).unwrap_err().to_string();
        assert!(e.contains("--max-seqs"), "{e}");
    }

    #[test]
    fn splits_cover_the_sequence() {
        for total in [1, 31, 32, 33, 4096, 8191, 65536, 262144, 262145] {
            let (len, n) = split_for(total);
            assert!(
                len >= MIN_SPLIT && n <= MAX_SPLITS && n * len >= total && (n - 1) * len < total,
                "{total}: {len} x {n}"
            );
        }
    }
}
