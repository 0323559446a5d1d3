//! The processes a benchmark measures: MLflow (with its S3 store), mlscope-proxy in front of it
//! (forwarding everything, or serving the artifact API from the store itself) and, where a
//! benchmark compares with them, nginx in front of MLflow as the reference reverse proxy and
//! further mlscope-proxy instances with system-metric scoping partly or wholly off.
//!
//! Everything is started by the `mlscope-tests` harness on free loopback ports under one temporary
//! directory, and torn down when [`BenchStack`] is dropped.

use std::fmt;

use anyhow::Context as _;
use mlscope_tests::{MlflowServer, Nginx, PostgresDatabase, ProxyProcess, StackOptions, TestStack};

use crate::cli::{FleetArgs, FleetTarget, StackArgs};

/// How the benchmark's MLflow serves (workers, job runner), set once when its stack starts, for
/// every report beside MLflow's version.
static SERVING: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// How MLflow serves in this run, once its stack has started.
pub(crate) fn serving() -> Option<&'static str> {
    SERVING.get().map(String::as_str)
}

/// Where a benchmark sends its requests. The order is the report's row order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum TargetKind {
    /// Straight to MLflow: the baseline every other target is compared with.
    Direct,
    /// nginx in front of MLflow, with the settings of `deploy/nginx/mlscope-bench.conf.tmpl`.
    Nginx,
    /// A second mlscope-proxy with `--rewrite-system-metrics false --dedup false`: forwarding
    /// only, for the cost of scoping itself.
    ProxyScopingOff,
    /// A second mlscope-proxy with `--coalesce-window 0s --dedup false`: every request forwarded
    /// on its own, keys rewritten, every sample kept.
    ProxyCoalesceOff,
    /// A second mlscope-proxy with `--dedup false`: keys are rewritten, every sample is kept.
    ProxyDedupOff,
    /// mlscope-proxy in front of MLflow, as configured by `--proxy-arg` (scoping and dedup on
    /// by default).
    Proxy,
    /// nginx with the shipped gateway configuration (`deploy/nginx/mlscope-gateway.conf`) in front
    /// of several mlscope-proxy replicas (configured as [`TargetKind::Proxy`]) that share their
    /// state in one PostgreSQL database: the production shape.
    ProxyReplicas,
}

/// One target and its base URL (`http://127.0.0.1:<port>`, no trailing slash).
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub(crate) kind: TargetKind,
    pub(crate) base_url: String,
}

/// What a benchmark needs started besides MLflow and the main proxy.
#[derive(Debug, Clone, Default)]
pub(crate) struct StackPlan {
    pub(crate) nginx: bool,
    /// Extra proxies, each of a kind that has [`TargetKind::extra_proxy_args`].
    pub(crate) extra_proxies: Vec<TargetKind>,
    /// Start the main proxy as an artifact gateway: `--artifacts-destination` MLflow's own
    /// (`s3://mlflow/artifacts`), `--s3-endpoint-url` the stack's store, `--s3-quirks seaweedfs`.
    pub(crate) artifact_gateway: bool,
    /// Start [`TargetKind::ProxyReplicas`].
    pub(crate) replicas: Option<ReplicaPlan>,
}

/// Replicas of mlscope-proxy behind nginx, sharing one PostgreSQL database.
#[derive(Debug, Clone)]
pub(crate) struct ReplicaPlan {
    pub(crate) count: usize,
    /// A PostgreSQL URL allowed to create databases; the bench creates one of its own there
    /// and drops it afterwards.
    pub(crate) postgres_admin_url: String,
    /// Serve the artifact API from the stack's store (as [`StackPlan::artifact_gateway`]).
    pub(crate) artifact_gateway: bool,
}

/// The running replicas, their gateway and their database.
struct Replicas {
    // Field order is drop order: the gateway, the replicas, then the database they use.
    gateway: Nginx,
    /// Each replica with the ports it listens on, to start it again on the same ones.
    processes: std::sync::Mutex<Vec<(ProxyProcess, u16, u16)>>,
    args: Vec<String>,
    upstream: String,
    dir: std::path::PathBuf,
    database: PostgresDatabase,
}

