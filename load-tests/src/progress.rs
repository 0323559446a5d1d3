//! Progress bars on stderr, so stdout carries nothing but the report. indicatif hides them when
//! stderr is not a terminal.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

const TICK: Duration = Duration::from_millis(120);

/// A spinner for a step of unknown length, such as starting the stack.
pub(crate) fn spinner(message: impl Into<String>) -> ProgressBar {
    let bar = ProgressBar::new_spinner().with_message(message.into());
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed}] {msg}").expect("valid template"),
    );
    bar.enable_steady_tick(TICK);
    bar
}

/// A bar over planned load time in milliseconds.
pub(crate) fn timed_bar(planned: Duration) -> ProgressBar {
    let bar = ProgressBar::new(planned.as_millis() as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed}/~{duration}] {wide_bar} {percent:>3}% {msg}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.enable_steady_tick(TICK);
    bar
}

/// A bar over a number of requests.
pub(crate) fn count_bar(total: u64) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed}] {wide_bar} {pos}/{len} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(TICK);
    bar
}

/// A bar over bytes transferred.
pub(crate) fn bytes_bar(total: u64, message: impl Into<String>) -> ProgressBar {
    let bar = ProgressBar::new(total).with_message(message.into());
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>16} {wide_bar} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar
}
