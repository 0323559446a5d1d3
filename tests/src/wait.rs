//! Waiting for conditions: tests wait for what they need, never for a fixed time.
//!
//! - [`eventually`] polls a check until it holds and returns what it found; after the timeout it
//!   panics with what was awaited, the timeout and the last state the check saw.
//! - [`consistently`] is the negative form ("nothing happened for 3 s"): it checks over the whole
//!   window and panics as soon as the check fails.
//! - [`eventually_blocking`] and [`consistently_blocking`] are the same for std-thread code.
//!
//! A check returns `Ok(value)` when the condition holds and `Err(state)` when it does not (yet),
//! `state` being what it observed, for the failure message. Checks are polled after 20 ms, then
//! ever less often, up to every 500 ms; the last check of [`eventually`] falls on its deadline,
//! the last one of [`consistently`] at the end of its window.
//!
//! Timeouts are meant to be generous: a passing test returns as soon as its condition holds, so a
//! long timeout costs nothing but on a failure. On a slow or loaded machine,
//! `MLSCOPE_TEST_TIMEOUT_SCALE` (a positive number, default 1) multiplies every timeout and every
//! window given to these functions, and [`scaled`] does the same for other timeouts.
//!
//! The model is linkerd2-proxy's `assert_eventually!`.

use std::fmt::Display;
use std::sync::OnceLock;
use std::time::Duration;

/// The first pause between two checks; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(20);
const MAX_PAUSE: Duration = Duration::from_millis(500);
/// How long a check of [`eventually`] may still run once the deadline has passed, before the wait
/// fails as a check that hangs.
const CHECK_GRACE: Duration = Duration::from_secs(30);

/// The environment variable that scales every timeout.
pub const TIMEOUT_SCALE_VAR: &str = "MLSCOPE_TEST_TIMEOUT_SCALE";

/// `timeout` multiplied by `MLSCOPE_TEST_TIMEOUT_SCALE` (1 when unset).
///
/// # Panics
///
/// When the variable is set to anything but a positive number.
pub fn scaled(timeout: Duration) -> Duration {
    static SCALE: OnceLock<f64> = OnceLock::new();
    let scale = *SCALE.get_or_init(|| match std::env::var(TIMEOUT_SCALE_VAR) {
        Err(_) => 1.0,
        Ok(value) => match value.trim().parse::<f64>() {
            Ok(scale) if scale.is_finite() && scale > 0.0 => scale,
            _ => panic!("{TIMEOUT_SCALE_VAR}={value:?}: expected a positive number"),
        },
    });
    timeout.mul_f64(scale)
}

/// The pauses between checks: 20 ms, doubling up to 500 ms.
struct Backoff(Duration);

impl Backoff {
    fn new() -> Backoff {
        Backoff(FIRST_PAUSE)
    }

    /// The next pause, never beyond `left`.
    fn next(&mut self, left: Duration) -> Duration {
        let pause = self.0.min(left);
        self.0 = (self.0 * 2).min(MAX_PAUSE);
        pause
    }
}

/// Polls `check` until it returns `Ok`, and returns that value.
///
/// # Panics
///
/// When `check` has not held within `within` (scaled, see the module doc), with `what`, the
/// timeout and the state of the last check; when one check runs 30 s past the deadline; and
/// when `check` panics.
///
/// ```no_run
/// # async fn example(url: &str) {
/// use std::time::Duration;
/// let body = mlscope_tests::eventually(Duration::from_secs(30), "the proxy answers", async || {
///     match reqwest::get(url).await {
///         Ok(response) => Ok(response.text().await.unwrap()),
///         Err(e) => Err(e.to_string()),
///     }
/// })
/// .await;
/// # }
/// ```
pub async fn eventually<T>(
    within: Duration,
    what: impl Display,
    mut check: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    let within = scaled(within);
    let start = tokio::time::Instant::now();
    let deadline = start + within;
    let mut backoff = Backoff::new();
    let mut checks = 0u32;
    loop {
        checks += 1;
        let limit = deadline.max(tokio::time::Instant::now()) + CHECK_GRACE;
        let outcome = match tokio::time::timeout_at(limit, check()).await {
            Ok(outcome) => outcome,
            Err(_) => panic!(
                "{what}: a check was still running {CHECK_GRACE:?} after the timeout of \
                 {within:?} (check {checks})"
            ),
        };
        let state = match outcome {
            Ok(value) => return value,
            Err(state) => state,
        };
        let now = tokio::time::Instant::now();
        if now >= deadline {
            panic!("{what}: not so within {within:?} ({checks} checks); the last one saw: {state}");
        }
        tokio::time::sleep(backoff.next(deadline - now)).await;
    }
}

