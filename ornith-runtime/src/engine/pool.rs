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

/// K/V blocks, reference-counted: a block is free when no sequence's table and no entry of the
/// prefix cache holds it.
#[derive(Debug, Clone)]
pub struct BlockPool {
    free: Vec<u32>,
    refs: Vec<u32>,
}

impl BlockPool {
    pub fn new(total: usize) -> Self {
        assert!(total <= u32::MAX as usize, "a pool of {total} blocks");
        BlockPool { free: (0..total as u32).rev().collect(), refs: vec![0; total] }
    }
    /// `n` free blocks, each with one reference, or None (and nothing taken) when fewer are free.
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let at = self.free.len() - n;
        let mut v = self.free.split_off(at);
        v.reverse();
        for &b in &v {
            self.refs[b as usize] = 1;
        }
        Some(v)
    }
    /// One more reference to each of `blocks` (all in use).
    pub fn retain(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let r = &mut self.refs[b as usize];
            assert!(*r > 0, "block {b} retained while free");
            *r += 1;
        }
    }
    /// Drops one reference to each of `blocks`; those left with none are free again.
    pub fn give(&mut self, blocks: Vec<u32>) {
        for &b in blocks.iter().rev() {
            let r = self.refs.get_mut(b as usize).unwrap_or_else(|| panic!("block {b} outside the pool"));
            assert!(*r > 0, "block {b} returned twice");
            *r -= 1;
            if *r == 0 {
                self.free.push(b);
            }
        }
    }
    pub fn free(&self) -> usize {
        self.free.len()
    }
    pub fn total(&self) -> usize {
        self.refs.len()
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
    fn a_shared_block_is_free_after_its_last_reference() {
        let mut b = BlockPool::new(4);
        let a = b.take(2).unwrap();
        b.retain(&a[..1]);
        b.give(a.clone());
        assert_eq!(b.free(), 3, "block {} is still held once", a[0]);
        b.give(a[..1].to_vec());
        assert_eq!(b.free(), 4);
    }

    #[test]
    #[should_panic(expected = "returned twice")]
    fn a_block_cannot_be_returned_twice() {
        let mut b = BlockPool::new(2);
        let a = b.take(1).unwrap();
        b.give(a.clone());
        b.give(a);
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