/// The running stack; dropping it stops nginx, the proxies, MLflow and the store.
pub(crate) struct BenchStack {
    // Field order is drop order: nginx and the extra proxies go before the MLflow server they
    // forward to.
    nginx: Option<Nginx>,
    replicas: Option<Replicas>,
    extra_proxies: Vec<(TargetKind, ProxyProcess)>,
    /// The main proxy when the bench starts it itself: in front of the stub instead of MLflow,
    /// or as an artifact gateway (the harness knows the store's address only once it runs).
    own_proxy: Option<ProxyProcess>,
    /// What `direct` means and every proxy forwards to: MLflow, or the stub.
    upstream_url: String,
    /// MLflow as started again by [`BenchStack::restart_mlflow`], in place of the stack's own.
    restarted_mlflow: std::sync::Mutex<Option<MlflowServer>>,
    /// How MLflow serves (and serves again after a restart).
    serving: mlscope_tests::MlflowServing,
    stack: TestStack,
}

// === impl TargetKind ===

impl TargetKind {
    pub(crate) fn label(self) -> &'static str {
        match self {
            TargetKind::Direct => "direct",
            TargetKind::Nginx => "nginx",
            TargetKind::ProxyScopingOff => "mlscope-proxy (scoping off)",
            TargetKind::ProxyCoalesceOff => "mlscope-proxy (coalescing and dedup off)",
            TargetKind::ProxyDedupOff => "mlscope-proxy (dedup off)",
            TargetKind::Proxy => "mlscope-proxy",
            TargetKind::ProxyReplicas => {
                "nginx gateway → mlscope-proxy replicas (PostgreSQL state)"
            }
        }
    }

    /// The label as one word, for run names.
    pub(crate) fn slug(self) -> &'static str {
        match self {
            TargetKind::Direct => "direct",
            TargetKind::Nginx => "nginx",
            TargetKind::ProxyScopingOff => "mlscope-proxy-scoping-off",
            TargetKind::ProxyCoalesceOff => "mlscope-proxy-coalescing-off",
            TargetKind::ProxyDedupOff => "mlscope-proxy-dedup-off",
            TargetKind::Proxy => "mlscope-proxy",
            TargetKind::ProxyReplicas => "mlscope-proxy-replicas",
        }
    }

    /// Flags that make a second mlscope-proxy this kind of target; `None` for kinds that are not
    /// an extra proxy.
    pub(crate) fn extra_proxy_args(self) -> Option<&'static [&'static str]> {
        match self {
            TargetKind::ProxyScopingOff => {
                Some(&["--rewrite-system-metrics", "false", "--dedup", "false"])
            }
            TargetKind::ProxyCoalesceOff => Some(&["--coalesce-window", "0s", "--dedup", "false"]),
            TargetKind::ProxyDedupOff => Some(&["--dedup", "false"]),
            TargetKind::Direct
            | TargetKind::Nginx
            | TargetKind::Proxy
            | TargetKind::ProxyReplicas => None,
        }
    }
}

impl fmt::Display for TargetKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

// === impl StackPlan ===

impl StackPlan {
    /// What starting the stack means, for the spinner.
    pub(crate) fn describe(&self) -> String {
        let main_proxy = if self.artifact_gateway {
            "mlscope-proxy (artifact gateway)"
        } else {
            "mlscope-proxy"
        };
        let mut parts = vec!["S3 store", "MLflow", main_proxy];
        parts.extend(self.extra_proxies.iter().map(|kind| kind.label()));
        let replicas;
        if let Some(plan) = &self.replicas {
            replicas = format!("{} mlscope-proxy replicas behind nginx", plan.count);
            parts.push(&replicas);
        }
        if self.nginx {
            parts.push("nginx");
        }
        let last = parts.pop().unwrap_or_default();
        format!("starting {} and {last}", parts.join(", "))
    }
}

