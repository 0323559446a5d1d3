//! What ranks used, for the run report (`health::usage`): series buckets and histograms, added to
//! by every replica in one statement per row, read per run, and merged into wider buckets when a
//! series holds more than `usage::POINTS`.

use super::HealthStore;
use crate::capabilities::health::usage::{self, Bucket, Series};
use crate::plumbing::store::{on_backend, StoreError};

/// A `rank_series` row.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct SeriesRow {
    pub run_id: String,
    pub node: String,
    pub rank: i64,
    pub series: String,
    pub bucket_ms: i64,
    pub width_ms: i64,
    pub n: i64,
    pub total: f64,
    pub peak: f64,
    pub peak_ms: i64,
    pub low: f64,
}

impl SeriesRow {
    pub fn new(
        (run_id, node, rank, series): (&str, &str, i64, &str),
        bucket_ms: i64,
        width_ms: i64,
        b: &Bucket,
    ) -> SeriesRow {
        SeriesRow {
            run_id: run_id.to_owned(),
            node: node.to_owned(),
            rank,
            series: series.to_owned(),
            bucket_ms,
            width_ms,
            n: b.n,
            total: b.total,
            peak: b.peak,
            peak_ms: b.peak_ms,
            low: b.low,
        }
    }

    pub fn bucket(&self) -> Bucket {
        Bucket {
            n: self.n,
            total: self.total,
            peak: self.peak,
            peak_ms: self.peak_ms,
            low: self.low,
        }
    }
}

/// A `rank_histogram` row.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct HistogramRow {
    pub run_id: String,
    pub node: String,
    pub rank: i64,
    pub series: String,
    pub bucket: i64,
    pub n: i64,
    pub last_ms: i64,
}

/// The rows of what one replica gathered for (run, node, rank) and `series`.
pub fn rows_of(
    (run_id, node, rank): (&str, &str, i64),
    series: Series,
    gathered: &usage::Gathered,
) -> (Vec<SeriesRow>, Vec<HistogramRow>) {
    let key = (run_id, node, rank, series.name());
    let buckets = gathered
        .buckets
        .iter()
        .map(|(&start, b)| SeriesRow::new(key, start, gathered.width_ms, b))
        .collect();
    let last_ms = gathered
        .buckets
        .keys()
        .next_back()
        .copied()
        .unwrap_or_default();
    let histogram = gathered
        .histogram
        .iter()
        .map(|(&bucket, &n)| HistogramRow {
            run_id: run_id.to_owned(),
            node: node.to_owned(),
            rank,
            series: series.name().to_owned(),
            bucket: i64::from(bucket),
            n,
            last_ms,
        })
        .collect();
    (buckets, histogram)
}

const SERIES_COLUMNS: &str =
    "run_id, node, rank, series, bucket_ms, width_ms, n, total, peak, peak_ms, low";
const HISTOGRAM_COLUMNS: &str = "run_id, node, rank, series, bucket, n, last_ms";

/// Adds a bucket to its row: counts and sums add up, the higher peak (the earlier of two equal
/// ones) and the lower low stay; only for runs the store has ranks of, and with `open_only`
/// only for runs not settled (a replica's samples; not the sweep's merge of stored rows).
fn add_series_sql(open_only: bool) -> String {
    let (t, e) = ("rank_series", "excluded");
    let open = if open_only {
        format!("AND NOT {}", super::bills::settled("$1"))
    } else {
        String::new()
    };
    format!(
        "INSERT INTO rank_series ({SERIES_COLUMNS}) \
         SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11 \
         WHERE EXISTS (SELECT 1 FROM run_ranks r WHERE r.run_id = $1) {open} \
         ON CONFLICT (run_id, node, rank, series, bucket_ms, width_ms) DO UPDATE SET \
           n = {t}.n + {e}.n, total = {t}.total + {e}.total, \
           peak_ms = CASE WHEN {e}.peak > {t}.peak \
             OR ({e}.peak = {t}.peak AND {e}.peak_ms < {t}.peak_ms) \
             THEN {e}.peak_ms ELSE {t}.peak_ms END, \
           peak = CASE WHEN {e}.peak > {t}.peak THEN {e}.peak ELSE {t}.peak END, \
           low = CASE WHEN {e}.low < {t}.low THEN {e}.low ELSE {t}.low END"
    )
}

