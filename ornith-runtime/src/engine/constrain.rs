//! Constrained decoding, the engine's side: a sequence's draws restricted to the ids a grammar
//! allows next (structured output: `response_format`). The grammar itself is behind
//! [`Grammar`] (the JSON grammars are `protocol::structured`'s); the engine asks it for the
//! allowed ids before each step where the constraint is active, passes them to the backend with
//! the row ([`crate::graph::RowSample::mask`]: the disallowed ids' logits become −∞ after the
//! penalties), and tells it the token the sequence output.
//!
//! A constraint starts once the output ends with its `after` tokens (`</think>` for a model that
//! thinks first: the reasoning stays free, the answer is constrained, as vLLM does with a
//! reasoning parser), or at once when `after` is empty.

use std::collections::VecDeque;
use std::sync::Arc;

/// The ids allowed at one step: bit `i % 32` of word `i / 32` set for id `i`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMask {
    pub words: Vec<u32>,
}

impl TokenMask {
    pub fn allows(&self, id: u32) -> bool {
        self.words.get(id as usize / 32).is_some_and(|w| w >> (id % 32) & 1 == 1)
    }

    /// Sets every disallowed candidate of a bf16 row (bits) to −∞.
    pub fn apply(&self, row: &mut [u16]) {
        const NEG_INF: u16 = 0xff80;
        for (i, x) in row.iter_mut().enumerate() {
            if !self.allows(i as u32) {
                *x = NEG_INF;
            }
        }
    }
}

/// A grammar over token ids, one sequence's (its state advances with the output).
pub trait Grammar: Send {
    /// The ids allowed next, over `vocab` ids; an error when the grammar can go no further.
    fn allowed(&mut self, vocab: usize) -> anyhow::Result<TokenMask>;
    /// The sequence output `id`.
    fn commit(&mut self, id: u32) -> anyhow::Result<()>;
    /// A copy in the same state (for another sequence: `n` choices).
    fn clone_box(&self) -> Box<dyn Grammar>;
}

/// A request's constraint: its grammar, from the step after the output ends with `after`.
pub struct Constraint {
    pub after: Vec<u32>,
    pub grammar: Box<dyn Grammar>,
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint { after: self.after.clone(), grammar: self.grammar.clone_box() }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("after", &self.after).finish_non_exhaustive()
    }
}

/// One sequence's constraint while it runs.
pub(super) struct Active {
    c: Constraint,
    started: bool,
    recent: VecDeque<u32>,
}

impl Active {
    pub(super) fn new(c: Constraint) -> Self {
        let started = c.after.is_empty();
        Active { c, started, recent: VecDeque::new() }
    }

    /// The mask of the next step, or None while the constraint has not started.
    pub(super) fn mask(&mut self, vocab: usize) -> anyhow::Result<Option<Arc<TokenMask>>> {
        if !self.started {
            return Ok(None);
        }
        self.c.grammar.allowed(vocab).map(|m| Some(Arc::new(m)))
    }

    /// The sequence output `id`: the grammar takes it once started; before, the constraint
    /// starts when the output ends with `after`.
    pub(super) fn output(&mut self, id: u32) -> anyhow::Result<()> {
        if self.started {
            return self.c.grammar.commit(id);
        }
        self.recent.push_back(id);
        if self.recent.len() > self.c.after.len() {
            self.recent.pop_front();
        }
        self.started = self.recent.iter().eq(self.c.after.iter());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allows ids `≡ r (mod m)`, `r` advancing with each commit.
    #[derive(Clone)]
    struct Modulo {
        m: u32,
        r: u32,
    }
    impl Grammar for Modulo {
        fn allowed(&mut self, vocab: usize) -> anyhow::Result<TokenMask> {
            let mut words = vec![0u32; vocab.div_ceil(32)];
            for i in (0..vocab as u32).filter(|i| i % self.m == self.r) {
                words[i as usize / 32] |= 1 << (i % 32);
            }
            Ok(TokenMask { words })
        }
        fn commit(&mut self, id: u32) -> anyhow::Result<()> {
            anyhow::ensure!(id % self.m == self.r, "{id} not allowed");
            self.r = (self.r + 1) % self.m;
            Ok(())
        }
        fn clone_box(&self) -> Box<dyn Grammar> {
            Box::new(self.clone())
        }
    }

    #[test]
    fn a_constraint_starts_after_its_trigger_and_masks_rows() {
        let mut a = Active::new(Constraint { after: vec![7, 8], grammar: Box::new(Modulo { m: 3, r: 0 }) });
        for id in [8, 7, 9, 7] {
            assert_eq!(a.mask(40).unwrap(), None, "not started");
            a.output(id).unwrap();
        }
        a.output(8).unwrap(); // the output now ends with 7, 8
        let m = a.mask(40).unwrap().unwrap();
        assert!(m.allows(0) && m.allows(39) && !m.allows(1) && !m.allows(40));
        a.output(3).unwrap();
        assert!(a.mask(40).unwrap().unwrap().allows(4));
        assert!(a.output(5).is_err(), "the grammar refuses what it did not allow");
        let mut row = vec![0x3f80u16; 5];
        TokenMask { words: vec![0b10010] }.apply(&mut row);
        assert_eq!(row, [0xff80, 0x3f80, 0xff80, 0xff80, 0x3f80]);
        // Empty trigger: from the first token; a clone keeps the grammar's state.
        let c = Constraint { after: vec![], grammar: Box::new(Modulo { m: 2, r: 1 }) };
        let mut b = Active::new(c.clone());
        assert!(b.mask(4).unwrap().unwrap().allows(1));
    }
}
