//! Text ↔ token ids with a Hugging Face `tokenizer.json` (byte-level BPE, as Qwen3.5 ships it),
//! on the `tokenizers` crate with its pure-Rust regex backend.
//!
//! Streaming decode works on bytes: each id maps to the bytes it stands for (a vocabulary token's
//! byte-level spelling mapped back through GPT-2's byte↔char table, an added token's content),
//! and text is released only up to the last complete UTF-8 character. Invalid bytes become
//! U+FFFD exactly where `String::from_utf8_lossy` on the whole byte string would put them, which
//! is what the byte-level decoder of `decode` does, so the concatenated stream equals `decode`.
//!
//! Encoding splits the text at its added tokens first, as the library's own first step does, and
//! keeps the ids of long pieces in a cache: a coding agent resends its whole conversation every
//! turn, and only the pieces it has not sent before are encoded again (see [`Tokenizer::encode`]).
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context, Result};
use tokenizers::DecoderWrapper;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Bytes of every id, indexed by id (empty for ids the tokenizer does not know).
    bytes: Vec<Vec<u8>>,
    /// Ids of added tokens flagged `special` (dropped by `skip_special` decoding).
    special: HashSet<u32>,
    /// Ids of every added token (special or not: `<think>`, the tool-call markers too).
    added: HashSet<u32>,
    /// The added tokens as the library's first split matches them, when that split is all there
    /// is to them (see [`AddedSplit::of`]); `None`: every text goes through the whole pipeline.
    split: Option<AddedSplit>,
    /// Ids of text pieces (see [`Tokenizer::encode`]).
    cache: Mutex<PieceCache>,
    /// Whether a long piece may be cut at its seams ([`seams`]) to be encoded on threads: the
    /// normalizer and pre-tokenizer are Qwen3.5's ([`seams_hold`]).
    cut_seams: bool,
}

/// Pieces this long are encoded in parts cut at seams ([`seams`]) at least this far apart.
const SUB_PIECE: usize = 16 << 10;

/// The Qwen3.5 pre-tokenizer: the regex split (`Isolated`), then byte-level mapping without a
/// regex of its own.
const QWEN_PRETOKENIZER: &str = r#"{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},"behavior":"Isolated","invert":false},{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":false,"use_regex":false}]}"#;

/// Whether [`seams`] are places where the library's pipeline treats the two sides apart: NFC (or
/// no normalizer) and [`QWEN_PRETOKENIZER`] exactly. Then in `…\n` + ASCII letter the newline
/// ends a match of the split regex in the whole text as in the left part alone — only the
/// alternatives `\s*[\r\n]+` and ` ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*` can hold a newline, a match
/// of either ends right after a newline that a letter follows, and `\s*[\r\n]+` comes before
/// the one alternative that looks ahead (which so never takes a newline) — so the matches on
/// either side are those of the whole text, and the next one starts at the letter; NFC
/// composes nothing across a newline followed by an ASCII letter (neither is part of a
/// composition across them, and the letter, a starter, blocks reordering); the byte-level map and
/// BPE work within a match.
fn seams_hold(inner: &tokenizers::Tokenizer) -> bool {
    let nfc = match inner.get_normalizer().map(serde_json::to_value) {
        None => true,
        Some(Ok(v)) => v == serde_json::json!({"type": "NFC"}),
        Some(Err(_)) => false,
    };
    let pre = inner.get_pre_tokenizer().map(serde_json::to_value);
    let want: serde_json::Value = serde_json::from_str(QWEN_PRETOKENIZER).expect("the pattern constant is JSON");
    nfc && matches!(pre, Some(Ok(v)) if v == want)
}

