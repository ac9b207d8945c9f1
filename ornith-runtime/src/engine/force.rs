//! Forced tokens: a request's output continues with given tokens once a trigger holds, whatever
//! the sampler draws for those steps (the draw is dropped; the step, and the request's random
//! stream, go on as for any token). Two uses: a forced tool call (`tool_choice` `required` or
//! a named function: the start of a call, after `</think>` when the model thinks) and a thinking
//! budget (the Qwen3 report's stop-thinking text once the reasoning reaches the budget, unless
//! the model closed its thinking itself). Per sequence and after sampling, so no kernel, batch or
//! graph changes.

use std::collections::VecDeque;

/// What fires a [`Forcing`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trigger {
    /// Once the output ends with these tokens; at once when empty.
    After(Vec<u32>),
    /// Once the output holds `tokens` tokens, unless it has ended with `unless` before.
    Count { tokens: u64, unless: Vec<u32> },
}

/// Tokens forced once `when` holds; each plan fires at most once, plans in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forcing {
    pub when: Trigger,
    pub tokens: Vec<u32>,
}

/// One sequence's forced tokens: those still to come, the plans not yet fired, and the last
/// outputs the triggers compare with.
#[derive(Debug, Clone)]
pub(super) struct Forced {
    pending: VecDeque<u32>,
    plans: Vec<Forcing>,
    recent: VecDeque<u32>,
    keep: usize,
    n: u64,
}

impl Forced {
    /// The state before the first output (plans that hold at once have fired).
    pub(super) fn new(plans: &[Forcing]) -> Self {
        let keep = plans
            .iter()
            .map(|p| match &p.when {
                Trigger::After(a) => a.len(),
                Trigger::Count { unless, .. } => unless.len(),
            })
            .max()
            .unwrap_or(0);
        let mut f = Forced { pending: VecDeque::new(), plans: plans.to_vec(), recent: VecDeque::new(), keep, n: 0 };
        f.fire();
        f
    }

    /// The token the next step outputs whatever its draw, if one is forced there.
    pub(super) fn peek(&self) -> Option<u32> {
        self.pending.front().copied()
    }

    /// The token the sequence outputs for a step whose draw is `drawn`.
    pub(super) fn next(&mut self, drawn: u32) -> u32 {
        let t = self.pending.pop_front().unwrap_or(drawn);
        self.n += 1;
        if self.keep > 0 {
            self.recent.push_back(t);
            if self.recent.len() > self.keep {
                self.recent.pop_front();
            }
        }
        self.fire();
        t
    }

    fn ends_with(&self, s: &[u32]) -> bool {
        s.len() <= self.recent.len() && self.recent.iter().skip(self.recent.len() - s.len()).eq(s.iter())
    }

    /// Fires every plan whose trigger holds now (in order), and drops the counts whose `unless`
    /// the output has just met.
    fn fire(&mut self) {
        let mut i = 0;
        while i < self.plans.len() {
            let (go, cancel) = match &self.plans[i].when {
                Trigger::After(a) => (self.ends_with(a), false),
                Trigger::Count { tokens, unless } => {
                    let met = !unless.is_empty() && self.ends_with(unless);
                    (!met && self.n >= *tokens, met)
                }
            };
            if go {
                let p = self.plans.remove(i);
                self.pending.extend(p.tokens);
            } else if cancel {
                self.plans.remove(i);
            } else {
                i += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(plans: &[Forcing], draws: &[u32]) -> Vec<u32> {
        let mut f = Forced::new(plans);
        draws.iter().map(|&d| f.next(d)).collect()
    }

    #[test]
    fn after_fires_once_at_the_trigger_or_at_once() {
        let at_once = Forcing { when: Trigger::After(vec![]), tokens: vec![90, 91] };
        assert_eq!(run(&[at_once], &[1, 2, 3, 4]), [90, 91, 3, 4]);
        let after = Forcing { when: Trigger::After(vec![2, 3]), tokens: vec![90] };
        assert_eq!(run(&[after], &[1, 2, 3, 4, 2, 3, 5]), [1, 2, 3, 90, 2, 3, 5], "once only");
    }

    #[test]
    fn a_count_fires_at_its_length_unless_met_before() {
        let budget = |n| Forcing { when: Trigger::Count { tokens: n, unless: vec![7] }, tokens: vec![80, 7] };
        assert_eq!(run(&[budget(3)], &[1, 2, 3, 4, 5, 6]), [1, 2, 3, 80, 7, 6]);
        assert_eq!(run(&[budget(3)], &[1, 7, 3, 4, 5]), [1, 7, 3, 4, 5], "closed before the budget");
        assert_eq!(run(&[budget(0)], &[1, 2, 3]), [80, 7, 3], "a budget of 0 fires at once");
    }

    #[test]
    fn a_budget_closing_the_thinking_fires_the_call_after_it() {
        // The budget's forced close (ending in 7) is what the forced call waits for.
        let plans = [
            Forcing { when: Trigger::Count { tokens: 2, unless: vec![7] }, tokens: vec![80, 7] },
            Forcing { when: Trigger::After(vec![7]), tokens: vec![60, 61] },
        ];
        assert_eq!(run(&plans, &[1, 2, 3, 4, 5, 6, 9]), [1, 2, 80, 7, 60, 61, 9]);
        assert_eq!(run(&plans, &[1, 7, 3, 4, 5]), [1, 7, 60, 61, 5], "the model closed it itself");
    }
}