/// Checks over the whole of `during` (scaled, see the module doc) that `check` holds: at once,
/// then repeatedly, the last time at the end of the window. Returns the value of the last check.
///
/// # Panics
///
/// As soon as a check returns `Err`, with `what`, when in the window it failed, and its state.
pub async fn consistently<T>(
    during: Duration,
    what: impl Display,
    mut check: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    let during = scaled(during);
    let start = tokio::time::Instant::now();
    let end = start + during;
    let mut backoff = Backoff::new();
    loop {
        let value = match check().await {
            Ok(value) => value,
            Err(state) => panic!(
                "{what}: no longer so after {:?} of {during:?}: {state}",
                start.elapsed()
            ),
        };
        let now = tokio::time::Instant::now();
        if now >= end {
            return value;
        }
        tokio::time::sleep(backoff.next(end - now)).await;
    }
}

/// [`eventually`] for blocking code: `check` runs on this thread, which sleeps between checks.
///
/// # Panics
///
/// As [`eventually`], except that a check that hangs is not cut short.
pub fn eventually_blocking<T>(
    within: Duration,
    what: impl Display,
    mut check: impl FnMut() -> Result<T, String>,
) -> T {
    let within = scaled(within);
    let start = std::time::Instant::now();
    let deadline = start + within;
    let mut backoff = Backoff::new();
    let mut checks = 0u32;
    loop {
        checks += 1;
        let state = match check() {
            Ok(value) => return value,
            Err(state) => state,
        };
        let now = std::time::Instant::now();
        if now >= deadline {
            panic!("{what}: not so within {within:?} ({checks} checks); the last one saw: {state}");
        }
        std::thread::sleep(backoff.next(deadline - now));
    }
}

/// [`consistently`] for blocking code.
///
/// # Panics
///
/// As [`consistently`].
pub fn consistently_blocking<T>(
    during: Duration,
    what: impl Display,
    mut check: impl FnMut() -> Result<T, String>,
) -> T {
    let during = scaled(during);
    let start = std::time::Instant::now();
    let end = start + during;
    let mut backoff = Backoff::new();
    loop {
        let value = match check() {
            Ok(value) => value,
            Err(state) => panic!(
                "{what}: no longer so after {:?} of {during:?}: {state}",
                start.elapsed()
            ),
        };
        let now = std::time::Instant::now();
        if now >= end {
            return value;
        }
        std::thread::sleep(backoff.next(end - now));
    }
}

#[cfg(test)]
mod tests {
    //! The async functions are tested on tokio's paused clock, which makes their timing exact;
    //! the blocking ones on the real clock, with bounds a loaded machine keeps to.

    use std::future::Future;

    use tokio::time::Instant;

    use super::*;

    /// A check that holds from its `n`-th call on, returning the call's number.
    fn holds_from(n: u32) -> impl FnMut() -> Result<u32, String> {
        let mut calls = 0;
        move || {
            calls += 1;
            if calls >= n {
                Ok(calls)
            } else {
                Err(format!("call {calls}"))
            }
        }
    }

