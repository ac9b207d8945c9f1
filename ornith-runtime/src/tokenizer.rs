//! Text ↔ token ids with a Hugging Face `tokenizer.json` (byte-level BPE, as Qwen3.5 ships it),
//! on the `tokenizers` crate with its pure-Rust regex backend.
//!
//! Streaming decode works on bytes: each id maps to the bytes it stands for (a vocabulary token's
//! byte-level spelling mapped back through GPT-2's byte↔char table, an added token's content),
//! and text is released only up to the last complete UTF-8 character. Invalid bytes become
//! U+FFFD exactly where `String::from_utf8_lossy` on the whole byte string would put them, which
//! is what the byte-level decoder of `decode` does, so the concatenated stream equals `decode`.
use std::collections::HashSet;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use tokenizers::DecoderWrapper;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Bytes of every id, indexed by id (empty for ids the tokenizer does not know).
    bytes: Vec<Vec<u8>>,
    /// Ids of added tokens flagged `special` (dropped by `skip_special` decoding).
    special: HashSet<u32>,
}

/// GPT-2's byte-level alphabet as a char → byte table indexed by code point: printable Latin-1
/// bytes (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for themselves, the other 68 bytes, in order,
/// for U+0100…U+0143.
fn byte_level_table() -> [Option<u8>; 0x144] {
    let mut t = [None; 0x144];
    let mut next = 0x100;
    for b in 0..=255u8 {
        if matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF) {
            t[b as usize] = Some(b);
        } else {
            t[next] = Some(b);
            next += 1;
        }
    }
    t
}

fn char_to_byte(table: &[Option<u8>; 0x144], c: char) -> Option<u8> {
    table.get(c as usize).copied().flatten()
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|e| anyhow!("loading tokenizer {}: {e}", path.display()))?;
        match inner.get_decoder() {
            Some(DecoderWrapper::ByteLevel(_)) => {}
            _ => bail!("{}: only byte-level BPE tokenizers are supported (decoder is not ByteLevel)", path.display()),
        }
        let added = inner.get_added_tokens_decoder();
        let special: HashSet<u32> = added.iter().filter(|(_, t)| t.special).map(|(&id, _)| id).collect();
        let n = inner.get_vocab_size(true);
        let table = byte_level_table();
        let mut bytes = vec![Vec::new(); n];
        for (tok, id) in inner.get_vocab(true) {
            let slot = bytes
                .get_mut(id as usize)
                .with_context(|| format!("{}: token id {id} outside the vocabulary size {n}", path.display()))?;
            *slot = match added.get(&id) {
                Some(t) => t.content.as_bytes().to_vec(),
                None => tok
                    .chars()
                    .map(|c| {
                        char_to_byte(&table, c).with_context(|| {
                            format!("{}: vocabulary token {tok:?} (id {id}) is not byte-level", path.display())
                        })
                    })
                    .collect::<Result<Vec<u8>>>()?,
            };
        }
        Ok(Self { inner, bytes, special })
    }

    /// Token ids of `text` (NFC-normalised, split by the pre-tokenizer regex, BPE). Added tokens
    /// written in the text (`<|im_start|>`, `<think>`, …) are matched whole, special or not.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| anyhow!("encoding failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; with `skip_special`, added tokens flagged special are dropped (`<think>`
    /// and the tool markers are not special and stay). An id the tokenizer does not know (the
    /// samplers never produce one) becomes U+FFFD rather than failing the whole text.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let known = |id: &u32| self.knows(*id);
        if ids.iter().all(known) {
            return self.inner.decode(ids, skip_special).map_err(|e| anyhow!("decoding failed: {e}"));
        }
        let mut out = String::new();
        for (i, run) in ids.split(|id| !known(id)).enumerate() {
            if i > 0 {
                out.push(char::REPLACEMENT_CHARACTER);
            }
            out.push_str(&self.inner.decode(run, skip_special).map_err(|e| anyhow!("decoding failed: {e}"))?);
        }
        Ok(out)
    }

    /// True when `id` stands for a token (an id past the vocabulary, or a hole in it, does not).
    pub fn knows(&self, id: u32) -> bool {
        self.bytes.get(id as usize).is_some_and(|b| !b.is_empty())
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary spelling of `id` (byte-level form for BPE tokens, e.g. `Ġthe`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream<'_> {
        DecodeStream { tok: self, skip_special, pending: Vec::new() }
    }
}

/// Incremental decoder: `push` one id at a time, `flush` at the end.
pub struct DecodeStream<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    /// Bytes not yet released: at most an incomplete UTF-8 sequence (≤ 3 bytes) between calls.
    pending: Vec<u8>,
}

impl DecodeStream<'_> {
    /// Adds `id`; returns the text completed by it, if any. An id the tokenizer does not know
    /// stands for U+FFFD (as in [`Tokenizer::decode`]): the completion is kept.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        const REPLACEMENT: &[u8] = "\u{FFFD}".as_bytes();
        let b = if self.tok.knows(id) { self.tok.bytes[id as usize].as_slice() } else { REPLACEMENT };
        if self.skip_special && self.tok.special.contains(&id) {
            return Ok(None);
        }
        self.pending.extend_from_slice(b);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(valid).expect("valid prefix"));
                    match e.error_len() {
                        // Definitely invalid: one U+FFFD per maximal invalid subsequence, as
                        // from_utf8_lossy does.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[n..];
                        }
                        // A possibly incomplete character at the end: hold it back.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        Ok((!out.is_empty()).then_some(out))
    }

    /// Releases what is left: an incomplete trailing sequence becomes U+FFFD.
    pub fn flush(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::{byte_level_table, char_to_byte as cb};

    #[test]
    fn byte_level_alphabet() {
        let t = byte_level_table();
        let char_to_byte = |c| cb(&t, c);
        assert_eq!(char_to_byte('Ġ'), Some(b' '));
        assert_eq!(char_to_byte('Ċ'), Some(b'\n'));
        assert_eq!(char_to_byte('Ā'), Some(0));
        assert_eq!(char_to_byte('Ń'), Some(0xAD));
        assert_eq!(char_to_byte('a'), Some(b'a'));
        assert_eq!(char_to_byte('Ņ'), None); // U+0145: past the 68 remapped bytes
        assert_eq!(char_to_byte('中'), None);
    }
}
