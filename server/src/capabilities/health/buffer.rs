//! Heartbeats gather in memory, cheaply, as requests are answered, and go to the store in batches
//! every `--health-flush-interval`; what a failed flush held stays for the next one.

use serde_json::{json, Value};

use super::bill::IdleWindow;
use super::store::{rows_of, FindingRow, GpuIdleRow, RankRow, SUPERSEDE_AFTER_MS};
use super::usage::{Gathered, Series};
use super::{findings, Beat, Health};

/// Ranks with unflushed heartbeats a replica holds before new ones are dropped (and counted).
const MAX_PENDING_RANKS: usize = 100_000;

impl Health {
    /// Records what an accepted request said, as heard at `now_ms`. Cheap: memory only.
    pub fn record(&self, beat: Beat, now_ms: i64) {
        // A sample stamped in the future (a wrong clock, or a forged one) counts as heard now.
        let at = |ms: i64| if ms > 0 { ms.min(now_ms) } else { now_ms };
        if !beat.findings.is_empty() {
            let mut pending = self.inner.pending_findings.lock().expect("health lock");
            for finding in &beat.findings {
                if pending.len() < MAX_PENDING_RANKS {
                    pending.push(finding.clone().row(&beat.run_id, now_ms));
                } else {
                    self.inner.metrics.heartbeat_dropped();
                }
            }
        }
        {
            let mut pending_idle = self.inner.pending_idle.lock().expect("health lock");
            for rank in &beat.ranks {
                let mut readings = rank.idle_readings.clone();
                readings.sort_by_key(|&(gpu, ms, _)| (gpu, ms));
                for (gpu, ms, idle) in readings {
                    let key = (beat.run_id.clone(), rank.node.clone(), rank.rank, gpu);
                    if let Some(window) = pending_idle.get_mut(&key) {
                        window.push(at(ms), idle);
                    } else if pending_idle.len() < MAX_PENDING_RANKS {
                        pending_idle.insert(key, IdleWindow::new(at(ms), idle));
                    } else {
                        self.inner.metrics.heartbeat_dropped();
                    }
                }
            }
        }
        self.record_usage(&beat, &at);
        let mut pending = self.inner.pending.lock().expect("health lock");
        for rank in beat.ranks {
            let key = (beat.run_id.clone(), rank.node.clone(), rank.rank);
            if !pending.contains_key(&key) && pending.len() >= MAX_PENDING_RANKS {
                self.inner.metrics.heartbeat_dropped();
                continue;
            }
            let entry = pending.entry(key).or_insert_with(|| RankRow {
                run_id: beat.run_id.clone(),
                node: rank.node.clone(),
                rank: rank.rank,
                first_heard_ms: now_ms,
                last_heard_ms: now_ms,
                ..RankRow::default()
            });
            if beat.workspace.is_some() {
                entry.workspace = beat.workspace.clone();
            }
            if now_ms > entry.last_heard_ms {
                entry.interval_ms = Some(now_ms - entry.last_heard_ms);
                entry.last_heard_ms = now_ms;
            }
            if let Some((first, last)) = rank.sampled_between {
                let (first, last) = (at(first), at(last));
                entry.bill_first_ms = Some(entry.bill_first_ms.map_or(first, |f| f.min(first)));
                entry.bill_last_ms = Some(entry.bill_last_ms.map_or(last, |l| l.max(last)));
            }
            if rank.sampled {
                entry.last_sample_ms = Some(now_ms);
                // The rank samples again well after its reported end: the end no longer holds
                // (the store applies the same rule to an end it already has).
                if entry
                    .ended_ms
                    .is_some_and(|ended| now_ms > ended + SUPERSEDE_AFTER_MS)
                {
                    entry.outcome = None;
                    entry.exit_code = None;
                    entry.ended_ms = None;
                }
            }
            if rank.outcome.is_some() {
                entry.outcome = rank.outcome;
                entry.ended_ms = Some(now_ms);
            }
            entry.exit_code = rank.exit_code.or(entry.exit_code);
            entry.pod = rank.pod.or(entry.pod.take());
            entry.gpu_model = rank.gpu_model.or(entry.gpu_model.take());
            if let Some(basis) = rank.gpu_idle_basis {
                entry.gpu_idle_basis = Some(basis.to_owned());
            }
            entry.memory_limit_mb = rank.memory_limit_mb.or(entry.memory_limit_mb);
            entry.cpu_limit_cores = rank.cpu_limit_cores.or(entry.cpu_limit_cores);
            entry.gpus = entry.gpus.max(rank.gpus);
            if rank.gpu_idle.iter().any(Option::is_some) {
                let idle: Vec<Value> = rank
                    .gpu_idle
                    .iter()
                    .map(|v| v.map_or(Value::Null, |s| json!(s)))
                    .collect();
                entry.gpu_idle = Some(Value::Array(idle).to_string());
                entry.gpu_idle_ms = Some(now_ms);
            }
        }
    }

