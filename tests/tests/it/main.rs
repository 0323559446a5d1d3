//! Integration tests against the real stack (SeaweedFS, MLflow, mlscope-proxy), compiled as one
//! binary so that its tests share one stack (`TestStack::shared`).

use std::sync::OnceLock;

use mlscope_tests::{StackOptions, TestStack};

mod artifacts;
mod authz;
mod binary;
mod coalesce;
mod collector;
mod compat;
mod data_paths;
mod deploy;
mod faults;
mod forwarding;
mod gpu_basis;
mod gpu_bill;
mod health;
mod hostile;
mod inject;
mod inject_workloads;
mod legacy_listing;
mod mlflow;
mod nginx_gateway;
mod objects;
mod path_differential;
mod python_client;
mod relay;
mod relocate;
mod replicas;
mod report;
mod retries;
mod s3_quirks;
mod stack;
mod system_metrics;
mod workspaces;
mod write_path;

/// SeaweedFS and MLflow without a proxy, for the tests of one module that start their own proxies
/// or talk to the store directly: started by the first test that asks `cell`. A stack that did not
/// start fails every test that asks, with `what` and the error.
fn module_stack(
    cell: &'static OnceLock<Result<TestStack, String>>,
    what: &str,
) -> &'static TestStack {
    let stack = cell.get_or_init(|| {
        TestStack::start(StackOptions {
            proxy: false,
            ..StackOptions::default()
        })
        .map_err(|e| format!("{e:#}"))
    });
    match stack {
        Ok(stack) => stack,
        Err(error) => panic!("the {what} did not start: {error}"),
    }
}
