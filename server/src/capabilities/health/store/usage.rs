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

const SERIES_COLUMNS: &str =
    "run_id, node, rank, series, bucket_ms, width_ms, n, total, peak, peak_ms, low";
const HISTOGRAM_COLUMNS: &str = "run_id, node, rank, series, bucket, n, last_ms";

/// Adds a bucket to its row: counts and sums add up, the higher peak (the earlier of two equal
/// ones) and the lower low stay; only for runs the store has ranks of.
fn add_series_sql() -> String {
    let (t, e) = ("rank_series", "excluded");
    format!(
        "INSERT INTO rank_series ({SERIES_COLUMNS}) \
         SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11 \
         WHERE EXISTS (SELECT 1 FROM run_ranks r WHERE r.run_id = $1) \
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
    /// store has no ranks of are not added).
    pub async fn record_usage(
        &self,
        series: &[SeriesRow],
        histograms: &[HistogramRow],
    ) -> Result<(), StoreError> {
        if series.is_empty() && histograms.is_empty() {
            return Ok(());
        }
        let add_series = add_series_sql();
        let add_histogram = format!(
            "INSERT INTO rank_histogram ({HISTOGRAM_COLUMNS}) \
             SELECT $1, $2, $3, $4, $5, $6, $7 \
             WHERE EXISTS (SELECT 1 FROM run_ranks r WHERE r.run_id = $1) \
             ON CONFLICT (run_id, node, rank, series, bucket) DO UPDATE SET \
               n = rank_histogram.n + excluded.n, \
               last_ms = CASE WHEN excluded.last_ms > rank_histogram.last_ms \
                 THEN excluded.last_ms ELSE rank_histogram.last_ms END"
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
        let add = add_series_sql();
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
                    let row = SeriesRow {
                        run_id: run_id.clone(),
                        node: node.clone(),
                        rank: *rank,
                        series: series.clone(),
                        bucket_ms: start,
                        width_ms: width,
                        n: bucket.n,
                        total: bucket.total,
                        peak: bucket.peak,
                        peak_ms: bucket.peak_ms,
                        low: bucket.low,
                    };
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
