//! Counts of failed artifact uploads per run.

use std::time::SystemTime;

use super::{unix_millis, Store, StoreError};

impl Store {
    /// Adds one failure for `run_id` and returns the run's new count.
    pub async fn record_upload_failure(
        &self,
        run_id: &str,
        path: &str,
        error: &str,
    ) -> Result<i64, StoreError> {
        let sql = "INSERT INTO artifact_upload_failures (run_id, failures, last_error, last_path, updated_at) \
                   VALUES ($1, 1, $2, $3, $4) \
                   ON CONFLICT (run_id) DO UPDATE SET failures = artifact_upload_failures.failures + 1, \
                   last_error = excluded.last_error, last_path = excluded.last_path, updated_at = excluded.updated_at \
                   RETURNING failures";
        let now = unix_millis(SystemTime::now());
        let count: (i64,) = on_backend!(self, |pool| sqlx::query_as(sql)
            .bind(run_id)
            .bind(error)
            .bind(path)
            .bind(now)
            .fetch_one(pool)
            .await?);
        Ok(count.0)
    }
}
