//! Gated DeltaNet core: gates, q/k preparation and the gated delta rule (docs/ARCHITECTURE.md §3.4 Gated DeltaNet, §4 Chunked gated delta rule).
//!
//! Shapes (row-major): conv output `[T, 2·Hk·dk + Hv·dv]` = `[q | k | v]`; `q, k [T, Hk, dk]`;
//! `v [T, Hv, dv]`; `b, a, β, g [T, Hv]`; state `S [Hv, dk, dv]` fp32; output `o [T, Hv, dv]`.
//! Grouped value attention: v-head `h` reads q/k head `h / (Hv/Hk)` (repeat_interleave).
//!
//! Gates (HF `Qwen3_5MoeGatedDeltaNet.forward`):
//! `β = bf16(sigmoid(b))`, `g = −exp(A_log) · softplus(a + dt_bias)` in fp32, softplus(x) = x for
//! x > 20 (torch threshold), else `ln(1 + e^x)`.
//!
//! q/k (fp32): `l2norm(x) = x · rsqrt(Σx² + 1e-6)` (eps inside the rsqrt), `q = l2norm(q)·dk^-0.5`,
//! `k = l2norm(k)`.
//!
//! Recurrent form, per v-head, per token (decode, and the reference):
//! ```text
//! S = exp(g_t) S;  m = Sᵀk_t;  d = β_t (v_t − m);  S = S + k_t dᵀ;  o_t = Sᵀ q_t
//! ```
//! Chunked form (prefill; chunk 64; HF `torch_chunk_gated_delta_rule`, fp32 throughout), per chunk
//! of L ≤ 64 rows with G = inclusive cumsum of g inside the chunk:
//! ```text
//! M_rs = β_r (k_r·k_s) e^{G_r−G_s}  (s < r)        A = (I + M)^{-1}   (forward substitution)
//! U = A (β ⊙ V)        W = A (β e^{G} ⊙ K)        Vn = U − W S
//! O_r = e^{G_r} q_r S + Σ_{s≤r} (q_r·k_s) e^{G_r−G_s} Vn_s
//! S' = e^{G_{L−1}} S + Σ_r e^{G_{L−1}−G_r} k_r Vn_rᵀ
//! ```
//! Both forms take and update the fp32 state; [`gated_delta_rule`] rounds the output to bf16 once.

use super::{bf16_to_f32, check_len, sigmoid};
use half::bf16;
use rayon::prelude::*;

/// Chunk length of the chunked form (HF and FLA use 64).
pub const CHUNK: usize = 64;

/// Head counts and head dims of a GDN layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnDims {
    /// q/k heads (`linear_num_key_heads`).
    pub hk: usize,
    /// v heads (`linear_num_value_heads`), a multiple of `hk`.
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

impl GdnDims {
    /// Width of the conv output / `in_proj_qkv` output: `2·Hk·dk + Hv·dv`.
    pub fn conv_dim(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }
    /// Number of f32 values of the recurrent state `[Hv, dk, dv]`.
    pub fn state_len(&self) -> usize {
        self.hv * self.dk * self.dv
    }
    fn check(&self) {
        assert!(
            self.hk > 0 && self.hv.is_multiple_of(self.hk) && self.dk > 0 && self.dv > 0,
            "GdnDims: Hv ({}) must be a positive multiple of Hk ({}), dims nonzero",
            self.hv,
            self.hk
        );
    }
}

/// torch.nn.functional.softplus with beta 1, threshold 20.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// β and g for `t` tokens (module doc). `b, a [t, hv]`, `a_log [hv]` (pass bf16-rounded values to
/// match an HF bf16 run, which casts the F32-stored A_log to bf16), `dt_bias [hv]`.
/// Writes `beta [t, hv]` (bf16 values widened to f32) and `g [t, hv]`.
#[allow(clippy::too_many_arguments)]
pub fn gates(
    b: &[bf16],
    a: &[bf16],
    a_log: &[f32],
    dt_bias: &[bf16],
    t: usize,
    hv: usize,
    beta: &mut [f32],
    g: &mut [f32],
) {
    check_len("gates b", b.len(), t * hv);
    check_len("gates a", a.len(), t * hv);
    check_len("gates a_log", a_log.len(), hv);
    check_len("gates dt_bias", dt_bias.len(), hv);
    check_len("gates beta", beta.len(), t * hv);
    check_len("gates g", g.len(), t * hv);
    for i in 0..t * hv {
        let h = i % hv;
        beta[i] = bf16::from_f32(sigmoid(bf16_to_f32(b[i]))).to_f32();
        g[i] = -a_log[h].exp() * softplus(bf16_to_f32(a[i]) + bf16_to_f32(dt_bias[h]));
    }
}

