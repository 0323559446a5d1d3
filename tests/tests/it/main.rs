//! Integration tests against the real stack (SeaweedFS, MLflow, mlscope-proxy), compiled as one
//! binary so that its tests share one stack (`TestStack::shared`).

mod artifacts;
mod binary;
mod collector;
mod compat;
mod forwarding;
mod legacy_listing;
mod mlflow;
mod python_client;
mod relocate;
mod s3_quirks;
mod stack;
mod system_metrics;
