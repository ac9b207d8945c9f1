//! The contract between the JSONL front end and a backend: a generator that prefills a prompt
//! and decodes one token at a time, sampling where the backend runs.

/// Sampling settings of one request (OpenAI / vLLM semantics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 means disabled.
    pub top_k: usize,
    /// 1.0 means disabled; must be in (0, 1].
    pub top_p: f32,
    /// 0.0 means disabled.
    pub min_p: f32,
    /// Seed of the request's random stream; the same seed reproduces the same output.
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0 }
    }
}

/// One sequence being generated. Backends implement this; the front end drives it.
pub trait Generator {
    /// Largest number of tokens (prompt + generated) this generator can hold.
    fn max_context(&self) -> usize;
    /// Vocabulary rows of the lm_head (logit count).
    fn vocab_size(&self) -> usize;
    /// Restricts sampling to ids `0..n`, the ids the tokenizer can decode (the lm_head has
    /// padding rows past them that must never come out). Fails when `n` is 0 or exceeds the
    /// lm_head's rows. Until called, every row is a candidate.
    fn limit_vocab(&mut self, n: usize) -> anyhow::Result<()>;
    /// Forgets any previous sequence, runs `prompt` (non-empty), and returns the first sampled
    /// token. The request's sampled tokens are counted from 0 (the first is this one); the count
    /// feeds the seeded random stream, so a seed reproduces the whole completion.
    fn prefill(&mut self, prompt: &[u32], params: &SamplingParams) -> anyhow::Result<u32>;
    /// Appends `token` to the sequence and returns the next sampled token.
    fn decode(&mut self, token: u32, params: &SamplingParams) -> anyhow::Result<u32>;
}
