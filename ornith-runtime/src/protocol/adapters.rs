//! The protocol traits implemented for the real tokenizer and chat template.
//!
//! Not in the module tree until `ornith_runtime::tokenizer` and `ornith_runtime::chat` exist:
//! enable it with `pub mod adapters;` in `protocol/mod.rs`, then have `load::build_frontend`
//! return `adapters::load_frontend(&model_dir)`.

use std::path::Path;

use anyhow::Context;
use serde_json::{Map, Value};

use super::{PromptRenderer, TextCodec, TokenStream};
use crate::chat::ChatTemplate;
use crate::tokenizer::{DecodeStream, Tokenizer};

/// `DecodeStream::flush` is specified as `anyhow::Result<Option<String>>`; a draft of the
/// tokenizer returns a bare `Option<String>`. Either converts.
trait FlushOutput {
    fn into_result(self) -> anyhow::Result<Option<String>>;
}
impl FlushOutput for Option<String> {
    fn into_result(self) -> anyhow::Result<Option<String>> {
        Ok(self)
    }
}
impl FlushOutput for anyhow::Result<Option<String>> {
    fn into_result(self) -> anyhow::Result<Option<String>> {
        self
    }
}

impl TokenStream for DecodeStream<'_> {
    fn push(&mut self, id: u32) -> anyhow::Result<Option<String>> {
        DecodeStream::push(self, id)
    }
    fn flush(&mut self) -> anyhow::Result<Option<String>> {
        DecodeStream::flush(self).into_result()
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
    let tok = Tokenizer::from_file(&dir.join("tokenizer.json"))
        .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let tpl_path = dir.join("chat_template.jinja");
    anyhow::ensure!(tpl_path.exists(), "{} has no chat_template.jinja", dir.display());
    let tpl = ChatTemplate::from_file(&tpl_path)
        .with_context(|| format!("loading the chat template {}", tpl_path.display()))?;
    Ok((Box::new(tok), Box::new(tpl)))
}
