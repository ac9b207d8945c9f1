//! Launchers of attention.cu and flash_attn.cu: q/k norm + partial RoPE + paged K/V write, the
//! split-sequence decode attention (split + combine) and causal flash attention for prefill.
//!
//! One launcher per kernel (see [`super`]): device addresses and shapes (or the kernel's parameter
//! struct) in, the kernel's assumptions checked, grid, block, shared memory and bytes computed,
//! launched through [`CudaContext::launch`]; the CUDA backend calls these. After them, the
//! slice-based wrappers the kernel tests call, which check buffer lengths (and device-held
//! tables and slots) and convert slices to addresses. The math is in
//! `kernels/include/ornith_kernels.h`; bf16 tensors are `CudaSlice<u16>` (bit patterns), FP8
//! E4M3 codes `CudaSlice<u8>`.
use super::{i32of, need, CudaContext, Launch};
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

/// Rows (query tokens) of one decode attention launch (one per thread of the split kernel's
/// per-row set-up).
pub const ATT_MAX_ROWS: usize = ORNITH_ATT_MAX_ROWS as usize;

/// Most splits the combine merges (`ATT_MAX_SPLITS` in attention.cu).
const ATT_MAX_SPLITS: usize = 1024;

/// Resident `attn_decode_split` blocks per SM its grid is sized for (fewer where the shared
/// memory allows fewer): at long context one row is 256 work items of equal length (a split of
/// both kv heads), which 2 per SM on the H200's 132 SMs take in one round.
pub(crate) const ATT_BLOCKS_PER_SM: u32 = 2;

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

/// `flash_attn_prefill`: Q, K and V tiles of 64 rows x 512 bytes (`FA_BQ`, `FA_BK`).
pub(crate) const FA_SMEM: u32 = 3 * 64 * 512;

/// Inputs of [`CudaContext::flash_attention`].
pub struct FlashAttnArgs<'a> {
    /// `[tokens, q_heads, 256]` (after q norm + RoPE).
    pub q: &'a Bf,
    /// Paged `[blocks, KV_BLOCK, kv_heads, 256]`, positions `0..pos0 + tokens` written through
    /// `table`.
    pub k_cache: &'a Bf,
    pub v_cache: &'a Bf,
    /// The sequence's block table (position p in cache row `table[p / KV_BLOCK] · KV_BLOCK + p % KV_BLOCK`).
    pub table: &'a CudaSlice<i32>,
    /// q_proj output `[tokens, q_heads, 512]` (query | gate per head): applies the output gate.
    pub qg: Option<&'a Bf>,
    pub tokens: usize,
    pub pos0: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
}

impl CudaContext {
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
    pub(crate) fn k_attention(&self, mut p: OrnithAttnParams, keys: usize) -> Result<()> {
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
        let mut part = t * qh * splits * (256 + 2) * 4 + t * qh * 256 * 4; // at most
        ensure!(p.out_q8.is_null() == p.out_scale.is_null(), "attention: FP8 output needs both codes and scales");
        if !p.out_q8.is_null() {
            // The rows' arrival counters: the context's (zero between launches, one launch's at
            // a time: every user counts after its PDL wait; this launch has no attribute).
            const _: () = assert!(ATT_MAX_ROWS <= super::WIDE_TICKETS as usize);
            p.ticket = self.addr(&self.wide_ticket) as _;
            part += t * qh * 256 * (2 + 1) + t * 4; // the row read back, the codes, the scale
        }
        let grid = (qh as u32, t as u32, ORNITH_ATT_COMBINE_CHUNKS);
        self.launch(Launch::new("attn_decode_combine", grid, 256, part as u64), p)
    }

    /// Causal flash attention (head_dim 256) of `p.tokens` queries at positions `pos0..` over the
    /// paged K/V cache (through the sequence's block table `p.table`), with the sigmoid output
    /// gate from `p.qg` when given (see `OrnithFlashAttnParams`). Bytes: every K/V row once, q,
    /// the gate and the output.
    pub(crate) fn k_flash_attn(&self, p: OrnithFlashAttnParams) -> Result<()> {
        ensure!(
            p.tokens > 0 && p.pos0 >= 0 && p.kv_heads > 0 && p.q_heads % p.kv_heads == 0,
            "flash_attention: q_heads {} must be a multiple of kv_heads {}",
            p.q_heads,
            p.kv_heads
        );
        let (t, qh, kvh) = (p.tokens as usize, p.q_heads as usize, p.kv_heads as usize);
        let bytes = (p.pos0 as usize + t) * kvh * 256 * 2 * 2 + t * qh * 256 * 2 * 3;
        let grid = (t.div_ceil(64) as u32, qh as u32, 1);
        self.launch(Launch::new("flash_attn_prefill", grid, 128, bytes as u64).smem(FA_SMEM), p)
    }
}

// The slice-based wrappers (the kernel tests' entry points).
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

    /// [`Self::attention_decode`] whose combine also writes the output's per-token FP8 codes and
    /// scales (`OrnithAttnParams.out_q8`: `quantize_fp8_rows`' bits, without its launch).
    pub fn attention_decode_q8(
        &self,
        a: &AttnArgs,
        part_o: &mut CudaSlice<f32>,
        part_ml: &mut CudaSlice<f32>,
        out: &mut Bf,
        q8: &mut CudaSlice<u8>,
        scale: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (mut p, keys) = self.attention_params(a, part_o, part_ml, out)?;
        need("attn out_q8", q8, a.tokens * a.q_heads * 256)?;
        need("attn out_scale", scale, a.tokens)?;
        (p.out_q8, p.out_scale) = (self.addr(q8) as _, self.addr(scale) as _);
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
            out_q8: std::ptr::null_mut(),
            out_scale: std::ptr::null_mut(),
            ticket: std::ptr::null_mut(),
        };
        Ok((p, positions.iter().map(|&x| x + 1).sum()))
    }

    /// [`Self::k_flash_attn`] on buffers: `tokens` queries at positions `pos0..` over the K/V
    /// cache, optionally with the sigmoid output gate.
    pub fn flash_attention(&self, a: &FlashAttnArgs, out: &mut Bf) -> Result<()> {
        ensure!(a.tokens > 0, "flash_attention: no tokens");
        let total = a.pos0 + a.tokens;
        need("flash q", a.q, a.tokens * a.q_heads * 256)?;
        self.check_paged(
            "flash attention",
            a.k_cache.len().min(a.v_cache.len()),
            a.kv_heads * 256,
            a.table,
            0,
            &[total - 1],
        )?;
        if let Some(g) = a.qg {
            need("flash qg", g, a.tokens * a.q_heads * 512)?;
        }
        need("flash out", out, a.tokens * a.q_heads * 256)?;
        self.k_flash_attn(OrnithFlashAttnParams {
            q: self.addr(a.q) as _,
            k_cache: self.addr(a.k_cache) as _,
            v_cache: self.addr(a.v_cache) as _,
            qg: a.qg.map_or(std::ptr::null(), |g| self.addr(g) as _),
            out: self.addr(out) as _,
            tokens: i32of("tokens", a.tokens)?,
            pos0: i32of("pos0", a.pos0)?,
            q_heads: i32of("q_heads", a.q_heads)?,
            kv_heads: i32of("kv_heads", a.kv_heads)?,
            scale: 1.0 / 16.0,
            table: self.addr(a.table) as _,
        })
    }
}
