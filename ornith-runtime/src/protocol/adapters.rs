//! The protocol traits implemented for the real tokenizer (`crate::tokenizer`) and chat template
//! (`crate::chat`), and the loading of both from a checkpoint directory.

use std::path::Path;

use anyhow::Context;
use serde_json::{Map, Value};

use super::{PromptRenderer, TextCodec, TokenStream};
use crate::chat::ChatTemplate;
use crate::tokenizer::{DecodeStream, Tokenizer};

impl TokenStream for DecodeStream<'_> {
    fn push(&mut self, id: u32) -> anyhow::Result<Option<String>> {
        DecodeStream::push(self, id)
    }
    fn flush(&mut self) -> anyhow::Result<Option<String>> {
        Ok(DecodeStream::flush(self))
    }
}

impl TextCodec for Tokenizer {
    fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        Tokenizer::encode(self, text)
    }
    fn decode(&self, ids: &[u32], skip_special: bool) -> anyhow::Result<String> {
        Tokenizer::decode(self, ids, skip_special)
    }
    fn token_id(&self, token: &str) -> Option<u32> {
        Tokenizer::token_id(self, token)
    }
    fn vocab_size(&self) -> usize {
        Tokenizer::vocab_size(self)
    }
    fn stream<'a>(&'a self, skip_special: bool) -> Box<dyn TokenStream + 'a> {
        Box::new(self.decode_stream(skip_special))
    }
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        Tokenizer::token_bytes(self, id).map_or_else(|| "\u{FFFD}".as_bytes().to_vec(), <[u8]>::to_vec)
    }
    fn is_added(&self, id: u32) -> bool {
        Tokenizer::is_added(self, id)
    }
}

impl PromptRenderer for ChatTemplate {
    fn render(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> anyhow::Result<String> {
        ChatTemplate::render(self, messages, tools, add_generation_prompt, kwargs)
    }
}

/// The tokenizer (`tokenizer.json`) and chat template (`chat_template.jinja`, the Jinja source
/// that `ChatTemplate::from_file` reads) of a checkpoint directory.
pub fn load_frontend(dir: &Path) -> anyhow::Result<(Box<dyn TextCodec>, Box<dyn PromptRenderer>)> {
    let (tok, tpl) = load_frontend_parts(dir)?;
    Ok((Box::new(tok), Box::new(tpl)))
}

/// [`load_frontend`] with the concrete types (both `Send`, so they can be loaded on a thread).
pub fn load_frontend_parts(dir: &Path) -> anyhow::Result<(Tokenizer, ChatTemplate)> {
    for f in [TOKENIZER_FILE, CHAT_TEMPLATE_FILE] {
        anyhow::ensure!(
            dir.join(f).is_file(),
            "{}: no {f}. Fix: copy {f} from the original checkpoint into this directory",
            dir.display()
        );
    }
    let tok = Tokenizer::from_file(&dir.join(TOKENIZER_FILE))
        .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let tpl_path = dir.join(CHAT_TEMPLATE_FILE);
    let tpl = ChatTemplate::from_file(&tpl_path)?;
    Ok((tok, tpl))
}

/// The front-end files the runtime reads from a checkpoint directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
