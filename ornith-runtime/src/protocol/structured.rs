//! Structured output (`response_format`): the answer constrained to JSON, or to JSON matching a
//! schema, by a grammar over token ids ([`crate::engine::Grammar`]).
//!
//! The grammars are llguidance's (guidance-ai/llguidance, MIT; one of the structured-output
//! backends vLLM and SGLang offer, and llama.cpp's optional one): a JSON schema compiles to a grammar and a per-sequence
//! matcher computes the allowed ids at each step from a byte trie of the vocabulary. The trie is
//! built from the tokenizer once, on the first structured request, and shared. The JSON is
//! written compactly (`", "` and `": "` separators, no free whitespace, as Python's
//! `json.dumps`), so a model cannot spend its tokens on blank space inside the object; once the
//! value is complete only the end-of-sequence token is allowed. Added tokens (`<think>`, the
//! tool-call markers, the specials) can never appear inside the JSON.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use super::request::LineError;
use super::TextCodec;
use crate::engine::{Grammar, TokenMask};

/// The vocabulary indexed for grammars, built on first use.
#[derive(Default)]
pub struct Grammars {
    cell: OnceLock<Result<Arc<ParserFactory>, String>>,
}

impl Grammars {
    pub fn new() -> Self {
        Grammars::default()
    }

    fn factory(&self, codec: &dyn TextCodec, eos: u32) -> Result<&Arc<ParserFactory>, LineError> {
        let built = self.cell.get_or_init(|| {
            let n = codec.vocab_size();
            // Added tokens (`<|im_end|>`, `<think>`, tool markers) carry the trie's marker byte, so
            // that no grammar writes them as text; the end-of-sequence token is the one grammars
            // allow at the end.
            let words: Vec<Vec<u8>> = (0..n as u32)
                .map(|id| {
                    let b = codec.token_bytes(id);
                    if codec.is_added(id) {
                        [&[TokTrie::SPECIAL_TOKEN_MARKER][..], &b].concat()
                    } else {
                        b
                    }
                })
                .collect();
            let trie = TokTrie::from(&TokRxInfo::new(n as u32, eos), &words);
            let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
            let mut f = ParserFactory::new_simple(&env).map_err(|e| format!("{e:#}"))?;
            f.quiet();
            Ok(Arc::new(f))
        });
        built.as_ref().map_err(|e| LineError::new("internal_error", format!("structured output: {e}")))
    }

    /// A grammar for JSON matching `schema` (`None`: any JSON object, `json_object` mode). A
    /// schema the compiler refuses is an `invalid_request` with its message.
    pub fn json(&self, codec: &dyn TextCodec, eos: u32, schema: Option<&Value>) -> Result<Box<dyn Grammar>, LineError> {
        let factory = self.factory(codec, eos)?;
        let mut schema = schema.cloned().unwrap_or_else(|| json!({"type": "object"}));
        let Some(obj) = schema.as_object_mut() else {
            return Err(LineError::invalid("`response_format.json_schema.schema` must be a JSON object"));
        };
        obj.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
        let parser = factory
            .create_parser(TopLevelGrammar::from_json_schema(schema))
            .map_err(|e| LineError::invalid(format!("`response_format` schema: {e:#}")))?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(LineError::invalid(format!("`response_format` schema: {e}")));
        }
        Ok(Box::new(JsonGrammar { m }))
    }
}

/// One sequence's JSON matcher.
struct JsonGrammar {
    m: Matcher,
}

impl Grammar for JsonGrammar {
    fn allowed(&mut self, vocab: usize) -> anyhow::Result<TokenMask> {
        let v = self.m.compute_mask_or_eos()?;
        let mut words = v.as_slice().to_vec();
        words.resize(vocab.div_ceil(32), 0);
        // Ids past `vocab` (the trie's padding bits) are not candidates.
        if !vocab.is_multiple_of(32) {
            let last = words.len() - 1;
            words[last] &= (1u32 << (vocab % 32)) - 1;
        }
        anyhow::ensure!(words.iter().any(|&w| w != 0), "the grammar allows no token");
        Ok(TokenMask { words })
    }

