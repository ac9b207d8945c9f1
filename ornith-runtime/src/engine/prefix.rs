//! The prefix cache: a request whose prompt begins with the same tokens as an earlier prompt
//! resumes where that prompt's prefill was, instead of prefilling from position 0.
//!
//! A Gated DeltaNet layer's state summarises every earlier token and cannot be cut at an
//! arbitrary position, so a cached prefix is usable only up to a place where a copy of the
//! recurrent state was taken: a *snapshot*. Snapshots are taken during prefill at chunk
//! boundaries (absolute multiples of [`PREFILL_CHUNK`]), the boundaries every cold prefill passes:
//! the state there and the K/V of the chunks before it are exactly what a cold run of the same
//! tokens computes, so a run resumed from them gives bit-identical logits (batch invariance does
//! the rest: the chunks may have been computed beside any other sequences). State produced by
//! decoding is never cached: a prefill of those tokens would round differently.
//!
//! The index is a tree of chunks. A node is one full chunk of [`PREFILL_CHUNK`] tokens following
//! its parent's, found among its siblings by a hash of its tokens and then compared token for
//! token (a hash collision is never a hit). It holds the chunk's K/V blocks (one reference each in
//! the [`BlockPool`]) and maybe a snapshot of the state after the chunk. Memory that no running
//! sequence uses is evicted least recently used first, leaves before their parents, so a node's
//! ancestors (whose K/V it needs) stay as long as it does; snapshots are limited by their own
//! count (the `--prefix-cache-bytes` budget), K/V blocks by the pool (evicted when admission
//! needs them).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use super::pool::{BlockPool, SlotPool};
use super::PREFILL_CHUNK;
use crate::graph::KV_BLOCK;

/// K/V blocks of one chunk.
pub const CHUNK_BLOCKS: usize = PREFILL_CHUNK / KV_BLOCK;
const _: () = assert!(PREFILL_CHUNK.is_multiple_of(KV_BLOCK), "a chunk is a whole number of K/V blocks");

/// Inside a long prompt, every this many chunks' boundary keeps a snapshot (16,384 tokens: a
/// 262,144-token prompt keeps 16 besides its last two), so that a conversation that changes far
/// back (an edited earlier message) still resumes near the change.
pub const SPARSE_SNAPSHOT_CHUNKS: usize = 8;

struct Node {
    parent: Option<usize>,
    key: u64,
    tokens: Box<[u32]>,
    /// The chunk's K/V blocks; the cache holds one reference to each.
    blocks: Vec<u32>,
    /// Snapshot of the recurrent state after this chunk.
    snap: Option<usize>,
    children: HashMap<u64, usize>,
    /// Running sequences whose prefix includes this chunk (never evicted while > 0).
    users: usize,
    /// Last use (a tick of the cache's clock).
    used: u64,
}

/// The cached chain a prompt begins with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Match {
    /// Nodes of the prompt's first full chunks, in order, as far as they are cached.
    pub path: Vec<usize>,
    /// How many of them a sequence resumes after: `path[resume - 1]` has a snapshot, and at
    /// least one prompt token follows (its logits are needed). 0: a cold start.
    pub resume: usize,
}

impl Match {
    /// Prompt tokens served from the cache.
    pub fn cached_tokens(&self) -> usize {
        self.resume * PREFILL_CHUNK
    }
}

/// Counters since the engine started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Admissions that resumed from a snapshot.
    pub hits: u64,
    /// Admissions (with at least one full chunk before the prompt's last token) that started cold.
    pub misses: u64,
    /// Prompt tokens not prefilled thanks to the cache.
    pub cached_tokens: u64,
    pub snapshots_taken: u64,
    pub snapshots_evicted: u64,
    pub chunks_evicted: u64,
}

pub struct PrefixCache {
    nodes: Vec<Option<Node>>,
    vacant: Vec<usize>,
    roots: HashMap<u64, usize>,
    snaps: SlotPool,
    clock: u64,
    pub stats: CacheStats,
}

fn key(tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    tokens.hash(&mut h);
    h.finish()
}

/// The keys of `prompt`'s full chunks (computed once per request: a request waiting for memory
/// is looked up again every step).
pub fn chunk_keys(prompt: &[u32]) -> Vec<u64> {
    prompt.chunks_exact(PREFILL_CHUNK).map(key).collect()
}

