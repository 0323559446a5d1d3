//! The processes a benchmark measures: MLflow (with its S3 store), mlscope-proxy in front of it
//! and, for the pass-through benchmark, nginx in front of MLflow as the reference reverse proxy.
//!
//! Everything is started by the `mlscope-tests` harness on free loopback ports under one temporary
//! directory, and torn down when [`BenchStack`] is dropped.

use std::fmt;

use anyhow::Context as _;
use mlscope_tests::{Nginx, StackOptions, TestStack};

use crate::cli::StackArgs;

/// Where a benchmark sends its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum TargetKind {
    /// Straight to MLflow: the baseline every other target is compared with.
    Direct,
    /// nginx in front of MLflow, with the settings of `deploy/nginx/mlscope-bench.conf.tmpl`.
    Nginx,
    /// mlscope-proxy in front of MLflow.
    Proxy,
}

/// One target and its base URL (`http://127.0.0.1:<port>`, no trailing slash).
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub(crate) kind: TargetKind,
    pub(crate) base_url: String,
}

/// The running stack; dropping it stops nginx, the proxy, MLflow and the store.
pub(crate) struct BenchStack {
    // Field order is drop order: nginx goes before the MLflow server it forwards to.
    nginx: Option<Nginx>,
    stack: TestStack,
}

// === impl TargetKind ===

impl TargetKind {
    pub(crate) fn label(self) -> &'static str {
        match self {
            TargetKind::Direct => "direct",
            TargetKind::Nginx => "nginx",
            TargetKind::Proxy => "mlscope-proxy",
        }
    }
}

impl fmt::Display for TargetKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

// === impl BenchStack ===

impl BenchStack {
    /// Starts the store, MLflow and mlscope-proxy, and nginx when `with_nginx`. Blocking: call it
    /// before the async runtime starts.
    pub(crate) fn start(args: &StackArgs, with_nginx: bool) -> anyhow::Result<BenchStack> {
        let stack = TestStack::start(StackOptions {
            proxy: true,
            proxy_args: args.proxy_args.clone(),
            mlflow_backend: args.mlflow_backend.clone(),
        })
        .context("starting the benchmark stack (S3 store, MLflow, mlscope-proxy)")?;
        let nginx = if with_nginx {
            let dir = stack.dir.path().join("nginx");
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let nginx = Nginx::start(&stack.mlflow.url, &dir)
                .context("starting nginx in front of MLflow")?;
            Some(nginx)
        } else {
            None
        };
        Ok(BenchStack { nginx, stack })
    }

    /// The targets in report order: direct first, then nginx (when started), then the proxy.
    pub(crate) fn targets(&self) -> Vec<Target> {
        let mut targets = vec![Target {
            kind: TargetKind::Direct,
            base_url: trim_url(&self.stack.mlflow.url),
        }];
        if let Some(nginx) = &self.nginx {
            targets.push(Target {
                kind: TargetKind::Nginx,
                base_url: trim_url(&nginx.url),
            });
        }
        targets.push(Target {
            kind: TargetKind::Proxy,
            base_url: trim_url(&self.proxy().url),
        });
        targets
    }

    pub(crate) fn target(&self, kind: TargetKind) -> Option<Target> {
        self.targets().into_iter().find(|t| t.kind == kind)
    }

    /// Process id of mlscope-proxy, for reading its memory use from `/proc`.
    pub(crate) fn proxy_pid(&self) -> u32 {
        self.proxy().process.pid()
    }

    fn proxy(&self) -> &mlscope_tests::ProxyProcess {
        self.stack
            .proxy
            .as_ref()
            .expect("the benchmark stack always starts the proxy")
    }
}

fn trim_url(url: &str) -> String {
    url.trim_end_matches('/').to_string()
}
