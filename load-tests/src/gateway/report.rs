//! The gateway benchmark's checks and markdown: medians per route, the targets, and
//! every transfer with what it cost each process.

use std::fmt::Write as _;
use std::time::Duration;

use super::{Facts, Route, Timed, Trip, ARTIFACTS_ROUTE, ROUTES, SHM};
use crate::artifact::memory::mib;
use crate::markdown::{command_block, Align, Table};
use crate::units::{hex, ByteSize};

/// Gateway throughput over the direct store's, both ways, at least.
const THROUGHPUT_TARGET: f64 = 0.9;
/// Gateway peak resident memory below this.
const PEAK_RSS_TARGET: u64 = 128 << 20;
/// The gateway's time to first byte counts as independent of the object's size when what it adds
/// to the store's own first byte differs by at most this much between the large and the small
/// object: on two shared cores a few milliseconds of scheduling say nothing about the size (the
/// store's own first byte may grow with it; the gateway can only add to it).
const FIRST_BYTE_SLACK: Duration = Duration::from_millis(10);

/// One route's medians over the rounds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Summary {
    pub(crate) route: Route,
    pub(crate) put_mib_s: f64,
    pub(crate) get_mib_s: f64,
    pub(crate) large_first_byte: Duration,
    pub(crate) small_first_byte: Duration,
    /// Mean bytes the server wrote to disk per upload and per download; `None` without a server.
    pub(crate) put_writes: Option<f64>,
    pub(crate) get_writes: Option<f64>,
}

/// Whether one of the targets was met, and the figures that decide it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub(crate) target: String,
    pub(crate) met: bool,
    pub(crate) figures: String,
}

/// Everything that makes the run a failure: a download that differs from the upload.
pub(crate) fn verify(facts: &Facts, trips: &[Trip]) -> Vec<String> {
    let mut problems = Vec::new();
    for trip in trips {
        for (what, expected, received) in [
            (ByteSize(facts.size), facts.large, trip.large_received),
            (ByteSize(facts.small_size), facts.small, trip.small_received),
        ] {
            if received != expected {
                problems.push(format!(
                    "round {}: the {what} object downloaded via {} differs from the upload: \
                     {} bytes, sha256 {} (uploaded {} bytes, sha256 {})",
                    trip.round,
                    trip.route,
                    received.bytes,
                    hex(&received.sha256),
                    expected.bytes,
                    hex(&expected.sha256),
                ));
            }
        }
    }
    problems
}

pub(crate) fn summarize(trips: &[Trip], route: Route, size: u64) -> Option<Summary> {
    let mine: Vec<&Trip> = trips.iter().filter(|t| t.route == route).collect();
    if mine.is_empty() {
        return None;
    }
    let rate = |timed: &Timed| mib(size) / timed.elapsed.as_secs_f64().max(1e-9);
    let writes = |pick: fn(&Trip) -> &Timed| {
        let all: Option<Vec<u64>> = mine
            .iter()
            .map(|t| pick(t).server.map(|usage| usage.write_bytes))
            .collect();
        all.map(|all| all.iter().sum::<u64>() as f64 / all.len() as f64)
    };
    Some(Summary {
        route,
        put_mib_s: median(mine.iter().map(|t| rate(&t.put)).collect()),
        get_mib_s: median(mine.iter().map(|t| rate(&t.get)).collect()),
        large_first_byte: Duration::from_secs_f64(median(
            mine.iter()
                .map(|t| t.large_first_byte.as_secs_f64())
                .collect(),
        )),
        small_first_byte: Duration::from_secs_f64(median(
            mine.iter()
                .map(|t| t.small_first_byte.as_secs_f64())
                .collect(),
        )),
        put_writes: writes(|t| &t.put),
        get_writes: writes(|t| &t.get),
    })
}