/// `x · rsqrt(Σx² + 1e-6)` in place (fp32).
#[inline]
pub fn l2norm(x: &mut [f32]) {
    let ss = super::linear::dot(x, x);
    let r = 1.0 / (ss + 1e-6).sqrt();
    for v in x {
        *v *= r;
    }
}

/// Splits the conv output `[t, conv_dim]` into fp32 `q, k [t, hk, dk]` (l2-normed; q also scaled
/// by dk^-0.5) and `v [t, hv, dv]`.
pub fn split_qkv(conv_out: &[bf16], t: usize, d: GdnDims, q: &mut [f32], k: &mut [f32], v: &mut [f32]) {
    d.check();
    let (kd, vd) = (d.hk * d.dk, d.hv * d.dv);
    check_len("split_qkv conv_out", conv_out.len(), t * d.conv_dim());
    check_len("split_qkv q", q.len(), t * kd);
    check_len("split_qkv k", k.len(), t * kd);
    check_len("split_qkv v", v.len(), t * vd);
    let scale = (d.dk as f32).powf(-0.5);
    for tt in 0..t {
        let row = &conv_out[tt * d.conv_dim()..(tt + 1) * d.conv_dim()];
        for (dst, src) in
            [(&mut q[tt * kd..(tt + 1) * kd], &row[..kd]), (&mut k[tt * kd..(tt + 1) * kd], &row[kd..2 * kd])]
        {
            for (x, &s) in dst.iter_mut().zip(src) {
                *x = bf16_to_f32(s);
            }
            for head in dst.chunks_mut(d.dk) {
                l2norm(head);
            }
        }
        for x in &mut q[tt * kd..(tt + 1) * kd] {
            *x *= scale;
        }
        for (x, &s) in v[tt * vd..(tt + 1) * vd].iter_mut().zip(&row[2 * kd..]) {
            *x = bf16_to_f32(s);
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn check_core(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    t: usize,
    d: GdnDims,
    state: &[f32],
    out: &[f32],
) {
    d.check();
    check_len("gdn q", q.len(), t * d.hk * d.dk);
    check_len("gdn k", k.len(), t * d.hk * d.dk);
    check_len("gdn v", v.len(), t * d.hv * d.dv);
    check_len("gdn g", g.len(), t * d.hv);
    check_len("gdn beta", beta.len(), t * d.hv);
    check_len("gdn state", state.len(), d.state_len());
    check_len("gdn out", out.len(), t * d.hv * d.dv);
}

/// Runs `per_head(h, kh, S_h, o_h)` for every v-head in parallel (o_h is `[t, dv]`) and scatters
/// the per-head outputs into `out [t, hv, dv]`.
fn for_heads<F>(t: usize, d: GdnDims, state: &mut [f32], out: &mut [f32], per_head: F)
where
    F: Fn(usize, usize, &mut [f32], &mut [f32]) + Sync,
{
    let group = d.hv / d.hk;
    let outs: Vec<Vec<f32>> = state
        .par_chunks_mut(d.dk * d.dv)
        .enumerate()
        .map(|(h, s)| {
            let mut o = vec![0f32; t * d.dv];
            per_head(h, h / group, s, &mut o);
            o
        })
        .collect();
    for (h, o) in outs.iter().enumerate() {
        for tt in 0..t {
            out[(tt * d.hv + h) * d.dv..(tt * d.hv + h + 1) * d.dv].copy_from_slice(&o[tt * d.dv..(tt + 1) * d.dv]);
        }
    }
}

/// Recurrent gated delta rule (module doc), fp32. `q` must be l2-normed and scaled, `k`
/// l2-normed (see [`split_qkv`]). Updates `state [hv, dk, dv]`, writes `out [t, hv, dv]`.
#[allow(clippy::too_many_arguments)]
pub fn recurrent(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    t: usize,
    d: GdnDims,
    state: &mut [f32],
    out: &mut [f32],
) {
    check_core(q, k, v, g, beta, t, d, state, out);
    let (dk, dv) = (d.dk, d.dv);
    for_heads(t, d, state, out, |h, kh, s, o| {
        let mut m = vec![0f32; dv];
        for tt in 0..t {
            let kt = &k[(tt * d.hk + kh) * dk..][..dk];
            let qt = &q[(tt * d.hk + kh) * dk..][..dk];
            let vt = &v[(tt * d.hv + h) * dv..][..dv];
            let decay = g[tt * d.hv + h].exp();
            let b = beta[tt * d.hv + h];
            // 1. decay and 2. read with k: m = Sᵀ k
            m.fill(0.0);
            for (i, row) in s.chunks_exact_mut(dv).enumerate() {
                let ki = kt[i];
                for (x, mj) in row.iter_mut().zip(m.iter_mut()) {
                    *x *= decay;
                    *mj += *x * ki;
                }
            }
            // 3. delta d = β (v − m), kept in m
            for (mj, &vj) in m.iter_mut().zip(vt) {
                *mj = (vj - *mj) * b;
            }
            // 4. write S += k dᵀ and 5. read with q: o = Sᵀ q
            let ot = &mut o[tt * dv..(tt + 1) * dv];
            ot.fill(0.0);
            for (i, row) in s.chunks_exact_mut(dv).enumerate() {
                let (ki, qi) = (kt[i], qt[i]);
                for ((x, &dj), oj) in row.iter_mut().zip(m.iter()).zip(ot.iter_mut()) {
                    *x += ki * dj;
                    *oj += *x * qi;
                }
            }
        }
    });
}

/// Chunked gated delta rule (module doc), chunk [`CHUNK`], fp32; same contract as [`recurrent`].
#[allow(clippy::too_many_arguments)]
pub fn chunked(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    t: usize,
    d: GdnDims,
    state: &mut [f32],
    out: &mut [f32],
) {
    check_core(q, k, v, g, beta, t, d, state, out);
    let (dk, dv) = (d.dk, d.dv);
    for_heads(t, d, state, out, |h, kh, s, o| {
        let mut t0 = 0;
        while t0 < t {
            let l = CHUNK.min(t - t0);
            let kr = |r: usize| &k[((t0 + r) * d.hk + kh) * dk..][..dk];
            let qr = |r: usize| &q[((t0 + r) * d.hk + kh) * dk..][..dk];
            let vr = |r: usize| &v[((t0 + r) * d.hv + h) * dv..][..dv];
            let br = |r: usize| beta[(t0 + r) * d.hv + h];
            // G: inclusive cumsum of g within the chunk.
            let mut gc = vec![0f32; l];
            let mut acc = 0f32;
            for (r, x) in gc.iter_mut().enumerate() {
                acc += g[(t0 + r) * d.hv + h];
                *x = acc;
            }
            // M (strictly lower) and the causal decayed q·k (lower incl. diagonal), [l, l].
            let mut mm = vec![0f32; l * l];
            let mut qk = vec![0f32; l * l];
            let mut kb = vec![0f32; dk];
            for r in 0..l {
                for (x, &y) in kb.iter_mut().zip(kr(r)) {
                    *x = y * br(r);
                }
                for s_ in 0..=r {
                    let decay = (gc[r] - gc[s_]).exp();
                    if s_ < r {
                        mm[r * l + s_] = super::linear::dot(&kb, kr(s_)) * decay;
                    }
                    qk[r * l + s_] = super::linear::dot(qr(r), kr(s_)) * decay;
                }
            }
            // U = (I+M)^{-1} (β V) and W = (I+M)^{-1} (β e^G K), by forward substitution.
            let mut u = vec![0f32; l * dv];
            let mut w = vec![0f32; l * dk];
            for r in 0..l {
                let (done_u, cur_u) = u.split_at_mut(r * dv);
                let cur_u = &mut cur_u[..dv];
                for (x, &y) in cur_u.iter_mut().zip(vr(r)) {
                    *x = y * br(r);
                }
                let (done_w, cur_w) = w.split_at_mut(r * dk);
                let cur_w = &mut cur_w[..dk];
                let eg = gc[r].exp();
                for (x, &y) in cur_w.iter_mut().zip(kr(r)) {
                    *x = y * br(r) * eg;
                }
                for s_ in 0..r {
                    let c = mm[r * l + s_];
                    for (x, &y) in cur_u.iter_mut().zip(&done_u[s_ * dv..(s_ + 1) * dv]) {
                        *x -= c * y;
                    }
                    for (x, &y) in cur_w.iter_mut().zip(&done_w[s_ * dk..(s_ + 1) * dk]) {
                        *x -= c * y;
                    }
                }
            }
            // Vn = U − W S  (u becomes Vn) and the inter-chunk read e^{G_r} q_r S.
            for r in 0..l {
                let vn = &mut u[r * dv..(r + 1) * dv];
                let or = &mut o[(t0 + r) * dv..(t0 + r + 1) * dv];
                let eg = gc[r].exp();
                let (wr, qrr) = (&w[r * dk..(r + 1) * dk], qr(r));
                for (i, srow) in s.chunks_exact(dv).enumerate() {
                    let (wi, qi) = (wr[i], qrr[i] * eg);
                    for ((x, oj), &sv) in vn.iter_mut().zip(or.iter_mut()).zip(srow) {
                        *x -= wi * sv;
                        *oj += qi * sv;
                    }
                }
            }
            // Intra-chunk part: O_r += Σ_{s≤r} qk[r,s] Vn_s.
            for r in 0..l {
                let or = &mut o[(t0 + r) * dv..(t0 + r + 1) * dv];
                for s_ in 0..=r {
                    let c = qk[r * l + s_];
                    for (oj, &x) in or.iter_mut().zip(&u[s_ * dv..(s_ + 1) * dv]) {
                        *oj += c * x;
                    }
                }
            }
            // S' = e^{G_last} S + Σ_r e^{G_last − G_r} k_r Vn_rᵀ
            let glast = gc[l - 1];
            let el = glast.exp();
            for x in s.iter_mut() {
                *x *= el;
            }
            for r in 0..l {
                let c = (glast - gc[r]).exp();
                let (krr, vn) = (kr(r), &u[r * dv..(r + 1) * dv]);
                for (i, srow) in s.chunks_exact_mut(dv).enumerate() {
                    let ki = krr[i] * c;
                    for (x, &y) in srow.iter_mut().zip(vn) {
                        *x += ki * y;
                    }
                }
            }
            t0 += l;
        }
    });
}

/// The GDN core from the conv output to the (pre-norm) attention output, as HF runs it:
/// gates, q/k preparation, then the chunked form for `t > 1` and the recurrent form for `t == 1`;
/// output rounded once to bf16. `conv_out [t, conv_dim]`, `b, a [t, hv]`, `a_log [hv]`,
/// `dt_bias [hv]`, `state [hv, dk, dv]` (fp32, updated; zeros at sequence start), `out [t, hv·dv]`.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule(
    conv_out: &[bf16],
    b: &[bf16],
    a: &[bf16],
    a_log: &[f32],
    dt_bias: &[bf16],
    t: usize,
    d: GdnDims,
    state: &mut [f32],
    out: &mut [bf16],
) {
    check_len("gated_delta_rule out", out.len(), t * d.hv * d.dv);
    let (mut beta, mut g) = (vec![0f32; t * d.hv], vec![0f32; t * d.hv]);
    gates(b, a, a_log, dt_bias, t, d.hv, &mut beta, &mut g);
    let (mut q, mut k) = (vec![0f32; t * d.hk * d.dk], vec![0f32; t * d.hk * d.dk]);
    let mut v = vec![0f32; t * d.hv * d.dv];
    split_qkv(conv_out, t, d, &mut q, &mut k, &mut v);
    let mut o = vec![0f32; t * d.hv * d.dv];
    if t == 1 {
        recurrent(&q, &k, &v, &g, &beta, t, d, state, &mut o);
    } else {
        chunked(&q, &k, &v, &g, &beta, t, d, state, &mut o);
    }
    for (d_, &x) in out.iter_mut().zip(&o) {
        *d_ = bf16::from_f32(x);
    }
}

#[cfg(test)]
mod tests;
