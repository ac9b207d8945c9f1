//! The JSONL generation interface: one request per input line, one result line per input line.
//!
//! Input shapes (see `request`): a bare chat body (`messages`, ...), an OpenAI Batch line
//! (`custom_id`, `method`, `url`, `body`), or a raw completion (`prompt` / `prompt_token_ids`).
//! Output: the OpenAI Batch output shape (see `serve`), `chat.completion.chunk` lines before the
//! result when `stream` is set.
//!
//! The front end reaches the tokenizer and the chat template through the two small traits below,
//! so that it can be tested with doubles; `adapters.rs` implements them for the real types.

pub mod adapters;
pub mod batch;
pub mod genconfig;
pub mod lines;
pub mod live;
pub mod request;
pub mod serve;
pub mod split;
pub mod stop;
pub mod structured;
pub mod tokenize;
pub mod toolcall;

pub use genconfig::GenerationDefaults;
pub use request::{LineError, ERROR_CODES};
pub use serve::{serve, serve_with, BatchControl, ServeOptions, ServeStats};
pub use tokenize::tokenize;

/// Incremental detokenizer: returns text only once it is complete UTF-8.
pub trait TokenStream {
    fn push(&mut self, id: u32) -> anyhow::Result<Option<String>>;
    /// Whatever is still buffered at the end of the sequence.
    fn flush(&mut self) -> anyhow::Result<Option<String>>;
}

/// What the front end needs of a tokenizer.
pub trait TextCodec {
    fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>>;
    fn decode(&self, ids: &[u32], skip_special: bool) -> anyhow::Result<String>;
    fn token_id(&self, token: &str) -> Option<u32>;
    /// Real vocabulary size (ids `0..vocab_size` are valid token ids).
    fn vocab_size(&self) -> usize;
    fn stream<'a>(&'a self, skip_special: bool) -> Box<dyn TokenStream + 'a>;
    /// The bytes one id stands for in decoded text (a special token's text; U+FFFD for an id
    /// the tokenizer does not know): the `bytes` of a logprobs entry.
    fn token_bytes(&self, id: u32) -> Vec<u8>;
    /// Whether `id` is an added token (`<|im_end|>`, `<think>`, tool-call markers): structured
    /// output never writes one as text.
    fn is_added(&self, id: u32) -> bool;
}

/// What the front end needs of a chat template.
pub trait PromptRenderer {
    fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> anyhow::Result<String>;
}