// === impl BenchStack ===

impl BenchStack {
    /// Starts the store, MLflow and mlscope-proxy, then what `plan` asks for. Blocking: call it
    /// before the async runtime starts. `args.proxy_args` go to every mlscope-proxy, before an
    /// extra proxy's own flags.
    pub(crate) fn start(args: &StackArgs, plan: &StackPlan) -> anyhow::Result<BenchStack> {
        let _ = SERVING.set(args.serving().describe());
        let stack = TestStack::start(StackOptions {
            proxy: !args.stub_upstream && !plan.artifact_gateway,
            proxy_args: args.proxy_args.clone(),
            mlflow_backend: args.mlflow_backend.clone(),
            mlflow_serving: args.serving(),
            ..StackOptions::default()
        })
        .context("starting the benchmark stack (S3 store, MLflow, mlscope-proxy)")?;
        let (upstream_url, own_proxy) = if args.stub_upstream {
            let stub = crate::stub::StubUpstream::start()?;
            let proxy_args: Vec<&str> = args.proxy_args.iter().map(String::as_str).collect();
            let proxy = mlscope_tests::spawn_proxy(&stub.url, &proxy_args, stack.dir.path())
                .context("starting mlscope-proxy in front of the stub upstream")?;
            (stub.url, Some(proxy))
        } else if plan.artifact_gateway {
            // The gateway's own flags first: `--proxy-arg` comes after them (the proxy refuses a
            // flag given twice, so it can add settings but not repeat these).
            let gateway_args = stack.s3.gateway_args(&stack.s3.url);
            let proxy_args: Vec<&str> = gateway_args
                .iter()
                .chain(&args.proxy_args)
                .map(String::as_str)
                .collect();
            let proxy =
                mlscope_tests::spawn_proxy(&stack.mlflow.url, &proxy_args, stack.dir.path())
                    .context("starting mlscope-proxy as the artifact gateway in front of MLflow")?;
            (stack.mlflow.url.clone(), Some(proxy))
        } else {
            (stack.mlflow.url.clone(), None)
        };
        let mut extra_proxies = Vec::with_capacity(plan.extra_proxies.len());
        for &kind in &plan.extra_proxies {
            let own_args = kind
                .extra_proxy_args()
                .with_context(|| format!("{kind} is not an extra mlscope-proxy"))?;
            let proxy_args: Vec<&str> = args
                .proxy_args
                .iter()
                .map(String::as_str)
                .chain(own_args.iter().copied())
                .collect();
            let proxy = mlscope_tests::spawn_proxy(&upstream_url, &proxy_args, stack.dir.path())
                .with_context(|| format!("starting {kind} in front of MLflow"))?;
            extra_proxies.push((kind, proxy));
        }
        let nginx = if plan.nginx {
            let dir = stack.dir.path().join("nginx");
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let nginx =
                Nginx::start(&upstream_url, &dir).context("starting nginx in front of MLflow")?;
            Some(nginx)
        } else {
            None
        };
        let replicas = match &plan.replicas {
            Some(replicas) => {
                let gateway_args = if replicas.artifact_gateway {
                    stack.s3.gateway_args(&stack.s3.url)
                } else {
                    Default::default()
                };
                Some(Replicas::start(
                    args,
                    replicas,
                    &gateway_args,
                    &upstream_url,
                    stack.dir.path(),
                )?)
            }
            None => None,
        };
        Ok(BenchStack {
            nginx,
            replicas,
            extra_proxies,
            own_proxy,
            upstream_url,
            restarted_mlflow: std::sync::Mutex::new(None),
            serving: args.serving(),
            stack,
        })
    }