    /// Adds the readings of a beat to the report's series (`at`: a sample's time as counted).
    fn record_usage(&self, beat: &Beat, at: &dyn Fn(i64) -> i64) {
        let readings = beat.ranks.iter().flat_map(|r| {
            r.usage
                .iter()
                .map(move |&(series, ms, value)| (r.node.as_str(), r.rank, series, ms, value))
        });
        let step = beat
            .step
            .map(|(step, ms)| ("", -1, Series::Step, ms, step as f64));
        let mut pending = self.inner.pending_usage.lock().expect("health lock");
        for (node, rank, series, ms, value) in readings.chain(step) {
            let key = (beat.run_id.clone(), node.to_owned(), rank, series);
            if !pending.contains_key(&key) && pending.len() >= MAX_PENDING_RANKS {
                self.inner.metrics.heartbeat_dropped();
                continue;
            }
            pending.entry(key).or_default().add(series, at(ms), value);
        }
    }

    /// Records that MLflow accepted a write to `run_id` at `now_ms`: a sign of life for the run
    /// even when it carried no system samples (a training loop logging its loss). Memory only;
    /// a run the store has no ranks of is not added by it.
    pub fn touch(&self, run_id: &str, now_ms: i64) {
        let mut writes = self.inner.writes.lock().expect("health lock");
        if let Some(latest) = writes.get_mut(run_id) {
            *latest = (*latest).max(now_ms);
        } else if writes.len() < MAX_PENDING_RANKS {
            writes.insert(run_id.to_owned(), now_ms);
        } else {
            self.inner.metrics.heartbeat_dropped();
        }
    }

    /// Writes the buffered heartbeats to the store; on failure they stay buffered.
    pub async fn flush(&self) {
        self.flush_writes().await;
        self.flush_ranks().await;
        self.flush_idle().await;
        self.flush_findings().await;
        self.flush_usage().await;
    }

    async fn flush_usage(&self) {
        let gathered: Vec<((String, String, i64, Series), Gathered)> = self
            .inner
            .pending_usage
            .lock()
            .expect("health lock")
            .drain()
            .collect();
        if gathered.is_empty() {
            return;
        }
        let (mut series, mut histograms) = (Vec::new(), Vec::new());
        for ((run_id, node, rank, kind), g) in &gathered {
            let (buckets, histogram) = rows_of((run_id, node, *rank), *kind, g);
            series.extend(buckets);
            histograms.extend(histogram);
        }
        if let Err(error) = self.inner.store.record_usage(&series, &histograms).await {
            tracing::warn!(%error, buckets = series.len(), "recording what ranks used failed; kept for the next flush");
            self.inner.metrics.health_error("store");
            let mut pending = self.inner.pending_usage.lock().expect("health lock");
            for (key, g) in gathered {
                let room = pending.len() < MAX_PENDING_RANKS;
                match pending.get_mut(&key) {
                    Some(newer) => newer.merge(g),
                    None if room => {
                        pending.insert(key, g);
                    }
                    None => {}
                }
            }
        }
    }

