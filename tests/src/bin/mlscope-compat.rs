//! `mlscope-compat`: the differential compatibility suite against your own deployment. Every
//! operation of the suite runs once against MLflow directly and once through mlscope-proxy (or
//! the gateway in front of it), in experiments of its own that it deletes afterwards; it prints
//! one line per operation and the differences, and exits 1 when any answer differed other than
//! as intended: the differences the gateway makes on purpose (it fixes an MLflow bug) are
//! listed in docs/compatibility.md and reported as such, and an operation the MLflow behind
//! both sides lacks is skipped.
//!
//! Run it in staging before moving `MLFLOW_TRACKING_URI`, and after every MLflow upgrade. The
//! client's credentials come from MLflow's usual variables (`MLFLOW_TRACKING_USERNAME` /
//! `MLFLOW_TRACKING_PASSWORD`, or `MLFLOW_TRACKING_TOKEN`), the same for both sides.

use std::io::Write as _;
use std::process::ExitCode;

use clap::Parser;
use mlscope_tests::compat::{compare_deployments, operation_names, Credentials, Verdict};

/// Exit status when an answer differed.
const EXIT_DIFFERENT: u8 = 1;
/// Exit status when the tool could not run (bad arguments, nothing answering).
const EXIT_UNUSABLE: u8 = 2;

#[derive(Debug, Parser)]
#[command(
    name = "mlscope-compat",
    version,
    about = "Runs every MLflow operation of mlscope's compatibility suite directly and through the proxy, and compares the answers",
    after_help = "Credentials: MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (basic), or MLFLOW_TRACKING_TOKEN (bearer), used on both sides.\nExit status: 0 all answers equal or different as intended, 1 some differed, 2 the comparison could not run."
)]
struct Args {
    /// MLflow itself, e.g. `http://mlflow.mlflow.svc:5000`.
    #[arg(long, env = "MLSCOPE_COMPAT_DIRECT", value_name = "URL")]
    direct: String,
    /// The same MLflow through mlscope-proxy or the gateway, e.g. `http://mlscope-proxy.mlflow.svc:5000`.
    #[arg(long, env = "MLSCOPE_COMPAT_THROUGH", value_name = "URL")]
    through: String,
    /// Print only the differences and the summary.
    #[arg(long, short)]
    quiet: bool,
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let text = e.to_string();
            let line = text
                .lines()
                .next()
                .unwrap_or("invalid arguments")
                .trim_start_matches("error: ");
            eprintln!("mlscope-compat: {line} (see --help)");
            return ExitCode::from(EXIT_UNUSABLE);
        }
    };
    for (flag, url) in [("--direct", &args.direct), ("--through", &args.through)] {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            eprintln!("mlscope-compat: {flag} {url:?} is not an http:// or https:// URL");
            return ExitCode::from(EXIT_UNUSABLE);
        }
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("mlscope-compat: cannot start: {e}");
            return ExitCode::from(EXIT_UNUSABLE);
        }
    };
    runtime.block_on(run(&args))
}

async fn run(args: &Args) -> ExitCode {
    let client = reqwest::Client::new();
    for (side, url) in [("--direct", &args.direct), ("--through", &args.through)] {
        let health = format!("{}/health", url.trim_end_matches('/'));
        if let Err(e) = client.get(&health).send().await {
            eprintln!("mlscope-compat: {side} {url} does not answer: {e}");
            return ExitCode::from(EXIT_UNUSABLE);
        }
    }
    let total = operation_names().len();
    let credentials = Credentials::from_env();
    println!(
        "comparing {total} operations: direct {} / through {} ({credentials:?})",
        args.direct, args.through
    );
    let mut done = 0;
    let quiet = args.quiet;
    let comparison = compare_deployments(&args.direct, &args.through, &credentials, |result| {
        done += 1;
        let (verdict, note) = match &result.verdict {
            Verdict::Equal if quiet => return,
            Verdict::Equal => ("equal", String::new()),
            Verdict::Intentional(reason) => ("intended", format!(": {reason}")),
            Verdict::Unsupported(why) => ("skipped", format!(": {why}")),
            Verdict::Different(_) => ("DIFFERENT", String::new()),
        };
        println!("[{done:>3}/{total}] {verdict:<9} {}{note}", result.name);
        let _ = std::io::stdout().flush();
    })
    .await;
    let different: Vec<_> = comparison.differences().collect();
    if !different.is_empty() {
        println!("\ndifferences:");
        for result in &different {
            println!(
                "\n{}:\n{}",
                result.name,
                result.difference().unwrap_or_default()
            );
        }
    }
    println!(
        "\ncleaned up: experiments compat-*-{} (direct) and compat-*-{} (through) deleted",
        comparison.suffixes[0], comparison.suffixes[1]
    );
    for problem in &comparison.cleanup_problems {
        eprintln!("mlscope-compat: clean-up: {problem}");
    }
    let intended = comparison.count(|v| matches!(v, Verdict::Intentional(_)));
    let skipped = comparison.count(|v| matches!(v, Verdict::Unsupported(_)));
    println!(
        "\nMLflow {}: {} of {total} operations answered the same directly and through {}; \
         {intended} differed as intended (docs/compatibility.md), {skipped} not supported by this \
         MLflow, {} different",
        comparison
            .mlflow_version
            .as_deref()
            .unwrap_or("(version unknown)"),
        comparison.count(|v| *v == Verdict::Equal),
        args.through,
        different.len(),
    );
    if different.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_DIFFERENT)
    }
}
