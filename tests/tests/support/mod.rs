//! Test doubles shared by the front-end tests (JSONL and HTTP): a byte-level codec, a ChatML
//! renderer and a runner that replays the text after `SAY:` in the prompt.
#![allow(dead_code)]

pub mod server;

use std::sync::{Arc, Mutex};

use ornith_runtime::engine::{Capacity, EngineConfig, Penalties, Runner, SamplingParams};
use ornith_runtime::graph::{Batch, RowSample, Sampled, KV_BLOCK};
use ornith_runtime::logprobs::TokenLogprobs;
use ornith_runtime::protocol::{PromptRenderer, TextCodec, TokenStream};
use serde_json::{json, Map, Value};

/// The engine configuration of the front-end tests: a [`ScriptRunner`]'s 259 ids sampled,
/// contexts of `ctx`, 2,048-row steps (with or without decode rows).
pub fn script_config(ctx: usize) -> EngineConfig {
    EngineConfig { max_batch_tokens: 2048, idle_batch_tokens: 2048, max_context: ctx, sample_vocab: 259 }
}

pub const IM_END: u32 = 256;
pub const ENDOFTEXT: u32 = 257;
pub const IM_START: u32 = 258;
pub const SPECIALS: [(&str, u32); 3] =
    [("<|im_end|>", IM_END), ("<|endoftext|>", ENDOFTEXT), ("<|im_start|>", IM_START)];

/// Ids 0–255 are bytes (so multi-byte characters span several tokens), 256–258 specials.
pub struct ByteCodec;

pub struct ByteStream {
    pending: Vec<u8>,
    skip: bool,
}

impl TokenStream for ByteStream {
    fn push(&mut self, id: u32) -> anyhow::Result<Option<String>> {
        if let Some((s, _)) = SPECIALS.iter().find(|(_, i)| *i == id) {
            return Ok(if self.skip { None } else { Some(s.to_string()) });
        }
        anyhow::ensure!(id < 256, "token id {id} out of range");
        self.pending.push(id as u8);
        let ok = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(), // incomplete tail: wait
            Err(_) => self.pending.len(),                         // invalid: emit lossily
        };
        if ok == 0 {
            return Ok(None);
        }
        let out: Vec<u8> = self.pending.drain(..ok).collect();
        Ok(Some(String::from_utf8_lossy(&out).into_owned()))
    }
    fn flush(&mut self) -> anyhow::Result<Option<String>> {
        if self.pending.is_empty() {
            return Ok(None);
        }
        Ok(Some(String::from_utf8_lossy(&std::mem::take(&mut self.pending)).into_owned()))
    }
}

impl TextCodec for ByteCodec {
    fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut rest = text;
        'outer: while !rest.is_empty() {
            for (s, id) in SPECIALS {
                if let Some(r) = rest.strip_prefix(s) {
                    ids.push(id);
                    rest = r;
                    continue 'outer;
                }
            }
            let c = rest.chars().next().unwrap();
            ids.extend(rest[..c.len_utf8()].bytes().map(u32::from));
            rest = &rest[c.len_utf8()..];
        }
        Ok(ids)
    }
    fn decode(&self, ids: &[u32], skip_special: bool) -> anyhow::Result<String> {
        let mut s = self.stream(skip_special);
        let mut out = String::new();
        for &i in ids {
            out.extend(s.push(i)?);
        }
        out.extend(s.flush()?);
        Ok(out)
    }
    fn token_id(&self, token: &str) -> Option<u32> {
        SPECIALS.iter().find(|(s, _)| *s == token).map(|(_, i)| *i)
    }
    fn vocab_size(&self) -> usize {
        259
    }
    fn stream<'a>(&'a self, skip_special: bool) -> Box<dyn TokenStream + 'a> {
        Box::new(ByteStream { pending: Vec::new(), skip: skip_special })
    }
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        match SPECIALS.iter().find(|(_, i)| *i == id) {
            Some((s, _)) => s.as_bytes().to_vec(),
            None => vec![id as u8],
        }
    }
    fn is_added(&self, id: u32) -> bool {
        id >= 256
    }
}

/// ChatML with the 35B generation prompt (`<think>\n` unless `enable_thinking` is false).
pub struct ChatMl;

