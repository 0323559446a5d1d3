//! Test support for mlscope: starts the real parts of an MLflow deployment (SeaweedFS as the S3
//! store, the MLflow tracking server, `mlscope-proxy`, nginx as a reference gateway) as child
//! processes on free loopback ports.
//!
//! Shared by the integration tests in this crate, the load tests and the `mlscope-stack` binary
//! behind the README's quick start, so that all of them run exactly the same stack.

mod cgroup;
pub mod compat;
pub mod s3shim;
mod stack;
pub mod wait;

pub use cgroup::MemoryCgroup;
pub use stack::*;
pub use wait::{consistently, consistently_blocking, eventually, eventually_blocking, scaled};
