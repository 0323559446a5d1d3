//! Pseudo-random object content produced chunk by chunk while it is sent, so a 1 GiB upload needs
//! one chunk of memory and no disk on the sending side.

use bytes::{Bytes, BytesMut};

/// Chunks of a deterministic pseudo-random byte sequence of a fixed total length.
///
/// The bytes come from SplitMix64: fast, and incompressible enough that no layer (compression,
/// deduplication in the store) can make the transfer cheaper than its length.
pub(crate) struct PseudoRandomChunks {
    remaining: u64,
    chunk_size: usize,
    state: u64,
}

impl PseudoRandomChunks {
    pub(crate) fn new(total: u64, chunk_size: usize, seed: u64) -> PseudoRandomChunks {
        assert!(chunk_size > 0, "chunks must not be empty");
        PseudoRandomChunks {
            remaining: total,
            chunk_size,
            state: seed,
        }
    }

    fn next_word(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

impl Iterator for PseudoRandomChunks {
    type Item = Bytes;

    fn next(&mut self) -> Option<Bytes> {
        if self.remaining == 0 {
            return None;
        }
        let len = self
            .chunk_size
            .min(usize::try_from(self.remaining).unwrap_or(usize::MAX));
        let mut chunk = BytesMut::with_capacity(len.next_multiple_of(8));
        while chunk.len() < len {
            let word = self.next_word().to_le_bytes();
            chunk.extend_from_slice(&word);
        }
        chunk.truncate(len);
        self.remaining -= len as u64;
        Some(chunk.freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_add_up_to_the_exact_total() {
        let lengths: Vec<usize> = PseudoRandomChunks::new(10_000, 4_096, 1)
            .map(|c| c.len())
            .collect();
        assert_eq!(lengths, vec![4_096, 4_096, 1_808]);
    }

    #[test]
    fn the_same_seed_gives_the_same_bytes() {
        let a: Vec<u8> = PseudoRandomChunks::new(3_000, 1_000, 42)
            .flat_map(|c| c.to_vec())
            .collect();
        let b: Vec<u8> = PseudoRandomChunks::new(3_000, 1_000, 42)
            .flat_map(|c| c.to_vec())
            .collect();
        let c: Vec<u8> = PseudoRandomChunks::new(3_000, 1_000, 43)
            .flat_map(|c| c.to_vec())
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn the_bytes_look_random() {
        let bytes: Vec<u8> = PseudoRandomChunks::new(1 << 16, 1 << 16, 7)
            .flat_map(|c| c.to_vec())
            .collect();
        let mut seen = [0u32; 256];
        for b in &bytes {
            seen[usize::from(*b)] += 1;
        }
        // 256 expected per value; a constant or short-period pattern would be far off.
        assert!(seen.iter().all(|&n| (150..400).contains(&n)), "{seen:?}");
    }
}