impl PromptRenderer for ChatMl {
    fn render(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add: bool,
        kwargs: &Map<String, Value>,
    ) -> anyhow::Result<String> {
        let msgs = messages.as_array().unwrap();
        anyhow::ensure!(msgs.iter().any(|m| m["role"] == "user"), "No user query found in messages.");
        let mut s = String::new();
        if let Some(t) = tools {
            s += &format!("<|im_start|>system\n# Tools\n{t}<|im_end|>\n");
        }
        for m in msgs {
            s +=
                &format!("<|im_start|>{}\n{}<|im_end|>\n", m["role"].as_str().unwrap(), m["content"].as_str().unwrap());
        }
        if add {
            s += "<|im_start|>assistant\n";
            s += if kwargs.get("enable_thinking") == Some(&json!(false)) {
                "<think>\n\n</think>\n\n"
            } else {
                "<think>\n"
            };
        }
        Ok(s)
    }
}

/// Replays the tokens after the last `SAY:` of the prompt (up to `<|im_end|>`; `$S` becomes the
/// last digit of the sequence's seed), then `<|im_end|>`, then `x` forever, for each sequence of a
/// batch from its own slot.
/// `SAY:FAIL` fails the step, `SAY:PANIC` panics in it. A row with a grammar's mask draws the
/// scripted token where the mask allows it. With
/// [`with_snapshots`](ScriptRunner::with_snapshots), a snapshot row after the slots holds a copy
/// of a slot's state (for the prefix cache).
pub struct ScriptRunner {
    pub ctx: usize,
    pub slots: usize,
    pub snapshots: usize,
    /// Per state row (the slots', then the snapshots'): the tokens fed so far, and the script
    /// with its read position once sampling began.
    pub fed: Vec<Vec<u32>>,
    pub script: Vec<Option<(Vec<u32>, usize)>>,
    pub calls: Arc<Mutex<Vec<SamplingParams>>>,
    /// The penalties each sequence's first sampled row carried (beside `calls`).
    pub penalties: Arc<Mutex<Vec<Penalties>>>,
    /// Time one step takes (0: as fast as it goes).
    pub step_time: std::time::Duration,
}

impl ScriptRunner {
    pub fn new(ctx: usize, slots: usize) -> Self {
        ScriptRunner {
            ctx,
            slots,
            snapshots: 0,
            fed: vec![Vec::new(); slots],
            script: vec![None; slots],
            calls: Arc::new(Mutex::new(Vec::new())),
            penalties: Arc::new(Mutex::new(Vec::new())),
            step_time: std::time::Duration::ZERO,
        }
    }

    /// The same with `n` prefix-cache snapshot rows.
    pub fn with_snapshots(mut self, n: usize) -> Self {
        self.snapshots = n;
        self.fed.resize(self.slots + n, Vec::new());
        self.script.resize(self.slots + n, None);
        self
    }
}

