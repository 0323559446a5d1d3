//! `mlscope-bench data-scan`: what the collector's data watch costs per round on a large local
//! tree — the fingerprint scan (one `readdir` per directory, one `stat` per file, SHA-256 over
//! path, size and mtime) and the comparison with the previous scan — in wall time, CPU time of
//! the scanning thread and memory of the file list. Runs in process on one thread, with the
//! collector's own code (`mlscope_collector::data::scan`).

use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use mlscope_collector::data::scan::{scan, Scan, ScanBudget};
use mlscope_collector::data::Diff;

use crate::cli::DataScanArgs;
use crate::markdown::{command_block, Align, Table};
use crate::Report;

/// CPU time of the calling thread (`/proc/thread-self/schedstat`, nanoseconds on a CPU).
fn thread_cpu() -> Duration {
    fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .map(Duration::from_nanos)
        .unwrap_or_default()
}

/// Builds `files` sparse files (sizes 0..4095 bytes, no data written) in directories of
/// `per_dir`: `shard-00042/sample-000042123.bin`.
fn build_tree(root: &Path, files: u64, per_dir: u64) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut dir = root.to_owned();
    for i in 0..files {
        if i % per_dir == 0 {
            dir = root.join(format!("shard-{:05}", i / per_dir));
            fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let file = fs::File::create(dir.join(format!("sample-{i:09}.bin")))
            .with_context(|| format!("creating file {i} in {}", dir.display()))?;
        file.set_len(i % 4096)?;
        if i % 100_000 == 99_999 {
            eprintln!("data-scan: {} files created", i + 1);
        }
    }
    Ok(started.elapsed())
}

/// Sync, then drop the page, dentry and inode caches (root only; the whole machine's).
fn drop_caches() -> bool {
    let _ = std::process::Command::new("sync").status();
    fs::write("/proc/sys/vm/drop_caches", "3\n").is_ok()
}

struct Measured {
    label: String,
    scan: Scan,
    wall: Duration,
    cpu: Duration,
}

fn measure(label: String, root: &Path, budget: ScanBudget) -> anyhow::Result<Measured> {
    let cpu = thread_cpu();
    let started = Instant::now();
    let scan = scan(
        root,
        budget,
        &AtomicBool::new(false),
        Duration::from_secs(10),
        "bench",
    )
    .context("scanning the tree")?;
    Ok(Measured {
        label,
        wall: started.elapsed(),
        cpu: thread_cpu().saturating_sub(cpu),
        scan,
    })
}

pub(crate) fn run(args: &DataScanArgs, command_line: &str) -> anyhow::Result<Report> {
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let tree = tempfile::Builder::new()
        .prefix("mlscope-data-scan-")
        .tempdir_in(&parent)
        .with_context(|| format!("creating a directory in {}", parent.display()))?;
    eprintln!(
        "data-scan: building {} files in {}",
        args.files,
        tree.path().display()
    );
    let built = build_tree(tree.path(), args.files, args.per_dir)?;
    let budget = ScanBudget {
        max_files: u64::MAX,
        max_time: Duration::from_secs(3600),
    };
    let mut problems = Vec::new();
    let cold = args.drop_caches && drop_caches();
    if args.drop_caches && !cold {
        problems.push("--drop-caches: cannot write /proc/sys/vm/drop_caches (not root?)".into());
    }
    let first = if cold {
        "first, caches dropped (cold)"
    } else {
        "first, right after building (cold-ish: dentries and inodes cached)"
    };
    let mut runs = vec![measure(first.to_owned(), tree.path(), budget)?];
    for n in 1..=args.scans {
        runs.push(measure(format!("warm {n}"), tree.path(), budget)?);
    }
    let diff_cpu = thread_cpu();
    let diff_started = Instant::now();
    let (a, b) = (&runs[runs.len() - 2].scan, &runs[runs.len() - 1].scan);
    let diff = Diff::between(&a.list, false, &b.list, false);
    let (diff_wall, diff_cpu) = (
        diff_started.elapsed(),
        thread_cpu().saturating_sub(diff_cpu),
    );
    if !diff.is_empty() || a.digest != b.digest {
        problems.push(format!(
            "two scans of an unchanged tree differ: {}",
            diff.describe()
        ));
    }
    if runs.iter().any(|r| r.scan.files != args.files) {
        problems.push("a scan did not count every file".into());
    }

    let mut table = Table::new(&[
        ("scan", Align::Left),
        ("files", Align::Right),
        ("wall s", Align::Right),
        ("CPU s", Align::Right),
        ("files/s", Align::Right),
        ("CPU µs/file", Align::Right),
    ]);
    for r in &runs {
        let files = r.scan.files as f64;
        table.row(vec![
            r.label.clone(),
            r.scan.files.to_string(),
            format!("{:.2}", r.wall.as_secs_f64()),
            format!("{:.2}", r.cpu.as_secs_f64()),
            format!("{:.0}", files / r.wall.as_secs_f64()),
            format!("{:.2}", r.cpu.as_secs_f64() * 1e6 / files),
        ]);
    }
    table.row(vec![
        "compare the last two scans".into(),
        b.files.to_string(),
        format!("{:.2}", diff_wall.as_secs_f64()),
        format!("{:.2}", diff_cpu.as_secs_f64()),
        format!("{:.0}", b.files as f64 / diff_wall.as_secs_f64()),
        format!("{:.2}", diff_cpu.as_secs_f64() * 1e6 / b.files as f64),
    ]);
    let list_bytes = b.list.heap_bytes();
    let mut markdown = command_block(command_line);
    let _ = writeln!(
        markdown,
        "\n{} files (sparse, 0–4095 bytes) in directories of {} under {}, built in {:.0} s; \
         {} scans after the first; one thread, the collector's scan code.\n",
        args.files,
        args.per_dir,
        parent.display(),
        built.as_secs_f64(),
        args.scans
    );
    markdown.push_str(&table.render());
    let _ = writeln!(
        markdown,
        "\nFile list kept between rounds: {:.1} MB, {:.1} bytes per file (front-coded paths and \
         an 8-byte size/mtime key). A watch round is one scan plus the comparison.",
        list_bytes as f64 / 1e6,
        list_bytes as f64 / b.files.max(1) as f64
    );
    eprintln!("data-scan: removing the tree");
    drop(tree);
    Ok(Report { markdown, problems })
}
