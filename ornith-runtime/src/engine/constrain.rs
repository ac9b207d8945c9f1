//! Constrained decoding, the engine's side: a sequence's draws restricted to the ids a grammar
//! allows next (structured output: `response_format`). The grammar itself is behind
//! [`Grammar`] (the JSON grammars are `protocol::structured`'s); the engine asks it for the
//! allowed ids before each step where the constraint is active, passes them to the backend with
//! the row ([`crate::graph::RowSample::mask`]: the disallowed ids' logits become −∞ after the
//! penalties), and tells it the token the sequence output.
//!
//! A constraint starts once the output ends with its `after` tokens (`</think>` for a model that
//! thinks first: the reasoning stays free, the answer is constrained, as vLLM does with a
//! reasoning parser), or at once when `after` is empty. With an `escape` (the tool-call marker,
//! when tools are offered beside the JSON), the first constrained token may instead begin the
//! escape: its other tokens are then the only ones allowed, and after them the constraint is
//! gone (the answer is a tool call, not the JSON).

use std::collections::VecDeque;
use std::sync::Arc;

/// The ids allowed at one step: bit `i % 32` of word `i / 32` set for id `i`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMask {
    pub words: Vec<u32>,
}

impl TokenMask {
    /// Allows `id` too (an id past the mask's words is left out).
    pub fn allow(&mut self, id: u32) {
        if let Some(w) = self.words.get_mut(id as usize / 32) {
            *w |= 1 << (id % 32);
        }
    }

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

/// A request's constraint: its grammar, from the step after the output ends with `after`, unless
/// the answer opens with `escape` (empty: no way out).
pub struct Constraint {
    pub after: Vec<u32>,
    pub grammar: Box<dyn Grammar>,
    pub escape: Vec<u32>,
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint { after: self.after.clone(), grammar: self.grammar.clone_box(), escape: self.escape.clone() }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("after", &self.after).field("escape", &self.escape).finish_non_exhaustive()
    }
}

/// Where a started constraint's escape stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Escape {
    /// The first constrained token is still to come: it may begin the escape.
    Open,
    /// The grammar took the first token: no escape any more.
    Closed,
    /// This many of the escape's tokens are out; the next must be the following one.
    Taking(usize),
    /// The escape is out: the output is free.
    Out,
}

/// One sequence's constraint while it runs.
pub(super) struct Active {
    c: Constraint,
    started: bool,
    recent: VecDeque<u32>,
    escape: Escape,
}

impl Active {
    pub(super) fn new(c: Constraint) -> Self {
        let started = c.after.is_empty();
        let escape = if c.escape.is_empty() { Escape::Closed } else { Escape::Open };
        Active { c, started, recent: VecDeque::new(), escape }
    }

    /// The mask of the next step, or None while the constraint has not started or after its
    /// escape.
    pub(super) fn mask(&mut self, vocab: usize) -> anyhow::Result<Option<Arc<TokenMask>>> {
        if !self.started {
            return Ok(None);
        }
        let m = match self.escape {
            Escape::Out => return Ok(None),
            Escape::Taking(k) => {
                let mut m = TokenMask { words: vec![0; vocab.div_ceil(32)] };
                m.allow(self.c.escape[k]);
                m
            }
            Escape::Closed => self.c.grammar.allowed(vocab)?,
            Escape::Open => {
                let mut m = self.c.grammar.allowed(vocab)?;
                m.allow(self.c.escape[0]);
                m
            }
        };
        Ok(Some(Arc::new(m)))
    }

    /// The sequence output `id`: the grammar takes it once started (or the escape does); before,
    /// the constraint starts when the output ends with `after`.
    pub(super) fn output(&mut self, id: u32) -> anyhow::Result<()> {
        if self.started {
            let e = &self.c.escape;
            self.escape = match self.escape {
                Escape::Out => Escape::Out,
                Escape::Open | Escape::Taking(_) if Some(&id) != e.get(self.taken()) => {
                    anyhow::ensure!(
                        self.escape == Escape::Open,
                        "the escape's token {} was due, not {id}",
                        e[self.taken()]
                    );
                    self.c.grammar.commit(id)?;
                    Escape::Closed
                }
                Escape::Open | Escape::Taking(_) if self.taken() + 1 == e.len() => Escape::Out,
                Escape::Open | Escape::Taking(_) => Escape::Taking(self.taken() + 1),
                Escape::Closed => {
                    self.c.grammar.commit(id)?;
                    Escape::Closed
                }
            };
            return Ok(());
        }
        self.recent.push_back(id);
        if self.recent.len() > self.c.after.len() {
            self.recent.pop_front();
        }
        self.started = self.recent.iter().eq(self.c.after.iter());
        Ok(())
    }

    /// Escape tokens out so far.
    fn taken(&self) -> usize {
        match self.escape {
            Escape::Taking(k) => k,
            _ => 0,
        }
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
            let mut m = TokenMask { words: vec![0; vocab.div_ceil(32)] };
            (0..vocab as u32).filter(|i| i % self.m == self.r).for_each(|i| m.allow(i));
            Ok(m)
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
        let mut a =
            Active::new(Constraint { after: vec![7, 8], grammar: Box::new(Modulo { m: 3, r: 0 }), escape: vec![] });
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
        // Empty trigger: from the first token; a clone keeps the grammar's state (taken after
        // the grammar moved on from odd to even ids).
        let mut c = Constraint { after: vec![], grammar: Box::new(Modulo { m: 2, r: 1 }), escape: vec![] };
        let mut b = Active::new(c.clone());
        assert!(b.mask(4).unwrap().unwrap().allows(1));
        c.grammar.commit(1).unwrap();
        let m = Active::new(c.clone()).mask(4).unwrap().unwrap();
        assert!(m.allows(2) && !m.allows(1), "the clone lost the grammar's state");
    }

    #[test]
    fn an_escape_may_open_the_answer_and_then_frees_it() {
        let escaped =
            |esc: Vec<u32>| Constraint { after: vec![], grammar: Box::new(Modulo { m: 3, r: 0 }), escape: esc };
        // Taken: its first token is allowed beside the grammar's, then only its next ones.
        let mut a = Active::new(escaped(vec![10, 20]));
        let m = a.mask(40).unwrap().unwrap();
        assert!(m.allows(0) && m.allows(3) && m.allows(10) && !m.allows(20));
        a.output(10).unwrap();
        let m = a.mask(40).unwrap().unwrap();
        assert!(m.allows(20) && !m.allows(0) && !m.allows(10), "only the escape's next token");
        assert!(a.mask(40).is_ok());
        a.output(20).unwrap();
        assert_eq!(a.mask(40).unwrap(), None, "free after the escape");
        a.output(5).unwrap();
        // Not taken: the grammar took the first token, the escape is gone.
        let mut b = Active::new(escaped(vec![11]));
        b.output(0).unwrap();
        let m = b.mask(40).unwrap().unwrap();
        assert!(!m.allows(11) && m.allows(1));
        assert!(b.output(11).is_err(), "the grammar refuses the escape's token now");
        // A one-token escape frees at once; leaving an escape midway is an error.
        let mut c = Active::new(escaped(vec![10]));
        c.output(10).unwrap();
        assert_eq!(c.mask(40).unwrap(), None);
        let mut d = Active::new(escaped(vec![10, 20]));
        d.output(10).unwrap();
        assert!(d.output(21).is_err());
    }
}
