//! Byte-level BPE from tiktoken ranks: parse the rank file, derive the Hugging Face merge list,
//! and map token bytes to GPT-2's printable byte alphabet.
//!
//! tiktoken and Hugging Face BPE encode a pre-token the same way once the merges are derived
//! correctly. tiktoken repeatedly joins the adjacent pair whose concatenation has the lowest
//! rank; Hugging Face repeatedly applies the adjacent pair with the lowest merge priority. So
//! every token `t` (rank `r`) contributes one merge `(a, b)` with priority `r`, where `a`, `b`
//! are the last two pieces tiktoken holds when it encodes the bytes of `t` alone, just before
//! it joins them into `t`. Both procedures then build `t` from the same two halves at the same
//! point in the ordering.
//!
//! The ranks are not monotone along merge paths: e.g. `人力资源` (rank 99,655) is built from
//! `人力` (rank 108,583) + `资源`. Restricting the derivation to ranks `< r` would miss such
//! tokens (31 of them in Qwen3.5); running tiktoken's own unrestricted procedure finds them.
//! Tokens whose bytes never reduce to a single piece are unreachable by merging and get no
//! merge (they stay in the vocabulary). For the Qwen3.5 ranks this yields 247,587 merges, the
//! count of the official tokenizer (201 of the 247,788 multi-byte tokens are unreachable).
use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use base64::Engine as _;

/// The tiktoken rank file: one `base64(token bytes) rank` per line. Returns tokens indexed by
/// rank; ranks must be exactly `0..n` with no gaps or duplicates.
pub fn parse_tiktoken(text: &str) -> Result<Vec<Vec<u8>>> {
    let mut by_rank: Vec<Option<Vec<u8>>> = Vec::new();
    for (lineno, line) in text.lines().enumerate() {
        if line.is_empty() {
            continue;
        }
        let (tok, rank) = line
            .split_once(' ')
            .with_context(|| format!("tiktoken line {}: expected `<base64> <rank>`", lineno + 1))?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(tok)
            .with_context(|| format!("tiktoken line {}: bad base64 {tok:?}", lineno + 1))?;
        let rank: usize =
            rank.trim().parse().with_context(|| format!("tiktoken line {}: bad rank {rank:?}", lineno + 1))?;
        if rank >= by_rank.len() {
            by_rank.resize(rank + 1, None);
        }
        if by_rank[rank].replace(bytes).is_some() {
            bail!("tiktoken line {}: rank {rank} appears twice", lineno + 1);
        }
    }
    by_rank
        .into_iter()
        .enumerate()
        .map(|(r, t)| t.with_context(|| format!("tiktoken ranks have a gap at {r}")))
        .collect()
}

/// tiktoken's byte-pair merge of the bytes of a token: start from single bytes; while more
/// than two pieces remain, join the adjacent pair whose concatenation has the lowest rank
/// (leftmost on ties, as tiktoken does). Returns the offset splitting the last two pieces, or
/// `None` when the procedure gets stuck first. (With two pieces left, their concatenation is the
/// token itself, so tiktoken's next step would join them.)
fn last_split(bytes: &[u8], ranks: &HashMap<&[u8], u32>) -> Option<usize> {
    let mut bounds: Vec<usize> = (0..=bytes.len()).collect();
    while bounds.len() > 3 {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..bounds.len() - 2 {
            if let Some(&r) = ranks.get(&bytes[bounds[i]..bounds[i + 2]]) {
                if best.is_none_or(|(br, _)| r < br) {
                    best = Some((r, i));
                }
            }
        }
        let (_, i) = best?;
        bounds.remove(i + 1);
    }
    (bounds.len() == 3).then(|| bounds[1])
}

/// Merges as `(left, right)` token byte strings, in priority order (= rank of the merged token).
/// Tokens of one byte have no merge; multi-byte tokens unreachable by merging are skipped.
pub fn derive_merges(tokens: &[Vec<u8>]) -> Vec<(&[u8], &[u8])> {
    let ranks: HashMap<&[u8], u32> = tokens.iter().enumerate().map(|(r, t)| (t.as_slice(), r as u32)).collect();
    let mut merges = Vec::with_capacity(tokens.len());
    for tok in tokens.iter().filter(|t| t.len() >= 2) {
        if let Some(k) = last_split(tok, &ranks) {
            merges.push((&tok[..k], &tok[k..]));
        }
    }
    merges
}

/// GPT-2's reversible byte → printable character map: the printable Latin-1 bytes
/// (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) map to themselves; the remaining 68 bytes map, in byte
/// order, to U+0100, U+0101, ….
pub fn byte_to_unicode() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        map[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).expect("U+0100..U+0143 are valid chars");
            next += 1;
            c
        };
    }
    map
}

/// Token bytes spelled in the byte-level alphabet.
pub fn to_byte_level(bytes: &[u8], map: &[char; 256]) -> String {
    bytes.iter().map(|&b| map[b as usize]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_a_bijection_onto_gpt2_alphabet() {
        let m = byte_to_unicode();
        let mut seen: Vec<char> = m.to_vec();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        assert_eq!(m[b' ' as usize], 'Ġ'); // 0x20 is the 33rd non-printable byte → U+0120
        assert_eq!(m[b'\n' as usize], 'Ċ'); // 0x0A → U+010A
        assert_eq!(m[b'A' as usize], 'A');
        assert_eq!(m[0xAD], 'Ń'); // soft hyphen is not printable → U+0143
    }

    #[test]
    fn merges_follow_tiktoken_order() {
        // ranks: a b c ab bc abc; tiktoken joins "ab" (3) before "bc" (4), so abc = ab + c.
        let toks: Vec<Vec<u8>> = ["a", "b", "c", "ab", "bc", "abc"].iter().map(|s| s.as_bytes().to_vec()).collect();
        let m = derive_merges(&toks);
        let m: Vec<(&str, &str)> =
            m.iter().map(|(l, r)| (std::str::from_utf8(l).unwrap(), std::str::from_utf8(r).unwrap())).collect();
        assert_eq!(m, vec![("a", "b"), ("b", "c"), ("ab", "c")]);
    }

    #[test]
    fn merge_through_a_higher_rank_piece() {
        // "xyz" (rank 3) is reached through "xy" (rank 4): x y z → xy z → xyz.
        let toks: Vec<Vec<u8>> = ["x", "y", "z", "xyz", "xy"].iter().map(|s| s.as_bytes().to_vec()).collect();
        let m = derive_merges(&toks);
        assert_eq!(m, vec![(&b"xy"[..], &b"z"[..]), (&b"x"[..], &b"y"[..])]);
    }

    #[test]
    fn unreachable_token_gets_no_merge() {
        // "abc" at rank 3 with no two-byte tokens below it cannot be built by merging.
        let toks: Vec<Vec<u8>> = ["a", "b", "c", "abc"].iter().map(|s| s.as_bytes().to_vec()).collect();
        assert!(derive_merges(&toks).is_empty());
    }
}
