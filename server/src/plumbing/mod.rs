//! Plumbing: what every capability stands on. It knows no capability and no configuration
//! file, and imports only plumbing.

pub(crate) mod after;
pub(crate) mod aged;
pub(crate) mod client;
pub(crate) mod credential;
pub mod error;
pub(crate) mod identity;
pub(crate) mod json_lines;
pub(crate) mod layers;
pub(crate) mod listen;
pub(crate) mod log_writer;
pub(crate) mod mlflow;
pub(crate) mod mlflow_version;
pub mod proxy;
pub(crate) mod route;
pub(crate) mod settings;
pub mod store;
pub mod telemetry;
pub(crate) mod workspace;
pub(crate) mod writes;