impl Runner for ScriptRunner {
    fn capacity(&self) -> Capacity {
        Capacity { slots: self.slots, blocks: self.slots * self.ctx.div_ceil(KV_BLOCK), snapshots: self.snapshots }
    }
    fn window(&self) -> usize {
        self.ctx
    }
    fn vocab_size(&self) -> usize {
        259
    }
    fn clear_slot(&mut self, slot: usize) -> anyhow::Result<()> {
        self.fed[slot].clear();
        self.script[slot] = None;
        Ok(())
    }
    fn copy_slot(&mut self, from: usize, to: usize) -> anyhow::Result<()> {
        let rows = self.slots + self.snapshots;
        anyhow::ensure!(from < rows && to < rows, "copy {from} -> {to} outside the {rows} state rows");
        self.fed[to] = self.fed[from].clone();
        self.script[to] = self.script[from].clone();
        Ok(())
    }
    fn run(&mut self, batch: &Batch, n: usize, rows: &[RowSample]) -> anyhow::Result<Vec<Sampled>> {
        assert!(n > 0 && n <= 259, "sampling {n} ids");
        std::thread::sleep(self.step_time);
        batch.validate(self.slots, self.capacity().blocks, self.ctx).expect("the engine sent a bad batch");
        let marker: Vec<u32> = b"SAY:".iter().map(|&b| b as u32).collect();
        let mut r0 = 0;
        for s in &batch.seqs {
            let fed = &mut self.fed[s.slot];
            assert_eq!(fed.len(), s.pos, "the engine skipped or repeated positions");
            fed.extend_from_slice(&batch.ids[r0..r0 + s.len]);
            r0 += s.len;
        }
        let mut out = Vec::new();
        for r in rows {
            let slot = batch.seqs[r.row].slot;
            if self.script[slot].is_none() {
                let prompt = &self.fed[slot];
                self.calls.lock().unwrap().push(r.params);
                self.penalties.lock().unwrap().push(r.penalties.as_ref().map_or(Penalties::NONE, |p| p.penalties));
                let start = prompt.windows(4).rposition(|w| w == marker.as_slice()).map_or(prompt.len(), |i| i + 4);
                let mut script: Vec<u32> = prompt[start..].iter().copied().take_while(|&t| t != IM_END).collect();
                let text: Vec<u8> = script.iter().filter(|&&t| t < 256).map(|&t| t as u8).collect();
                if text == b"FAIL" {
                    anyhow::bail!("simulated device failure");
                }
                if text == b"PANIC" {
                    panic!("simulated bug");
                }
                // `$S` says the last digit of the row's seed (choices of one request differ).
                let digit = b'0' as u32 + (r.params.seed % 10) as u32;
                while let Some(i) = script.windows(2).position(|w| w == [b'$' as u32, b'S' as u32]) {
                    script.splice(i..i + 2, [digit]);
                }
                script.push(IM_END);
                self.script[slot] = Some((script, 0));
            }
            let (script, at) = self.script[slot].as_mut().unwrap();
            let mut id = script.get(*at).copied().unwrap_or(b'x' as u32);
            *at += 1;
            // Under a grammar's mask a scripted token the grammar refuses becomes the first
            // allowed of `}"]:,0` and `<|im_end|>`, else the lowest allowed id (closing what is
            // open, so that junk scripts still end).
            if let Some(m) = r.mask.as_ref().filter(|m| !m.allows(id)) {
                let prefer = b"}\"]:,0".iter().map(|&b| b as u32).chain([IM_END]);
                id = prefer.chain(0..n as u32).find(|&t| m.allows(t)).expect("the mask allows some id");
            }
            let logprobs = r.logprobs.map(|w| Box::new(script_logprobs(w.forced.unwrap_or(id), w.top)));
            out.push(Sampled { id, logprobs });
        }
        Ok(out)
    }
}

/// The scripted model's log-probabilities: token `t` has `-t / 1000`, the top `k` are `A`, `B`,
/// … with -0.25, -0.5, ….
pub fn script_logprobs(token: u32, top: usize) -> TokenLogprobs {
    let top = (0..top).map(|i| (b'A' as u32 + i as u32, -0.25 * (i + 1) as f32)).collect();
    TokenLogprobs { token, logprob: -(token as f32) / 1000.0, top }
}

/// [`ByteCodec`] whose encoding of a text holding [`HOLD`] waits until its [`Gate`] opens: a
/// prompt whose preparation takes as long as the test wants.
pub struct GatedCodec(pub std::sync::Arc<Gate>);

/// The marker [`GatedCodec`] waits on.
pub const HOLD: &str = "@@hold@@";

/// Shut until [`Gate::open`]; counts the encodes waiting at it.
#[derive(Default)]
pub struct Gate {
    open: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
    pub waiting: std::sync::atomic::AtomicUsize,
}

impl Gate {
    pub fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }

    /// Whether [`Self::open`] has been called.
    pub fn is_open(&self) -> bool {
        *self.open.lock().unwrap()
    }

    /// Blocks (up to 10 s) until `n` encodes wait at the gate.
    pub fn wait_for(&self, n: usize) {
        let t = std::time::Instant::now();
        while self.waiting.load(std::sync::atomic::Ordering::SeqCst) < n {
            assert!(t.elapsed() < std::time::Duration::from_secs(10), "no encode reached the gate");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}

impl ornith_runtime::protocol::TextCodec for GatedCodec {
    fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        if text.contains(HOLD) {
            self.0.waiting.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut open = self.0.open.lock().unwrap();
            while !*open {
                open = self.0.cv.wait(open).unwrap();
            }
        }
        ByteCodec.encode(text)
    }
    fn decode(&self, ids: &[u32], skip_special: bool) -> anyhow::Result<String> {
        ByteCodec.decode(ids, skip_special)
    }
    fn token_id(&self, token: &str) -> Option<u32> {
        ByteCodec.token_id(token)
    }
    fn vocab_size(&self) -> usize {
        ByteCodec.vocab_size()
    }
    fn stream<'a>(&'a self, skip_special: bool) -> Box<dyn ornith_runtime::protocol::TokenStream + 'a> {
        ByteCodec.stream(skip_special)
    }
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        ByteCodec.token_bytes(id)
    }
    fn is_added(&self, id: u32) -> bool {
        ByteCodec.is_added(id)
    }
}