/// The targets for the gateway, judged against the direct route of the same run.
pub(crate) fn verdicts(facts: &Facts, direct: &Summary, gateway: &Summary) -> Vec<Verdict> {
    let mut verdicts = Vec::new();
    for (direction, ours, reference) in [
        ("uploads", gateway.put_mib_s, direct.put_mib_s),
        ("downloads", gateway.get_mib_s, direct.get_mib_s),
    ] {
        let ratio = ours / reference.max(1e-9);
        verdicts.push(Verdict {
            target: format!("throughput of {direction} at least {THROUGHPUT_TARGET}× direct"),
            met: ratio >= THROUGHPUT_TARGET,
            figures: format!("{ratio:.2}× ({ours:.1} vs {reference:.1} MiB/s)"),
        });
    }
    let added = |ours: Duration, store: Duration| ours.as_secs_f64() - store.as_secs_f64();
    let added_large = added(gateway.large_first_byte, direct.large_first_byte);
    let added_small = added(gateway.small_first_byte, direct.small_first_byte);
    verdicts.push(Verdict {
        target: "time to first byte independent of object size".into(),
        met: added_large - added_small <= FIRST_BYTE_SLACK.as_secs_f64(),
        figures: format!(
            "{} ms for {} vs {} ms for {}; the store's own {} vs {} ms, so the gateway adds \
             {:+.1} vs {:+.1} ms",
            millis(gateway.large_first_byte),
            ByteSize(facts.size),
            millis(gateway.small_first_byte),
            ByteSize(facts.small_size),
            millis(direct.large_first_byte),
            millis(direct.small_first_byte),
            added_large * 1_000.0,
            added_small * 1_000.0,
        ),
    });
    if let Some(memory) = facts.gateway_memory_after {
        verdicts.push(Verdict {
            target: format!("peak RSS under {}", ByteSize(PEAK_RSS_TARGET)),
            met: memory.peak < PEAK_RSS_TARGET,
            figures: format!("VmHWM {:.1} MiB", mib(memory.peak)),
        });
    }
    let transfer_writes = gateway.put_writes.unwrap_or(0.0) + gateway.get_writes.unwrap_or(0.0);
    verdicts.push(Verdict {
        target: "no bytes written to local disk".into(),
        met: transfer_writes == 0.0 && facts.gateway_run_writes == 0,
        figures: format!(
            "{} bytes per upload, {} per download, {} in the whole run, while its log file (the \
             harness sends its stdout to a file on disk) grew by {} bytes",
            gateway.put_writes.unwrap_or(0.0).round(),
            gateway.get_writes.unwrap_or(0.0).round(),
            facts.gateway_run_writes,
            facts.gateway_log_growth,
        ),
    });
    verdicts
}