/// `piece` in parts for encoding apart (see [`seams_hold`]): cut after a `\n` followed by an ASCII
/// letter, the first such place at or past every [`SUB_PIECE`] bytes; a shorter piece whole.
fn seams(piece: &str) -> Vec<&str> {
    let b = piece.as_bytes();
    let mut parts = Vec::new();
    let mut start = 0;
    let mut at = SUB_PIECE;
    while at < b.len() {
        // The seam at or after `at`: b[i - 1] == '\n' and b[i] an ASCII letter (a char boundary).
        match (at.max(1)..b.len()).find(|&i| b[i - 1] == b'\n' && b[i].is_ascii_alphabetic()) {
            Some(i) => {
                parts.push(&piece[start..i]);
                start = i;
                at = i + SUB_PIECE;
            }
            None => break,
        }
    }
    parts.push(&piece[start..]);
    parts
}

/// Text pieces at least this long are cached (shorter ones cost less to encode than to store).
const CACHE_MIN_PIECE: usize = 256;
/// Bytes the piece cache holds at most (texts and ids): ~40 conversations of 200K tokens.
const CACHE_BUDGET: usize = 64 << 20;
/// Uncached pieces adding up to this many bytes are encoded on several threads.
const PARALLEL_MIN_BYTES: usize = 128 << 10;
/// Most threads one encode uses.
const MAX_THREADS: usize = 8;

/// One piece of a text as the library's first split sees it: an added token, or the text between two.
enum Piece<'a> {
    Added(u32),
    Text(&'a str),
}

/// The added tokens, longest first, and the bytes they can start with.
struct AddedSplit {
    tokens: Vec<(String, u32)>,
    first: [bool; 256],
}

impl AddedSplit {
    /// `tokenizers` encodes a text by splitting it at the added tokens it finds in the raw text
    /// (leftmost-longest, the `normalized: false` ones), normalising what lies between, splitting
    /// that again at the `normalized: true` tokens, then pre-tokenizing and running the model on
    /// each piece by itself (tokenizers 0.22, `AddedVocabulary::extract_and_normalize`). When
    /// every added token is matched in the raw text as it stands (`normalized`, `lstrip`, `rstrip`
    /// and `single_word` all false: the Qwen3.5 files), specials are not encoded as text, and no
    /// truncation or padding is set, that first split is the only place where pieces meet, so the
    /// ids of a text are those of its pieces in order. Otherwise `None`.
    fn of(inner: &tokenizers::Tokenizer) -> Option<Self> {
        let added = inner.get_added_tokens_decoder();
        let plain =
            added.values().all(|t| !t.normalized && !t.lstrip && !t.rstrip && !t.single_word && !t.content.is_empty());
        if !plain
            || inner.get_encode_special_tokens()
            || inner.get_truncation().is_some()
            || inner.get_padding().is_some()
        {
            return None;
        }
        let mut tokens: Vec<(String, u32)> = added.iter().map(|(&id, t)| (t.content.clone(), id)).collect();
        tokens.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut first = [false; 256];
        for (t, _) in &tokens {
            first[t.as_bytes()[0] as usize] = true;
        }
        Some(Self { tokens, first })
    }

    /// `text` cut at its added tokens, leftmost first and the longest token at a place (the
    /// library's `MatchKind::LeftmostLongest`); empty pieces between tokens are left out.
    fn split<'a>(&self, text: &'a str) -> Vec<Piece<'a>> {
        let b = text.as_bytes();
        let mut pieces = Vec::new();
        let (mut start, mut i) = (0, 0);
        while i < b.len() {
            if self.first[b[i] as usize] {
                // A token's first byte never continues a UTF-8 character, so `i` is a char boundary.
                if let Some((t, id)) = self.tokens.iter().find(|(t, _)| b[i..].starts_with(t.as_bytes())) {
                    if start < i {
                        pieces.push(Piece::Text(&text[start..i]));
                    }
                    pieces.push(Piece::Added(*id));
                    i += t.len();
                    start = i;
                    continue;
                }
            }
            i += 1;
        }
        if start < b.len() {
            pieces.push(Piece::Text(&text[start..]));
        }
        pieces
    }
}

