//! `slowloris`: thousands of connections that send their request headers a byte at a time,
//! against MLflow directly, nginx and mlscope-proxy, one target after the other. While they
//! trickle, a normal client asks `/health` once a second. Reported per target: how many of the
//! slow connections the server closed within the hold time, whether the normal client was
//! answered and how slowly, and the server's resident memory before and with the connections
//! open.

use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::cli::SlowlorisArgs;
use crate::gateway::procfs::group_rss;
use crate::markdown::{command_block, Align, Table};
use crate::stack::{BenchStack, Target};
use crate::Report;

/// What one target did under the slow connections.
struct Outcome {
    target: Target,
    opened: usize,
    closed: usize,
    normal_ok: usize,
    normal_sent: usize,
    slowest_normal: Duration,
    rss_before: u64,
    rss_peak: u64,
}

pub(crate) async fn run(
    args: &SlowlorisArgs,
    stack: &BenchStack,
    command_line: &str,
) -> anyhow::Result<Report> {
    let mut outcomes = Vec::new();
    for target in stack.targets() {
        let pgid = stack.pgid(target.kind);
        eprintln!(
            "slowloris: {} connections against {} for {:?}",
            args.connections, target.kind, args.hold
        );
        outcomes.push(one_target(args, target, pgid).await);
        // Let the server settle before the next one.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let mut table = Table::new(&[
        ("target", Align::Left),
        ("slow connections opened", Align::Right),
        ("closed by the server", Align::Right),
        ("normal requests answered", Align::Right),
        ("slowest normal answer (answered ones)", Align::Right),
        ("resident memory: before → peak", Align::Right),
    ]);
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1 << 20) as f64);
    let mut problems = Vec::new();
    for o in &outcomes {
        table.row(vec![
            o.target.kind.to_string(),
            o.opened.to_string(),
            format!(
                "{} ({:.0} %)",
                o.closed,
                100.0 * o.closed as f64 / o.opened.max(1) as f64
            ),
            format!("{} of {}", o.normal_ok, o.normal_sent),
            if o.normal_ok == 0 {
                "—".into()
            } else {
                format!("{:.1} ms", o.slowest_normal.as_secs_f64() * 1e3)
            },
            if o.rss_before == 0 {
                "n/a".into()
            } else {
                format!("{} → {}", mib(o.rss_before), mib(o.rss_peak))
            },
        ]);
        if o.target.kind == crate::stack::TargetKind::Proxy && o.normal_ok < o.normal_sent {
            problems.push(format!(
                "mlscope-proxy left {} of {} normal requests unanswered",
                o.normal_sent - o.normal_ok,
                o.normal_sent
            ));
        }
    }
    let markdown = format!(
        "## Slow-header connections (slowloris)\n\n{} connections per target, each sending `GET /health HTTP/1.1` and then one header byte per second, held for {:?}; a normal client asks `/health` once a second meanwhile. \"Closed by the server\": connections the server had closed when the hold ended.\n\n{}\n{}",
        args.connections,
        args.hold,
        table.render(),
        command_block(command_line)
    );
    Ok(Report { markdown, problems })
}

async fn one_target(args: &SlowlorisArgs, target: Target, pgid: Option<u32>) -> Outcome {
    let address = target.base_url.trim_start_matches("http://").to_owned();
    let rss = || pgid.map_or(0, group_rss);
    let rss_before = rss();
    let mut sockets = Vec::with_capacity(args.connections);
    let head = format!("GET /health HTTP/1.1\r\nHost: {address}\r\nX-Slow: ");
    for _ in 0..args.connections {
        let Ok(mut socket) = TcpStream::connect(&address).await else {
            continue;
        };
        if socket.write_all(head.as_bytes()).await.is_ok() {
            sockets.push(Some(socket));
        }
    }
    let opened = sockets.len();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .no_proxy()
        .build()
        .expect("an HTTP client");
    let (mut normal_ok, mut normal_sent, mut slowest) = (0, 0, Duration::ZERO);
    let mut rss_peak = rss_before;
    let started = Instant::now();
    while started.elapsed() < args.hold {
        // One more header byte on every connection still open; a failed write means closed.
        for slot in sockets.iter_mut() {
            if let Some(socket) = slot {
                if closed(socket) || socket.write_all(b"a").await.is_err() {
                    *slot = None;
                }
            }
        }
        let asked = Instant::now();
        normal_sent += 1;
        if client
            .get(format!("{}/health", target.base_url))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            normal_ok += 1;
            // Over answered requests only: a refusal is fast and says nothing about service.
            slowest = slowest.max(asked.elapsed());
        }
        rss_peak = rss_peak.max(rss());
        tokio::time::sleep(Duration::from_secs(1).saturating_sub(asked.elapsed())).await;
    }
    for slot in sockets.iter_mut() {
        if slot.as_ref().is_some_and(closed) {
            *slot = None;
        }
    }
    let closed = sockets.iter().filter(|s| s.is_none()).count();
    Outcome {
        target,
        opened,
        closed,
        normal_ok,
        normal_sent,
        slowest_normal: slowest,
        rss_before,
        rss_peak,
    }
}

/// Whether the server closed `socket` (or answered and closed): a read returns end of stream or
/// data instead of would-block.
fn closed(socket: &TcpStream) -> bool {
    let mut buf = [0u8; 256];
    match socket.try_read(&mut buf) {
        Ok(_) => true,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}