    fn commit(&mut self, id: u32) -> anyhow::Result<()> {
        if self.m.is_stopped() {
            return Ok(()); // the end-of-sequence token after a complete value
        }
        self.m.consume_token(id)
    }

    fn clone_box(&self) -> Box<dyn Grammar> {
        Box::new(JsonGrammar { m: self.m.deep_clone() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::TokenStream;

    /// Bytes 0–255, then `<|im_end|>` (256) and `<|endoftext|>` (257).
    struct Bytes;
    impl TextCodec for Bytes {
        fn encode(&self, t: &str) -> anyhow::Result<Vec<u32>> {
            Ok(t.bytes().map(u32::from).collect())
        }
        fn decode(&self, _: &[u32], _: bool) -> anyhow::Result<String> {
            unimplemented!()
        }
        fn token_id(&self, token: &str) -> Option<u32> {
            ["<|im_end|>", "<|endoftext|>"].iter().position(|t| *t == token).map(|i| 256 + i as u32)
        }
        fn vocab_size(&self) -> usize {
            258
        }
        fn stream<'a>(&'a self, _: bool) -> Box<dyn TokenStream + 'a> {
            unimplemented!()
        }
        fn token_bytes(&self, id: u32) -> Vec<u8> {
            match id {
                256 => b"<|im_end|>".to_vec(),
                257 => b"<|endoftext|>".to_vec(),
                b => vec![b as u8],
            }
        }
        fn is_added(&self, id: u32) -> bool {
            id >= 256
        }
    }

    /// Greedy under the mask with a preference: the first allowed byte of `prefer`, else the
    /// lowest allowed id. Returns the output and whether it ended with `<|im_end|>`.
    fn run(g: &mut Box<dyn Grammar>, prefer: &[u8]) -> (String, bool) {
        let mut out = Vec::new();
        for _ in 0..200 {
            let m = g.allowed(258).unwrap();
            let id =
                prefer.iter().map(|&b| b as u32).find(|&b| m.allows(b)).or_else(|| (0..258).find(|&i| m.allows(i)));
            let id = id.unwrap();
            g.commit(id).unwrap();
            if id == 256 {
                return (String::from_utf8(out).unwrap(), true);
            }
            assert!(id < 256, "a special token inside the JSON");
            out.push(id as u8);
        }
        (String::from_utf8(out).unwrap(), false)
    }

    #[test]
    fn schemas_constrain_the_output_and_end_it() {
        let g = Grammars::new();
        let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}},
                            "required": ["ok", "n"], "additionalProperties": false});
        let mut a = g.json(&Bytes, 256, Some(&schema)).unwrap();
        let (text, ended) = run(&mut a, b"x {");
        assert!(ended, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(v["ok"].is_boolean() && (v["n"] == 1 || v["n"] == 2), "{text}");
        assert!(text.contains("\": ") && !text.contains("  "), "compact separators: {text}");
        // json_object: any object; a model that wants to ramble gets `{` first anyway.
        let mut b = g.json(&Bytes, 256, None).unwrap();
        let (text, ended) = run(&mut b, b"hello}");
        assert!(ended);
        assert!(serde_json::from_str::<serde_json::Map<String, Value>>(&text).is_ok(), "{text}");
        // A clone goes on from the same state, independently.
        let mut c = g.json(&Bytes, 256, Some(&schema)).unwrap();
        c.commit(b'{' as u32).unwrap();
        let mut d = c.clone_box();
        assert!(!d.allowed(258).unwrap().allows(b'{' as u32) && d.allowed(258).unwrap().allows(b'"' as u32));
        assert_eq!(run(&mut c, b"").0, run(&mut d, b"").0);
        // Bad schemas are the request's error.
        assert_eq!(g.json(&Bytes, 256, Some(&json!([1]))).err().unwrap().code, "invalid_request");
        let e = g.json(&Bytes, 256, Some(&json!({"type": "nonsense"}))).err().unwrap();
        assert_eq!(e.code, "invalid_request", "{}", e.message);
    }
}
