//! Sparse MoE block: router, routed experts, gated shared expert (docs/ARCHITECTURE.md §3.6 Sparse MoE, §6 items 10–11).
//!
//! For `x [T, D]` (the post-attention-norm output):
//! ```text
//! logits = bf16(x @ W_router^T)                         [T, E]   (bf16 linear)
//! p      = softmax(f32(logits))                         fp32
//! (w, i) = top-k of p, descending; ties: lower expert index first
//! w      = bf16( w / Σw )                               renormalised in fp32, then bf16
//! mlp(x) = down( bf16( bf16(silu(gate x)) · up x ) )    each Linear rounds to bf16 (BF16 or FP8 W8A8)
//! routed = bf16( Σ_{j<k} bf16( mlp_{i_j}(x) · w_j ) )   products in bf16, the k-sum in fp32 in slot
//!                                                       order j = 0..k-1 (HF grouped_mm: `.sum(1)`)
//! shared = bf16( bf16(sigmoid(bf16(x · w_seg))) · mlp_shared(x) )
//! out    = bf16( routed + shared )
//! ```
//! HF's eager expert loop instead adds expert outputs into a bf16 buffer one expert at a time;
//! this follows the grouped_mm default (fp32 k-sum, one rounding).
//!
//! Tie handling: `torch.topk` on CPU does not document its order for equal values; here equal
//! probabilities are taken lower expert index first.

use super::linear::{linear_bf16, LinearWeight};
use super::{bf16_to_f32, check_len, sigmoid, silu};
use half::bf16;
use rayon::prelude::*;

/// A SwiGLU MLP's three Linears: `gate, up [inter, D]`, `down [D, inter]`. For HF's fused BF16
/// `gate_up_proj[e]` (`[2·inter, D]`) pass rows `0..inter` as gate and `inter..2·inter` as up.
#[derive(Clone, Copy, Debug)]
pub struct Mlp<'a> {
    pub gate: LinearWeight<'a>,
    pub up: LinearWeight<'a>,
    pub down: LinearWeight<'a>,
}

impl Mlp<'_> {
    /// `y = down(bf16(bf16(silu(gate x)) · up x))` for `x [t, d]`, `inter` hidden units; `y [t, d]`.
    pub fn forward(&self, x: &[bf16], t: usize, d: usize, inter: usize, y: &mut [bf16]) {
        let (mut g, mut u) = (vec![bf16::ZERO; t * inter], vec![bf16::ZERO; t * inter]);
        self.gate.apply(x, t, d, inter, &mut g);
        self.up.apply(x, t, d, inter, &mut u);
        for (gi, &ui) in g.iter_mut().zip(&u) {
            let a = bf16::from_f32(silu(bf16_to_f32(*gi))).to_f32();
            *gi = bf16::from_f32(a * bf16_to_f32(ui));
        }
        self.down.apply(&g, t, inter, d, y);
    }
}

/// Router: from bf16 logits `[t, e]` to the top-k expert ids `idx [t, k]` and bf16 weights
/// `w [t, k]` (module doc). Slot 0 is the most probable expert.
pub fn route(logits: &[bf16], t: usize, e: usize, k: usize, idx: &mut [u32], w: &mut [bf16]) {
    assert!(k >= 1 && k <= e, "route: top-k {k} must be in 1..={e}");
    check_len("route logits", logits.len(), t * e);
    check_len("route idx", idx.len(), t * k);
    check_len("route w", w.len(), t * k);
    let mut p = vec![0f32; e];
    let mut order: Vec<u32> = Vec::with_capacity(e);
    for tt in 0..t {
        let lr = &logits[tt * e..(tt + 1) * e];
        let m = lr.iter().map(|&v| bf16_to_f32(v)).fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f32;
        for (pi, &l) in p.iter_mut().zip(lr) {
            *pi = (bf16_to_f32(l) - m).exp();
            z += *pi;
        }
        for pi in p.iter_mut() {
            *pi /= z;
        }
        order.clear();
        order.extend(0..e as u32);
        // Descending probability; equal values: lower index first (stable sort of ascending ids).
        order.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]));
        let top = &order[..k];
        let s: f32 = top.iter().map(|&i| p[i as usize]).sum();
        for j in 0..k {
            idx[tt * k + j] = top[j];
            w[tt * k + j] = bf16::from_f32(p[top[j] as usize] / s);
        }
    }
}

