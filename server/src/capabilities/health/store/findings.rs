//! `run_findings`: what a run's collectors reported about what it stood on (see
//! [`crate::capabilities::health::findings`]), bounded per run.

use super::HealthStore;
use crate::plumbing::store::{on_backend, StoreError};

/// The rows of one run the store keeps, the newest.
pub const MAX_FINDINGS_PER_RUN: i64 = 64;

/// A `run_findings` row.
#[derive(Debug, Clone, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct FindingRow {
    pub run_id: String,
    pub node: String,
    pub rank: i64,
    pub kind: String,
    pub subject: String,
    pub detail: String,
    pub heard_ms: i64,
}

const FINDING_COLUMNS: &str = "run_id, node, rank, kind, subject, detail, heard_ms";

impl HealthStore {
    /// Stores reports as heard, in one transaction; a report already stored (a collector's
    /// retry, or another replica that heard it) is kept as first heard. Returns, per row,
    /// whether it was new. Each run touched keeps its newest [`MAX_FINDINGS_PER_RUN`] rows.
    pub async fn record_findings(&self, rows: &[FindingRow]) -> Result<Vec<bool>, StoreError> {
        let insert = format!(
            "INSERT INTO run_findings ({FINDING_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7) \
             ON CONFLICT (run_id, node, rank, kind, subject, detail) DO NOTHING"
        );
        let trim = "DELETE FROM run_findings WHERE run_id = $1 AND \
             (node, rank, kind, subject, detail) NOT IN \
             (SELECT node, rank, kind, subject, detail FROM run_findings WHERE run_id = $1 \
              ORDER BY heard_ms DESC, kind, subject, detail, node, rank LIMIT $2)";
        let mut runs: Vec<&str> = rows.iter().map(|r| r.run_id.as_str()).collect();
        runs.sort_unstable();
        runs.dedup();
        let mut inserted = Vec::with_capacity(rows.len());
        on_backend!(&self.0, |pool| {
            let mut tx = pool.begin().await?;
            for row in rows {
                let affected = sqlx::query(&insert)
                    .bind(&row.run_id)
                    .bind(&row.node)
                    .bind(row.rank)
                    .bind(&row.kind)
                    .bind(&row.subject)
                    .bind(&row.detail)
                    .bind(row.heard_ms)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                inserted.push(affected == 1);
            }
            for run_id in runs {
                sqlx::query(trim)
                    .bind(run_id)
                    .bind(MAX_FINDINGS_PER_RUN)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
        });
        Ok(inserted)
    }

    /// A run's reports, oldest first.
    pub async fn findings_of_run(&self, run_id: &str) -> Result<Vec<FindingRow>, StoreError> {
        let sql = format!(
            "SELECT {FINDING_COLUMNS} FROM run_findings WHERE run_id = $1 \
             ORDER BY heard_ms, kind, subject, detail, node, rank"
        );
        Ok(on_backend!(&self.0, |pool| sqlx::query_as(&sql)
            .bind(run_id)
            .fetch_all(pool)
            .await?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(run: &str, detail: &str, heard_ms: i64) -> FindingRow {
        FindingRow {
            run_id: run.into(),
            node: "n1".into(),
            rank: 0,
            kind: "data_changed".into(),
            subject: "val".into(),
            detail: detail.into(),
            heard_ms,
        }
    }

    async fn a_report_heard_twice_is_one_row_and_a_run_keeps_its_newest(store: &HealthStore) {
        let first = store
            .record_findings(&[row("r", "a", 1), row("r", "a", 2), row("s", "a", 1)])
            .await
            .unwrap();
        assert_eq!(first, [true, false, true]);
        assert_eq!(
            store.findings_of_run("r").await.unwrap(),
            [row("r", "a", 1)]
        );

        let many: Vec<FindingRow> = (0..100)
            .map(|i| row("r", &format!("change {i}"), 10 + i))
            .collect();
        store.record_findings(&many).await.unwrap();
        let kept = store.findings_of_run("r").await.unwrap();
        assert_eq!(kept.len(), MAX_FINDINGS_PER_RUN as usize);
        assert_eq!(kept.first().unwrap().detail, "change 36");
        assert_eq!(kept.last().unwrap().detail, "change 99");
        // Another run's rows are not its to trim.
        assert_eq!(store.findings_of_run("s").await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn findings_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::capabilities::health::store::opened(&dir).await;
        a_report_heard_twice_is_one_row_and_a_run_keeps_its_newest(&store).await;
    }

    #[tokio::test]
    async fn findings_on_postgres() {
        let database = crate::plumbing::store::TestDatabase::create().await;
        let store = HealthStore::new(
            crate::plumbing::store::Store::open(&database.url)
                .await
                .unwrap(),
        );
        a_report_heard_twice_is_one_row_and_a_run_keeps_its_newest(&store).await;
        store.0.close().await;
        database.drop().await;
    }
}
