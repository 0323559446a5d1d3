//! Which batches of one run may be at MLflow at the same time.
//!
//! Metrics commute: MLflow stores a set of samples, and a run's latest value is the sample with
//! the highest step and time, whatever arrived first. Params and tags are what a run's order is
//! about. Two batches that write the same param or tag must not overlap when
//!
//! - the values differ: the later value must be written later (a tag), or the earlier one must be
//!   the one MLflow keeps and the later one refused (a param);
//! - or the key is new to the run: MLflow inserts it, and two inserts of one key at once collide
//!   (for a param, the loser is answered 400, which its client does not retry).
//!
//! A key MLflow already holds with the batch's value is *settled*: MLflow skips a param it holds
//! with that value, and sets a tag to the value it has; batches that write it with that value
//! commute, and the key claims nothing. Settled keys are learned from the batches MLflow answered
//! 200, a bounded number per run and of runs ([`Settled`]); what was forgotten or never learned
//! is treated as new, which only costs overlap.

use std::collections::HashMap;
use std::sync::Arc;

use crate::plumbing::aged::AgedMap;
use crate::plumbing::writes::{Pair, Writes};

/// Runs whose settled keys are remembered; the least recently written is forgotten first.
pub(super) const SETTLED_RUNS: usize = 2048;
/// Bytes of settled keys and values remembered per run; keys past it are not learned.
pub(super) const SETTLED_BYTES_PER_RUN: usize = 16 << 10;

/// The params and tags a batch at MLflow writes that a later batch must not race: the keys
/// that were not settled with the batch's value when it left, and every tag with its value.
#[derive(Debug, Default)]
pub(super) struct Claims {
    params: Vec<(Box<str>, Box<str>)>,
    tags: Vec<(Box<str>, Box<str>)>,
    /// A request the coalescer could not read as writes: it claims the whole run.
    everything: bool,
}

impl Claims {
    /// What a request the coalescer cannot read claims: the run, alone.
    pub(super) fn everything() -> Claims {
        Claims {
            everything: true,
            ..Claims::default()
        }
    }

    /// What the writes of `members` claim, given what is `settled` of their run.
    pub(super) fn of<'a>(
        members: impl Iterator<Item = &'a Writes>,
        settled: Option<&RunSettled>,
    ) -> Claims {
        let mut claims = Claims::default();
        for writes in members {
            for p in &writes.params {
                let known = settled.is_some_and(|s| s.param(&p.key) == Some(&*p.value));
                if !known && !claims.params.iter().any(|(k, _)| **k == *p.key) {
                    claims.params.push((p.key.clone(), p.value.clone()));
                }
            }
            for t in &writes.tags {
                if !claims
                    .tags
                    .iter()
                    .any(|(k, v)| **k == *t.key && **v == *t.value)
                {
                    claims.tags.push((t.key.clone(), t.value.clone()));
                }
            }
        }
        claims
    }

    /// Whether this batch must wait for the batches `at_mlflow`: it writes a key one of them
    /// writes with another value, or a key not settled (with that value) that one of them writes.
    pub(super) fn conflicts(
        &self,
        at_mlflow: &[Arc<Claims>],
        settled: Option<&RunSettled>,
    ) -> bool {
        if at_mlflow.is_empty() {
            return false;
        }
        if self.everything || at_mlflow.iter().any(|other| other.everything) {
            return true;
        }
        let tag_settled = |k: &str, v: &str| settled.is_some_and(|s| s.tag(k) == Some(v));
        self.params.iter().any(|(key, _)| {
            at_mlflow
                .iter()
                .any(|other| other.params.iter().any(|(k, _)| k == key))
        }) || self.tags.iter().any(|(key, value)| {
            at_mlflow.iter().any(|other| {
                other
                    .tags
                    .iter()
                    .any(|(k, v)| k == key && (v != value || !tag_settled(key, value)))
            })
        })
    }
}

/// What MLflow is known to hold of one run's params and tags.
#[derive(Debug, Default)]
pub(super) struct RunSettled {
    params: HashMap<Box<str>, Box<str>>,
    tags: HashMap<Box<str>, Box<str>>,
    bytes: usize,
}

impl RunSettled {
    pub(super) fn param(&self, key: &str) -> Option<&str> {
        self.params.get(key).map(|v| &**v)
    }

    fn tag(&self, key: &str) -> Option<&str> {
        self.tags.get(key).map(|v| &**v)
    }

    /// Records `pairs` as stored. A tag takes its new value (the batch's last for the key); a
    /// param keeps the value MLflow keeps, its first.
    fn learn(&mut self, pairs: &[Pair], tags: bool) {
        for pair in pairs {
            let map = if tags {
                &mut self.tags
            } else {
                &mut self.params
            };
            match map.get_mut(&*pair.key) {
                Some(value) if tags => {
                    let (old, new) = (value.len(), pair.value.len());
                    if self.bytes - old + new > SETTLED_BYTES_PER_RUN {
                        // Not learned: a stale value would claim the key as settled.
                        map.remove(&*pair.key);
                        self.bytes -= pair.key.len() + old;
                        continue;
                    }
                    *value = pair.value.clone();
                    self.bytes = self.bytes - old + new;
                }
                Some(_) => {}
                None => {
                    let size = pair.key.len() + pair.value.len();
                    if self.bytes + size <= SETTLED_BYTES_PER_RUN {
                        map.insert(pair.key.clone(), pair.value.clone());
                        self.bytes += size;
                    }
                }
            }
        }
    }
}