    /// The targets in report order: direct, nginx (when started), the extra proxies, the proxy.
    pub(crate) fn targets(&self) -> Vec<Target> {
        let mut targets = vec![Target {
            kind: TargetKind::Direct,
            base_url: trim_url(&self.upstream_url),
        }];
        if let Some(nginx) = &self.nginx {
            targets.push(Target {
                kind: TargetKind::Nginx,
                base_url: trim_url(&nginx.url),
            });
        }
        targets.extend(self.extra_proxies.iter().map(|(kind, proxy)| Target {
            kind: *kind,
            base_url: trim_url(&proxy.url),
        }));
        targets.push(Target {
            kind: TargetKind::Proxy,
            base_url: trim_url(&self.proxy().url),
        });
        if let Some(replicas) = &self.replicas {
            targets.push(Target {
                kind: TargetKind::ProxyReplicas,
                base_url: trim_url(&replicas.gateway.url),
            });
        }
        targets.sort_by_key(|t| t.kind);
        targets
    }

    /// MLflow itself (or the stub in its place).
    pub(crate) fn upstream_url(&self) -> &str {
        &self.upstream_url
    }

    pub(crate) fn target(&self, kind: TargetKind) -> Option<Target> {
        self.targets().into_iter().find(|t| t.kind == kind)
    }

    /// Kills MLflow (SIGKILL to its process group, as a crashed or evicted pod), waits `down`,
    /// and starts it again on the same port with the same backend store; returns how long MLflow
    /// was gone. Blocking.
    pub(crate) fn restart_mlflow(
        &self,
        down: std::time::Duration,
    ) -> anyhow::Result<std::time::Duration> {
        let mut restarted = self.restarted_mlflow.lock().expect("restart lock");
        let pgid = restarted
            .as_ref()
            .map_or_else(|| self.stack.mlflow.process.pid(), |m| m.process.pid());
        let gone = std::time::Instant::now();
        // `--`: without it kill(1) may read the negative process group id as an option.
        let killed = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{pgid}")])
            .status()
            .context("running kill")?;
        anyhow::ensure!(killed.success(), "kill -KILL -- -{pgid} failed: {killed}");
        std::thread::sleep(down);
        let port: u16 = self
            .stack
            .mlflow
            .url
            .rsplit(':')
            .next()
            .and_then(|p| p.trim_end_matches('/').parse().ok())
            .context("MLflow's URL has no port")?;
        let server = MlflowServer::start_serving(
            self.stack.dir.path(),
            &self.stack.s3,
            Some(&self.stack.mlflow.backend_store_uri),
            port,
            self.serving,
        )
        .context("starting MLflow again")?;
        *restarted = Some(server);
        Ok(gone.elapsed())
    }

    /// Kills replica `index` of [`TargetKind::ProxyReplicas`] (SIGKILL, as a crashed or evicted
    /// pod), waits `down`, and starts it again on the same ports and database; returns how long
    /// it was gone. Blocking.
    pub(crate) fn kill_replica(
        &self,
        index: usize,
        down: std::time::Duration,
    ) -> anyhow::Result<std::time::Duration> {
        let replicas = self
            .replicas
            .as_ref()
            .context("the stack was started without replicas")?;
        replicas.kill(index, down)
    }

    /// Process id of mlscope-proxy, for reading its memory use from `/proc`.
    pub(crate) fn proxy_pid(&self) -> u32 {
        self.proxy().process.pid()
    }

    /// Process id (and process group id: the harness starts each process in a group of its own)
    /// of the MLflow server.
    pub(crate) fn mlflow_pid(&self) -> u32 {
        self.stack.mlflow.process.pid()
    }

    /// Where the harness writes mlscope-proxy's stdout and stderr (a file in the stack's
    /// directory, on disk).
    pub(crate) fn proxy_log_path(&self) -> &std::path::Path {
        &self.proxy().log_path
    }

    /// Process group of the server behind `kind`: MLflow (direct), nginx, or an mlscope-proxy.
    pub(crate) fn pgid(&self, kind: TargetKind) -> Option<u32> {
        match kind {
            TargetKind::Direct => (!self.upstream_is_stub()).then(|| self.mlflow_pid()),
            TargetKind::Nginx => self.nginx.as_ref().map(|n| n.process.pid()),
            TargetKind::Proxy => Some(self.proxy_pid()),
            TargetKind::ProxyReplicas => self.replicas.as_ref().map(|r| r.gateway.process.pid()),
            other => self
                .extra_proxies
                .iter()
                .find(|(k, _)| *k == other)
                .map(|(_, p)| p.process.pid()),
        }
    }

