//! Bookkeeping of the backend's state pools: which recurrent-state slots and which K/V blocks
//! are free. The memory itself is the backend's; these hand out indices.

/// Free recurrent-state slots. The lowest free slot is handed out first (deterministic).
#[derive(Debug, Clone)]
pub struct SlotPool {
    free: Vec<usize>,
    total: usize,
}

impl SlotPool {
    pub fn new(total: usize) -> Self {
        SlotPool { free: (0..total).rev().collect(), total }
    }
    pub fn take(&mut self) -> Option<usize> {
        self.free.pop()
    }
    pub fn give(&mut self, slot: usize) {
        assert!(slot < self.total && !self.free.contains(&slot), "slot {slot} returned twice or never taken");
        self.free.push(slot);
        self.free.sort_unstable_by(|a, b| b.cmp(a));
    }
    pub fn free(&self) -> usize {
        self.free.len()
    }
    pub fn total(&self) -> usize {
        self.total
    }
}

/// Free K/V blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    free: Vec<u32>,
    total: usize,
}

impl BlockPool {
    pub fn new(total: usize) -> Self {
        assert!(total <= u32::MAX as usize, "a pool of {total} blocks");
        BlockPool { free: (0..total as u32).rev().collect(), total }
    }
    /// `n` blocks, or None (and nothing taken) when fewer are free.
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let at = self.free.len() - n;
        let mut v = self.free.split_off(at);
        v.reverse();
        Some(v)
    }
    pub fn give(&mut self, blocks: Vec<u32>) {
        for &b in &blocks {
            assert!((b as usize) < self.total, "block {b} outside the pool");
        }
        self.free.extend(blocks.into_iter().rev());
        debug_assert!(self.free.len() <= self.total, "blocks returned twice");
    }
    pub fn free(&self) -> usize {
        self.free.len()
    }
    pub fn total(&self) -> usize {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_and_blocks_come_back() {
        let mut s = SlotPool::new(3);
        assert_eq!((s.take(), s.take()), (Some(0), Some(1)));
        s.give(0);
        assert_eq!(s.take(), Some(0));
        assert_eq!(s.take(), Some(2));
        assert_eq!(s.take(), None);
        let mut b = BlockPool::new(5);
        let a = b.take(3).unwrap();
        assert_eq!(a, [0, 1, 2]);
        assert!(b.take(3).is_none());
        assert_eq!(b.free(), 2);
        b.give(a);
        assert_eq!(b.free(), 5);
        assert_eq!(b.take(5).unwrap().len(), 5);
    }

    #[test]
    #[should_panic(expected = "returned twice")]
    fn a_slot_cannot_be_returned_twice() {
        let mut s = SlotPool::new(2);
        let a = s.take().unwrap();
        s.give(a);
        s.give(a);
    }
}
