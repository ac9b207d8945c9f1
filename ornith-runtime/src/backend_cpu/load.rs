//! CPU backend: weight storage and loading. Every tensor is copied out of the shard maps once
//! (bf16 and E4M3 kept as stored; scales and small vectors widened to f32).

use super::{CpuBackend, CpuExperts, CpuLinear};
use crate::engine::{snapshots_for, Capacity, PoolRequest};
use crate::graph::Prec;
use crate::graph::KV_BLOCK;
use crate::weights::{to_bf16, to_f32, Checkpoint};
use anyhow::Result;
use half::bf16;
use model_spec::{DType, ExpertLayout, Precision};
use std::marker::PhantomData;

const VEC: &[DType] = &[DType::BF16, DType::F32];

/// One Linear as loaded (see [`CpuLinear`]'s fields).
pub(super) fn load_linear_parts<P: Prec>(
    ck: &Checkpoint,
    module: &str,
    out_f: usize,
    in_f: usize,
) -> Result<CpuLinear<P>> {
    let wname = format!("{module}.weight");
    let mut l = CpuLinear {
        out_features: out_f,
        in_features: in_f,
        w: Vec::new(),
        w8: Vec::new(),
        scale: Vec::new(),
        scale8: Vec::new(),
        global: 0.0,
        _p: PhantomData,
    };
    match P::KIND {
        Precision::Bf16 => l.w = to_bf16(&ck.tensor(&wname, &[DType::BF16], &[out_f, in_f])?),
        Precision::Fp8 => {
            l.w8 = ck.tensor(&wname, &[DType::F8_E4M3], &[out_f, in_f])?.bytes.to_vec();
            l.scale = to_f32(&ck.tensor(&format!("{module}.weight_scale"), VEC, &[out_f, 1])?);
        }
        Precision::Nvfp4 => {
            let g = model_spec::nvfp4::GROUP;
            anyhow::ensure!(
                in_f.is_multiple_of(g),
                "{module}: NVFP4 needs in_features a multiple of {g}, found {in_f}"
            );
            l.w8 = ck.tensor(&format!("{module}.weight_packed"), &[DType::U8], &[out_f, in_f / 2])?.bytes.to_vec();
            l.scale8 =
                ck.tensor(&format!("{module}.weight_scale"), &[DType::F8_E4M3], &[out_f, in_f / g])?.bytes.to_vec();
            let gs = to_f32(&ck.tensor(&format!("{module}.weight_global_scale"), &[DType::F32], &[1])?);
            l.global = gs[0];
            anyhow::ensure!(
                l.global.is_finite() && l.global > 0.0,
                "{module}.weight_global_scale: expected a positive finite F32, found {}. Fix: re-export the checkpoint with the NVFP4A16 scheme",
                l.global
            );
        }
    }
    Ok(l)
}

impl CpuBackend {
    pub(super) fn linear<P: Prec>(
        &self,
        ck: &Checkpoint,
        module: &str,
        out_f: usize,
        in_f: usize,
    ) -> Result<CpuLinear<P>> {
        load_linear_parts(ck, module, out_f, in_f)
    }

    pub(super) fn experts<G: Prec, U: Prec, D: Prec>(
        &self,
        ck: &Checkpoint,
        module: &str,
        layout: ExpertLayout,
        e: usize,
        inter: usize,
        hidden: usize,
    ) -> Result<CpuExperts<G, U, D>> {
        let mut gate = Vec::with_capacity(e);
        let mut up = Vec::with_capacity(e);
        let mut down = Vec::with_capacity(e);
        match layout {
            ExpertLayout::PerExpert => {
                for x in 0..e {
                    gate.push(self.linear::<G>(ck, &format!("{module}.{x}.gate_proj"), inter, hidden)?);
                    up.push(self.linear::<U>(ck, &format!("{module}.{x}.up_proj"), inter, hidden)?);
                    down.push(self.linear::<D>(ck, &format!("{module}.{x}.down_proj"), hidden, inter)?);
                }
            }
            ExpertLayout::Fused => {
                anyhow::ensure!(
                    G::KIND == Precision::Bf16 && U::KIND == Precision::Bf16 && D::KIND == Precision::Bf16,
                    "{module}: fused experts are BF16 only"
                );
                // gate_up_proj [E, 2I, H]: per expert rows 0..I are gate_proj, I..2I up_proj.
                let gu =
                    to_bf16(&ck.tensor(&format!("{module}.gate_up_proj"), &[DType::BF16], &[e, 2 * inter, hidden])?);
                let dn = to_bf16(&ck.tensor(&format!("{module}.down_proj"), &[DType::BF16], &[e, hidden, inter])?);
                for x in 0..e {
                    let base = x * 2 * inter * hidden;
                    gate.push(bf16_linear(gu[base..base + inter * hidden].to_vec(), inter, hidden));
                    up.push(bf16_linear(gu[base + inter * hidden..base + 2 * inter * hidden].to_vec(), inter, hidden));
                    down.push(bf16_linear(dn[x * hidden * inter..(x + 1) * hidden * inter].to_vec(), hidden, inter));
                }
            }
        }
        Ok(CpuExperts { gate, up, down })
    }

