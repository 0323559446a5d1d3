//! The proxy's own state in SQL: SQLite by default (one file, zero setup), PostgreSQL when several
//! replicas share state behind a gateway. Migrations live in the top-level `migrations/` folder
//! and run at startup; they, and every statement here, are written in the SQL both dialects
//! share (`$n` placeholders, `ON CONFLICT`, `RETURNING`, `CASE`), so there is one copy of each.
//!
//! Here: the connection, the replica rows, node and work leases, upload-failure counts and the
//! retention sweep. A capability whose rows are its own keeps their statements beside it (run
//! health: `health::store`), on this [`Store`] with [`on_backend!`].

/// Runs one query on whichever backend the store has.
macro_rules! on_backend {
    ($store:expr, |$pool:ident| $body:expr) => {
        match $store {
            $crate::plumbing::store::Store::Sqlite($pool) => $body,
            $crate::plumbing::store::Store::Postgres($pool) => $body,
        }
    };
}
pub(crate) use on_backend;

mod failures;
mod leases;
mod retention;

pub use leases::NodeLease;
pub(crate) use retention::cutoff;
pub use retention::Swept;

use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database url {0:?}: use sqlite://<path> or postgres://user@host/db")]
    UnsupportedUrl(String),
    #[error("cannot open the state store ({backend}): {source}")]
    Connect {
        backend: &'static str,
        source: sqlx::Error,
    },
    #[error("cannot migrate the state store ({backend}): {source}")]
    Migrate {
        backend: &'static str,
        source: sqlx::migrate::MigrateError,
    },
    #[error("state store query failed: {0}")]
    Query(#[from] sqlx::Error),
}

/// A parsed `--database-url`, checked at config time so a typo fails before anything starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    Sqlite(String),
    Postgres(String),
}

impl StoreUrl {
    pub fn parse(url: &str) -> Result<Self, StoreError> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Self::Postgres(url.to_owned()))
        } else if url.starts_with("sqlite:") {
            Ok(Self::Sqlite(url.to_owned()))
        } else {
            Err(StoreError::UnsupportedUrl(url.to_owned()))
        }
    }
}

/// Which store to open and how long its rows are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    pub database_url: String,
    /// Rows untouched this long (leases, upload-failure counts, replicas) are deleted by the
    /// retention sweep.
    pub state_retention: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            database_url: "sqlite://mlscope.db".to_owned(),
            state_retention: Duration::from_secs(14 * 86_400),
        }
    }
}

impl StoreConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.state_retention < Duration::from_secs(3600) {
            return Err(
                "state-retention must be at least 1h (leases of live runs must never expire)"
                    .into(),
            );
        }
        StoreUrl::parse(&self.database_url).map_err(|e| e.to_string())?;
        Ok(())
    }
}

/// The store's settings as given (see [`crate::plumbing::settings`]); `None`: not given here.
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
pub struct StoreOptions {
    /// State store: `sqlite://<path>` (created on first start) or `postgres://...` when several
    /// replicas share state [default: sqlite://mlscope.db].
    #[arg(long, env = "MLSCOPE_DATABASE_URL", value_name = "URL")]
    pub database_url: Option<String>,
    /// State-store rows untouched this long (node leases, upload-failure counts, replica rows)
    /// are deleted; keep it above the longest pause of a run that may resume [default: 14d].
    #[arg(long, env = "MLSCOPE_STATE_RETENTION", value_parser = crate::plumbing::settings::parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub state_retention: Option<Duration>,
}

impl StoreOptions {
    /// The given values over the defaults.
    pub fn resolve(self) -> StoreConfig {
        let d = StoreConfig::default();
        StoreConfig {
            database_url: self.database_url.unwrap_or(d.database_url),
            state_retention: self.state_retention.unwrap_or(d.state_retention),
        }
    }
}

