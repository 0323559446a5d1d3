//! A map of bounded size that forgets its least recently used entry first.
//!
//! Every use of a key stamps it and appends `(stamp, key)` to a queue; eviction pops the queue's
//! front until it finds a stamp that is still its key's latest (older stamps of a key used since
//! are skipped). The queue is compacted once it holds twice the entries there are (and `SLACK`
//! more), so it takes memory in proportion to the entries, not to the capacity (compacted only at
//! twice the capacity, it grew with every use until then: about a megabyte every quarter of an
//! hour under a steady fleet, for maps of a few dozen entries). Each use costs amortized O(1), and nothing walks the map under the
//! caller's lock on a single insert.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// Stale stamps the queue may hold beyond one per entry before it is compacted.
const SLACK: usize = 64;

#[derive(Debug)]
pub(crate) struct AgedMap<K, V> {
    entries: HashMap<K, (u64, V)>,
    order: VecDeque<(u64, K)>,
    next: u64,
    capacity: usize,
}

impl<K: Hash + Eq + Clone, V> AgedMap<K, V> {
    /// A map of at most `capacity` entries (at least one).
    pub(crate) fn new(capacity: usize) -> Self {
        AgedMap {
            entries: HashMap::new(),
            order: VecDeque::new(),
            next: 0,
            capacity: capacity.max(1),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    #[cfg(test)]
    pub(crate) fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// The entry of `key`, not marked as used.
    pub(crate) fn peek_mut(&mut self, key: &K) -> Option<&mut V> {
        self.entries.get_mut(key).map(|(_, v)| v)
    }

    /// The entry of `key`, marked as used.
    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        if !self.entries.contains_key(key) {
            return None;
        }
        self.touch(key);
        self.entries.get_mut(key).map(|(_, v)| v)
    }

    /// The entry of `key`, made with `make` when absent (the least recently used one forgotten
    /// first when the map is full), marked as used.
    pub(crate) fn get_or_insert_with(&mut self, key: &K, make: impl FnOnce() -> V) -> &mut V {
        if !self.entries.contains_key(key) {
            while self.entries.len() >= self.capacity {
                if self.evict_oldest().is_none() {
                    break;
                }
            }
            self.entries.insert(key.clone(), (0, make()));
        }
        self.touch(key);
        &mut self.entries.get_mut(key).expect("just inserted").1
    }

    /// Puts `value` under `key` (the least recently used entry forgotten first when the map is
    /// full), marked as used.
    pub(crate) fn insert(&mut self, key: &K, value: V) {
        let mut value = Some(value);
        let slot = self.get_or_insert_with(key, || value.take().expect("taken once"));
        if let Some(value) = value {
            *slot = value;
        }
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.values().map(|(_, v)| v)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.entries.iter().map(|(k, (_, v))| (k, v))
    }

    /// Forgets the least recently used entry.
    pub(crate) fn evict_oldest(&mut self) -> Option<(K, V)> {
        while let Some((stamp, key)) = self.order.pop_front() {
            if self.entries.get(&key).is_some_and(|(s, _)| *s == stamp) {
                return self.entries.remove(&key).map(|(_, v)| (key, v));
            }
        }
        None
    }

    fn touch(&mut self, key: &K) {
        let stamp = self.next;
        self.next += 1;
        if let Some((s, _)) = self.entries.get_mut(key) {
            *s = stamp;
        }
        self.order.push_back((stamp, key.clone()));
        if self.order.len() > 2 * self.entries.len() + SLACK {
            let entries = &self.entries;
            self.order
                .retain(|(stamp, key)| entries.get(key).is_some_and(|(s, _)| s == stamp));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_map_forgets_the_least_recently_used_entry_and_stays_bounded() {
        let mut map = AgedMap::new(3);
        for k in ["a", "b", "c"] {
            *map.get_or_insert_with(&k, || 0) += 1;
        }
        // "a" is used again: "b" is now the oldest.
        *map.get_mut(&"a").unwrap() += 1;
        map.get_or_insert_with(&"d", || 0);
        assert_eq!(map.len(), 3);
        assert!(!map.contains(&"b"));
        assert!(map.contains(&"a") && map.contains(&"c") && map.contains(&"d"));
        // A million uses of a few keys keep the queue bounded.
        for i in 0..1_000_000u32 {
            map.get_or_insert_with(&["a", "c", "d"][i as usize % 3], || 0);
        }
        assert!(map.order.len() <= 2 * 3 + SLACK + 1, "{}", map.order.len());
        // In a map that may hold many, a few keys used a million times take memory for a few:
        // the queue follows the entries, not the capacity.
        let mut map = AgedMap::new(100_000);
        for i in 0..1_000_000u32 {
            *map.get_or_insert_with(&(i % 5), || 0) += 1;
            let _ = map.get_mut(&(i % 3));
        }
        assert!(map.order.len() <= 2 * 5 + SLACK + 1, "{}", map.order.len());
        // A million distinct keys: never more than three entries.
        let mut map = AgedMap::new(3);
        for i in 0..1_000_000u32 {
            map.get_or_insert_with(&i, || ());
            assert!(map.len() <= 3);
        }
        assert!(map.contains(&999_999) && !map.contains(&0));
    }
}