    async fn flush_findings(&self) {
        let rows: Vec<FindingRow> =
            std::mem::take(&mut *self.inner.pending_findings.lock().expect("health lock"));
        if rows.is_empty() {
            return;
        }
        match self.inner.store.record_findings(&rows).await {
            Ok(inserted) => {
                for (row, new) in rows.iter().zip(inserted) {
                    if let Some(kind) = findings::counted_kind(row).filter(|_| new) {
                        self.inner.metrics.finding(kind);
                    }
                }
            }
            Err(error) => {
                tracing::warn!(%error, reports = rows.len(), "recording data changes and leftovers failed; kept for the next flush");
                self.inner.metrics.health_error("store");
                let mut pending = self.inner.pending_findings.lock().expect("health lock");
                let room = MAX_PENDING_RANKS.saturating_sub(pending.len());
                pending.extend(rows.into_iter().take(room));
            }
        }
    }

    async fn flush_idle(&self) {
        let windows: Vec<GpuIdleRow> = {
            let mut pending = self.inner.pending_idle.lock().expect("health lock");
            if pending.is_empty() {
                return;
            }
            pending
                .drain()
                .map(|((run_id, node, rank, gpu), w)| GpuIdleRow {
                    run_id,
                    node,
                    rank,
                    gpu,
                    first_ms: w.first_ms,
                    first_idle: w.first_idle,
                    last_ms: w.last_ms,
                    last_idle: w.last_idle,
                    idle_s: w.idle_s,
                })
                .collect()
        };
        if let Err(error) = self.inner.store.record_gpu_idle(&windows).await {
            tracing::warn!(%error, gpus = windows.len(), "recording GPU idle clocks failed; kept for the next flush");
            self.inner.metrics.health_error("store");
            let mut pending = self.inner.pending_idle.lock().expect("health lock");
            for row in windows {
                let window = row.window();
                let key = (row.run_id, row.node, row.rank, row.gpu);
                let room = pending.len() < MAX_PENDING_RANKS;
                match pending.get_mut(&key) {
                    Some(newer) => {
                        let mut merged = window;
                        merged.merge(newer);
                        *newer = merged;
                    }
                    None if room => {
                        pending.insert(key, window);
                    }
                    None => {}
                }
            }
        }
    }

    async fn flush_writes(&self) {
        let writes: Vec<(String, i64)> = {
            let mut writes = self.inner.writes.lock().expect("health lock");
            writes.drain().collect()
        };
        if writes.is_empty() {
            return;
        }
        if let Err(error) = self.inner.store.record_writes(&writes).await {
            tracing::warn!(%error, runs = writes.len(), "recording writes failed; kept for the next flush");
            self.inner.metrics.health_error("store");
            let mut pending = self.inner.writes.lock().expect("health lock");
            for (run_id, ms) in writes {
                if pending.len() < MAX_PENDING_RANKS || pending.contains_key(&run_id) {
                    let latest = pending.entry(run_id).or_insert(ms);
                    *latest = (*latest).max(ms);
                }
            }
        }
    }

    async fn flush_ranks(&self) {
        let batch: Vec<RankRow> = {
            let mut pending = self.inner.pending.lock().expect("health lock");
            if pending.is_empty() {
                return;
            }
            pending.drain().map(|(_, update)| update).collect()
        };
        if let Err(error) = self.inner.store.record_ranks(&batch).await {
            tracing::warn!(%error, ranks = batch.len(), "recording heartbeats failed; kept for the next flush");
            self.inner.metrics.health_error("store");
            let mut pending = self.inner.pending.lock().expect("health lock");
            for update in batch {
                let key = (update.run_id.clone(), update.node.clone(), update.rank);
                // Newer heartbeats gathered meanwhile win; the failed batch fills the rest and
                // keeps the earliest first heartbeat and sample (the start of the bill).
                let room = pending.len() < MAX_PENDING_RANKS;
                match pending.get_mut(&key) {
                    Some(newer) => merge_older(newer, update),
                    None if room => {
                        pending.insert(key, update);
                    }
                    None => self.inner.metrics.heartbeat_dropped(),
                }
            }
        }
    }
}