/// Ids of text pieces by their text, least recently used evicted first past [`CACHE_BUDGET`].
#[derive(Default)]
struct PieceCache {
    map: HashMap<String, (Arc<[u32]>, u64)>,
    bytes: usize,
    clock: u64,
    budget: usize,
    /// Lookups that found their piece, and those that did not.
    hits: u64,
    misses: u64,
}

/// The encode cache's counters ([`Tokenizer::cache_stats`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheStats {
    /// Pieces held.
    pub pieces: usize,
    /// Lookups of long pieces that found them, and that did not.
    pub hits: u64,
    pub misses: u64,
}

impl PieceCache {
    fn new(budget: usize) -> Self {
        Self { budget, ..Self::default() }
    }

    fn cost(text: &str, ids: &[u32]) -> usize {
        text.len() + 4 * ids.len()
    }

    fn get(&mut self, text: &str) -> Option<Arc<[u32]>> {
        self.clock += 1;
        let clock = self.clock;
        let found = self.map.get_mut(text).map(|(ids, used)| {
            *used = clock;
            ids.clone()
        });
        if found.is_some() {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        found
    }

    /// Stores a piece's ids; past the budget, drops the least recently used pieces down to 3/4 of
    /// it (a piece larger than that is not kept).
    fn insert(&mut self, text: &str, ids: Arc<[u32]>) {
        let cost = Self::cost(text, &ids);
        if cost > self.budget / 4 * 3 || self.map.contains_key(text) {
            return;
        }
        self.clock += 1;
        self.bytes += cost;
        self.map.insert(text.to_string(), (ids, self.clock));
        if self.bytes > self.budget {
            let mut by_age: Vec<(u64, String)> = self.map.iter().map(|(t, (_, used))| (*used, t.clone())).collect();
            by_age.sort_unstable();
            for (_, t) in by_age {
                if self.bytes <= self.budget / 4 * 3 {
                    break;
                }
                if let Some((ids, _)) = self.map.remove(&t) {
                    self.bytes -= Self::cost(&t, &ids);
                }
            }
        }
    }
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
        let added_ids: HashSet<u32> = added.keys().copied().collect();
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
        let split = AddedSplit::of(&inner);
        let cut_seams = seams_hold(&inner);
        Ok(Self {
            inner,
            bytes,
            special,
            added: added_ids,
            split,
            cache: Mutex::new(PieceCache::new(CACHE_BUDGET)),
            cut_seams,
        })
    }

