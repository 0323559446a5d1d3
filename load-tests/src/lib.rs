//! Benchmarks for mlscope: what mlscope-proxy adds to MLflow requests (next to nginx, the usual
//! alternative), how it streams large artifacts (forwarded to MLflow, or served by its artifact
//! gateway next to MLflow's own proxy and boto3 straight to the store), what its system-metric
//! rewrite engine costs per sample, and how many rows its node-series deduplication saves MLflow.
//!
//! Every benchmark that talks to MLflow starts its own stack through the `mlscope-tests` harness —
//! loopback only, free ports, one temporary directory — and bounds every request loop in count
//! and time. `rewrite` needs no stack: it runs the engine in process.

mod artifact;
mod cli;
mod dedup_rows;
mod fairshare;
mod fleet;
mod gateway;
mod http;
mod markdown;
mod mlflow;
mod monitor;
mod passthrough;
mod progress;
mod prometheus;
mod report_cost;
mod rewrite;
mod slowloris;
mod stack;
mod stub;
mod units;
mod workload;

pub use cli::{
    ArtifactArgs, Cli, ClientFleetArgs, Command, DedupRowsArgs, Endpoint, FairShareArgs, FleetArgs,
    FleetTarget, GatewayArgs, K6LogBatchArgs, PassthroughArgs, ReportCostArgs, RewriteArgs,
    SlowlorisArgs, StackArgs,
};
pub use markdown::shell_words;
pub use units::ByteSize;

use anyhow::Context as _;

use stack::{BenchStack, ReplicaPlan, StackPlan, TargetKind};

/// A finished benchmark: the markdown for stdout, and what made it a failure (empty when nothing).
pub struct Report {
    pub markdown: String,
    pub problems: Vec<String>,
}

/// Starts the stack the command needs, runs the benchmark and tears the stack down again.
/// `command_line` is quoted into the report as the way to reproduce it.
pub fn run(cli: &Cli, command_line: &str) -> anyhow::Result<Report> {
    let (stack_args, plan) = match &cli.command {
        // In process, on a runtime of its own: nothing to start.
        Command::Rewrite(args) => return rewrite::run(args, command_line),
        Command::Passthrough(args) => (
            &args.stack,
            StackPlan {
                nginx: true,
                extra_proxies: if args.system_metrics {
                    vec![TargetKind::ProxyScopingOff]
                } else {
                    Vec::new()
                },
                ..StackPlan::default()
            },
        ),
        Command::Artifact(args) => (&args.stack, StackPlan::default()),
        Command::K6LogBatch(args) => (&args.stack, StackPlan::default()),
        Command::ClientFleet(args) => (&args.stack, StackPlan::default()),
        Command::FairShare(args) => (&args.stack, StackPlan::default()),
        Command::Slowloris(args) => (
            &args.stack,
            StackPlan {
                nginx: true,
                ..StackPlan::default()
            },
        ),
        Command::Gateway(args) => (
            &args.stack,
            StackPlan {
                artifact_gateway: true,
                ..StackPlan::default()
            },
        ),
        Command::Fleet(args) => {
            let kinds = crate::stack::fleet_target_kinds(args);
            (
                &args.stack,
                StackPlan {
                    nginx: kinds.contains(&TargetKind::Nginx),
                    extra_proxies: [TargetKind::ProxyCoalesceOff, TargetKind::ProxyDedupOff]
                        .into_iter()
                        .filter(|k| kinds.contains(k))
                        .collect(),
                    artifact_gateway: false,
                    replicas: kinds
                        .contains(&TargetKind::ProxyReplicas)
                        .then(|| ReplicaPlan {
                            count: args.replicas,
                            postgres_admin_url: args.replica_postgres.clone(),
                            // Checkpoints go through the replicas' artifact gateway to the store.
                            artifact_gateway: !args.checkpoint_every.is_zero(),
                        }),
                },
            )
        }
        Command::DedupRows(args) => (
            &args.stack,
            StackPlan {
                nginx: false,
                extra_proxies: vec![TargetKind::ProxyDedupOff],
                ..StackPlan::default()
            },
        ),
        Command::ReportCost(args) => (&args.stack, StackPlan::default()),
    };
    // The report-cost bench keeps the proxy's state in a PostgreSQL database of its own, and has
    // it flush and sweep every second.
    let report_db = match &cli.command {
        Command::ReportCost(args) => Some(
            mlscope_tests::PostgresDatabase::create(
                &args.postgres_admin_url,
                "mlscope_report_cost",
            )
            .context("creating the proxy's state database")?,
        ),
        _ => None,
    };
    let report_cost_args;
    let stack_args = match (&cli.command, &report_db) {
        (Command::ReportCost(args), Some(db)) => {
            let mut owned = args.stack.clone();
            owned.proxy_args.extend([
                format!("--database-url={}", db.url),
                "--health-flush-interval=1s".to_owned(),
                "--health-sweep-interval=1s".to_owned(),
            ]);
            report_cost_args = owned;
            &report_cost_args
        }
        _ => stack_args,
    };
    // The fair-share bench trusts loopback's X-Forwarded-For, and may set the proxy's write share.
    let fair_share_args;
    let stack_args = match &cli.command {
        Command::FairShare(args) => {
            let mut owned = args.stack.clone();
            owned
                .proxy_args
                .push("--trusted-proxies=127.0.0.1".to_owned());
            if let Some(rate) = args.client_write_rate {
                owned.proxy_args.push(format!("--client-write-rate={rate}"));
            }
            fair_share_args = owned;
            &fair_share_args
        }
        _ => stack_args,
    };
    // A missing environment or binary is one line that says what to run, before anything starts.
    mlscope_tests::preflight(plan.nginx || plan.replicas.is_some())?;
    let starting = progress::spinner(plan.describe());
    let stack = BenchStack::start(stack_args, &plan);
    starting.finish_and_clear();
    let stack = std::sync::Arc::new(stack?);

    // One thread: the load generator should take as little as possible of the two cores it shares
    // with MLflow, nginx and the proxies, and the rates involved need far less than one.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        match &cli.command {
            Command::Passthrough(args) => passthrough::run(args, &stack, command_line).await,
            Command::Artifact(args) => artifact::run(args, &stack, command_line).await,
            Command::Gateway(args) => gateway::run(args, &stack, command_line).await,
            Command::DedupRows(args) => dedup_rows::run(args, &stack, command_line).await,
            Command::ReportCost(args) => {
                let url = report_db.as_ref().map_or("", |db| db.url.as_str());
                report_cost::run(args, &stack, url, command_line).await
            }
            Command::Slowloris(args) => slowloris::run(args, &stack, command_line).await,
            Command::Fleet(args) => fleet::run(args, stack.clone(), command_line).await,
            Command::K6LogBatch(args) => workload::k6::run(args, &stack, command_line).await,
            Command::ClientFleet(args) => workload::client::run(args, &stack, command_line).await,
            Command::FairShare(args) => fairshare::run(args, &stack, command_line).await,
            Command::Rewrite(_) => unreachable!("rewrite returned above"),
        }
    })
}