/// Folds what a failed flush held of a rank (`older`) into what was gathered since (`newer`):
/// the newer facts win, the older fill the gaps, and the spans take both ends (the earliest
/// first heartbeat and sample, the latest last ones), as the store's merge does.
fn merge_older(newer: &mut RankRow, older: RankRow) {
    let min = |a: Option<i64>, b: Option<i64>| a.into_iter().chain(b).min();
    let max = |a: Option<i64>, b: Option<i64>| a.into_iter().chain(b).max();
    newer.first_heard_ms = newer.first_heard_ms.min(older.first_heard_ms);
    newer.last_heard_ms = newer.last_heard_ms.max(older.last_heard_ms);
    newer.bill_first_ms = min(newer.bill_first_ms, older.bill_first_ms);
    newer.bill_last_ms = max(newer.bill_last_ms, older.bill_last_ms);
    newer.last_sample_ms = max(newer.last_sample_ms, older.last_sample_ms);
    newer.last_write_ms = max(newer.last_write_ms, older.last_write_ms);
    newer.interval_ms = newer.interval_ms.or(older.interval_ms);
    newer.gpus = newer.gpus.max(older.gpus);
    newer.workspace = newer.workspace.take().or(older.workspace);
    newer.pod = newer.pod.take().or(older.pod);
    newer.gpu_model = newer.gpu_model.take().or(older.gpu_model);
    newer.gpu_idle_basis = newer.gpu_idle_basis.take().or(older.gpu_idle_basis);
    newer.memory_limit_mb = newer.memory_limit_mb.or(older.memory_limit_mb);
    newer.cpu_limit_cores = newer.cpu_limit_cores.or(older.cpu_limit_cores);
    if newer.gpu_idle_ms.is_none() {
        newer.gpu_idle = older.gpu_idle;
        newer.gpu_idle_ms = older.gpu_idle_ms;
    }
    // An end reported before the newer samples: the newer entry already dropped it when the
    // samples superseded it; otherwise it still holds.
    if newer.outcome.is_none()
        && newer.last_sample_ms <= older.ended_ms.map(|e| e + SUPERSEDE_AFTER_MS)
    {
        newer.outcome = older.outcome;
        newer.exit_code = newer.exit_code.or(older.exit_code);
        newer.ended_ms = older.ended_ms;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_flush_merged_back_keeps_the_ranks_first_sample_and_facts() {
        let older = RankRow {
            run_id: "r".into(),
            first_heard_ms: 1_000,
            last_heard_ms: 5_000,
            bill_first_ms: Some(900),
            bill_last_ms: Some(4_900),
            last_sample_ms: Some(5_000),
            pod: Some("train-0".into()),
            gpus: 8,
            gpu_idle_basis: Some("sm_active".into()),
            ..RankRow::default()
        };
        let mut newer = RankRow {
            run_id: "r".into(),
            first_heard_ms: 6_000,
            last_heard_ms: 7_000,
            bill_first_ms: Some(5_900),
            bill_last_ms: Some(6_900),
            last_sample_ms: Some(7_000),
            ..RankRow::default()
        };
        merge_older(&mut newer, older);
        assert_eq!((newer.first_heard_ms, newer.last_heard_ms), (1_000, 7_000));
        assert_eq!(
            (newer.bill_first_ms, newer.bill_last_ms),
            (Some(900), Some(6_900))
        );
        assert_eq!((newer.pod.as_deref(), newer.gpus), (Some("train-0"), 8));
        assert_eq!(newer.gpu_idle_basis.as_deref(), Some("sm_active"));
        assert_eq!(newer.outcome, None);
    }
}