pub(crate) fn render(facts: &Facts, trips: &[Trip]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "### Artifact gateway\n");
    out.push_str(&command_block(&facts.command_line));
    let _ = writeln!(out, "\n{}\n", caption(facts));

    let summaries: Vec<Summary> = ROUTES
        .iter()
        .filter_map(|&route| summarize(trips, route, facts.size))
        .collect();
    let direct = summaries.iter().find(|s| s.route == Route::Direct);
    let mut table = Table::new(&[
        ("target", Align::Left),
        ("PUT MiB/s", Align::Right),
        ("PUT ÷ direct", Align::Right),
        ("GET MiB/s", Align::Right),
        ("GET ÷ direct", Align::Right),
        (&format!("TTFB {} ms", ByteSize(facts.size)), Align::Right),
        (
            &format!("TTFB {} ms", ByteSize(facts.small_size)),
            Align::Right,
        ),
        ("server peak RSS MiB", Align::Right),
        ("server disk writes per PUT MiB", Align::Right),
        ("per GET MiB", Align::Right),
    ]);
    for summary in &summaries {
        let ratio = |ours: f64, pick: fn(&Summary) -> f64| {
            direct.map_or_else(
                || "n/a".into(),
                |d| format!("{:.2}×", ours / pick(d).max(1e-9)),
            )
        };
        let peak = match summary.route {
            Route::Direct => None,
            Route::Mlflow => facts.mlflow_peak_rss,
            Route::Gateway => facts.gateway_memory_after.map(|m| m.peak),
        };
        let writes = |w: Option<f64>| {
            w.map_or_else(
                || "—".into(),
                |w| format!("{:.1}", w / f64::from(1u32 << 20)),
            )
        };
        table.row(vec![
            summary.route.to_string(),
            format!("{:.1}", summary.put_mib_s),
            ratio(summary.put_mib_s, |d| d.put_mib_s),
            format!("{:.1}", summary.get_mib_s),
            ratio(summary.get_mib_s, |d| d.get_mib_s),
            millis(summary.large_first_byte),
            millis(summary.small_first_byte),
            peak.map_or_else(|| "—".into(), |p| format!("{:.1}", mib(p))),
            writes(summary.put_writes),
            writes(summary.get_writes),
        ]);
    }
    out.push_str(&table.render());
    let _ = writeln!(
        out,
        "\nMedians over {} rounds; `÷ direct`: the route's median MiB/s over the direct route's. \
         Server peak RSS: the gateway's `VmHWM` (pid {}, `{}`) at the end of the run; for MLflow \
         the largest `VmHWM` among the {} processes of its group. Disk writes: the server process \
         group's `write_bytes`, mean per transfer.",
        facts.rounds, facts.gateway_pid, facts.gateway_process, facts.mlflow_processes
    );

    let gateway = summaries.iter().find(|s| s.route == Route::Gateway);
    if let (Some(direct), Some(gateway)) = (direct, gateway) {
        let _ = writeln!(out, "\nTargets for the gateway:");
        for verdict in verdicts(facts, direct, gateway) {
            let _ = writeln!(
                out,
                "- {}: {} — {}",
                verdict.target,
                if verdict.met { "met" } else { "**not met**" },
                verdict.figures
            );
        }
    }
    if let (Some(direct), Some(mlflow)) =
        (direct, summaries.iter().find(|s| s.route == Route::Mlflow))
    {
        let _ = writeln!(
            out,
            "\nMLflow's own proxy, for comparison: PUT {:.2}×, GET {:.2}× direct; first byte after \
             {} ms for {} and {} ms for {}; {:.1} MiB written to its disk per upload, {:.1} MiB \
             per download.",
            mlflow.put_mib_s / direct.put_mib_s.max(1e-9),
            mlflow.get_mib_s / direct.get_mib_s.max(1e-9),
            millis(mlflow.large_first_byte),
            ByteSize(facts.size),
            millis(mlflow.small_first_byte),
            ByteSize(facts.small_size),
            mlflow.put_writes.unwrap_or(0.0) / f64::from(1u32 << 20),
            mlflow.get_writes.unwrap_or(0.0) / f64::from(1u32 << 20),
        );
    }
    if let (Some(before), Some(after)) = (facts.gateway_memory_before, facts.gateway_memory_after) {
        let _ = writeln!(
            out,
            "\nGateway memory: before the warm-up {before}; after the last round {after}."
        );
    }

    let _ = writeln!(out, "\nEvery transfer, in the order it ran:\n");
    let mut detail = Table::new(&[
        ("round", Align::Right),
        ("target", Align::Left),
        ("direction", Align::Left),
        ("time s", Align::Right),
        ("MiB/s", Align::Right),
        ("TTFB ms", Align::Right),
        ("CPU s client", Align::Right),
        ("CPU s server", Align::Right),
        ("CPU s store", Align::Right),
        ("disk MiB server", Align::Right),
        ("disk MiB store", Align::Right),
        ("content", Align::Left),
    ]);
    for trip in trips {
        for (direction, timed) in [("PUT", &trip.put), ("GET", &trip.get)] {
            let get = direction == "GET";
            detail.row(vec![
                trip.round.to_string(),
                trip.route.to_string(),
                direction.to_string(),
                format!("{:.2}", timed.elapsed.as_secs_f64()),
                format!(
                    "{:.1}",
                    mib(facts.size) / timed.elapsed.as_secs_f64().max(1e-9)
                ),
                if get {
                    millis(trip.large_first_byte)
                } else {
                    "—".into()
                },
                seconds(timed.client_cpu),
                timed
                    .server
                    .map_or_else(|| "—".into(), |u| seconds(u.cpu())),
                seconds(timed.store.cpu()),
                timed
                    .server
                    .map_or_else(|| "—".into(), |u| format!("{:.1}", mib(u.write_bytes))),
                format!("{:.1}", mib(timed.store.write_bytes)),
                match (get, trip.large_received == facts.large) {
                    (false, _) => "—".into(),
                    (true, true) => "sha256 matches".into(),
                    (true, false) => "**differs**".into(),
                },
            ]);
        }
    }
    out.push_str(&detail.render());
    let _ = writeln!(
        out,
        "\nCPU: `utime + stime` from `/proc/<pid>/stat` summed over each process group (10 ms \
         ticks); boto3's from its own `getrusage`. The direct route's TTFB is a separate GET \
         of the same object (see above), not boto3's ranged download."
    );
    out
}

