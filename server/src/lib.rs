//! mlscope-proxy: an MLflow-compatible reverse proxy, built in three floors that look only down.
//!
//! **Plumbing** knows no capability and no configuration:
//! - [`proxy`] forwards every MLflow route, streaming, with pooled upstream connections (and owns
//!   its settings: the upstream, the `Host` policy, the timeouts);
//! - [`mlflow`] is the typed MLflow client every call of the proxy's own goes through (as nobody,
//!   the service credential or a client's own credentials, in a workspace), with one error type;
//! - [`route`] classifies requests (route classes for metrics and logs, reads and writes);
//! - [`store`] keeps the proxy's own state in SQLite or PostgreSQL;
//! - [`telemetry`] sets up logging and holds the Prometheus registry (the request metrics; each
//!   component registers its own families into it when it is built); [`error`] is the one error
//!   type, `Error`, whose kind decides the status and MLflow's error JSON of every answer the proxy
//!   gives itself;
//! - [`credential`] holds secrets, service credentials and client fingerprints; [`client`] says
//!   which client a request comes from; [`identity`] reads the collector's identity headers;
//! - [`writes`] reads MLflow's write bodies (`log-batch`, `log-metric`, `log-parameter`,
//!   `set-tag`) the way MLflow's parser does; [`upstream`] learns MLflow's version;
//!   [`workspace`] reads MLflow workspaces; [`listen`] binds listeners; [`layers`] are the
//!   cross-cutting layers every route gets;
//! - [`settings`] says how a component declares its settings, and how durations, sizes and times
//!   are written in flags and in the file.
//!
//! **Capabilities** use plumbing, and one another only through a named seam ([`floors`] lists
//! them):
//! - the metric routes: [`rewrite`] (the scope contract), [`dedup`] (one reporter per node) and
//!   [`coalesce`] (merged writes per run);
//! - [`artifacts`], the gateway on an S3-compatible store; [`health`], heartbeats and the
//!   stale-run sweep, the GPU bill (a house of its own: its rows and SQL in `health::store`, its
//!   metrics beside it); [`fairshare`], each client's share of MLflow's writes;
//! - [`authz`], the seam every capability that acts for a client uses: it asks MLflow, with the
//!   client's credentials, whether what the proxy does itself is allowed;
//! - every run tag the proxy writes (run health's verdicts, GPU bill and idle GPUs, the gateway's
//!   upload failures) goes through [`coalesce`], so it joins the run's write queue.
//!
//! Every component owns its settings: one `*Options` struct in its module (a flag, its
//! environment variable and a key of the config file per field), turned into its settings with
//! its own defaults and checked by its own `validate`.
//!
//! **The shell** composes them: [`config`] gathers every component's options into the command
//! line and the file and layers them (flag, environment, file, default), [`state`] builds the
//! components, [`app`] is the route table (which requests a capability answers, with [`layers`]
//! around every route and forwarding as the fallback) and runs until shutdown, [`serve`] accepts
//! connections (and owns the listeners' settings), [`admin`] serves `/healthz`, `/readyz` and
//! `/metrics`, and [`relocate`] is a tool (not on the request path) that copies stray objects into a run.
//!
//! Modules another crate of the workspace uses (the binary, the integration tests, the load
//! tests) are `pub`; every other module is `pub(crate)`, and the `unreachable_pub` lint keeps
//! items inside them from claiming more.

pub(crate) mod admin;
pub(crate) mod aged;
pub(crate) mod app;
pub mod artifacts;
pub(crate) mod authz;
pub(crate) mod client;
pub mod coalesce;
pub mod config;
pub(crate) mod credential;
pub(crate) mod dedup;
pub(crate) mod error;
pub(crate) mod fairshare;
pub mod health;
pub(crate) mod identity;
pub(crate) mod layers;
pub(crate) mod listen;
pub(crate) mod metric_routes;
pub(crate) mod mlflow;
pub mod proxy;
pub mod relocate;
pub mod rewrite;
pub(crate) mod route;
pub(crate) mod serve;
pub(crate) mod settings;
pub(crate) mod state;

#[cfg(test)]
mod fuzz;
pub mod store;
pub mod telemetry;
pub(crate) mod upstream;
pub(crate) mod workspace;
pub(crate) mod writes;

#[cfg(test)]
mod floors;

pub use app::{app, run};
pub use config::Config;
pub use state::AppState;