impl PrefixCache {
    /// A cache of at most `snapshots` recurrent-state snapshots (0 disables it).
    pub fn new(snapshots: usize) -> Self {
        PrefixCache {
            nodes: Vec::new(),
            vacant: Vec::new(),
            roots: HashMap::new(),
            snaps: SlotPool::new(snapshots),
            clock: 0,
            stats: CacheStats::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.snaps.total() > 0
    }

    fn node(&self, id: usize) -> &Node {
        self.nodes[id].as_ref().expect("a live node")
    }
    fn node_mut(&mut self, id: usize) -> &mut Node {
        self.nodes[id].as_mut().expect("a live node")
    }
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn child(&self, parent: Option<usize>, key: u64, tokens: &[u32]) -> Option<usize> {
        let siblings = match parent {
            None => &self.roots,
            Some(p) => &self.node(p).children,
        };
        siblings.get(&key).copied().filter(|&c| *self.node(c).tokens == *tokens)
    }

    /// Whether the chunk `tokens` (key `key`) is cached after `parent` (None: a prompt's first).
    pub fn contains(&self, parent: Option<usize>, key: u64, tokens: &[u32]) -> bool {
        self.child(parent, key, tokens).is_some()
    }

    /// The longest chain of cached chunks that `prompt` begins with (`keys`: its
    /// [`chunk_keys`]), and how much of it a sequence can resume after.
    pub fn lookup(&self, prompt: &[u32], keys: &[u64]) -> Match {
        let mut m = Match::default();
        if !self.enabled() {
            return m;
        }
        let mut parent = None;
        for (i, (chunk, &k)) in prompt.chunks_exact(PREFILL_CHUNK).zip(keys).enumerate() {
            let Some(id) = self.child(parent, k, chunk) else { break };
            m.path.push(id);
            if self.node(id).snap.is_some() && (i + 1) * PREFILL_CHUNK < prompt.len() {
                m.resume = i + 1;
            }
            parent = Some(id);
        }
        m
    }

    /// The snapshot after chunk `node`.
    pub fn snapshot(&self, node: usize) -> Option<usize> {
        self.node(node).snap
    }

    /// The K/V blocks of `path`'s chunks, in order.
    pub fn blocks(&self, path: &[usize]) -> Vec<u32> {
        path.iter().flat_map(|&id| self.node(id).blocks.iter().copied()).collect()
    }

    /// A sequence starts on `path` (it uses those chunks until [`release`](Self::release)).
    pub fn acquire(&mut self, path: &[usize]) {
        let t = self.tick();
        for &id in path {
            let n = self.node_mut(id);
            n.users += 1;
            n.used = t;
        }
    }

    /// A sequence that used `path` is gone; chunks it left useless (no snapshot, no children,
    /// no other user) go at once.
    pub fn release(&mut self, path: &[usize], pool: &mut BlockPool) {
        for &id in path {
            let n = self.node_mut(id);
            assert!(n.users > 0, "chunk {id} released more often than acquired");
            n.users -= 1;
        }
        if let Some(&last) = path.last() {
            self.prune(last, pool);
        }
    }

    /// A sequence prefilled the full chunk `tokens` (key `k`) after `parent`, into `blocks`:
    /// the node for it, and whether it was already cached (another prompt computed the same
    /// chunk). A new node takes a reference to `blocks`. The sequence is counted as a user
    /// either way. None when a different chunk with the same hash is cached (nothing is cached
    /// then).
    pub fn insert(
        &mut self,
        parent: Option<usize>,
        k: u64,
        tokens: &[u32],
        blocks: &[u32],
        pool: &mut BlockPool,
    ) -> Option<(usize, bool)> {
        assert_eq!((tokens.len(), blocks.len()), (PREFILL_CHUNK, CHUNK_BLOCKS), "a chunk and its blocks");
        debug_assert_eq!(k, key(tokens), "the chunk's key");
        let t = self.tick();
        let siblings = match parent {
            None => &self.roots,
            Some(p) => &self.node(p).children,
        };
        if let Some(&id) = siblings.get(&k) {
            if *self.node(id).tokens != *tokens {
                return None;
            }
            let n = self.node_mut(id);
            n.users += 1;
            n.used = t;
            return Some((id, true));
        }
        pool.retain(blocks);
        let node = Node {
            parent,
            key: k,
            tokens: tokens.into(),
            blocks: blocks.to_vec(),
            snap: None,
            children: HashMap::new(),
            users: 1,
            used: t,
        };
        let id = match self.vacant.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        match parent {
            None => self.roots.insert(k, id),
            Some(p) => self.node_mut(p).children.insert(k, id),
        };
        Some((id, false))
    }

    /// A snapshot index for the state after chunk `node` (which has none), taking the least
    /// recently used one when none is free; the caller copies the state there (or calls
    /// [`drop_snapshot`](Self::drop_snapshot) when it cannot). None when the cache is disabled.
    pub fn new_snapshot(&mut self, node: usize, pool: &mut BlockPool) -> Option<usize> {
        assert!(self.node(node).snap.is_none(), "chunk {node} already has a snapshot");
        if !self.enabled() {
            return None;
        }
        if self.snaps.free() == 0 {
            let victim = (0..self.nodes.len())
                .filter(|&i| i != node && self.nodes[i].as_ref().is_some_and(|n| n.snap.is_some()))
                .min_by_key(|&i| self.node(i).used)?;
            self.drop_snapshot(victim, pool);
            self.stats.snapshots_evicted += 1;
        }
        let s = self.snaps.take()?;
        self.node_mut(node).snap = Some(s);
        self.stats.snapshots_taken += 1;
        Some(s)
    }

    /// Forgets the snapshot of `node` (and the node, if that leaves it useless).
    pub fn drop_snapshot(&mut self, node: usize, pool: &mut BlockPool) {
        if let Some(s) = self.node_mut(node).snap.take() {
            self.snaps.give(s);
        }
        self.prune(node, pool);
    }

    fn useless(&self, id: usize) -> bool {
        let n = self.node(id);
        n.snap.is_none() && n.children.is_empty() && n.users == 0
    }

    /// Removes `id` if useless, then its parent if that leaves it useless, and so on.
    fn prune(&mut self, mut id: usize, pool: &mut BlockPool) {
        while self.useless(id) {
            let parent = self.node(id).parent;
            self.remove(id, pool);
            match parent {
                Some(p) => id = p,
                None => break,
            }
        }
    }

    /// Removes leaf `id` (no children, no users), freeing its snapshot and its blocks.
    fn remove(&mut self, id: usize, pool: &mut BlockPool) {
        let n = self.nodes[id].take().expect("a live node");
        assert!(n.children.is_empty() && n.users == 0, "removing chunk {id} that is still needed");
        match n.parent {
            None => self.roots.remove(&n.key),
            Some(p) => self.node_mut(p).children.remove(&n.key),
        };
        if let Some(s) = n.snap {
            self.snaps.give(s);
        }
        pool.give(n.blocks);
        self.vacant.push(id);
        self.stats.chunks_evicted += 1;
    }

    /// Evicts unused chunks, least recently used leaves first, until `pool` has `need` free
    /// blocks or nothing unused is left. Returns whether `need` blocks are free.
    pub fn make_room(&mut self, need: usize, pool: &mut BlockPool) -> bool {
        while pool.free() < need {
            let leaf = (0..self.nodes.len())
                .filter(|&i| self.nodes[i].as_ref().is_some_and(|n| n.children.is_empty() && n.users == 0))
                .min_by_key(|&i| self.node(i).used);
            let Some(leaf) = leaf else { return false };
            let parent = self.node(leaf).parent;
            self.remove(leaf, pool);
            if let Some(p) = parent {
                self.prune(p, pool);
            }
        }
        true
    }

    /// (cached chunks, snapshots held, snapshot capacity).
    pub fn usage(&self) -> (usize, usize, usize) {
        let chunks = self.nodes.iter().filter(|n| n.is_some()).count();
        (chunks, self.snaps.total() - self.snaps.free(), self.snaps.total())
    }
}

/// Whether a sequence whose prompt has `prompt_len` tokens keeps a snapshot at boundary `pos`
/// (a multiple of [`PREFILL_CHUNK`]) that it just reached. `shared`: the chunk before `pos` was
/// already cached (another prompt has the same prefix: a shared system prompt, a branch of a
/// conversation); `wanted`: a waiting request asked for it.
pub fn keeps_snapshot(pos: usize, prompt_len: usize, shared: bool, wanted: bool) -> bool {
    let last = prompt_len / PREFILL_CHUNK * PREFILL_CHUNK;
    // The next turn of a conversation resumes at the last boundary its changed tail leaves
    // alone: the template may re-render the end of this prompt (the generation prompt), so the
    // boundary before the last is kept too.
    let tail = pos == last || pos + PREFILL_CHUNK == last;
    tail || pos.is_multiple_of(SPARSE_SNAPSHOT_CHUNKS * PREFILL_CHUNK) || shared || wanted
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: usize = PREFILL_CHUNK;

    fn prompt(seed: u32, chunks: usize, extra: usize) -> Vec<u32> {
        (0..(chunks * C + extra) as u32).map(|i| i.wrapping_mul(2654435761) ^ seed).collect()
    }

    /// Caches every full chunk of `p` as one sequence would, with snapshots where `snap(i)`.
    fn fill(c: &mut PrefixCache, pool: &mut BlockPool, p: &[u32], snap: impl Fn(usize) -> bool) -> Vec<usize> {
        let mut chain = Vec::new();
        for (i, chunk) in p.chunks_exact(C).enumerate() {
            let blocks = pool.take(CHUNK_BLOCKS).unwrap();
            let (id, _) = c.insert(chain.last().copied(), key(chunk), chunk, &blocks, pool).unwrap();
            pool.give(blocks); // the sequence's own reference
            if snap(i) && c.snapshot(id).is_none() {
                c.new_snapshot(id, pool).unwrap();
            }
            chain.push(id);
        }
        c.release(&chain, pool);
        chain
    }

    #[test]
    fn a_prompt_resumes_after_its_deepest_snapshot_before_its_last_token() {
        let (mut c, mut pool) = (PrefixCache::new(8), BlockPool::new(64));
        let p = prompt(1, 3, 0);
        let chain = fill(&mut c, &mut pool, &p, |_| true);
        // The same prompt: 3 full chunks, but its last token must be computed, so 2 resume.
        let m = c.lookup(&p, &chunk_keys(&p));
        assert_eq!((m.path.clone(), m.resume, m.cached_tokens()), (chain.clone(), 2, 2 * C));
        // A longer prompt with the same beginning resumes after all 3.
        let mut longer = p.clone();
        longer.extend_from_slice(&[7; 10]);
        assert_eq!(c.lookup(&longer, &chunk_keys(&longer)).resume, 3);
        // A prompt that differs inside chunk 1 matches chunk 0 only.
        let mut other = longer.clone();
        other[C + 5] ^= 1;
        assert_eq!(c.lookup(&other, &chunk_keys(&other)), Match { path: vec![chain[0]], resume: 1 });
        // Blocks: the cache holds 3 chunks' worth; the sequence's references are gone.
        assert_eq!(pool.free(), 64 - 3 * CHUNK_BLOCKS);
        assert_eq!(c.blocks(&chain[..1]).len(), CHUNK_BLOCKS);
    }

    #[test]
    fn a_chunk_without_a_snapshot_is_kept_only_as_an_ancestor() {
        let (mut c, mut pool) = (PrefixCache::new(8), BlockPool::new(64));
        let p = prompt(2, 3, 1);
        let chain = fill(&mut c, &mut pool, &p, |i| i == 1);
        // chunk 2 had no snapshot and no children: gone when its sequence was; 0 and 1 stay.
        assert_eq!(c.usage(), (2, 1, 8));
        assert_eq!(c.lookup(&p, &chunk_keys(&p)), Match { path: chain[..2].to_vec(), resume: 2 });
        assert_eq!(pool.free(), 64 - 2 * CHUNK_BLOCKS);
    }

    #[test]
    fn snapshots_are_evicted_least_recently_used_and_take_their_useless_chunks() {
        let (mut c, mut pool) = (PrefixCache::new(2), BlockPool::new(64));
        let (a, b, d) = (prompt(3, 1, 1), prompt(4, 1, 1), prompt(5, 1, 1));
        fill(&mut c, &mut pool, &a, |_| true);
        fill(&mut c, &mut pool, &b, |_| true);
        let m = c.lookup(&a, &chunk_keys(&a));
        c.acquire(&m.path[..m.resume]); // a is used again: b is now the older
        c.release(&m.path[..m.resume], &mut pool);
        fill(&mut c, &mut pool, &d, |_| true);
        assert_eq!(
            (
                c.lookup(&a, &chunk_keys(&a)).resume,
                c.lookup(&b, &chunk_keys(&b)).resume,
                c.lookup(&d, &chunk_keys(&d)).resume
            ),
            (1, 0, 1)
        );
        assert_eq!(c.usage(), (2, 2, 2));
        assert_eq!(pool.free(), 64 - 2 * CHUNK_BLOCKS, "b's blocks went with its snapshot");
        assert_eq!(c.stats.snapshots_evicted, 1);
    }

    #[test]
    fn making_room_evicts_unused_leaves_first_and_never_a_used_chain() {
        let (mut c, mut pool) = (PrefixCache::new(8), BlockPool::new(4 * CHUNK_BLOCKS));
        let (a, b) = (prompt(6, 2, 1), prompt(7, 2, 1));
        fill(&mut c, &mut pool, &a, |_| true);
        fill(&mut c, &mut pool, &b, |_| true);
        assert_eq!(pool.free(), 0);
        let m = c.lookup(&b, &chunk_keys(&b));
        c.acquire(&m.path);
        assert!(c.make_room(2 * CHUNK_BLOCKS, &mut pool), "a's two chunks can go");
        assert_eq!(c.lookup(&a, &chunk_keys(&a)).path.len(), 0);
        assert!(!c.make_room(3 * CHUNK_BLOCKS, &mut pool), "b's chunks are in use");
        assert_eq!(c.lookup(&b, &chunk_keys(&b)).resume, 2);
        c.release(&m.path, &mut pool);
        assert!(c.make_room(4 * CHUNK_BLOCKS, &mut pool));
        assert_eq!(c.usage(), (0, 0, 8));
    }

    #[test]
    fn two_sequences_with_the_same_chunk_share_one_node() {
        let (mut c, mut pool) = (PrefixCache::new(4), BlockPool::new(64));
        let p = prompt(8, 1, 3);
        let (b1, b2) = (pool.take(CHUNK_BLOCKS).unwrap(), pool.take(CHUNK_BLOCKS).unwrap());
        let (n1, existed1) = c.insert(None, key(&p[..C]), &p[..C], &b1, &mut pool).unwrap();
        let (n2, existed2) = c.insert(None, key(&p[..C]), &p[..C], &b2, &mut pool).unwrap();
        assert_eq!((n1, existed1, existed2), (n2, false, true));
        assert_eq!(c.blocks(&[n1]), b1, "the first sequence's blocks are the cached ones");
        c.new_snapshot(n1, &mut pool).unwrap();
        pool.give(b1);
        pool.give(b2);
        c.release(&[n1], &mut pool);
        c.release(&[n1], &mut pool);
        assert_eq!(pool.free(), 64 - CHUNK_BLOCKS);
    }

    #[test]
    fn a_disabled_cache_matches_nothing() {
        let (mut c, mut pool) = (PrefixCache::new(0), BlockPool::new(64));
        let p = prompt(9, 2, 1);
        fill(&mut c, &mut pool, &p, |_| false);
        assert_eq!(c.lookup(&p, &chunk_keys(&p)), Match::default());
        assert_eq!(pool.free(), 64);
    }

    #[test]
    fn snapshot_policy() {
        // A prompt of 5 chunks and a bit: the last two boundaries (4C, 5C) are kept.
        let n = 5 * C + 10;
        let kept: Vec<usize> = (1..=5).filter(|&k| keeps_snapshot(k * C, n, false, false)).collect();
        assert_eq!(kept, [4, 5]);
        assert!(keeps_snapshot(C, n, true, false) && keeps_snapshot(2 * C, n, false, true));
        // A long prompt: sparse boundaries plus the tail, bounded.
        let n = 128 * C + 1;
        let kept = (1..=128).filter(|&k| keeps_snapshot(k * C, n, false, false)).count();
        assert_eq!(kept, 128 / SPARSE_SNAPSHOT_CHUNKS + 1);
    }
}
