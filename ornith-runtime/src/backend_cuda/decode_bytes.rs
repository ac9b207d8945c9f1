//! The bytes one decode step of one sequence must read, by group — the denominator of
//! `ornith-bench`'s achieved GB/s and "% of ceiling" — from the spec alone (no weights):
//! every weight once as the backend holds it ([`plan::device_form`]: FP8 codes, NVFP4 codes and
//! group scales and BF16 matrices as stored, FP8 scales as f32, an NVFP4 global scale as its
//! 4 KiB dequantisation table, vectors in the one form the kernels read: bf16, `A_log` f32),
//! except the embedding table (one row) and the routed experts (top-k of E per layer); the
//! Gated DeltaNet states read and written once (conv bf16, recurrent f32); BF16 K and V of every
//! full-attention layer at `position` cached positions.
use super::plan::{device_form, DeviceForm};
use model_spec::{report, LayerKind, ModelSpec, TensorInfo};

/// One row of the byte count.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ByteGroup {
    pub group: &'static str,
    pub bytes: u64,
}

/// Weight groups in the order printed (`model_spec::report::group_of`'s names).
const WEIGHT_GROUPS: [&str; 8] =
    ["embeddings", "attention", "linear_attn", "norms", "router", "shared expert", "routed experts", "lm_head"];
/// The rows after the weights.
pub const STATE_GROUP: &str = "GDN state (read + written)";
pub const KV_GROUP: &str = "K/V";

/// Bytes a decode step reads of tensor `name`.
fn read_bytes(name: &str, t: &TensorInfo) -> u64 {
    match device_form(name, t) {
        DeviceForm::AsStored => t.nbytes(),
        DeviceForm::ScaleF32 => 4 * t.numel() as u64,
        // an NVFP4 weight's scale table (the kernels look every group's scale up in it)
        DeviceForm::ScaleTable => crate::cuda::nvfp4::TAB_BYTES as u64 * t.numel() as u64,
        // the gated delta rule reads `A_log` as f32, every other vector as bf16
        DeviceForm::Vector if name.ends_with(".A_log") => 4 * t.numel() as u64,
        DeviceForm::Vector => 2 * t.numel() as u64,
    }
}

/// The byte count of one decode step at `position` cached positions, by group (weights in
/// [`WEIGHT_GROUPS`] order, then [`STATE_GROUP`] and [`KV_GROUP`]).
pub fn decode_step_bytes(spec: &ModelSpec, position: usize) -> Vec<ByteGroup> {
    let d = &spec.dims;
    let mut w = [0u64; WEIGHT_GROUPS.len()];
    for (name, t) in &spec.tensors {
        let g = report::group_of(spec, name);
        if let Some(i) = WEIGHT_GROUPS.iter().position(|&x| x == g) {
            w[i] += read_bytes(name, t);
        }
    }
    let vocab = d.vocab_size as u64;
    for (g, b) in WEIGHT_GROUPS.iter().zip(w.iter_mut()) {
        match *g {
            "embeddings" => *b /= vocab, // one row
            "routed experts" => *b = *b * d.num_experts_per_tok as u64 / d.num_experts as u64,
            _ => {}
        }
    }
    let full = spec.layers.iter().filter(|l| l.kind == LayerKind::FullAttention).count();
    let gdn = spec.layers.len() - full;
    // per layer: conv state [kernel - 1, conv_dim] bf16 and recurrent state [Hv, dk, dv] f32
    let conv = (d.linear_conv_kernel_dim - 1) * d.conv_dim() * 2;
    let rec = d.linear_num_value_heads * d.linear_key_head_dim * d.linear_value_head_dim * 4;
    let mut out: Vec<ByteGroup> =
        WEIGHT_GROUPS.iter().zip(w).map(|(&group, bytes)| ByteGroup { group, bytes }).collect();
    out.push(ByteGroup { group: STATE_GROUP, bytes: 2 * (gdn * (conv + rec)) as u64 });
    out.push(ByteGroup { group: KV_GROUP, bytes: d.kv_bytes_per_token(full) * position as u64 });
    out
}

/// The sum of a count.
pub fn total(groups: &[ByteGroup]) -> u64 {
    groups.iter().map(|g| g.bytes).sum()
}
