//! What the collector's data watch costs per round on a large local tree — the fingerprint scan
//! (one `readdir` per directory, one `stat` per file, SHA-256 over path, size and mtime) and the
//! comparison with the previous scan — in wall time, CPU time of the scanning thread and memory
//! of the file list, with the collector's own code on one thread. Markdown on stdout, for
//! BENCHMARKS.md:
//!
//! ```sh
//! cargo bench -p mlscope-collector --bench data_scan -- [--files 1000000] [--per-dir 1000]
//!     [--scans 3] [--drop-caches] [--dir DIR]
//! ```

use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use clap::Parser;
use mlscope_collector::data::scan::{scan, Scan, ScanBudget};
use mlscope_collector::data::Diff;

#[derive(Debug, Parser)]
#[command(
    name = "data_scan",
    about = "What a data watch round costs on a generated tree"
)]
struct Args {
    /// Files in the generated tree.
    #[arg(long, default_value_t = 1_000_000)]
    files: u64,
    /// Files per directory.
    #[arg(long, default_value_t = 1000)]
    per_dir: u64,
    /// Scans after the first (warm: the tree's directories and inodes in the kernel's caches).
    #[arg(long, default_value_t = 3)]
    scans: u32,
    /// Drop the page, dentry and inode caches before the first scan (needs root; drops the
    /// whole machine's clean caches), so that the first scan is cold.
    #[arg(long)]
    drop_caches: bool,
    /// Where to build the tree (a directory of its own is made in it and removed after)
    /// [default: the temporary directory].
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Passed by `cargo bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

type Result<T> = std::result::Result<T, String>;

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if args.files == 0 || args.per_dir == 0 || args.scans == 0 {
        eprintln!("data_scan: --files, --per-dir and --scans must be at least 1");
        return std::process::ExitCode::from(64);
    }
    let command_line = format!(
        "cargo bench -p mlscope-collector --bench data_scan -- {}",
        std::env::args()
            .skip(1)
            .filter(|a| a != "--bench")
            .collect::<Vec<_>>()
            .join(" ")
    );
    match run(&args, command_line.trim_end()) {
        Ok((markdown, problems)) => {
            print!("{markdown}");
            for problem in &problems {
                eprintln!("data_scan: {problem}");
            }
            if problems.is_empty() {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::FAILURE
            }
        }
        Err(error) => {
            eprintln!("data_scan: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// A markdown table with the numeric columns right-aligned.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut out = format!(
        "| {} |\n|---|{}\n",
        header.join(" | "),
        "---:|".repeat(header.len() - 1)
    );
    for row in rows {
        let _ = writeln!(out, "| {} |", row.join(" | "));
    }
    out
}

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
fn build_tree(root: &Path, files: u64, per_dir: u64) -> Result<Duration> {
    let started = Instant::now();
    let mut dir = root.to_owned();
    for i in 0..files {
        if i % per_dir == 0 {
            dir = root.join(format!("shard-{:05}", i / per_dir));
            fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
        let file = fs::File::create(dir.join(format!("sample-{i:09}.bin")))
            .map_err(|e| format!("creating file {i} in {}: {e}", dir.display()))?;
        file.set_len(i % 4096).map_err(|e| e.to_string())?;
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

fn measure(label: String, root: &Path, budget: ScanBudget) -> Result<Measured> {
    let cpu = thread_cpu();
    let started = Instant::now();
    let scan = scan(
        root,
        budget,
        &AtomicBool::new(false),
        Duration::from_secs(10),
        "bench",
    )
    .map_err(|e| format!("scanning the tree: {e}"))?;
    Ok(Measured {
        label,
        wall: started.elapsed(),
        cpu: thread_cpu().saturating_sub(cpu),
        scan,
    })
}

fn run(args: &Args, command_line: &str) -> Result<(String, Vec<String>)> {
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let tree = tempfile::Builder::new()
        .prefix("mlscope-data-scan-")
        .tempdir_in(&parent)
        .map_err(|e| format!("creating a directory in {}: {e}", parent.display()))?;
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

    let mut rows = Vec::new();
    for r in &runs {
        let files = r.scan.files as f64;
        rows.push(vec![
            r.label.clone(),
            r.scan.files.to_string(),
            format!("{:.2}", r.wall.as_secs_f64()),
            format!("{:.2}", r.cpu.as_secs_f64()),
            format!("{:.0}", files / r.wall.as_secs_f64()),
            format!("{:.2}", r.cpu.as_secs_f64() * 1e6 / files),
        ]);
    }
    rows.push(vec![
        "compare the last two scans".into(),
        b.files.to_string(),
        format!("{:.2}", diff_wall.as_secs_f64()),
        format!("{:.2}", diff_cpu.as_secs_f64()),
        format!("{:.0}", b.files as f64 / diff_wall.as_secs_f64()),
        format!("{:.2}", diff_cpu.as_secs_f64() * 1e6 / b.files as f64),
    ]);
    let list_bytes = b.list.heap_bytes();
    let mut markdown = format!("```sh\n{command_line}\n```\n");
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
    markdown.push_str(&table(
        &["scan", "files", "wall s", "CPU s", "files/s", "CPU µs/file"],
        &rows,
    ));
    let _ = writeln!(
        markdown,
        "\nFile list kept between rounds: {:.1} MB, {:.1} bytes per file (front-coded paths and \
         an 8-byte size/mtime key). A watch round is one scan plus the comparison.",
        list_bytes as f64 / 1e6,
        list_bytes as f64 / b.files.max(1) as f64
    );
    eprintln!("data-scan: removing the tree");
    drop(tree);
    Ok((markdown, problems))
}
