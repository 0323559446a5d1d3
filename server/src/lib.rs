//! mlscope-proxy: an MLflow-compatible reverse proxy.
//!
//! - [`proxy`] forwards every MLflow route, streaming, with pooled upstream connections;
//! - [`store`] keeps the proxy's own state in SQLite or PostgreSQL;
//! - [`admin`] serves `/healthz`, `/readyz` and `/metrics` on their own listener;
//! - [`listen`] reads the listeners' `HOST:PORT` addresses and binds them at startup;
//! - [`app`] is the route table: which requests [`rewrite`] and [`artifacts`] answer, with
//!   [`layers`] around every route and forwarding as the fallback; it runs until shutdown;
//! - [`authz`] asks MLflow, with the client's credentials, whether what the proxy does itself is
//!   allowed;
//! - [`writes`] reads MLflow's write bodies (`log-batch`, `log-metric`, `log-parameter`,
//!   `set-tag`) the way MLflow's parser does, so a capability knows which ones MLflow stores as sent;
//! - [`coalesce`] merges concurrent writes to one run into MLflow batches;
//! - [`health`] records every rank's heartbeats and judges runs whose ranks all went silent;
//! - [`relocate`] is a tool (not on the request path) that copies stray objects into a run.

pub mod admin;
pub mod app;
pub mod artifacts;
pub mod authz;
pub mod client;
pub mod coalesce;
pub mod config;
pub mod dedup;
pub mod error;
pub mod fairshare;
pub mod health;
pub mod layers;
pub mod listen;
pub mod proxy;
pub mod relocate;
pub mod rewrite;
pub mod serve;
pub mod state;

#[cfg(test)]
mod fuzz;
pub mod store;
pub mod telemetry;
pub mod upstream;
pub mod workspace;
pub mod writes;

pub use app::{app, run};
pub use config::Config;
pub use state::AppState;