    /// The message of the panic `task` ends with.
    async fn panic_of<T>(task: impl Future<Output = T>) -> String {
        use futures_util::FutureExt;
        let failed = std::panic::AssertUnwindSafe(task).catch_unwind().await;
        *failed
            .map(|_| ())
            .unwrap_err()
            .downcast::<String>()
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn eventually_returns_the_value_as_soon_as_the_check_holds() {
        let started = Instant::now();
        let value = eventually(Duration::from_secs(60), "at once", async || {
            Ok::<_, String>(7)
        })
        .await;
        assert_eq!((value, started.elapsed()), (7, Duration::ZERO));
        let mut check = holds_from(3);
        let value = eventually(Duration::from_secs(60), "third call", async || check()).await;
        // After two pauses: 20 ms and 40 ms.
        assert_eq!((value, started.elapsed()), (3, Duration::from_millis(60)));
    }

    #[tokio::test(start_paused = true)]
    async fn eventually_can_borrow_and_change_what_the_test_holds() {
        let mut seen = Vec::new();
        let last = eventually(Duration::from_secs(60), "three values", async || {
            seen.push(seen.len());
            if seen.len() == 3 {
                Ok(seen.len())
            } else {
                Err(format!("{seen:?}"))
            }
        })
        .await;
        assert_eq!((last, seen), (3, vec![0, 1, 2]));
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "the thing happens: not so within 300ms")]
    async fn eventually_panics_with_what_it_waited_for_after_the_timeout() {
        eventually(
            Duration::from_millis(300),
            "the thing happens",
            async || Err::<(), _>("nothing yet".to_owned()),
        )
        .await;
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "never: not so within 2.1s (9 checks); the last one saw: call 9")]
    async fn eventually_panics_with_the_last_state_it_saw() {
        // Checks at 0, 20, 60, 140, 300, 620 ms, 1.12 s, 1.62 s and the deadline, 2.1 s.
        let mut check = holds_from(u32::MAX);
        eventually(Duration::from_millis(2100), "never", async || check()).await;
    }

    #[tokio::test(start_paused = true)]
    async fn eventually_checks_last_at_the_deadline() {
        let message = panic_of(async {
            let started = Instant::now();
            let mut at = Vec::new();
            eventually(Duration::from_millis(100), "never", async || {
                at.push(started.elapsed().as_millis());
                Err::<(), _>(format!("{at:?}"))
            })
            .await
        })
        .await;
        assert!(
            message.ends_with("(4 checks); the last one saw: [0, 20, 60, 100]"),
            "{message}"
        );
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "hanging: a check was still running 30s after the timeout of 100ms")]
    async fn eventually_does_not_wait_forever_for_a_check_that_hangs() {
        eventually(Duration::from_millis(100), "hanging", async || {
            std::future::pending::<Result<(), String>>().await
        })
        .await;
    }

    #[tokio::test(start_paused = true)]
    async fn consistently_checks_over_the_whole_window() {
        let started = Instant::now();
        let mut at = Vec::new();
        let last = consistently(Duration::from_millis(700), "holds", async || {
            at.push(started.elapsed().as_millis());
            Ok::<_, String>(at.len())
        })
        .await;
        assert_eq!(at, [0, 20, 60, 140, 300, 620, 700]);
        assert_eq!(last, 7);
        assert_eq!(started.elapsed(), Duration::from_millis(700));
    }

    #[tokio::test(start_paused = true)]
    async fn consistently_fails_as_soon_as_the_check_fails() {
        let message = panic_of(async {
            let mut calls = 0;
            consistently(Duration::from_secs(60), "quiet", async || {
                calls += 1;
                if calls < 4 {
                    Ok(())
                } else {
                    Err("something happened".to_owned())
                }
            })
            .await
        })
        .await;
        assert_eq!(
            message,
            "quiet: no longer so after 140ms of 60s: something happened"
        );
    }

    #[test]
    fn the_blocking_twins_behave_alike() {
        let started = std::time::Instant::now();
        let value = eventually_blocking(Duration::from_secs(60), "third", holds_from(3));
        assert_eq!(value, 3);
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );

        let failed = std::panic::catch_unwind(|| {
            eventually_blocking(Duration::from_millis(100), "never", holds_from(u32::MAX))
        });
        let message = *failed.unwrap_err().downcast::<String>().unwrap();
        // However many checks the machine's load left room for, the last one is quoted.
        let checks = message
            .strip_prefix("never: not so within 100ms (")
            .and_then(|rest| rest.split_once(" checks); the last one saw: call "))
            .unwrap_or_else(|| panic!("{message}"));
        assert_eq!(checks.0, checks.1, "{message}");

        // That the window is watched to its end is checked on the paused clock (the async
        // twin's test); here: at the start and at the end.
        let checks = consistently_blocking(Duration::from_millis(300), "holds", holds_from(1));
        assert!(checks >= 2, "checked at the start and at the end: {checks}");

        let started = std::time::Instant::now();
        let failed = std::panic::catch_unwind(|| {
            let mut calls = 0;
            consistently_blocking(Duration::from_secs(60), "quiet", || {
                calls += 1;
                if calls < 3 {
                    Ok(())
                } else {
                    Err("noise".to_owned())
                }
            })
        });
        let message = *failed.unwrap_err().downcast::<String>().unwrap();
        assert!(
            message.starts_with("quiet: no longer so after ") && message.ends_with("of 60s: noise"),
            "{message}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn backoff_doubles_up_to_half_a_second_and_never_passes_the_deadline() {
        let mut backoff = Backoff::new();
        let pauses: Vec<u128> = (0..8)
            .map(|_| backoff.next(Duration::from_secs(10)).as_millis())
            .collect();
        assert_eq!(pauses, [20, 40, 80, 160, 320, 500, 500, 500]);
        assert_eq!(
            backoff.next(Duration::from_millis(3)),
            Duration::from_millis(3)
        );
    }
}