    /// Token ids of `text` (NFC-normalised, split by the pre-tokenizer regex, BPE). Added tokens
    /// written in the text (`<|im_start|>`, `<think>`, …) are matched whole, special or not.
    ///
    /// The ids of [`Self::encode_uncached`], piece by piece: the text is cut at its added tokens
    /// (the library's first step, [`AddedSplit::of`]), pieces of at least [`CACHE_MIN_PIECE`]
    /// bytes are looked up in the cache, and the rest are encoded — on several threads when
    /// they add up to [`PARALLEL_MIN_BYTES`] — and the long ones cached. A conversation's messages
    /// are such pieces (the chat template puts `<|im_start|>` and `<|im_end|>` around each), so
    /// the next turn of a conversation encodes only its new messages.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let Some(split) = &self.split else {
            return self.encode_uncached(text);
        };
        enum Part {
            Id(u32),
            Ids(Arc<[u32]>),
            Miss(usize),
        }
        let mut misses: Vec<&str> = Vec::new();
        let parts: Vec<Part> = {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            split
                .split(text)
                .into_iter()
                .map(|p| match p {
                    Piece::Added(id) => Part::Id(id),
                    Piece::Text(t) => match (t.len() >= CACHE_MIN_PIECE).then(|| cache.get(t)).flatten() {
                        Some(ids) => Part::Ids(ids),
                        None => {
                            misses.push(t);
                            Part::Miss(misses.len() - 1)
                        }
                    },
                })
                .collect()
        };
        let encoded = self.encode_pieces(&misses)?;
        {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            for (t, ids) in misses.iter().zip(&encoded) {
                if t.len() >= CACHE_MIN_PIECE {
                    cache.insert(t, ids.clone());
                }
            }
        }
        let mut out = Vec::with_capacity(text.len() / 3);
        for p in parts {
            match p {
                Part::Id(id) => out.push(id),
                Part::Ids(ids) => out.extend_from_slice(&ids),
                Part::Miss(i) => out.extend_from_slice(&encoded[i]),
            }
        }
        Ok(out)
    }

    /// The library's whole pipeline on `text` at once, no cache: what [`Self::encode`] equals.
    pub fn encode_uncached(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| anyhow!("encoding failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Whether long pieces are encoded in parts cut at their seams (the Qwen3.5 normalizer and
    /// pre-tokenizer; for tests and diagnostics).
    pub fn cuts_long_pieces(&self) -> bool {
        self.cut_seams
    }

    /// The encode cache's counters (for tests and diagnostics).
    pub fn cache_stats(&self) -> CacheStats {
        let c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        CacheStats { pieces: c.map.len(), hits: c.hits, misses: c.misses }
    }

    /// [`Self::encode_uncached`] of each piece, in order. A piece of Qwen3.5 text longer than
    /// [`SUB_PIECE`] is encoded in parts cut at its seams ([`seams`]: the same ids); the parts run
    /// on up to [`MAX_THREADS`] threads (the longest first) when they add up to
    /// [`PARALLEL_MIN_BYTES`].
    fn encode_pieces(&self, pieces: &[&str]) -> Result<Vec<Arc<[u32]>>> {
        // The parts, each with the index of its piece, in order.
        let parts: Vec<(usize, &str)> = pieces
            .iter()
            .enumerate()
            .flat_map(|(i, p)| if self.cut_seams { seams(p) } else { vec![*p] }.into_iter().map(move |q| (i, q)))
            .collect();
        let total: usize = pieces.iter().map(|p| p.len()).sum();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = cores.min(MAX_THREADS).min(parts.len());
        let encoded: Vec<Vec<u32>> = if threads <= 1 || total < PARALLEL_MIN_BYTES {
            parts.iter().map(|(_, q)| self.encode_uncached(q)).collect::<Result<_>>()?
        } else {
            let mut order: Vec<usize> = (0..parts.len()).collect();
            order.sort_by_key(|&k| std::cmp::Reverse(parts[k].1.len()));
            let next = AtomicUsize::new(0);
            // One slot per part, filled by whichever thread encodes it.
            type Slot = Mutex<Option<Result<Vec<u32>>>>;
            let slots: Vec<Slot> = parts.iter().map(|_| Mutex::new(None)).collect();
            std::thread::scope(|s| {
                for _ in 0..threads {
                    s.spawn(|| loop {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&k) = order.get(n) else { break };
                        let r = self.encode_uncached(parts[k].1);
                        *slots[k].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                    });
                }
            });
            slots
                .into_iter()
                .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()).expect("every part encoded"))
                .collect::<Result<_>>()?
        };
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); pieces.len()];
        for ((i, _), ids) in parts.iter().zip(encoded) {
            out[*i].extend(ids);
        }
        Ok(out.into_iter().map(Arc::from).collect())
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
    /// Whether `id` is an added token (`<|im_end|>`, `<think>`, the tool-call markers, …).
    pub fn is_added(&self, id: u32) -> bool {
        self.added.contains(&id)
    }

    /// The bytes `id` stands for in decoded text (a special token's text), or None for an id
    /// the tokenizer does not know.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.knows(id).then(|| self.bytes[id as usize].as_slice())
    }

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
    use super::{byte_level_table, char_to_byte as cb, AddedSplit, Piece, PieceCache};
    use std::sync::Arc;

    fn split_of(tokens: &[(&str, u32)]) -> AddedSplit {
        let mut tokens: Vec<(String, u32)> = tokens.iter().map(|(t, id)| (t.to_string(), *id)).collect();
        tokens.sort_by_key(|t| std::cmp::Reverse(t.0.len()));
        let mut first = [false; 256];
        for (t, _) in &tokens {
            first[t.as_bytes()[0] as usize] = true;
        }
        AddedSplit { tokens, first }
    }

    fn show(pieces: Vec<Piece<'_>>) -> Vec<String> {
        pieces
            .into_iter()
            .map(|p| match p {
                Piece::Added(id) => format!("#{id}"),
                Piece::Text(t) => t.to_string(),
            })
            .collect()
    }

    #[test]
    fn added_split_is_leftmost_longest() {
        let s = split_of(&[("<a>", 1), ("<a>b", 2), ("<|x|>", 3), ("é<", 4)]);
        assert_eq!(show(s.split("")), Vec::<String>::new());
        assert_eq!(show(s.split("<a>")), ["#1"]);
        // The longest token at the leftmost place wins; nothing empty between adjacent tokens.
        assert_eq!(show(s.split("x<a>bc<a><|x|>")), ["x", "#2", "c", "#1", "#3"]);
        // Partial and nested markers stay text; a multi-byte first character splits on a boundary.
        assert_eq!(show(s.split("<<|x|>>|x|<a")), ["<", "#3", ">|x|<a"]);
        assert_eq!(show(s.split("aé<a>")), ["a", "#4", "a>"]);
    }

    #[test]
    fn seams_cut_after_a_newline_before_an_ascii_letter() {
        use super::{seams, SUB_PIECE};
        assert_eq!(seams("short\nlines"), ["short\nlines"]);
        // Past SUB_PIECE bytes, the first newline followed by an ASCII letter; a newline before
        // a space, a digit, another newline or a non-ASCII letter is not a seam.
        let head = "x".repeat(SUB_PIECE - 2);
        let text = format!("{head}\n \n1\n\n\u{e9}\nabc\n{}", "y".repeat(SUB_PIECE));
        let parts = seams(&text);
        assert_eq!(parts.len(), 2);
        assert!(parts[0].ends_with("\u{e9}\n") && parts[1].starts_with("abc\n"), "{:?}", &parts[1][..8]);
        assert_eq!(parts.concat(), text);
        // Cuts at least SUB_PIECE apart; none without a seam.
        let lines = "line of text\n".repeat(5 * SUB_PIECE / 13);
        let parts = seams(&lines);
        assert!(parts.len() >= 4 && parts[..parts.len() - 1].iter().all(|p| p.len() >= SUB_PIECE));
        assert_eq!(parts.concat(), lines);
        assert_eq!(seams(&"z".repeat(3 * SUB_PIECE)).len(), 1);
    }

    #[test]
    fn piece_cache_evicts_least_recently_used() {
        let ids = |n: usize| Arc::<[u32]>::from(vec![7u32; n]);
        // cost = text bytes + 4 per id: 10 + 40 = 50 each, budget 200 (kept down to 150).
        let mut c = PieceCache::new(200);
        for k in 0..4 {
            c.insert(&format!("piece-{k:04}"), ids(10));
        }
        assert_eq!((c.map.len(), c.bytes), (4, 200));
        assert!(c.get("piece-0000").is_some()); // now the most recently used
        c.insert("piece-0004", ids(10)); // 250 > 200: drop the oldest down to <= 150
        assert_eq!(c.bytes, 150);
        assert!(c.get("piece-0000").is_some() && c.get("piece-0004").is_some());
        assert!(c.get("piece-0001").is_none() && c.get("piece-0002").is_none());
        // A piece larger than 3/4 of the budget is not kept; a repeated insert changes nothing.
        c.insert("huge", ids(40));
        c.insert("piece-0004", ids(10));
        assert_eq!((c.map.len(), c.bytes), (3, 150));
        assert_eq!(&*c.get("piece-0004").unwrap(), &[7u32; 10][..]);
    }

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
