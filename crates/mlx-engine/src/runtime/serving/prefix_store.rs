//! The caches of prompt prefixes that requests share, bounded in bytes.
//!
//! Keyed by the adapter the prefix was computed under (none, or one of
//! the engine's per-row adapters) and its token ids: an entry holds the
//! keys and values of exactly its tokens, as a one-row cache that forks share without copying (see
//! [`KvCache::fork`]). A prompt reuses the longest entry whose tokens it
//! starts with (and goes past: a row needs at least one token of its own to
//! prefill). The model is the engine's own, so one store per engine is
//! keyed by adapter and tokens. Entries are evicted least recently used first
//! once their bytes pass the store's size; a pinned entry (the engine's
//! configured prefix messages) never is.

use crate::nn::cache::KvCache;

/// One cached prefix.
#[derive(Debug)]
struct Entry {
    id: u64,
    adapter: Option<usize>,
    tokens: Vec<u32>,
    cache: KvCache,
    bytes: usize,
    last_used: u64,
    pinned: bool,
}

/// A prefix found in the store: an id that tells rows sharing it apart
/// from rows of other prefixes (and of an evicted, recomputed one), its
/// length in tokens and its cache.
#[derive(Debug, Clone)]
pub(crate) struct Found {
    pub id: u64,
    pub len: usize,
    pub cache: KvCache,
}

/// See the module's docs.
#[derive(Debug)]
pub(crate) struct PrefixStore {
    entries: Vec<Entry>,
    capacity: usize,
    clock: u64,
    next_id: u64,
}

impl PrefixStore {
    /// A store that holds up to `capacity` bytes of unpinned entries.
    pub(crate) fn new(capacity: usize) -> PrefixStore {
        PrefixStore {
            entries: Vec::new(),
            capacity,
            clock: 0,
            // 0 is the empty prefix's.
            next_id: 1,
        }
    }

    /// The entries held and their bytes.
    pub(crate) fn size(&self) -> (usize, usize) {
        (
            self.entries.len(),
            self.entries.iter().map(|e| e.bytes).sum(),
        )
    }

    /// Drops every entry computed under the adapter in `slot` (unloaded:
    /// no request can name it again, and its slot is never reused).
    pub(crate) fn forget_adapter(&mut self, slot: usize) {
        self.entries.retain(|e| e.adapter != Some(slot));
    }

    /// The longest entry of `adapter`'s that `prompt` starts with and goes
    /// past.
    pub(crate) fn lookup(&mut self, adapter: Option<usize>, prompt: &[u32]) -> Option<Found> {
        self.clock += 1;
        let clock = self.clock;
        let entry = self
            .entries
            .iter_mut()
            .filter(|e| e.adapter == adapter)
            .filter(|e| e.tokens.len() < prompt.len() && prompt.starts_with(&e.tokens))
            .max_by_key(|e| e.tokens.len())?;
        entry.last_used = clock;
        Some(Found {
            id: entry.id,
            len: entry.tokens.len(),
            cache: entry.cache.clone(),
        })
    }

    /// Adds the cache of `tokens` under `adapter` (a one-row cache holding
    /// exactly them); evicts what no longer fits. Returns it as found, also
    /// when it was too big to keep.
    pub(crate) fn insert(
        &mut self,
        adapter: Option<usize>,
        tokens: Vec<u32>,
        cache: KvCache,
        pinned: bool,
    ) -> Found {
        self.clock += 1;
        let id = self.next_id;
        self.next_id += 1;
        let found = Found {
            id,
            len: tokens.len(),
            cache: cache.clone(),
        };
        let bytes = cache.nbytes();
        if !pinned && bytes > self.capacity {
            // Kept, it would evict everything else and then itself.
            return found;
        }
        self.entries.push(Entry {
            id,
            adapter,
            tokens,
            cache,
            bytes,
            last_used: self.clock,
            pinned,
        });
        self.evict();
        found
    }

    fn evict(&mut self) {
        loop {
            let unpinned: usize = self
                .entries
                .iter()
                .filter(|e| !e.pinned)
                .map(|e| e.bytes)
                .sum();
            if unpinned <= self.capacity {
                return;
            }
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| !e.pinned)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i);
            match oldest {
                Some(i) => {
                    let gone = self.entries.swap_remove(i);
                    tracing::debug!(
                        tokens = gone.tokens.len(),
                        bytes = gone.bytes,
                        "prefix evicted"
                    );
                }
                None => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::Array;

    /// A one-row cache of `n` positions, 32 bytes each.
    fn cache_of(n: i32) -> KvCache {
        let mut c = KvCache::new();
        let kv = Array::zeros::<f32>(&[1, 1, n, 4]).unwrap();
        c.append(0, kv.clone(), kv, None).unwrap();
        c.advance(n).unwrap();
        c.fork(1).unwrap()
    }

    #[test]
    fn the_longest_prefix_wins_and_the_least_recently_used_goes_first() {
        let mut store = PrefixStore::new(32 * 10);
        let pinned = store.insert(None, vec![1, 2], cache_of(2), true).id;
        let a = store.insert(None, vec![1, 2, 3, 4], cache_of(4), false).id;
        assert_eq!(store.lookup(None, &[1, 2, 3, 4, 5]).unwrap().id, a);
        // A prompt that is only the prefix has nothing to prefill.
        assert_eq!(store.lookup(None, &[1, 2, 3, 4]).unwrap().id, pinned);
        assert!(store.lookup(None, &[2, 1, 3]).is_none());
        let b = store.insert(None, vec![7, 7, 7, 7], cache_of(4), false).id;
        // Three of 4 positions pass 10: a, used least recently, goes.
        let c = store.insert(None, vec![9, 9, 9, 9], cache_of(4), false).id;
        assert!(store.lookup(None, &[1, 2, 3, 4, 5]).map(|f| f.id) != Some(a));
        assert_eq!(store.lookup(None, &[7, 7, 7, 7, 1]).unwrap().id, b);
        assert_eq!(store.lookup(None, &[9, 9, 9, 9, 1]).unwrap().id, c);
        assert_eq!(store.size().0, 3, "the pinned entry and two of four");
        // Too big for the store: answered, not kept.
        let big = store.insert(None, vec![5; 20], cache_of(20), false);
        assert_eq!(big.len, 20);
        assert!(store.lookup(None, &[5; 21]).is_none());
        assert_eq!(store.size().0, 3, "nothing evicted for it");
        assert_eq!(store.lookup(None, &[1, 2, 0]).unwrap().id, pinned);
        // Another adapter's prefix of the same tokens is another entry.
        assert!(store.lookup(Some(0), &[1, 2, 0]).is_none());
        let under = store.insert(Some(0), vec![1, 2], cache_of(2), false).id;
        assert_eq!(store.lookup(Some(0), &[1, 2, 0]).unwrap().id, under);
        assert_eq!(store.lookup(None, &[1, 2, 0]).unwrap().id, pinned);
    }
}