    pub(super) fn vector(&self, ck: &Checkpoint, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Ok(to_f32(&ck.tensor(name, VEC, shape)?))
    }

    pub(super) fn embedding(&self, ck: &Checkpoint, name: &str, vocab: usize, hidden: usize) -> Result<Vec<bf16>> {
        Ok(to_bf16(&ck.tensor(name, &[DType::BF16], &[vocab, hidden])?))
    }
}

fn bf16_linear<P: Prec>(w: Vec<bf16>, out_features: usize, in_features: usize) -> CpuLinear<P> {
    CpuLinear {
        out_features,
        in_features,
        w,
        w8: Vec::new(),
        scale: Vec::new(),
        scale8: Vec::new(),
        global: 0.0,
        _p: PhantomData,
    }
}

/// Bytes of host memory available for new allocations (Linux `MemAvailable`).
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Refuses to load when the weights would not fit: on a unified-memory machine an overcommit
/// wedges the whole system, so this check runs before any allocation. Returns the weights' bytes.
pub fn check_host_memory(ck: &Checkpoint) -> Result<u64> {
    // Weights are held as stored, except vectors and scales widened to f32 (a few MB).
    let need = ck.spec.device_weight_bytes() + (64 << 20);
    if let Some(avail) = available_memory() {
        anyhow::ensure!(
            need <= avail,
            "not enough memory to load {}: the CPU backend needs {:.2} GiB for weights, {:.2} GiB is available. \
             Fix: free memory, or use the CUDA backend (--backend cuda).",
            ck.spec.model_dir.display(),
            need as f64 / (1u64 << 30) as f64,
            avail as f64 / (1u64 << 30) as f64
        );
    }
    Ok(need)
}

/// What the CPU pools are made of, in bytes.
#[derive(Debug, Clone, Copy)]
pub struct PoolSizes {
    pub weights: u64,
    /// K/V bytes of one position over every attention layer.
    pub kv_per_token: u64,
    /// Recurrent state of one sequence over every Gated DeltaNet layer.
    pub slot: u64,
}