/// The state store, one variant per backend. Queries that differ between dialects are written
/// once per variant; everything else goes through the shared methods below.
#[derive(Debug, Clone)]
pub enum Store {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

/// Longest wait for a pooled connection, a lock (SQLite's busy timeout) or a statement
/// (PostgreSQL's `statement_timeout`).
pub const SQL_TIMEOUT: Duration = Duration::from_secs(5);

impl Store {
    /// Opens (creating an SQLite file when needed) and migrates the store. Every acquire and
    /// statement is bounded by [`SQL_TIMEOUT`].
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        let store = match StoreUrl::parse(url)? {
            StoreUrl::Sqlite(url) => {
                let options = SqliteConnectOptions::from_str(&url)
                    .map_err(|source| StoreError::Connect {
                        backend: "sqlite",
                        source,
                    })?
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Normal)
                    .busy_timeout(SQL_TIMEOUT);
                let pool = SqlitePoolOptions::new()
                    .max_connections(4)
                    .acquire_timeout(SQL_TIMEOUT)
                    .connect_with(options)
                    .await
                    .map_err(|source| StoreError::Connect {
                        backend: "sqlite",
                        source,
                    })?;
                sqlx::migrate!("../migrations")
                    .run(&pool)
                    .await
                    .map_err(|source| StoreError::Migrate {
                        backend: "sqlite",
                        source,
                    })?;
                Store::Sqlite(pool)
            }
            StoreUrl::Postgres(url) => {
                // Every statement is bounded on the server too, so a stuck lock never holds a
                // request (or a pool connection) longer than SQL_TIMEOUT.
                let options = PgConnectOptions::from_str(&url)
                    .map_err(|source| StoreError::Connect {
                        backend: "postgres",
                        source,
                    })?
                    .options([("statement_timeout", SQL_TIMEOUT.as_millis().to_string())]);
                let pool = PgPoolOptions::new()
                    .max_connections(8)
                    .acquire_timeout(SQL_TIMEOUT)
                    .connect_with(options)
                    .await
                    .map_err(|source| StoreError::Connect {
                        backend: "postgres",
                        source,
                    })?;
                sqlx::migrate!("../migrations")
                    .run(&pool)
                    .await
                    .map_err(|source| StoreError::Migrate {
                        backend: "postgres",
                        source,
                    })?;
                Store::Postgres(pool)
            }
        };
        Ok(store)
    }

    pub fn backend(&self) -> &'static str {
        match self {
            Store::Sqlite(_) => "sqlite",
            Store::Postgres(_) => "postgres",
        }
    }

    /// Records this replica as alive. Doubles as the readiness write check: a store that cannot
    /// take this write cannot take lease updates either.
    pub async fn refresh_replica(&self, replica: &Replica) -> Result<(), StoreError> {
        let now = unix_millis(SystemTime::now());
        let sql = "INSERT INTO proxy_replicas (replica_id, version, started_at, last_seen_at) \
                   VALUES ($1, $2, $3, $4) \
                   ON CONFLICT (replica_id) DO UPDATE SET last_seen_at = excluded.last_seen_at";
        on_backend!(self, |pool| sqlx::query(sql)
            .bind(&replica.id)
            .bind(&replica.version)
            .bind(replica.started_at_ms)
            .bind(now)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(())
    }

    /// Replicas seen within `window`, newest first.
    pub async fn live_replicas(&self, window: Duration) -> Result<Vec<String>, StoreError> {
        let since = unix_millis(SystemTime::now()) - window.as_millis() as i64;
        let sql = "SELECT replica_id FROM proxy_replicas WHERE last_seen_at >= $1 ORDER BY last_seen_at DESC";
        Ok(on_backend!(self, |pool| sqlx::query_scalar(sql)
            .bind(since)
            .fetch_all(pool)
            .await?))
    }

    pub async fn close(&self) {
        on_backend!(self, |pool| pool.close().await)
    }
}

/// This process, as the store knows it.
#[derive(Debug, Clone)]
pub struct Replica {
    pub id: String,
    pub version: String,
    pub started_at_ms: i64,
}

impl Replica {
    pub fn new() -> Self {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        Self {
            id: format!("{}-{}", host.trim(), uuid::Uuid::new_v4().simple()),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            started_at_ms: unix_millis(SystemTime::now()),
        }
    }
}

impl Default for Replica {
    fn default() -> Self {
        Self::new()
    }
}

pub(crate) fn unix_millis(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A database of its own on the PostgreSQL server the project's CI starts
/// (`MLSCOPE_TEST_POSTGRES_URL`, by default 127.0.0.1:5432 with trust auth), for the store's
/// tests; [`TestDatabase::drop`] removes it.
#[cfg(test)]
pub(crate) struct TestDatabase {
    admin: PgPool,
    name: String,
    pub(crate) url: String,
}

#[cfg(test)]
impl TestDatabase {
    pub(crate) async fn create() -> TestDatabase {
        let admin_url = std::env::var("MLSCOPE_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let admin = PgPool::connect(&admin_url).await.expect(
            "PostgreSQL at MLSCOPE_TEST_POSTGRES_URL (default 127.0.0.1:5432) must be running",
        );
        let name = format!("mlscope_test_{}", uuid::Uuid::new_v4().simple());
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await
            .unwrap();
        let url = format!("{}/{name}", admin_url.rsplit_once('/').unwrap().0);
        TestDatabase { admin, name, url }
    }

    pub(crate) async fn drop(self) {
        sqlx::query(&format!("DROP DATABASE {} WITH (FORCE)", self.name))
            .execute(&self.admin)
            .await
            .unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sqlite_store_is_created_migrated_and_lists_live_replicas() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/state.db", dir.path().display());
        let store = Store::open(&url).await.unwrap();
        let replica = Replica::new();
        store.refresh_replica(&replica).await.unwrap();
        store.refresh_replica(&replica).await.unwrap();
        assert_eq!(
            store.live_replicas(Duration::from_secs(60)).await.unwrap(),
            vec![replica.id.clone()]
        );
        store.close().await;
        // Reopening runs the migrations again without error and keeps the rows.
        let store = Store::open(&url).await.unwrap();
        assert_eq!(
            store
                .live_replicas(Duration::from_secs(60))
                .await
                .unwrap()
                .len(),
            1
        );
        store.close().await;
    }

    /// Runs against the PostgreSQL server the project's CI starts (127.0.0.1:5432, trust auth),
    /// in a database of its own that it drops afterwards.
    #[tokio::test]
    async fn postgres_store_is_migrated_once_and_shared_by_two_replicas() {
        let db = TestDatabase::create().await;
        let url = db.url.clone();

        let (a, b) = tokio::join!(Store::open(&url), Store::open(&url));
        let (a, b) = (a.unwrap(), b.unwrap());
        let (ra, rb) = (Replica::new(), Replica::new());
        a.refresh_replica(&ra).await.unwrap();
        b.refresh_replica(&rb).await.unwrap();
        let mut live = a.live_replicas(Duration::from_secs(60)).await.unwrap();
        live.sort();
        let mut expected = vec![ra.id.clone(), rb.id.clone()];
        expected.sort();
        assert_eq!(live, expected);
        a.close().await;
        b.close().await;
        db.drop().await;
    }

    #[test]
    fn unknown_database_schemes_are_refused() {
        assert!(StoreUrl::parse("mysql://localhost/x").is_err());
        assert_eq!(
            StoreUrl::parse("sqlite://a.db").unwrap(),
            StoreUrl::Sqlite("sqlite://a.db".into())
        );
    }
}
