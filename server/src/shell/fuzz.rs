//! Property tests that double as fuzzers: every property runs `MLSCOPE_FUZZ_CASES` cases (2,000
//! by default in the test suite) and prints how many ran, so the same code runs millions of cases
//! from the command line:
//!
//! ```text
//! MLSCOPE_FUZZ_CASES=1000000 cargo test --release -p mlscope-proxy fuzz:: -- --nocapture
//! ```

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use crate::capabilities::artifacts::path;
use crate::capabilities::rewrite::body::{Edit, Endpoint, MetricsBody};

fn cases() -> u32 {
    std::env::var("MLSCOPE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

fn run<S: Strategy>(name: &str, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>) {
    let cases = cases();
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let started = std::time::Instant::now();
    if let Err(e) = runner.run(&strategy, test) {
        panic!("{name}: {e}");
    }
    eprintln!(
        "fuzz {name}: {cases} cases passed in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// Percent-encodes every byte of `s` `depth` times.
fn encode(s: &str, depth: usize) -> String {
    let mut out = s.to_owned();
    for _ in 0..depth {
        out = out.bytes().map(|b| format!("%{b:02X}")).collect();
    }
    out
}

/// Path segments, each written raw or percent-encoded 1 to 3 times.
fn segment() -> impl Strategy<Value = String> {
    let plain = prop_oneof![
        Just("..".to_owned()),
        Just(".".to_owned()),
        "[a-z0-9._-]{1,6}",
        Just("\\..".to_owned()),
        Just("..\\x".to_owned())
    ];
    (plain, 0usize..4, any::<bool>()).prop_map(|(s, depth, dot_only)| {
        if dot_only && s.contains('.') {
            // Encode only the dots, the way real traversal attempts do.
            s.replace('.', &encode(".", depth))
        } else {
            encode(&s, depth)
        }
    })
}

fn separator() -> impl Strategy<Value = String> {
    (prop_oneof![Just("/"), Just("\\")], 0usize..3).prop_map(|(s, depth)| encode(s, depth))
}

#[test]
fn no_decoding_depth_lets_a_dot_dot_segment_through_path_validation() {
    let paths = (
        proptest::collection::vec((segment(), separator()), 1..8),
        any::<bool>(),
    )
        .prop_map(|(parts, leading)| {
            let mut p = if leading {
                "/".to_owned()
            } else {
                String::new()
            };
            for (seg, sep) in parts {
                p.push_str(&seg);
                p.push_str(&sep);
            }
            p
        });
    run("path validation", paths, |raw| {
        if let Ok(valid) = path::validate(&raw) {
            // What was accepted is decoded for good, relative, and free of `..` in either separator.
            prop_assert_eq!(
                percent_encoding::percent_decode_str(&valid)
                    .decode_utf8_lossy()
                    .into_owned(),
                valid.clone()
            );
            prop_assert!(!valid.starts_with('/') && !valid.starts_with('\\'));
            prop_assert!(
                valid.split(['/', '\\']).all(|s| s != ".."),
                "{} let through as {}",
                raw,
                valid
            );
            prop_assert!(!valid.chars().any(char::is_control));
        }
        Ok(())
    });
}

#[test]
fn arbitrary_bytes_never_panic_the_metrics_body_reader() {
    run(
        "metrics body bytes",
        proptest::collection::vec(any::<u8>(), 0..512),
        |bytes| {
            for endpoint in [Endpoint::LogBatch, Endpoint::LogMetric] {
                if let Ok(body) = MetricsBody::parse(&bytes, endpoint) {
                    let keep = vec![Edit::Keep; body.metrics.len()];
                    let (_, out) = body.render(&keep);
                    prop_assert_eq!(
                        out,
                        bytes.clone(),
                        "an unchanged body is rendered byte for byte"
                    );
                }
            }
            Ok(())
        },
    );
}

/// Near-valid bodies: the shapes MLflow clients send, with fields dropped, duplicated, retyped.
fn near_valid_body() -> impl Strategy<Value = String> {
    let value = prop_oneof![
        Just("1.5".to_owned()),
        Just("\"NaN\"".to_owned()),
        Just("\"x\"".to_owned()),
        Just("null".to_owned()),
        Just("-9223372036854775808".to_owned()),
        Just("1e999".to_owned()),
        Just("[]".to_owned()),
    ];
    let key = prop_oneof![
        Just("\"system/cpu_utilization_percentage\"".to_owned()),
        Just("\"system/node-a/rank-3/system_memory_usage_megabytes\"".to_owned()),
        Just("\"system//x\"".to_owned()),
        Just("\"loss\"".to_owned()),
        Just("\"\\u0000\"".to_owned()),
        Just("7".to_owned()),
    ];
    let metric =
        (key, value.clone(), value.clone(), value, any::<bool>()).prop_map(|(k, v, t, s, dup)| {
            if dup {
                format!("{{\"key\":{k},\"key\":{k},\"value\":{v}}}")
            } else {
                format!("{{\"key\":{k},\"value\":{v},\"timestamp\":{t},\"step\":{s}}}")
            }
        });
    (
        proptest::collection::vec(metric, 0..6),
        prop_oneof![
            Just("\"run_id\":\"r\""),
            Just("\"run_uuid\":\"r\",\"run_id\":\"s\""),
            Just("\"run_id\":5"),
            Just("")
        ],
    )
        .prop_map(|(metrics, run)| {
            format!(
                "{{{run}{}\"metrics\":[{}]}}",
                if run.is_empty() { "" } else { "," },
                metrics.join(",")
            )
        })
}

/// JSON whitespace put between tokens of a body from [`near_valid_body`] (whose strings hold no
/// structural characters), with an unknown field of nested values in some elements.
fn spaced_body() -> impl Strategy<Value = String> {
    let space = prop_oneof![Just(""), Just(" "), Just("\n "), Just("\t\r\n")];
    (
        near_valid_body(),
        proptest::collection::vec(space, 64),
        any::<bool>(),
    )
        .prop_map(|(body, spaces, extra)| {
            let body = if extra {
                body.replacen("{\"key\"", "{\"x\":{\"y\":[\"]}\",{}]},\"key\"", 1)
            } else {
                body
            };
            let mut out = String::with_capacity(body.len() * 2);
            let mut spaces = spaces.iter().cycle();
            for c in body.chars() {
                if matches!(c, '}' | ']') {
                    out.push_str(spaces.next().unwrap());
                }
                out.push(c);
                if matches!(c, '{' | '[' | ',' | ':') {
                    out.push_str(spaces.next().unwrap());
                }
            }
            out
        })
}

/// A spaced body with up to four bytes' worth of damage where JSON's grammar is decided: a byte
/// deleted, or one of JSON's structural or number characters, an escape, a control character or a
/// stray letter put in or over one. Most stay near enough to valid for the one-pass read to go far
/// into them, so where it accepts what the general read refuses (or the reverse) it shows.
fn damaged_body() -> impl Strategy<Value = String> {
    damaged(spaced_body())
}

/// Up to four bytes' worth of damage to a body of `bodies`, as [`damaged_body`] has.
fn damaged(bodies: impl Strategy<Value = String>) -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just(""),
        Just("\""),
        Just("\\"),
        Just("\\u00"),
        Just("\\x"),
        Just("{"),
        Just("}"),
        Just("["),
        Just("]"),
        Just(","),
        Just(":"),
        Just("0"),
        Just("-"),
        Just("."),
        Just("e"),
        Just("+"),
        Just(" "),
        Just("\u{1}"),
        Just("x"),
        Just("null"),
        Just("tru"),
    ];
    let damage = (any::<prop::sample::Index>(), piece, any::<bool>());
    (bodies, proptest::collection::vec(damage, 1..4)).prop_map(|(body, damage)| {
        let mut bytes = body.into_bytes();
        for (at, piece, over) in damage {
            let at = at.index(bytes.len() + 1);
            let end = if over { (at + 1).min(bytes.len()) } else { at };
            bytes.splice(at..end, piece.bytes());
        }
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

#[test]
fn a_batch_read_in_one_pass_reads_as_the_general_read_does() {
    let taken = std::sync::atomic::AtomicU32::new(0);
    run("metrics body one pass", spaced_body(), |text| {
        if MetricsBody::one_pass_agrees(text.as_bytes()).map_err(TestCaseError::fail)? {
            taken.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    });
    // The property says something only where the one pass reads the body.
    let taken = taken.into_inner();
    assert!(taken >= cases() / 20, "one pass took {taken} bodies");
    eprintln!("fuzz metrics body one pass: {taken} bodies read in one pass");
    let taken = std::sync::atomic::AtomicU32::new(0);
    run("metrics body one pass, damaged", damaged_body(), |text| {
        if MetricsBody::one_pass_agrees(text.as_bytes()).map_err(TestCaseError::fail)? {
            taken.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    });
    // Damage that leaves the body valid (a space, a digit in a number) is read in one pass too.
    let taken = taken.into_inner();
    assert!(
        taken >= cases() / 50,
        "one pass took {taken} damaged bodies"
    );
    eprintln!("fuzz metrics body one pass, damaged: {taken} bodies read in one pass");
    run(
        "metrics body one pass, arbitrary bytes",
        proptest::collection::vec(any::<u8>(), 0..256),
        |bytes| {
            MetricsBody::one_pass_agrees(&bytes).map_err(TestCaseError::fail)?;
            Ok(())
        },
    );
}

/// A `log-batch` body near a batch of the run's own metrics: most keys plain and outside
/// `system/`, some not (under `system/`, escaped, named like an envelope field); the run first or
/// last, valid or not; and one more top-level field: params or tags (empty, `null`, or not), the
/// run again or in another spelling, an unknown field, or none.
fn near_plain_body() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        6 => Just("\"loss\""),
        2 => Just("\"train/acc\""),
        1 => Just("\"params\""),
        1 => Just("\"system/cpu_utilization_percentage\""),
        1 => Just("\"sys\\u0074em/cpu_utilization_percentage\""),
        1 => Just("\"lo\\u0073s\""),
    ];
    let value = prop_oneof![
        6 => Just("1.5"),
        2 => Just("\"NaN\""),
        1 => Just("\"x\""),
        1 => Just("null"),
    ];
    let more = prop_oneof![
        6 => Just(""),
        1 => Just(",\"dataset_name\":\"d\""),
        1 => Just(",\"run_id\":\"q\""),
        1 => Just(",\"x\":1"),
    ];
    let metric = (key, value, more).prop_map(|(k, v, m)| {
        format!("{{\"key\":{k},\"value\":{v},\"timestamp\":1,\"step\":2{m}}}")
    });
    let run = prop_oneof![
        6 => Just("\"run_id\":\"r\""),
        1 => Just("\"run_id\":\"r-1_é\""),
        1 => Just("\"run_id\":\"-r\""),
        1 => Just("\"run_id\":null"),
        1 => Just("\"run_id\":\"\""),
        1 => Just("\"runId\":\"r\""),
    ];
    let field = prop_oneof![
        6 => Just(""),
        1 => Just(",\"params\":[]"),
        1 => Just(",\"params\":null"),
        1 => Just(",\"tags\":[]"),
        1 => Just(",\"params\":[{\"key\":\"lr\",\"value\":\"0.1\"}]"),
        1 => Just(",\"tags\":[{\"key\":\"mlscope/rank-0/exit\",\"value\":\"0\"}]"),
        1 => Just(",\"run_uuid\":\"r\""),
        1 => Just(",\"run_id\":\"q\""),
        1 => Just(",\"run_id\":\"r\""),
        1 => Just(",\"x\":1"),
    ];
    (
        proptest::collection::vec(metric, 0..4),
        run,
        field,
        any::<bool>(),
    )
        .prop_map(|(metrics, run, field, run_first)| {
            let metrics = format!("\"metrics\":[{}]", metrics.join(","));
            if run_first {
                format!("{{{run},{metrics}{field}}}")
            } else {
                format!("{{{metrics},{run}{field}}}")
            }
        })
}

#[test]
fn a_batch_sent_before_it_is_read_holds_the_runs_own_metrics_and_nothing_else() {
    // What `Scanned::plain` lets go to MLflow unread: MLflow acts on the run the proxy
    // holds it for, and the whole read finds the same metrics, none of the contract's, and
    // no param or tag, so the rewriter sends it as it came and it commutes with the run's
    // other writes.
    let check = |text: &str| -> Result<bool, TestCaseError> {
        let Some(plain) = MetricsBody::scan(text.as_bytes()).plain() else {
            return Ok(false);
        };
        let run = crate::plumbing::writes::run_of(text.as_bytes());
        prop_assert_eq!(run.as_deref(), Some(plain.run_id), "MLflow's run: {}", text);
        let read = MetricsBody::parse(text.as_bytes(), Endpoint::LogBatch)
            .map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
        prop_assert_eq!(read.run_id.as_deref(), Some(plain.run_id));
        prop_assert_eq!((read.metrics.len(), read.other_items), (plain.metrics, 0));
        prop_assert!(read.metrics.iter().all(|m| !m.key.starts_with("system/")));
        // The coalescer would merge it, claiming nothing.
        let bytes = bytes::Bytes::copy_from_slice(text.as_bytes());
        let merged = crate::plumbing::writes::parse("/api/2.0/mlflow/runs/log-batch", &bytes)
            .map_err(|alone| TestCaseError::fail(format!("{alone:?}: {text}")))?;
        prop_assert_eq!(&*merged.run_id, plain.run_id);
        prop_assert_eq!(
            (merged.writes.metrics.len(), merged.writes.items()),
            (plain.metrics, plain.metrics)
        );
        let json: serde_json::Value =
            serde_json::from_str(text).map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
        prop_assert_eq!(json["run_id"].as_str(), Some(plain.run_id));
        let metrics = json["metrics"].as_array().map_or(&[][..], Vec::as_slice);
        prop_assert_eq!(metrics.len(), plain.metrics);
        prop_assert!(metrics.iter().all(|m| m["key"]
            .as_str()
            .is_some_and(|key| !key.starts_with("system/"))));
        for field in ["params", "tags"] {
            prop_assert!(
                json.get(field)
                    .is_none_or(|v| v.is_null() || v.as_array().is_some_and(Vec::is_empty)),
                "{}",
                text
            );
        }
        Ok(true)
    };
    let taken = std::sync::atomic::AtomicU32::new(0);
    run("a batch sent unread", near_plain_body(), |text| {
        if check(&text)? {
            taken.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    });
    let taken = taken.into_inner();
    assert!(taken >= cases() / 20, "sent unread: {taken} bodies");
    eprintln!("fuzz a batch sent unread: {taken} bodies");
    run(
        "a batch sent unread, damaged",
        damaged(near_plain_body()),
        |text| {
            check(&text)?;
            Ok(())
        },
    );
}

/// Every metric renamed to `system/n/node_x`, and given step 7 where it carries a step (as the
/// rewriter does: a new step only where the sample has one).
fn rename_every_metric(body: &MetricsBody<'_>) -> Vec<Edit<'static>> {
    body.metrics
        .iter()
        .map(|m| Edit::Change {
            key: Some("system/n/node_x"),
            step: m.step.map(|_| 7),
            also_original: false,
        })
        .collect()
}

#[test]
fn near_valid_metrics_bodies_render_valid_json_and_change_only_keys_and_steps() {
    run("metrics body splice", near_valid_body(), |text| {
        let Ok(body) = MetricsBody::parse(text.as_bytes(), Endpoint::LogBatch) else {
            return Ok(());
        };
        if serde_json::from_str::<serde_json::Value>(&text).is_err() {
            // Kept byte for byte (the arbitrary-bytes property); valid JSON out needs valid JSON in.
            return Ok(());
        }
        let edits = rename_every_metric(&body);
        let (_, out) = body.render(&edits);
        let rendered: serde_json::Value = serde_json::from_slice(&out)
            .map_err(|e| TestCaseError::fail(format!("{e}: {}", String::from_utf8_lossy(&out))))?;
        let metrics = rendered["metrics"].as_array().cloned().unwrap_or_default();
        prop_assert_eq!(metrics.len(), body.metrics.len());
        for (m, parsed) in metrics.iter().zip(&body.metrics) {
            prop_assert_eq!(&m["key"], "system/n/node_x");
            if parsed.step.is_some() {
                prop_assert_eq!(&m["step"], 7);
            }
        }
        // Applying the same edits to the output changes nothing more (idempotent).
        let again = MetricsBody::parse(&out, Endpoint::LogBatch)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let (_, twice) = again.render(&edits);
        prop_assert_eq!(twice, out);
        Ok(())
    });
}

#[test]
fn listings_of_any_names_are_ascii_json_that_reads_back_the_same_entries() {
    use crate::capabilities::artifacts::listing::{pretty_string, to_mlflow_json, Entry};
    let entry = (
        any::<String>(),
        any::<bool>(),
        proptest::option::of(0i64..i64::MAX),
    );
    run(
        "listing JSON",
        proptest::collection::vec(entry, 0..20),
        |raw| {
            let entries: Vec<Entry> = raw
                .into_iter()
                .map(|(name, is_dir, size)| Entry {
                    name,
                    is_dir,
                    size: if is_dir { None } else { size },
                })
                .collect();
            let text = pretty_string(&to_mlflow_json(&entries));
            prop_assert!(text.is_ascii(), "MLflow escapes every non-ASCII character");
            let back: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let files = back["files"].as_array().cloned().unwrap_or_default();
            prop_assert_eq!(files.len(), entries.len());
            for (file, entry) in files.iter().zip(&entries) {
                prop_assert_eq!(file["path"].as_str(), Some(entry.name.as_str()));
                prop_assert_eq!(file["is_dir"].as_bool(), Some(entry.is_dir));
            }
            Ok(())
        },
    );
}

#[test]
fn any_client_headers_are_prepared_for_mlflow_without_panic_or_hop_by_hop_leaks() {
    use http::{HeaderMap, HeaderName, HeaderValue};
    let forwarder = crate::plumbing::proxy::Forwarder::new(
        &crate::plumbing::proxy::ForwarderConfig::default(),
        crate::plumbing::telemetry::Metrics::new(),
    );
    let name = prop_oneof![
        Just("connection".to_owned()),
        Just("keep-alive".to_owned()),
        Just("transfer-encoding".to_owned()),
        Just("host".to_owned()),
        Just("x-forwarded-for".to_owned()),
        Just("x-request-id".to_owned()),
        "[a-z][a-z0-9-]{0,12}",
    ];
    let value = proptest::collection::vec(
        prop_oneof![32u8..127, Just(b','), Just(b' '), 128u8..=255],
        0..40,
    );
    run(
        "header handling",
        proptest::collection::vec((name, value), 0..16),
        |pairs| {
            let mut headers = HeaderMap::new();
            for (name, value) in &pairs {
                if let (Ok(name), Ok(value)) = (
                    HeaderName::from_bytes(name.as_bytes()),
                    HeaderValue::from_bytes(value),
                ) {
                    headers.append(name, value);
                }
            }
            let named_by_connection: Vec<String> = headers
                .get_all(http::header::CONNECTION)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| {
                    v.split(',')
                        .map(|t| t.trim().to_ascii_lowercase())
                        .collect::<Vec<_>>()
                })
                .filter(|t| !t.is_empty())
                .collect();
            let id = HeaderValue::from_static("req-1");
            let out = forwarder.upstream_headers(
                &headers,
                std::net::SocketAddr::from(([10, 0, 0, 1], 4000)),
                None,
                &id,
            );
            for hop in [
                "connection",
                "keep-alive",
                "transfer-encoding",
                "te",
                "upgrade",
                "trailer",
                "proxy-connection",
            ] {
                prop_assert!(!out.contains_key(hop), "{} forwarded", hop);
            }
            for named in &named_by_connection {
                if named != "host" && HeaderName::from_bytes(named.as_bytes()).is_ok() {
                    prop_assert!(
                        !out.contains_key(named.as_str()),
                        "{} named by Connection forwarded",
                        named
                    );
                }
            }
            let forwarded_for = out
                .get("x-forwarded-for")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            prop_assert!(
                forwarded_for.ends_with("10.0.0.1"),
                "the peer ends the X-Forwarded-For chain: {}",
                forwarded_for
            );
            Ok(())
        },
    );
}

#[test]
fn the_rewriters_single_read_tells_the_coalescer_what_its_own_read_would() {
    const PATH: &str = "/api/2.0/mlflow/runs/log-batch";
    run("single read of a write body", near_valid_body(), |text| {
        let sent = bytes::Bytes::from(text.clone());
        let Ok(body) = MetricsBody::parse(&sent, Endpoint::LogBatch) else {
            return Ok(());
        };
        let keep = vec![Edit::Keep; body.metrics.len()];
        prop_assert_eq!(
            body.writes(PATH, &sent, None, keep.first()),
            Some(crate::plumbing::writes::parse(PATH, &sent)),
            "unchanged: {}",
            text
        );
        let edits = rename_every_metric(&body);
        let (target, out, spans) = body.render_spans(&edits);
        let out = bytes::Bytes::from(out);
        prop_assert_eq!(
            body.writes(PATH, &out, Some((target, &spans)), edits.first()),
            Some(crate::plumbing::writes::parse(PATH, &out)),
            "rendered: {}",
            text
        );
        Ok(())
    });
}
