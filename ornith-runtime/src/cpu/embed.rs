//! Embedding gather and the output head (docs/ARCHITECTURE.md §3.1 Embedding, §3.7 Output).
//!
//! `h[t] = embed_tokens[ids[t]]` (bf16 rows, no scaling). The final norm is
//! `norm::rms_norm` (zero-centred) and the logits are `linear::linear_bf16` with `lm_head`
//! (`[V, D]`), giving bf16 logits.

use super::check_len;
use half::bf16;

/// Gathers `ids.len()` rows of `table [vocab, d]` into `out [ids.len(), d]`. An id outside the
/// table is an error naming it.
pub fn embed(ids: &[u32], table: &[bf16], d: usize, out: &mut [bf16]) -> anyhow::Result<()> {
    check_len("embed out", out.len(), ids.len() * d);
    anyhow::ensure!(
        d > 0 && table.len().is_multiple_of(d),
        "embedding table of {} values is not a multiple of width {d}",
        table.len()
    );
    let vocab = table.len() / d;
    for (row, &id) in out.chunks_mut(d).zip(ids) {
        let i = id as usize;
        anyhow::ensure!(i < vocab, "token id {id} is outside the embedding table ({vocab} rows)");
        row.copy_from_slice(&table[i * d..(i + 1) * d]);
    }
    Ok(())
}

/// Logits of the last position only (what prefill needs): `bf16(h_last @ lm_head^T)`.
/// `h [t, d]` (already final-normed), `lm_head [vocab, d]`, `out [vocab]`.
pub fn last_logits(h: &[bf16], t: usize, d: usize, lm_head: &[bf16], out: &mut [bf16]) {
    assert!(t > 0, "last_logits: no positions");
    check_len("last_logits h", h.len(), t * d);
    let vocab = lm_head.len() / d.max(1);
    super::linear::linear_bf16(&h[(t - 1) * d..], lm_head, 1, d, vocab, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_rows_and_rejects_bad_ids() {
        let d = 3;
        let table: Vec<bf16> = (0..12).map(|i| bf16::from_f32(i as f32)).collect();
        let mut out = vec![bf16::ZERO; 2 * d];
        embed(&[2, 0], &table, d, &mut out).unwrap();
        assert_eq!(out.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), [6.0, 7.0, 8.0, 0.0, 1.0, 2.0]);
        let err = embed(&[4], &table, d, &mut out[..d]).unwrap_err();
        assert!(err.to_string().contains("token id 4"), "{err}");
    }

    #[test]
    fn last_logits_uses_last_row() {
        let (t, d) = (2, 2);
        let h: Vec<bf16> = [1.0f32, 0.0, 0.5, 2.0].iter().map(|&v| bf16::from_f32(v)).collect();
        let lm: Vec<bf16> = [1.0f32, 1.0, 0.0, 1.0, 2.0, -1.0].iter().map(|&v| bf16::from_f32(v)).collect();
        let mut out = vec![bf16::ZERO; 3];
        last_logits(&h, t, d, &lm, &mut out);
        assert_eq!(out.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), [2.5, 2.0, -1.0]);
    }
}