impl HealthStore {
    /// Adds one replica's buckets and histogram counts to the shared rows (rows of runs the
    /// store has no ranks of, or of settled runs, are not added).
    pub async fn record_usage(
        &self,
        series: &[SeriesRow],
        histograms: &[HistogramRow],
    ) -> Result<(), StoreError> {
        if series.is_empty() && histograms.is_empty() {
            return Ok(());
        }
        let add_series = add_series_sql(true);
        let add_histogram = format!(
            "INSERT INTO rank_histogram ({HISTOGRAM_COLUMNS}) \
             SELECT $1, $2, $3, $4, $5, $6, $7 \
             WHERE EXISTS (SELECT 1 FROM run_ranks r WHERE r.run_id = $1) \
               AND NOT {} \
             ON CONFLICT (run_id, node, rank, series, bucket) DO UPDATE SET \
               n = rank_histogram.n + excluded.n, \
               last_ms = CASE WHEN excluded.last_ms > rank_histogram.last_ms \
                 THEN excluded.last_ms ELSE rank_histogram.last_ms END",
            super::bills::settled("$1")
        );
        // In key order, as `record_ranks`: two replicas lock rows in one order.
        let mut series: Vec<&SeriesRow> = series.iter().collect();
        series.sort_by(|a, b| {
            (
                &a.run_id,
                &a.node,
                a.rank,
                &a.series,
                a.bucket_ms,
                a.width_ms,
            )
                .cmp(&(
                    &b.run_id,
                    &b.node,
                    b.rank,
                    &b.series,
                    b.bucket_ms,
                    b.width_ms,
                ))
        });
        let mut histograms: Vec<&HistogramRow> = histograms.iter().collect();
        histograms.sort_by(|a, b| {
            (&a.run_id, &a.node, a.rank, &a.series, a.bucket)
                .cmp(&(&b.run_id, &b.node, b.rank, &b.series, b.bucket))
        });
        on_backend!(&self.0, |pool| {
            let mut tx = pool.begin().await?;
            for s in &series {
                bind_series(sqlx::query(&add_series), s)
                    .execute(&mut *tx)
                    .await?;
            }
            for h in &histograms {
                sqlx::query(&add_histogram)
                    .bind(&h.run_id)
                    .bind(&h.node)
                    .bind(h.rank)
                    .bind(&h.series)
                    .bind(h.bucket)
                    .bind(h.n)
                    .bind(h.last_ms)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }

    /// Every bucket of a run's series.
    pub async fn series_of_run(&self, run_id: &str) -> Result<Vec<SeriesRow>, StoreError> {
        let sql = format!(
            "SELECT {SERIES_COLUMNS} FROM rank_series WHERE run_id = $1 \
             ORDER BY rank, node, series, bucket_ms"
        );
        Ok(on_backend!(&self.0, |pool| sqlx::query_as(&sql)
            .bind(run_id)
            .fetch_all(pool)
            .await?))
    }

    /// Every histogram bucket of a run.
    pub async fn histograms_of_run(&self, run_id: &str) -> Result<Vec<HistogramRow>, StoreError> {
        let sql = format!("SELECT {HISTOGRAM_COLUMNS} FROM rank_histogram WHERE run_id = $1");
        Ok(on_backend!(&self.0, |pool| sqlx::query_as(&sql)
            .bind(run_id)
            .fetch_all(pool)
            .await?))
    }

    /// Merges the buckets of up to `limit` series holding more than `usage::POINTS` into
    /// buckets wide enough to hold the series in `POINTS`; returns the series merged. Each
    /// series in one transaction: the narrow rows are deleted as they are read (`RETURNING`),
    /// so a replica adding to one meanwhile either went into what was merged or makes a new row,
    /// merged by a later sweep; nothing is counted twice or lost.
    pub async fn compact_series(&self, limit: i64) -> Result<usize, StoreError> {
        let crowded = "SELECT run_id, node, rank, series, MIN(bucket_ms), \
             MAX(bucket_ms + width_ms) FROM rank_series \
             GROUP BY run_id, node, rank, series HAVING COUNT(*) > $1 LIMIT $2";
        let delete = format!(
            "DELETE FROM rank_series WHERE run_id = $1 AND node = $2 AND rank = $3 \
             AND series = $4 AND width_ms < $5 RETURNING {SERIES_COLUMNS}"
        );
        // Merged rows join an existing wide row as a replica's bucket would.
        let add = add_series_sql(false);
        let groups: Vec<(String, String, i64, String, i64, i64)> =
            on_backend!(&self.0, |pool| sqlx::query_as(crowded)
                .bind(usage::POINTS)
                .bind(limit)
                .fetch_all(pool)
                .await?);
        for (run_id, node, rank, series, first, end) in &groups {
            let width = usage::width_for(*first, *end);
            on_backend!(&self.0, |pool| {
                let mut tx = pool.begin().await?;
                let narrow: Vec<SeriesRow> = sqlx::query_as(&delete)
                    .bind(run_id)
                    .bind(node)
                    .bind(rank)
                    .bind(series)
                    .bind(width)
                    .fetch_all(&mut *tx)
                    .await?;
                let merged = usage::rebucket(
                    narrow.iter().map(|r| (r.bucket_ms, r.width_ms, r.bucket())),
                    width,
                );
                for (start, bucket) in merged {
                    let row = SeriesRow::new((run_id, node, *rank, series), start, width, &bucket);
                    bind_series(sqlx::query(&add), &row)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
            });
        }
        Ok(groups.len())
    }

    /// Rows of the report's tables: (series buckets, histogram buckets), all runs.
    pub async fn usage_rows(&self) -> Result<(i64, i64), StoreError> {
        let count = |table: &'static str| format!("SELECT COUNT(*) FROM {table}");
        let (series, histogram) = (count("rank_series"), count("rank_histogram"));
        Ok(on_backend!(&self.0, |pool| (
            sqlx::query_scalar(&series).fetch_one(pool).await?,
            sqlx::query_scalar(&histogram).fetch_one(pool).await?,
        )))
    }
}

fn bind_series<'q, DB: sqlx::Database>(
    query: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>,
    row: &'q SeriesRow,
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>
where
    String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    f64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    query
        .bind(&row.run_id)
        .bind(&row.node)
        .bind(row.rank)
        .bind(&row.series)
        .bind(row.bucket_ms)
        .bind(row.width_ms)
        .bind(row.n)
        .bind(row.total)
        .bind(row.peak)
        .bind(row.peak_ms)
        .bind(row.low)
}

/// The series of a run by (node, rank, series), each merged into at most `usage::POINTS`
/// buckets of one width.
pub fn by_rank(rows: &[SeriesRow]) -> usage::RunSeries {
    let mut grouped: std::collections::BTreeMap<(String, i64, Series), Vec<&SeriesRow>> =
        Default::default();
    for row in rows {
        if let Some(series) = Series::parse(&row.series) {
            grouped
                .entry((row.node.clone(), row.rank, series))
                .or_default()
                .push(row);
        }
    }
    grouped
        .into_iter()
        .map(|(key, rows)| {
            let first = rows.iter().map(|r| r.bucket_ms).min().unwrap_or(0);
            let end = rows
                .iter()
                .map(|r| r.bucket_ms + r.width_ms)
                .max()
                .unwrap_or(0);
            let widest = rows
                .iter()
                .map(|r| r.width_ms)
                .max()
                .unwrap_or(usage::BASE_WIDTH_MS);
            let width = usage::width_for(first, end).max(widest);
            let merged = usage::rebucket(
                rows.iter().map(|r| (r.bucket_ms, r.width_ms, r.bucket())),
                width,
            );
            (key, (width, merged))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capabilities::health::store::{beat, opened, RankRow};
    use crate::capabilities::health::usage::{Gathered, BASE_WIDTH_MS, POINTS};

    fn rows_of(run: &str, rank: i64, g: &Gathered) -> (Vec<SeriesRow>, Vec<HistogramRow>) {
        super::rows_of((run, "n1", rank), Series::Memory, g)
    }

    #[tokio::test]
    async fn two_replicas_samples_add_up_stay_bounded_and_keep_their_peak() {
        let dir = tempfile::tempdir().unwrap();
        let store = opened(&dir).await;
        store.record_ranks(&[beat("r", 0, 0, 0)]).await.unwrap();
        // An hour at a sample a second, alternately heard by two replicas; the peak at 1234 s.
        let (mut a, mut b) = (Gathered::default(), Gathered::default());
        let value = |t: i64| {
            if t == 1_234 {
                5_000.0
            } else {
                1_000.0 + (t % 100) as f64
            }
        };
        for t in 0..3_600i64 {
            let g = if t % 2 == 0 { &mut a } else { &mut b };
            g.add(Series::Memory, t * 1_000, value(t));
        }
        for g in [&a, &b] {
            let (series, histograms) = rows_of("r", 0, g);
            store.record_usage(&series, &histograms).await.unwrap();
        }
        // Samples of a run the store has no ranks of are not kept.
        let (series, histograms) = rows_of("unknown", 0, &a);
        store.record_usage(&series, &histograms).await.unwrap();
        assert!(store.series_of_run("unknown").await.unwrap().is_empty());
        // Each replica gathered 1,800 samples 2 s apart, more buckets than it keeps between
        // flushes: 4 s buckets, which the two replicas' samples share.
        assert_eq!(
            (a.width_ms, b.width_ms),
            (4 * BASE_WIDTH_MS, 4 * BASE_WIDTH_MS)
        );
        assert_eq!(store.series_of_run("r").await.unwrap().len(), 900);

        assert_eq!(store.compact_series(10).await.unwrap(), 1);
        let rows = store.series_of_run("r").await.unwrap();
        assert!(rows.len() as i64 <= POINTS, "{}", rows.len());
        let merged = by_rank(&rows);
        let (_, buckets) = &merged[&("n1".to_owned(), 0, Series::Memory)];
        let n: i64 = buckets.values().map(|b| b.n).sum();
        let total: f64 = buckets.values().map(|b| b.total).sum();
        let exact: f64 = (0..3_600).map(value).sum();
        assert_eq!(n, 3_600);
        assert!((total - exact).abs() < 1e-6);
        let top = buckets
            .values()
            .max_by(|x, y| x.peak.total_cmp(&y.peak))
            .unwrap();
        assert_eq!((top.peak, top.peak_ms), (5_000.0, 1_234_000));
        // A replica's late sample lands beside the merged rows and is read with them.
        let mut late = Gathered::default();
        late.add(Series::Memory, 3_600_500, 6_000.0);
        let (series, _) = rows_of("r", 0, &late);
        store.record_usage(&series, &[]).await.unwrap();
        let merged = by_rank(&store.series_of_run("r").await.unwrap());
        let (_, buckets) = &merged[&("n1".to_owned(), 0, Series::Memory)];
        assert_eq!(buckets.values().map(|b| b.n).sum::<i64>(), 3_601);
        // The histogram counts every sample once, from both replicas.
        let histogram = store.histograms_of_run("r").await.unwrap();
        assert_eq!(histogram.iter().map(|h| h.n).sum::<i64>(), 3_600);
        assert_eq!(store.usage_rows().await.unwrap().1, histogram.len() as i64);
    }

    /// What the store holds of a run's usage and sampled spans.
    async fn held(store: &HealthStore, run: &str) -> (i64, f64, i64, Option<(i64, i64)>) {
        let series = store.series_of_run(run).await.unwrap();
        let histogram = store.histograms_of_run(run).await.unwrap();
        let ranks = store.ranks_of_run(run).await.unwrap();
        (
            series.iter().map(|r| r.n).sum(),
            series.iter().map(|r| r.peak).fold(0.0, f64::max),
            histogram.iter().map(|h| h.n).sum(),
            ranks[0].bill_first_ms.zip(ranks[0].bill_last_ms),
        )
    }

    /// Samples heard of a run once its bill is claimed (a rank that samples on after the run
    /// failed, a replica's late flush) leave its usage and spans as the bill and the report read
    /// them; a run its client resumed takes them again.
    #[tokio::test]
    async fn a_settled_runs_usage_and_spans_stay_as_billed_until_it_is_resumed() {
        let dir = tempfile::tempdir().unwrap();
        let store = opened(&dir).await;
        // A replica's flush of rank 0 sampled every second from `from` to `to` s at `value` MB.
        let hear = async |from: i64, to: i64, value: f64| {
            let mut g = Gathered::default();
            for t in from..to {
                g.add(Series::Memory, t * 1_000, value);
            }
            let (series, histograms) = rows_of("r", 0, &g);
            let rank = RankRow {
                bill_first_ms: Some(from * 1_000),
                bill_last_ms: Some(to * 1_000),
                ..beat("r", 0, from * 1_000, to * 1_000)
            };
            store.record_ranks(&[rank]).await.unwrap();
            store.record_usage(&series, &histograms).await.unwrap();
        };
        hear(0, 250, 100.0).await;
        // Ended: its bill is queued, due once the replicas have flushed; what they flush until
        // then counts.
        store
            .queue_bill("r", "FAILED", Some(300_000), 310_000)
            .await
            .unwrap();
        hear(250, 300, 100.0).await;
        let billed = held(&store, "r").await;
        assert_eq!(billed, (300, 100.0, 300, Some((0, 300_000))));

        // Claimed by a replica, which bills it and writes its report: later samples do not count.
        assert!(store.claim_bill("r", "a", 310_000, 1).await.unwrap());
        hear(300, 330, 900.0).await;
        assert_eq!(held(&store, "r").await, billed);
        assert!(store.finish_bill("r", "a", 0.0, 0.0).await.unwrap());
        hear(330, 360, 900.0).await;
        assert_eq!(held(&store, "r").await, billed);
        // The sweep still merges its stored rows (more than it keeps), losing nothing.
        assert_eq!(store.compact_series(10).await.unwrap(), 1);
        let rows = store.series_of_run("r").await.unwrap();
        assert!(rows.len() as i64 <= POINTS, "{}", rows.len());
        assert_eq!(held(&store, "r").await, billed);

        // Resumed by its client: live again, its samples count.
        store.reopen_run("r", 365_000).await.unwrap();
        hear(365, 370, 900.0).await;
        assert_eq!(
            held(&store, "r").await,
            (305, 900.0, 305, Some((0, 370_000)))
        );
    }
}