    fn upstream_is_stub(&self) -> bool {
        trim_url(&self.upstream_url) != trim_url(&self.stack.mlflow.url)
    }

    /// Process id (and process group id) of the S3 store.
    pub(crate) fn store_pid(&self) -> u32 {
        self.stack.s3.process.pid()
    }

    /// The S3 store's endpoint (`http://127.0.0.1:<port>`) and the bucket MLflow's artifacts go
    /// to under [`mlscope_tests::S3Store::PREFIX`].
    pub(crate) fn store(&self) -> (String, &str) {
        (trim_url(&self.stack.s3.url), &self.stack.s3.bucket)
    }

    /// Admin URLs (`/metrics`) of every mlscope-proxy behind `kind`: one for a proxy, each
    /// replica's for [`TargetKind::ProxyReplicas`], none for other targets.
    pub(crate) fn admin_urls(&self, kind: TargetKind) -> Vec<String> {
        self.each_replica(kind, |p| trim_url(&p.admin_url))
            .unwrap_or_else(|| self.admin_url(kind).into_iter().collect())
    }

    /// `f` of each replica of [`TargetKind::ProxyReplicas`]; `None` for other targets.
    fn each_replica<T>(&self, kind: TargetKind, f: impl Fn(&ProxyProcess) -> T) -> Option<Vec<T>> {
        let replicas = self
            .replicas
            .as_ref()
            .filter(|_| kind == TargetKind::ProxyReplicas)?;
        let processes = replicas.processes.lock().expect("replicas lock");
        Some(processes.iter().map(|(p, _, _)| f(p)).collect())
    }

    /// Admin URL (`/metrics`) of the mlscope-proxy behind `kind`; `None` for other targets.
    pub(crate) fn admin_url(&self, kind: TargetKind) -> Option<String> {
        let proxy = if kind == TargetKind::Proxy {
            Some(self.proxy())
        } else {
            self.extra_proxies
                .iter()
                .find(|(k, _)| *k == kind)
                .map(|(_, p)| p)
        };
        proxy.map(|p| trim_url(&p.admin_url))
    }

    /// Process ids of every mlscope-proxy behind `kind` (each replica's for
    /// [`TargetKind::ProxyReplicas`]), for reading their memory and descriptors from `/proc`.
    pub(crate) fn proxy_pids(&self, kind: TargetKind) -> Vec<u32> {
        if let Some(pids) = self.each_replica(kind, |p| p.process.pid()) {
            return pids;
        }
        match kind {
            TargetKind::Direct | TargetKind::Nginx | TargetKind::ProxyReplicas => Vec::new(),
            kind => self.pgid(kind).into_iter().collect(),
        }
    }

    /// The replicas' shared state database (`postgres://…`), when the stack has replicas.
    pub(crate) fn state_database_url(&self) -> Option<String> {
        self.replicas.as_ref().map(|r| r.database.url.clone())
    }

    pub(crate) fn proxy(&self) -> &ProxyProcess {
        self.own_proxy
            .as_ref()
            .or(self.stack.proxy.as_ref())
            .expect("the benchmark stack always starts the proxy")
    }
}

// === impl Replicas ===

