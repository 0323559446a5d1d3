//! A map of bounded size that forgets its least recently used entry first.
//!
//! The entries sit in slots linked in order of use, most recent first: a use looks its key up
//! once (one hash) and moves its slot to the front; eviction takes the last slot, and a later
//! entry reuses it. Nothing is queued per use, so memory follows the most entries held at once
//! (at most the capacity), and every operation is O(1). (An earlier version appended every use
//! to a queue and compacted it by looking each queued key up again: about four hashes per use,
//! on the write path several uses a request.)

use std::collections::HashMap;
use std::hash::Hash;

/// No slot: the end of the list.
const NONE: usize = usize::MAX;

#[derive(Debug)]
struct Slot<K, V> {
    /// `None` while the slot is free.
    entry: Option<(K, V)>,
    /// The neighbours in order of use: the slot used more recently (towards the front) and the
    /// one used less recently (towards the back).
    newer: usize,
    older: usize,
}

#[derive(Debug)]
pub(crate) struct AgedMap<K, V> {
    index: HashMap<K, usize>,
    slots: Vec<Slot<K, V>>,
    /// Slots whose entry was forgotten, for the next entries.
    free: Vec<usize>,
    /// The most and the least recently used slot.
    newest: usize,
    oldest: usize,
    capacity: usize,
}

impl<K: Hash + Eq + Clone, V> AgedMap<K, V> {
    /// A map of at most `capacity` entries (at least one).
    pub(crate) fn new(capacity: usize) -> Self {
        AgedMap {
            index: HashMap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            newest: NONE,
            oldest: NONE,
            capacity: capacity.max(1),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    #[cfg(test)]
    pub(crate) fn contains(&self, key: &K) -> bool {
        self.index.contains_key(key)
    }

    /// The entry of `key`, not marked as used.
    pub(crate) fn peek_mut(&mut self, key: &K) -> Option<&mut V> {
        let at = *self.index.get(key)?;
        self.value_mut(at)
    }

    /// The entry of `key`, marked as used.
    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        let at = *self.index.get(key)?;
        self.move_to_front(at);
        self.value_mut(at)
    }

    /// The entry of `key`, made with `make` when absent (the least recently used one forgotten
    /// first when the map is full), marked as used.
    pub(crate) fn get_or_insert_with(&mut self, key: &K, make: impl FnOnce() -> V) -> &mut V {
        let at = match self.index.get(key) {
            Some(&at) => {
                self.move_to_front(at);
                at
            }
            None => {
                while self.index.len() >= self.capacity {
                    if self.evict_oldest().is_none() {
                        break;
                    }
                }
                let indexed = key.clone();
                let slot = Slot {
                    entry: Some((key.clone(), make())),
                    newer: NONE,
                    older: NONE,
                };
                let at = match self.free.pop() {
                    Some(at) => {
                        self.slots[at] = slot;
                        at
                    }
                    None => {
                        self.slots.push(slot);
                        self.slots.len() - 1
                    }
                };
                self.index.insert(indexed, at);
                self.link_front(at);
                at
            }
        };
        self.value_mut(at)
            .expect("a slot the index names holds its entry")
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
        self.iter().map(|(_, v)| v)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.slots
            .iter()
            .filter_map(|slot| slot.entry.as_ref().map(|(k, v)| (k, v)))
    }

    /// Forgets the least recently used entry.
    pub(crate) fn evict_oldest(&mut self) -> Option<(K, V)> {
        let at = self.oldest;
        if at == NONE {
            return None;
        }
        self.unlink(at);
        let (key, value) = self.slots[at].entry.take()?;
        self.index.remove(&key);
        self.free.push(at);
        Some((key, value))
    }

    fn value_mut(&mut self, at: usize) -> Option<&mut V> {
        self.slots[at].entry.as_mut().map(|(_, v)| v)
    }

    fn move_to_front(&mut self, at: usize) {
        if self.newest != at {
            self.unlink(at);
            self.link_front(at);
        }
    }

    fn unlink(&mut self, at: usize) {
        let Slot { newer, older, .. } = self.slots[at];
        match newer {
            NONE => self.newest = older,
            newer => self.slots[newer].older = older,
        }
        match older {
            NONE => self.oldest = newer,
            older => self.slots[older].newer = newer,
        }
    }

    fn link_front(&mut self, at: usize) {
        let was = self.newest;
        self.slots[at].newer = NONE;
        self.slots[at].older = was;
        match was {
            NONE => self.oldest = at,
            was => self.slots[was].newer = at,
        }
        self.newest = at;
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
        // Looking at an entry does not make it recent: "c" goes next, then "a".
        *map.peek_mut(&"c").unwrap() += 1;
        assert_eq!(map.evict_oldest(), Some(("c", 2)));
        assert_eq!(map.evict_oldest(), Some(("a", 2)));
        map.insert(&"e", 5);
        map.insert(&"e", 6);
        assert_eq!(map.evict_oldest(), Some(("d", 0)));
        assert_eq!(map.evict_oldest(), Some(("e", 6)));
        assert_eq!(map.evict_oldest(), None);
        assert_eq!(map.len(), 0);
        // A million uses of a few keys keep it at a few slots.
        for i in 0..1_000_000u32 {
            map.get_or_insert_with(&["a", "c", "d"][i as usize % 3], || 0);
        }
        assert!(map.slots.len() <= 3, "{}", map.slots.len());
        // In a map that may hold many, a few keys used a million times take memory for a few.
        let mut map = AgedMap::new(100_000);
        for i in 0..1_000_000u32 {
            *map.get_or_insert_with(&(i % 5), || 0) += 1;
            let _ = map.get_mut(&(i % 3));
        }
        assert_eq!(map.slots.len(), 5);
        assert_eq!(map.values().sum::<u32>(), 1_000_000);
        // A million distinct keys: never more than three entries, nor slots.
        let mut map = AgedMap::new(3);
        for i in 0..1_000_000u32 {
            map.get_or_insert_with(&i, || ());
            assert!(map.len() <= 3);
        }
        assert!(map.contains(&999_999) && !map.contains(&0));
        assert!(map.slots.len() <= 3);
        let mut left: Vec<u32> = map.iter().map(|(k, _)| *k).collect();
        left.sort();
        assert_eq!(left, [999_997, 999_998, 999_999]);
    }

    #[test]
    fn eviction_follows_the_order_of_use_through_any_mix_of_uses() {
        // Against a plain list kept in order of use, most recent last.
        let mut map = AgedMap::new(4);
        let mut model: Vec<u32> = Vec::new();
        let mut x: u32 = 12345;
        for _ in 0..20_000 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let key = (x >> 16) % 7;
            match (x >> 8) % 3 {
                0 => {
                    map.get_or_insert_with(&key, || key);
                    model.retain(|k| *k != key);
                    if model.len() == 4 {
                        model.remove(0);
                    }
                    model.push(key);
                }
                1 => {
                    if map.get_mut(&key).is_some() {
                        model.retain(|k| *k != key);
                        model.push(key);
                    }
                }
                _ => {
                    let evicted = map.evict_oldest().map(|(k, _)| k);
                    let expected = (!model.is_empty()).then(|| model.remove(0));
                    assert_eq!(evicted, expected);
                }
            }
            assert_eq!(map.len(), model.len());
        }
    }
}