/// Shapes and weights of one MoE block.
#[derive(Clone, Copy, Debug)]
pub struct MoeWeights<'a> {
    /// Router `[E, D]` (bf16, `mlp.gate.weight`).
    pub router: &'a [bf16],
    /// `E` routed experts, each with `moe_intermediate_size` hidden units.
    pub experts: &'a [Mlp<'a>],
    pub moe_inter: usize,
    pub shared: Mlp<'a>,
    pub shared_inter: usize,
    /// `shared_expert_gate.weight` `[D]` (its `[1, D]` matrix).
    pub shared_gate: &'a [bf16],
    pub top_k: usize,
}

/// The MoE block (module doc): `x [t, d]` → `out [t, d]`.
pub fn moe(x: &[bf16], t: usize, d: usize, wts: &MoeWeights, out: &mut [bf16]) {
    let e = wts.experts.len();
    let k = wts.top_k;
    check_len("moe x", x.len(), t * d);
    check_len("moe out", out.len(), t * d);
    check_len("moe router", wts.router.len(), e * d);
    check_len("moe shared_gate", wts.shared_gate.len(), d);

    let mut logits = vec![bf16::ZERO; t * e];
    linear_bf16(x, wts.router, t, d, e, &mut logits);
    let (mut idx, mut w) = (vec![0u32; t * k], vec![bf16::ZERO; t * k]);
    route(&logits, t, e, k, &mut idx, &mut w);

    // Group (token, slot) assignments by expert, then run each active expert once on its tokens.
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); e];
    for (a, &ex) in idx.iter().enumerate() {
        by_expert[ex as usize].push(a);
    }
    // weighted[a] = bf16(y_e(x_t) · w_a) for assignment a = t·k + j.
    let results: Vec<(Vec<usize>, Vec<bf16>)> = by_expert
        .into_par_iter()
        .enumerate()
        .filter(|(_, a)| !a.is_empty())
        .map(|(ex, assign)| {
            let n = assign.len();
            let mut xs = Vec::with_capacity(n * d);
            for &a in &assign {
                let tt = a / k;
                xs.extend_from_slice(&x[tt * d..(tt + 1) * d]);
            }
            let mut ys = vec![bf16::ZERO; n * d];
            wts.experts[ex].forward(&xs, n, d, wts.moe_inter, &mut ys);
            for (row, &a) in ys.chunks_mut(d).zip(&assign) {
                let wa = bf16_to_f32(w[a]);
                for v in row.iter_mut() {
                    *v = bf16::from_f32(bf16_to_f32(*v) * wa);
                }
            }
            (assign, ys)
        })
        .collect();
    let mut weighted = vec![bf16::ZERO; t * k * d];
    for (assign, ys) in &results {
        for (row, &a) in ys.chunks(d).zip(assign) {
            weighted[a * d..(a + 1) * d].copy_from_slice(row);
        }
    }

    let mut shared = vec![bf16::ZERO; t * d];
    wts.shared.forward(x, t, d, wts.shared_inter, &mut shared);
    let mut sg = vec![bf16::ZERO; t];
    linear_bf16(x, wts.shared_gate, t, d, 1, &mut sg);

    out.par_chunks_mut(d).enumerate().for_each(|(tt, o)| {
        let gate = bf16::from_f32(sigmoid(bf16_to_f32(sg[tt]))).to_f32();
        for (c, oc) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for j in 0..k {
                acc += bf16_to_f32(weighted[(tt * k + j) * d + c]);
            }
            let routed = bf16::from_f32(acc).to_f32();
            let sh = bf16::from_f32(gate * bf16_to_f32(shared[tt * d + c])).to_f32();
            *oc = bf16::from_f32(routed + sh);
        }
    });
}

#[cfg(test)]
mod tests;