fn caption(facts: &Facts) -> String {
    let boto3 = facts.boto3.as_ref().map_or_else(
        || "boto3".to_string(),
        |b| {
            format!(
                "boto3 {} (default managed transfer: parts of {} above {}, {} threads)",
                b.version,
                ByteSize(b.part_size),
                ByteSize(b.multipart_threshold),
                b.max_concurrency
            )
        },
    );
    let proxy_args = if facts.proxy_args.is_empty() {
        "its defaults otherwise".to_string()
    } else {
        format!("and `{}`", facts.proxy_args.join(" "))
    };
    format!(
        "{rounds} rounds; in each, one {size} object of pseudo-random bytes (the same bytes every \
         time, sha256 `{sha}…`, generated before the clock starts) goes up and comes back down \
         through each target in turn, the targets' order rotated each round, and the object is \
         deleted before the next target. Targets, all on the same SeaweedFS bucket: **direct** — \
         {boto3} from the project's virtual environment, `upload_fileobj`/`download_fileobj` \
         with a file in {SHM} (tmpfs, so memory and not disk on the client side) and checksums \
         `when_required`, in a Python process of its own per transfer that starts its clock after \
         its imports and a `head_bucket`; **MLflow** {mlflow}'s own artifact proxy (`mlflow \
         server --serve-artifacts --artifacts-destination s3://mlflow/artifacts`); the \
         **gateway**, mlscope-proxy with `--artifacts-destination s3://mlflow/artifacts \
         --s3-endpoint-url <SeaweedFS> --s3-quirks seaweedfs` {proxy_args}. MLflow and the \
         gateway get `PUT` and `GET {ARTIFACTS_ROUTE}/<experiment>/<run>/artifacts/<file>` \
         (inside an existing run, which the gateway checks) from the bench's Rust client \
         (reqwest), the upload sent from memory in {chunk} slices with its Content-Length, the \
         download copied into a buffer allocated once; every download is hashed after its clock \
         stops and must match the upload. After every upload the page cache is flushed (`sync`, \
         outside the clocks), so no download starts while the store still writes the upload \
         back. TTFB: from sending the GET to the first byte of the body; for direct, a separate \
         unsigned GET straight to SeaweedFS from the same Rust client, dropped after the first \
         byte. A {small} object goes up and down through each target after the large one, for \
         its TTFB. Disk writes: `write_bytes` of `/proc/<pid>/io` (bytes dirtied in the \
         page cache of disk-backed files, also when the file is deleted before writeback; tmpfs \
         does not count) over each server's process group. Load average (1, 5, 15 min) {load} \
         before the run, {load_after} after it; {cpus} logical CPUs shared by the bench, boto3, \
         SeaweedFS, MLflow and the gateway.",
        rounds = facts.rounds,
        size = ByteSize(facts.size),
        sha = &hex(&facts.large.sha256)[..16],
        mlflow = facts
            .mlflow_version
            .as_deref()
            .unwrap_or("(version unknown)"),
        chunk = ByteSize(facts.chunk_size),
        small = ByteSize(facts.small_size),
        load = facts.load_before.as_deref().unwrap_or("unknown"),
        load_after = facts.load_after.as_deref().unwrap_or("unknown"),
        cpus = facts.cpus,
    )
}

fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    if values.len() % 2 == 1 {
        values[middle]
    } else {
        (values[middle - 1] + values[middle]) / 2.0
    }
}

fn millis(duration: Duration) -> String {
    format!("{:.1}", duration.as_secs_f64() * 1_000.0)
}