/// Settled params and tags of the runs written recently: at most [`SETTLED_RUNS`] runs of at
/// most [`SETTLED_BYTES_PER_RUN`] each.
pub(super) struct Settled {
    runs: AgedMap<Arc<str>, RunSettled>,
}

impl Default for Settled {
    fn default() -> Self {
        Self {
            runs: AgedMap::new(SETTLED_RUNS),
        }
    }
}

impl Settled {
    pub(super) fn of(&mut self, run_id: &Arc<str>) -> Option<&RunSettled> {
        self.runs.peek_mut(run_id).map(|r| &*r)
    }

    /// Records what MLflow answered 200 for: every param and tag of `members`, in their order.
    pub(super) fn learn<'a>(
        &mut self,
        run_id: &Arc<str>,
        members: impl Iterator<Item = &'a Writes>,
    ) {
        let mut members = members.filter(|w| w.is_ordered()).peekable();
        if members.peek().is_none() {
            return;
        }
        let run = self.runs.get_or_insert_with(run_id, RunSettled::default);
        for writes in members {
            run.learn(&writes.params, false);
            run.learn(&writes.tags, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn writes(params: &[(&str, &str)], tags: &[(&str, &str)]) -> Writes {
        Writes {
            metrics: vec![Bytes::from_static(b"{}")],
            params: params.iter().map(|(k, v)| Pair::of(k, v)).collect(),
            tags: tags.iter().map(|(k, v)| Pair::of(k, v)).collect(),
        }
    }

    #[test]
    fn only_settled_keys_written_with_their_value_overlap() {
        let run: Arc<str> = "r".into();
        let mut settled = Settled::default();
        let first = writes(&[("lr", "0.1")], &[("phase", "train")]);
        let at_mlflow = [Arc::new(Claims::of([&first].into_iter(), None))];
        // Nothing is settled yet: the same keys must wait, other keys need not.
        let same = Claims::of([&first].into_iter(), None);
        assert!(same.conflicts(&at_mlflow, None));
        let other = writes(&[("seed", "1")], &[("host", "a")]);
        assert!(!Claims::of([&other].into_iter(), None).conflicts(&at_mlflow, None));
        // Metrics alone never wait.
        let metrics = writes(&[], &[]);
        assert!(!Claims::of([&metrics].into_iter(), None).conflicts(&at_mlflow, None));

        settled.learn(&run, [&first].into_iter());
        let known = settled.of(&run);
        let at_mlflow = [Arc::new(Claims::of([&first].into_iter(), known))];
        // Settled with the same value: commutes with the batch at MLflow writing the same.
        assert!(!Claims::of([&first].into_iter(), known).conflicts(&at_mlflow, known));
        // Another value of the tag, or of the param, waits.
        let changed_tag = writes(&[], &[("phase", "eval")]);
        assert!(Claims::of([&changed_tag].into_iter(), known).conflicts(&at_mlflow, known));
        let at_mlflow_changing = [Arc::new(Claims::of([&changed_tag].into_iter(), known))];
        assert!(Claims::of([&first].into_iter(), known).conflicts(&at_mlflow_changing, known));
        let changed_param = writes(&[("lr", "0.2")], &[]);
        let unsettled_lr = [Arc::new(Claims::of([&changed_param].into_iter(), known))];
        assert!(Claims::of([&changed_param].into_iter(), known).conflicts(&unsettled_lr, known));
    }

    #[test]
    fn a_param_keeps_its_first_value_and_a_tag_its_last_within_a_bound() {
        let run: Arc<str> = "r".into();
        let mut settled = Settled::default();
        settled.learn(&run, [&writes(&[("lr", "0.1")], &[("t", "a")])].into_iter());
        settled.learn(&run, [&writes(&[("lr", "0.2")], &[("t", "b")])].into_iter());
        let known = settled.of(&run).unwrap();
        assert_eq!(known.param("lr"), Some("0.1"));
        assert_eq!(known.tag("t"), Some("b"));
        let big = "v".repeat(SETTLED_BYTES_PER_RUN);
        settled.learn(
            &run,
            [&writes(&[("huge", &big)], &[("t", &big)])].into_iter(),
        );
        let known = settled.of(&run).unwrap();
        assert_eq!(known.param("huge"), None);
        // A tag whose new value does not fit is forgotten, never left at its old value.
        assert_eq!(known.tag("t"), None);
        assert!(known.bytes <= SETTLED_BYTES_PER_RUN);
    }
}
