//! The proxy's own state in SQL: SQLite by default (one file, zero setup), PostgreSQL when several
//! replicas share state behind a gateway. Migrations live in the top-level `migrations/` folder
//! and run at startup; they, and every statement here, are written in the SQL both dialects
//! share (`$n` placeholders, `ON CONFLICT`, `RETURNING`, `CASE`), so there is one copy of each.
//!
//! Here: the connection, the replica rows, node and work leases, upload-failure counts and the
//! retention sweep. A capability whose rows are its own keeps their statements beside it (run
//! health: `health::store`), on this [`Store`] with [`on_backend!`].

/// Runs one query on whichever backend the store has, in the context of the store's runtime
/// (see [`Store::at_home`]); a [`StoreError`] (`?` in the body) ends the caller with it.
macro_rules! on_backend {
    ($store:expr, |$pool:ident| $body:expr) => {{
        let store: &$crate::plumbing::store::Store = $store;
        store
            .at_home(async {
                Ok::<_, $crate::plumbing::store::StoreError>(match store.pools() {
                    $crate::plumbing::store::Pools::Sqlite($pool) => $body,
                    $crate::plumbing::store::Pools::Postgres($pool) => $body,
                })
            })
            .await?
    }};
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

/// The state store: its connection pool and the runtime that drives the pool's connections.
#[derive(Debug, Clone)]
pub struct Store {
    pools: Pools,
    /// The runtime the store was opened on (the main runtime). Every query runs in its context,
    /// so whichever thread asks, a connection is opened, driven and handed back there: a serving
    /// thread busy with a large body never holds up a query on a connection it happened to open.
    home: tokio::runtime::Handle,
}

/// The pool, one variant per backend. Queries that differ between dialects are written once per
/// variant; everything else goes through the shared methods below.
#[derive(Debug, Clone)]
pub(crate) enum Pools {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

pin_project_lite::pin_project! {
    /// A future polled in the context of the store's home runtime: the I/O it registers, the
    /// timers it arms and the tasks it spawns belong to that runtime, while the future itself
    /// stays on the task that awaits it.
    pub(crate) struct AtHome<'a, F> {
        home: &'a tokio::runtime::Handle,
        #[pin]
        future: F,
    }
}

impl<F: std::future::Future> std::future::Future for AtHome<'_, F> {
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = self.project();
        let _home = this.home.enter();
        this.future.poll(cx)
    }
}

/// Longest wait for a pooled connection, a lock (SQLite's busy timeout) or a statement
/// (PostgreSQL's `statement_timeout`).
pub const SQL_TIMEOUT: Duration = Duration::from_secs(5);

impl Store {
    /// Opens (creating an SQLite file when needed) and migrates the store. Every acquire and
    /// statement is bounded by [`SQL_TIMEOUT`].
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        let pools = match StoreUrl::parse(url)? {
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
                Pools::Sqlite(pool)
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
                Pools::Postgres(pool)
            }
        };
        Ok(Store {
            pools,
            home: tokio::runtime::Handle::current(),
        })
    }

    pub fn backend(&self) -> &'static str {
        match self.pools {
            Pools::Sqlite(_) => "sqlite",
            Pools::Postgres(_) => "postgres",
        }
    }

    pub(crate) fn pools(&self) -> &Pools {
        &self.pools
    }

    /// `future`, polled in the context of the runtime the store was opened on (`home`).
    pub(crate) fn at_home<F: std::future::Future>(&self, future: F) -> AtHome<'_, F> {
        AtHome {
            home: &self.home,
            future,
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
        self.at_home(async {
            match &self.pools {
                Pools::Sqlite(pool) => pool.close().await,
                Pools::Postgres(pool) => pool.close().await,
            }
        })
        .await
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

    /// Eight queries at once on `store`, each holding its connection a moment: the pool grows
    /// to all its connections.
    async fn fill_the_pool(store: &Store) {
        let queries = (0..8).map(|_| async {
            on_backend!(store, |pool| sqlx::query("SELECT pg_sleep(0.05)")
                .execute(pool)
                .await?
                .rows_affected());
            Ok::<_, StoreError>(())
        });
        for done in futures_util::future::join_all(queries).await {
            done.unwrap();
        }
    }

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A serving thread runs a runtime of its own. The connections a query asked on it opens
    /// must not depend on that thread: when it is busy (here: stopped outright), the other
    /// threads' queries on those connections still complete. PostgreSQL, because a SQLite
    /// connection has a thread of its own anyway.
    #[test]
    fn connections_opened_for_a_stopped_thread_keep_serving_the_others() {
        let home = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let db = home.block_on(TestDatabase::create());
        let store = home.block_on(Store::open(&db.url)).unwrap();

        let (grown, has_grown) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let stopped = std::thread::spawn({
            let store = store.clone();
            move || {
                let runtime = current_thread();
                runtime.block_on(fill_the_pool(&store));
                grown.send(()).unwrap();
                // The runtime is kept but nothing polls it: a thread held up by other work.
                released.recv().unwrap();
                drop(runtime);
            }
        });
        has_grown.recv().unwrap();

        let (done, is_done) = std::sync::mpsc::channel();
        let other = std::thread::spawn({
            let store = store.clone();
            move || {
                current_thread().block_on(fill_the_pool(&store));
                done.send(()).unwrap();
            }
        });
        // Bounded only so that a failure ends: the queries take a fraction of a second.
        let finished = is_done.recv_timeout(Duration::from_secs(60));
        release.send(()).unwrap();
        assert!(
            finished.is_ok(),
            "queries on connections opened for a stopped thread waited for that thread"
        );
        stopped.join().unwrap();
        other.join().unwrap();
        home.block_on(async {
            store.close().await;
            db.drop().await;
        });
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
