//! mlscope-proxy: an MLflow-compatible reverse proxy.
//!
//! - [`proxy`] forwards every MLflow route, streaming, with pooled upstream connections;
//! - [`store`] keeps the proxy's own state in SQLite or PostgreSQL;
//! - [`admin`] serves `/healthz`, `/readyz` and `/metrics` on their own listener;
//! - [`app`] wires them and runs until shutdown.

pub mod admin;
pub mod app;
pub mod artifacts;
pub mod config;
pub mod dedup;
pub mod error;
pub mod proxy;
pub mod rewrite;
pub mod serve;

#[cfg(test)]
mod fuzz;
pub mod store;
pub mod telemetry;

pub use app::{app, run, AppState};
pub use config::Config;