fn seconds(duration: Duration) -> String {
    format!("{:.2}", duration.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::super::procfs::Usage;
    use super::super::transfer::Content;
    use super::*;
    use crate::artifact::memory::ResidentMemory;

    const SIZE: u64 = 1 << 30;

    fn timed(seconds: f64, server_writes: Option<u64>) -> Timed {
        Timed {
            elapsed: Duration::from_secs_f64(seconds),
            client_cpu: Duration::ZERO,
            server: server_writes.map(|write_bytes| Usage {
                cpu_ticks: 0,
                write_bytes,
            }),
            store: Usage::default(),
        }
    }

    fn content(bytes: u64, byte: u8) -> Content {
        Content {
            bytes,
            sha256: [byte; 32],
        }
    }

    fn trip(round: u32, route: Route, put_s: f64, get_s: f64, ttfb_ms: u64) -> Trip {
        let writes = (route != Route::Direct).then_some(0);
        Trip {
            round,
            route,
            put: timed(put_s, writes),
            get: timed(get_s, writes),
            large_received: content(SIZE, 1),
            large_first_byte: Duration::from_millis(ttfb_ms),
            small_received: content(1 << 20, 2),
            small_first_byte: Duration::from_millis(2),
        }
    }

    fn facts() -> Facts {
        Facts {
            command_line: "mlscope-bench gateway".into(),
            size: SIZE,
            small_size: 1 << 20,
            rounds: 3,
            chunk_size: 1 << 20,
            proxy_args: Vec::new(),
            large: content(SIZE, 1),
            small: content(1 << 20, 2),
            boto3: None,
            mlflow_version: Some("3.17.2".into()),
            cpus: 2,
            load_before: Some("0.10 0.20 0.30".into()),
            load_after: None,
            gateway_pid: 42,
            gateway_process: "mlscope-proxy".into(),
            gateway_memory_before: None,
            gateway_memory_after: Some(ResidentMemory {
                peak: 40 << 20,
                current: 20 << 20,
            }),
            gateway_run_writes: 0,
            gateway_log_growth: 900,
            mlflow_peak_rss: Some(300 << 20),
            mlflow_processes: 2,
        }
    }

    #[test]
    fn summaries_take_the_median_round() {
        let trips = [
            trip(1, Route::Gateway, 8.0, 4.0, 3),
            trip(2, Route::Gateway, 4.0, 16.0, 5),
            trip(3, Route::Gateway, 16.0, 8.0, 4),
            trip(1, Route::Direct, 1.0, 1.0, 1),
        ];
        let summary = summarize(&trips, Route::Gateway, SIZE).expect("gateway trips");
        assert_eq!(summary.put_mib_s, 128.0);
        assert_eq!(summary.get_mib_s, 128.0);
        assert_eq!(summary.large_first_byte, Duration::from_millis(4));
        assert_eq!(summary.put_writes, Some(0.0));
        let direct = summarize(&trips, Route::Direct, SIZE).expect("direct trip");
        assert_eq!(direct.put_writes, None);
        assert_eq!(summarize(&trips, Route::Mlflow, SIZE), None);
    }

    #[test]
    fn the_gateway_is_judged_against_the_direct_route_of_the_same_run() {
        let trips = [
            trip(1, Route::Direct, 8.0, 4.0, 5),
            trip(1, Route::Gateway, 10.0, 4.0, 14),
        ];
        let direct = summarize(&trips, Route::Direct, SIZE).expect("direct");
        let gateway = summarize(&trips, Route::Gateway, SIZE).expect("gateway");
        let judged = verdicts(&facts(), &direct, &gateway);
        let met: Vec<bool> = judged.iter().map(|v| v.met).collect();
        // Uploads 0.8× (not met), downloads 1.0×, first byte 14 ms vs 2 ms where the store's
        // own is 5 vs 2 ms (the gateway adds 9 vs 0 ms: within the 10 ms slack), 40 MiB peak,
        // nothing written.
        assert_eq!(met, vec![false, true, true, true, true]);
        assert_eq!(judged[0].figures, "0.80× (102.4 vs 128.0 MiB/s)");

        let slow_first_byte = [trip(1, Route::Gateway, 8.0, 4.0, 17)];
        let gateway = summarize(&slow_first_byte, Route::Gateway, SIZE).expect("gateway");
        assert!(!verdicts(&facts(), &direct, &gateway)[2].met);
    }

    #[test]
    fn a_download_that_differs_from_the_upload_is_a_problem() {
        let mut bad = trip(2, Route::Mlflow, 1.0, 1.0, 1);
        bad.large_received = content(SIZE, 9);
        let problems = verify(&facts(), &[trip(1, Route::Gateway, 1.0, 1.0, 1), bad]);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("round 2") && problems[0].contains("MLflow"));
    }

    #[test]
    fn the_report_has_one_summary_row_per_target_and_two_rows_per_trip() {
        let trips: Vec<Trip> = ROUTES
            .iter()
            .map(|&route| trip(1, route, 8.0, 4.0, 3))
            .collect();
        let markdown = render(&facts(), &trips);
        assert!(
            markdown.contains("| boto3 → SeaweedFS (direct) | 128.0 | 1.00× |"),
            "{markdown}"
        );
        assert!(markdown.contains("TTFB 1GiB ms"));
        assert_eq!(markdown.matches("sha256 matches").count(), 3);
        assert!(markdown.contains("- peak RSS under 128MiB: met — VmHWM 40.0 MiB"));
    }
}
