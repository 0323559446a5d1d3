//! Capabilities: what mlscope adds to MLflow. Each imports plumbing, and another capability
//! only through a seam named in `floors::SEAMS`.

pub mod artifacts;
pub(crate) mod authz;
pub mod coalesce;
pub(crate) mod dedup;
pub(crate) mod fairshare;
pub mod health;
pub(crate) mod metric_routes;
pub mod rewrite;