impl Replicas {
    fn start(
        args: &StackArgs,
        plan: &ReplicaPlan,
        gateway_args: &[String],
        upstream: &str,
        dir: &std::path::Path,
    ) -> anyhow::Result<Replicas> {
        let database = PostgresDatabase::create(&plan.postgres_admin_url, "mlscope_bench")
            .context("creating the replicas' state database")?;
        let mut proxy_args = gateway_args.to_vec();
        proxy_args.extend(args.proxy_args.iter().cloned());
        proxy_args.extend(["--database-url".to_owned(), database.url.clone()]);
        let mut processes = Vec::with_capacity(plan.count);
        for index in 0..plan.count {
            let (port, admin) = (mlscope_tests::free_port(), mlscope_tests::free_port());
            let proxy = spawn_replica(upstream, &proxy_args, dir, port, admin)
                .with_context(|| format!("starting mlscope-proxy replica {index}"))?;
            processes.push((proxy, port, admin));
        }
        let urls: Vec<&str> = processes.iter().map(|(p, _, _)| p.url.as_str()).collect();
        let gateway_dir = dir.join("nginx-replicas");
        std::fs::create_dir_all(&gateway_dir)
            .with_context(|| format!("creating {}", gateway_dir.display()))?;
        let gateway = Nginx::start_gateway(&urls, &gateway_dir).context(
            "starting nginx (deploy/nginx/mlscope-gateway.conf) in front of the replicas",
        )?;
        Ok(Replicas {
            gateway,
            processes: std::sync::Mutex::new(processes),
            args: proxy_args,
            upstream: upstream.to_owned(),
            dir: dir.to_owned(),
            database,
        })
    }

    fn kill(&self, index: usize, down: std::time::Duration) -> anyhow::Result<std::time::Duration> {
        let mut processes = self.processes.lock().expect("replicas lock");
        let (proxy, port, admin) = processes
            .get_mut(index)
            .with_context(|| format!("there is no replica {index}"))?;
        let gone = std::time::Instant::now();
        proxy.process.kill();
        std::thread::sleep(down);
        *proxy = spawn_replica(&self.upstream, &self.args, &self.dir, *port, *admin)
            .with_context(|| format!("starting replica {index} again"))?;
        Ok(gone.elapsed())
    }
}

fn spawn_replica(
    upstream: &str,
    args: &[String],
    dir: &std::path::Path,
    port: u16,
    admin: u16,
) -> anyhow::Result<ProxyProcess> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    mlscope_tests::spawn_proxy_on(upstream, &args, dir, port, admin)
}

fn trim_url(url: &str) -> String {
    url.trim_end_matches('/').to_string()
}

/// The targets a fleet run names, in the order given.
pub(crate) fn fleet_target_kinds(args: &FleetArgs) -> Vec<TargetKind> {
    args.targets
        .iter()
        .map(|t| match t {
            FleetTarget::Direct => TargetKind::Direct,
            FleetTarget::Nginx => TargetKind::Nginx,
            FleetTarget::MlscopePlain => TargetKind::ProxyCoalesceOff,
            FleetTarget::MlscopeCoalesce => TargetKind::ProxyDedupOff,
            FleetTarget::Mlscope => TargetKind::Proxy,
            FleetTarget::MlscopeReplicas => TargetKind::ProxyReplicas,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_extra_proxy_kinds_have_their_own_flags() {
        assert_eq!(
            TargetKind::ProxyScopingOff.extra_proxy_args(),
            Some(&["--rewrite-system-metrics", "false", "--dedup", "false"][..])
        );
        assert_eq!(
            TargetKind::ProxyDedupOff.extra_proxy_args(),
            Some(&["--dedup", "false"][..])
        );
        assert_eq!(TargetKind::Proxy.extra_proxy_args(), None);
    }

    #[test]
    fn the_spinner_names_every_process_it_starts() {
        let plan = StackPlan {
            nginx: true,
            extra_proxies: vec![TargetKind::ProxyScopingOff],
            artifact_gateway: false,
            replicas: None,
        };
        assert_eq!(
            plan.describe(),
            "starting S3 store, MLflow, mlscope-proxy, mlscope-proxy (scoping off) and nginx"
        );
        assert_eq!(
            StackPlan::default().describe(),
            "starting S3 store, MLflow and mlscope-proxy"
        );
        let gateway = StackPlan {
            artifact_gateway: true,
            ..StackPlan::default()
        };
        assert_eq!(
            gateway.describe(),
            "starting S3 store, MLflow and mlscope-proxy (artifact gateway)"
        );
    }
}