/// The CPU backend's pools: `--max-seqs` (default 4: the CPU is compute-bound, more sequences
/// at once buy little), K/V blocks from `--kv-budget` (default: every sequence at full context,
/// capped by half the memory left after weights and states, but always one full sequence), and
/// the prefix cache's snapshots from `--prefix-cache-bytes` (default: up to 4 GiB, at most a
/// quarter of what weights and states leave), and the total checked against `avail` (the host's
/// available memory, when known).
pub fn plan_pools(z: &PoolSizes, req: &PoolRequest, avail: Option<u64>) -> Result<Capacity> {
    let slots = req.max_seqs.unwrap_or(4);
    anyhow::ensure!(slots >= 1, "--max-seqs must be at least 1");
    let block_bytes = z.kv_per_token.max(1) * KV_BLOCK as u64;
    let per_seq = req.max_context.div_ceil(KV_BLOCK);
    let states = slots as u64 * z.slot;
    let room = avail.map_or(u64::MAX, |a| a.saturating_sub(z.weights + states));
    let snapshots = snapshots_for(req.prefix_cache, z.slot, room);
    let states = states + snapshots as u64 * z.slot;
    let blocks = match req.kv_budget {
        Some(b) => {
            let n = (b / block_bytes) as usize;
            anyhow::ensure!(
                n >= per_seq,
                "--kv-budget {b} bytes holds {} tokens of K/V, less than one sequence of --max-context {} tokens. \
                 Fix: raise --kv-budget to at least {} bytes or lower --max-context",
                n * KV_BLOCK,
                req.max_context,
                per_seq as u64 * block_bytes
            );
            n
        }
        None => {
            let all = slots * per_seq;
            match avail {
                Some(a) => all.min(((a.saturating_sub(z.weights + states) / 2 / block_bytes) as usize).max(per_seq)),
                None => all,
            }
        }
    };
    let need = z.weights + states + blocks as u64 * block_bytes;
    if let Some(a) = avail {
        let gib = |x: u64| x as f64 / (1u64 << 30) as f64;
        anyhow::ensure!(
            need <= a,
            "not enough memory: weights, {slots} recurrent states, {snapshots} prefix-cache snapshots and {} K/V tokens need {:.2} GiB, {:.2} GiB is available. \
             Fix: lower --max-seqs, --kv-budget, --prefix-cache-bytes or --max-context",
            blocks * KV_BLOCK,
            gib(need),
            gib(a)
        );
    }
    Ok(Capacity { slots, blocks, snapshots })
}

#[cfg(test)]
mod tests {
    use super::*;

    const Z: PoolSizes = PoolSizes { weights: 1 << 30, kv_per_token: 1024, slot: 64 << 20 };
    const MIB: u64 = 1 << 20;

    fn req(max_seqs: Option<usize>, kv_budget: Option<u64>, max_context: usize) -> PoolRequest {
        PoolRequest { max_seqs, default_seqs: 64, kv_budget, max_context, prefix_cache: None, max_batch_tokens: 2048 }
    }

    #[test]
    fn the_cpu_plan_admits_and_refuses_as_stated() {
        // Defaults: 4 slots, every sequence at full context when memory is plentiful, a 4 GiB
        // prefix cache (64 snapshots of 64 MiB).
        let c = plan_pools(&Z, &req(None, None, 4096), Some(64 << 30)).unwrap();
        assert_eq!(c, Capacity { slots: 4, blocks: 4 * 16, snapshots: 64 });
        // Tight memory caps the default pool, but never below one full sequence.
        let c = plan_pools(&Z, &req(Some(2), None, 4096), Some((1 << 30) + 128 * MIB + 8 * MIB)).unwrap();
        assert_eq!((c.blocks, c.snapshots), (16, 0), "a quarter of 8 MiB holds no snapshot");
        // An explicit budget is exact; one that cannot hold a full sequence is refused.
        let c = plan_pools(&Z, &req(Some(1), Some(64 * 256 * 1024), 4096), None).unwrap();
        assert_eq!(c, Capacity { slots: 1, blocks: 64, snapshots: 64 });
        // --prefix-cache-bytes is exact, 0 disables, and it counts against the memory.
        let cache = |b: u64| PoolRequest { prefix_cache: Some(b), ..req(Some(1), None, 4096) };
        assert_eq!(plan_pools(&Z, &cache(640 * MIB), None).unwrap().snapshots, 10);
        assert_eq!(plan_pools(&Z, &cache(0), Some(64 << 30)).unwrap().snapshots, 0);
        let e = plan_pools(&Z, &cache(8 << 30), Some(4 << 30)).unwrap_err().to_string();
        assert!(e.contains("128 prefix-cache snapshots") && e.contains("--prefix-cache-bytes"), "{e}");
        let e = plan_pools(&Z, &req(Some(1), Some(256 * 1024), 4096), None).unwrap_err().to_string();
        assert!(e.contains("--kv-budget") && e.contains("less than one sequence"), "{e}");
        // More than the host has is refused before anything is allocated, naming the flags.
        let e = plan_pools(&Z, &req(Some(64), None, 4096), Some(2 << 30)).unwrap_err().to_string();
        assert!(e.contains("not enough memory") && e.contains("--max-seqs"), "{e}");
        assert!(plan_pools(&Z, &req(Some(0), None, 4096), None).is_err());
    }
}
