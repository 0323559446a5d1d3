//! Values that another thread measures on its own schedule (the data watch's file counts), read
//! with each sample so that they share its timestamp and step.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};

use super::Named;

/// Named values, each unknown (not sent) until first set.
#[derive(Debug)]
pub struct Gauges {
    entries: Vec<(String, AtomicU64)>,
}

/// `f64::NAN`'s bits: not sent.
const UNKNOWN: u64 = 0x7ff8_0000_0000_0000;

impl Gauges {
    /// One gauge per bare metric name, in this order.
    pub fn new(names: Vec<String>) -> Self {
        Gauges {
            entries: names
                .into_iter()
                .map(|name| (name, AtomicU64::new(UNKNOWN)))
                .collect(),
        }
    }

    /// Sets gauge `index` (its position in `new`'s names).
    pub fn set(&self, index: usize, value: f64) {
        if let Some((_, cell)) = self.entries.get(index) {
            cell.store(value.to_bits(), Ordering::Relaxed);
        }
    }

    pub fn get(&self, index: usize) -> Option<f64> {
        let value = f64::from_bits(self.entries.get(index)?.1.load(Ordering::Relaxed));
        value.is_finite().then_some(value)
    }

    pub fn sample(&self, out: &mut Vec<Named>) {
        for (index, (name, _)) in self.entries.iter().enumerate() {
            if let Some(value) = self.get(index) {
                out.push((Cow::Owned(name.clone()), value));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gauge_is_sent_once_set() {
        let gauges = Gauges::new(vec!["data_val_files".into(), "data_train_files".into()]);
        let mut out = Vec::new();
        gauges.sample(&mut out);
        assert!(out.is_empty());
        gauges.set(1, 12.0);
        gauges.sample(&mut out);
        assert_eq!(out, [(Cow::Owned("data_train_files".into()), 12.0)]);
    }
}
