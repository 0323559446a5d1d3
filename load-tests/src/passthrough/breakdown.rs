//! Where a request's time goes inside mlscope-proxy, read from its own request log: each line
//! carries `latency_ms` (from the request's head to the answer's head, inside the proxy) and,
//! where MLflow answered, `upstream_ms` (MLflow's part of it, connection pool included). The
//! difference is the proxy's own work and waiting: its layers, the fair share's bookkeeping, the
//! coalescer's queue and its task hand-overs. What neither covers (the kernel, hyper reading
//! the head and writing the answer) is the end-to-end figure less `latency_ms`.

use std::fs::File;
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::Path;
use std::time::SystemTime;

use hdrhistogram::Histogram;
use serde_json::Value;

/// The proxy's log lines of one endpoint over a stretch of the run.
pub(crate) struct Breakdown {
    /// `latency_ms`: inside the proxy, head to head.
    pub(crate) inside: Histogram<u64>,
    /// `latency_ms` less `upstream_ms`: the proxy's own part.
    pub(crate) own: Histogram<u64>,
    /// `upstream_ms`: MLflow's part.
    pub(crate) upstream: Histogram<u64>,
}

impl Breakdown {
    pub(crate) fn new() -> Self {
        let histogram = || Histogram::<u64>::new(3).expect("a histogram");
        Breakdown {
            inside: histogram(),
            own: histogram(),
            upstream: histogram(),
        }
    }

    pub(crate) fn requests(&self) -> u64 {
        self.own.len()
    }

    /// Reads the log lines written from byte `from` on, for requests to `path` which MLflow
    /// answered (the proxy's own answers have no MLflow part) at `since` or later: the proxy
    /// writes its request lines in batches, so lines of the warm-up may follow `from`.
    pub(crate) fn read(
        &mut self,
        log: &Path,
        from: u64,
        path: &str,
        since: SystemTime,
    ) -> std::io::Result<()> {
        let mut file = File::open(log)?;
        file.seek(SeekFrom::Start(from))?;
        for line in BufReader::new(file).lines() {
            let Ok(line) = line else { break };
            let Ok(entry) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if entry["span"]["path"] != path {
                continue;
            }
            let logged = entry["timestamp"]
                .as_str()
                .and_then(|t| humantime::parse_rfc3339_weak(t).ok());
            if logged.is_some_and(|logged| logged < since) {
                continue;
            }
            let (Some(latency), Some(upstream)) =
                (entry["latency_ms"].as_f64(), entry["upstream_ms"].as_f64())
            else {
                continue;
            };
            let micros = |ms: f64| (ms.max(0.0) * 1e3).round() as u64;
            let _ = self.inside.record(micros(latency));
            let _ = self.own.record(micros(latency - upstream));
            let _ = self.upstream.record(micros(upstream));
        }
        Ok(())
    }
}

/// The size of the log now: where the next stretch's lines start.
pub(crate) fn log_size(log: &Path) -> u64 {
    std::fs::metadata(log).map_or(0, |m| m.len())
}

/// A quantile of `histogram` in milliseconds.
pub(crate) fn ms(histogram: &Histogram<u64>, quantile: f64) -> f64 {
    histogram.value_at_quantile(quantile) as f64 / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_answered_lines_of_the_endpoint_count_and_the_difference_is_the_proxys() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("proxy.log");
        let lines = [
            r#"{"timestamp":"2026-12-05T19:00:00.000100Z","latency_ms":0.9,"upstream_ms":0.5,"span":{"path":"/api/2.0/mlflow/runs/log-batch"}}"#,
            // Before the stretch began (a warm-up line written with the batch after it).
            r#"{"timestamp":"2026-12-05T18:59:59.999900Z","latency_ms":7.0,"upstream_ms":0.5,"span":{"path":"/api/2.0/mlflow/runs/log-batch"}}"#,
            r#"{"latency_ms":2.0,"span":{"path":"/api/2.0/mlflow/runs/log-batch"}}"#,
            r#"{"latency_ms":3.0,"upstream_ms":1.0,"span":{"path":"/api/2.0/mlflow/runs/get"}}"#,
            "not json",
        ];
        std::fs::write(&log, lines.join("\n")).unwrap();
        let since = humantime::parse_rfc3339("2026-12-05T19:00:00Z").unwrap();
        let mut breakdown = Breakdown::new();
        breakdown
            .read(&log, 0, "/api/2.0/mlflow/runs/log-batch", since)
            .unwrap();
        assert_eq!(breakdown.requests(), 1);
        assert!((ms(&breakdown.own, 0.5) - 0.4).abs() < 0.01);
        assert!((ms(&breakdown.upstream, 0.5) - 0.5).abs() < 0.01);
        // From an offset: only what was written after it.
        let mut later = Breakdown::new();
        later
            .read(
                &log,
                log_size(&log),
                "/api/2.0/mlflow/runs/log-batch",
                since,
            )
            .unwrap();
        assert_eq!(later.requests(), 0);
    }
}
