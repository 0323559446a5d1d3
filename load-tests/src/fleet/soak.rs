//! Resources of the proxies over a long fleet run (`--sample-every`): resident memory and open
//! file descriptors of every mlscope-proxy process (summed over replicas), the requests waiting in
//! their coalescers and in flight, and the rows of the replicas' state database. A soak passes when
//! these stay flat; the report gives start, peak and end of each.

use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::prometheus;

/// One reading of every series.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sample {
    pub(crate) at: Duration,
    pub(crate) rss_bytes: u64,
    pub(crate) open_fds: u64,
    pub(crate) queued_requests: f64,
    pub(crate) in_flight: f64,
    /// Rows of every state table but the run report's series and histograms.
    pub(crate) state_rows: Option<u64>,
    /// Rows of the run report's series and histograms: they grow with a run's first minutes, to
    /// a bound (240 buckets per series), not flat (`mlscope-bench report-cost` measures them).
    pub(crate) report_rows: Option<u64>,
}

/// Samples in the background until [`Sampler::finish`].
pub(crate) struct Sampler {
    stop: watch::Sender<bool>,
    task: JoinHandle<Vec<Sample>>,
}

impl Sampler {
    pub(crate) fn start(
        every: Duration,
        client: reqwest::Client,
        pids: Vec<u32>,
        admin_urls: Vec<String>,
        state_database: Option<String>,
    ) -> Sampler {
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(every);
            loop {
                // One sample per tick, and a last one once the load has been answered.
                let last = tokio::select! {
                    _ = tick.tick() => false,
                    _ = stopped.changed() => true,
                };
                let mut sample = Sample {
                    at: started.elapsed(),
                    ..Sample::default()
                };
                for pid in &pids {
                    sample.rss_bytes += rss_bytes(*pid).unwrap_or(0);
                    sample.open_fds += open_fds(*pid).unwrap_or(0);
                }
                for url in &admin_urls {
                    if let Some(text) = prometheus::scrape(&client, url).await {
                        // A space after the name: the gauge itself, not a longer name.
                        sample.queued_requests +=
                            prometheus::sum(&text, "mlscope_coalesce_queued_requests ");
                        sample.in_flight +=
                            prometheus::sum(&text, "mlscope_http_requests_in_flight ");
                    }
                }
                if let Some(url) = &state_database {
                    sample.state_rows = state_rows(url, false).await;
                    sample.report_rows = state_rows(url, true).await;
                }
                samples.push(sample);
                if last {
                    break;
                }
            }
            samples
        });
        Sampler { stop, task }
    }

    pub(crate) async fn finish(self) -> Vec<Sample> {
        let _ = self.stop.send(true);
        self.task.await.unwrap_or_default()
    }
}

/// The resident set of process `pid` now (`VmRSS`), in bytes.
pub(crate) fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn open_fds(pid: u32) -> Option<u64> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64)
}

/// The run report's tables.
const REPORT_TABLES: &str = "('rank_series', 'rank_histogram')";

/// Rows in the tables of the state database's public schema, counted exactly with psql: the run
/// report's (`report`), or every other one.
async fn state_rows(url: &str, report: bool) -> Option<u64> {
    let which = if report { "IN" } else { "NOT IN" };
    let query = format!("SELECT coalesce(sum((xpath('/row/c/text()', query_to_xml(format('SELECT count(*) AS c FROM %I', table_name), false, true, '')))[1]::text::bigint), 0) FROM information_schema.tables WHERE table_schema = 'public' AND table_name <> '_sqlx_migrations' AND table_name {which} {REPORT_TABLES}");
    let output = tokio::process::Command::new("psql")
        .args([url, "-At", "-c", &query])
        .output()
        .await
        .ok()?;
    String::from_utf8_lossy(&output.stdout).trim().parse().ok()
}

/// `| series | start | peak | end |` for the report.
pub(crate) fn table(samples: &[Sample]) -> String {
    let (Some(first), Some(last)) = (samples.first(), samples.last()) else {
        return "No resource samples were taken.\n".into();
    };
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0));
    let mut out = format!(
        "Resources of the mlscope-proxy processes, {} samples over {:.0} s:\n\n| series | start | peak | end |\n|---|---:|---:|---:|\n",
        samples.len(),
        last.at.as_secs_f64()
    );
    let peak_u = |f: fn(&Sample) -> u64| samples.iter().map(f).max().unwrap_or(0);
    let peak_f = |f: fn(&Sample) -> f64| samples.iter().map(f).fold(0.0, f64::max);
    out.push_str(&format!(
        "| resident memory (sum over processes) | {} | {} | {} |\n",
        mib(first.rss_bytes),
        mib(peak_u(|s| s.rss_bytes)),
        mib(last.rss_bytes)
    ));
    out.push_str(&format!(
        "| open file descriptors | {} | {} | {} |\n",
        first.open_fds,
        peak_u(|s| s.open_fds),
        last.open_fds
    ));
    out.push_str(&format!(
        "| requests queued in the coalescers | {:.0} | {:.0} | {:.0} |\n",
        first.queued_requests,
        peak_f(|s| s.queued_requests),
        last.queued_requests
    ));
    out.push_str(&format!(
        "| requests in flight | {:.0} | {:.0} | {:.0} |\n",
        first.in_flight,
        peak_f(|s| s.in_flight),
        last.in_flight
    ));
    if first.state_rows.is_some() {
        let rows = |s: &Sample| s.state_rows.map_or("–".into(), |r| r.to_string());
        out.push_str(&format!(
            "| state database rows | {} | {} | {} |\n",
            rows(first),
            samples
                .iter()
                .filter_map(|s| s.state_rows)
                .max()
                .unwrap_or(0),
            rows(last)
        ));
    }
    if first.report_rows.is_some() {
        let rows = |s: &Sample| s.report_rows.map_or("–".into(), |r| r.to_string());
        out.push_str(&format!(
            "| run report rows (bounded: 240 buckets per series) | {} | {} | {} |\n",
            rows(first),
            samples
                .iter()
                .filter_map(|s| s.report_rows)
                .max()
                .unwrap_or(0),
            rows(last)
        ));
    }
    out
}
