use super::*;
use serde_json::Value;

const BATCH: &str = r#"{"run_id":"r1","metrics":[{"key":"system/cpu_utilization_percentage","value":"NaN","timestamp":9007199254740993,"step":9007199254740995},{"key":"loss","value":1e-7,"timestamp":1,"step":0,"extra":{"x":[1,2]}}],"params":[{"key":"p","value":"v"}],"tags":[],"unknown":true}"#;

#[test]
fn untouched_bodies_come_back_byte_for_byte() {
    let body = MetricsBody::parse(BATCH.as_bytes(), Endpoint::LogBatch).unwrap();
    assert_eq!(body.run_id.as_deref(), Some("r1"));
    assert_eq!(body.metrics.len(), 2);
    assert_eq!(body.other_items, 1);
    let (_, out) = body.render(&[Edit::Keep, Edit::Keep]);
    assert_eq!(std::str::from_utf8(&out).unwrap(), BATCH);
}

#[test]
fn keys_and_steps_change_and_nothing_else_does() {
    let body = MetricsBody::parse(BATCH.as_bytes(), Endpoint::LogBatch).unwrap();
    let edits = [
        Edit::Change {
            key: Some("system/n/node_cpu_utilization_percentage"),
            step: Some(12),
            also_original: false,
        },
        Edit::Keep,
    ];
    let (_, out) = body.render(&edits);
    let text = std::str::from_utf8(&out).unwrap();
    assert_eq!(
        text,
        BATCH
            .replace(
                "system/cpu_utilization_percentage",
                "system/n/node_cpu_utilization_percentage"
            )
            .replace("9007199254740995", "12")
    );
}

#[test]
fn dropped_and_duplicated_metrics_keep_the_array_well_formed() {
    let body = MetricsBody::parse(BATCH.as_bytes(), Endpoint::LogBatch).unwrap();
    let (_, out) = body.render(&[Edit::Drop, Edit::Drop]);
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["metrics"], serde_json::json!([]));
    assert_eq!(v["params"][0]["key"], "p");

    let (_, out) = body.render(&[
        Edit::Change {
            key: Some("system/new"),
            step: None,
            also_original: true,
        },
        Edit::Drop,
    ]);
    let v: Value = serde_json::from_slice(&out).unwrap();
    let keys: Vec<_> = v["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["system/new", "system/cpu_utilization_percentage"]);
}

#[test]
fn log_metric_is_rewritten_in_place_or_rebuilt_as_a_batch() {
    let text = r#"{"run_id":"r1","run_uuid":"r1","key":"system/rank-1/network_receive_megabytes","value":"Infinity","timestamp":5,"step":"7"}"#;
    let body = MetricsBody::parse(text.as_bytes(), Endpoint::LogMetric).unwrap();
    assert_eq!(body.metrics[0].step, Some(7));
    let (endpoint, out) = body.render(&[Edit::Change {
        key: Some("system/x"),
        step: Some(9),
        also_original: false,
    }]);
    assert_eq!(endpoint, Endpoint::LogMetric);
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        text.replace("system/rank-1/network_receive_megabytes", "system/x")
            .replace("\"7\"", "\"9\"")
    );

    let (endpoint, out) = body.render(&[Edit::Drop]);
    assert_eq!(endpoint, Endpoint::LogBatch);
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        r#"{"run_id":"r1","metrics":[]}"#
    );

    let (endpoint, out) = body.render(&[Edit::Change {
        key: Some("system/x"),
        step: None,
        also_original: true,
    }]);
    assert_eq!(endpoint, Endpoint::LogBatch);
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        v["metrics"][0],
        serde_json::json!({"key": "system/x", "value": "Infinity", "timestamp": 5, "step": 7})
    );
    assert_eq!(
        v["metrics"][1]["key"],
        "system/rank-1/network_receive_megabytes"
    );
}

#[test]
fn conflicting_run_ids_and_repeated_fields_are_refused() {
    let err = MetricsBody::parse(
        br#"{"run_id":"a","run_uuid":"b","key":"k","value":1,"timestamp":1}"#,
        Endpoint::LogMetric,
    )
    .unwrap_err();
    assert!(
        matches!(&err, BodyError::Conflict(m) if m.contains("run_id=\"a\"") && m.contains("run_uuid=\"b\"")),
        "{err}"
    );
    let err = MetricsBody::parse(
        br#"{"runId":"a","run_id":"a","run_id":"b","metrics":[]}"#,
        Endpoint::LogBatch,
    )
    .unwrap_err();
    assert!(
        matches!(&err, BodyError::Conflict(m) if m.contains("`run_id` more than once")),
        "{err}"
    );
    assert!(MetricsBody::parse(
        br#"{"run_id":"a","runId":"a","metrics":[]}"#,
        Endpoint::LogBatch
    )
    .is_ok());
}

#[test]
fn unreadable_bodies_are_reported_for_pass_through() {
    for bad in [
        &b"not json"[..],
        b"{\"metrics\": 5}",
        b"{\"metrics\": [{\"value\": 1}]}",
        b"\xff\xfe",
        b"{\"run_id\": 5}",
    ] {
        assert!(
            matches!(
                MetricsBody::parse(bad, Endpoint::LogBatch),
                Err(BodyError::Unreadable(_))
            ),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn escaped_keys_are_decoded() {
    let body = MetricsBody::parse(br#"{"metrics":[{"key":"system\/cpu_utilization_percentage","value":1,"timestamp":1,"step":1}]}"#, Endpoint::LogBatch).unwrap();
    assert_eq!(body.metrics[0].key, "system/cpu_utilization_percentage");
}

/// The rewriter's one read of a body tells the coalescer exactly what the coalescer's own
/// read would: the same run, elements, params and tags, or the same reason to go alone.
#[test]
fn the_single_read_agrees_with_the_coalescers_read_of_the_same_body() {
    let element = |m: &str| {
        format!(
            r#"{{"run_id":"r","metrics":[{{"key":"a","value":1,"timestamp":1,"step":0}},{m}]}}"#
        )
    };
    let mut batches: Vec<String> = [
            r#"{"key":"b","value":"NaN","timestamp":2,"step":3}"#,
            r#"{"key":"b","value":"abc","timestamp":2}"#,
            r#"{"key":"b","value":1,"timestamp":2,"step":1.5}"#,
            r#"{"key":"b","value":1,"timestamp":"soon"}"#,
            r#"{"key":"b","value":1,"timestamp":"2"}"#,
            r#"{"key":"b","value":1,"timestamp":2,"step":"3"}"#,
            r#"{"key":"b","value":1e999,"timestamp":2}"#,
            r#"{"key":"b","value":true,"timestamp":2}"#,
            r#"{"key":"b","value":null,"timestamp":2}"#,
            r#"{"key":"b","value":1}"#,
            r#"{"key":"b","value":1,"timestamp":2,"datasetName":"d"}"#,
            r#"{"key":"b","value":1,"timestamp":2,"model_id":"m","dataset_name":"d","dataset_digest":"x","run_id":"r"}"#,
            r#"{"key":"b","value":1,"timestamp":2,"model_id":7}"#,
            r#"{"key":"b\u0041","value":-0.5e-3,"timestamp":-2,"step":9223372036854775807}"#,
            // Each field is decoded once by the single read: its rule on what it decoded.
            r#"{"key":"b","value":1,"timestamp":-0,"step":-0}"#,
            r#"{"key":"b","value":1,"timestamp":2.0,"step":1}"#,
            r#"{"key":"b","value":1,"timestamp":1e3}"#,
            r#"{"key":"b","value":1,"timestamp":9223372036854775808}"#,
            r#"{"key":"b","value":1,"timestamp":2,"step":"-3"}"#,
            r#"{"key":"b","value":1e308,"timestamp":2,"step":1}"#,
            r#"{"key":"b","value":"Infinity","timestamp":"-2"}"#,
        ]
        .iter()
        .map(|m| element(m))
        .collect();
    batches.extend(
            [
                r#"{"run_id":"r","params":[{"key":"p","value":"1"}],"tags":[{"key":"t","value":"x"}]}"#,
                r#"{"run_id":"r","metrics":[],"params":[{"key":"p","value":"1"},{"key":"p","value":"1"}]}"#,
                r#"{"run_id":"r","params":[{"key":"p","value":5}]}"#,
                r#"{"run_id":"r","tags":[{"key":"t"}]}"#,
                r#"{"run_id":"r","metrics":null,"params":null,"tags":[{"key":"t","value":"v"}]}"#,
                r#"{"run_id":"","metrics":[{"key":"a","value":1,"timestamp":1}]}"#,
                r#"{"run_id":"r"}"#,
                r#"{"run_id":"r","runId":"r","metrics":[{"key":"a","value":1,"timestamp":1}]}"#,
                r#"{"run_id":"r","extra":1,"metrics":[{"key":"a","value":1,"timestamp":1}]}"#,
                r#"{"run_id":"r","key":"k","metrics":[{"key":"a","value":1,"timestamp":1}]}"#,
            ]
            .map(String::from),
        );
    let metrics = |n: usize| {
        (0..n)
            .map(|i| format!(r#"{{"key":"k{i}","value":1,"timestamp":1}}"#))
            .collect::<Vec<_>>()
            .join(",")
    };
    batches.push(format!(r#"{{"run_id":"r","metrics":[{}]}}"#, metrics(1000)));
    batches.push(format!(
        r#"{{"run_id":"r","metrics":[{}],"tags":[{{"key":"t","value":"v"}}]}}"#,
        metrics(1000)
    ));
    let single = [
        r#"{"run_id":"r","run_uuid":"r","key":"loss","value":0.5,"timestamp":7,"step":3}"#,
        r#"{"run_id":"r","key":"loss","value":0.5,"timestamp":7,"model_id":"m","dataset_digest":"d"}"#,
        r#"{"run_id":"r","run_uuid":null,"key":"loss","value":0.5,"timestamp":7}"#,
        r#"{"run_id":"r","key":"loss","value":"NaN","timestamp":7}"#,
        r#"{"run_id":"r","key":"loss","value":1,"timestamp":7,"step":"3"}"#,
        r#"{"run_id":"r","key":"loss","value":1,"timestamp":7.5}"#,
        r#"{"run_id":"r","key":"loss","value":1}"#,
        r#"{"run_id":"r","key":"loss","value":1,"timestamp":7,"extra":true}"#,
        r#"{"run_id":"","key":"loss","value":1,"timestamp":7}"#,
    ];
    let cases = batches
        .iter()
        .map(|b| {
            (
                Endpoint::LogBatch,
                "/api/2.0/mlflow/runs/log-batch",
                b.as_str(),
            )
        })
        .chain(single.iter().map(|b| {
            (
                Endpoint::LogMetric,
                "/ajax-api/2.0/mlflow/runs/log-metric",
                *b,
            )
        }));
    for (endpoint, path, text) in cases {
        let sent = bytes::Bytes::from(text.to_owned());
        let coalescer = writes::parse(path, &sent);
        let Ok(body) = MetricsBody::parse(&sent, endpoint) else {
            // The rewriter passes bodies it cannot read through; the coalescer reads them.
            continue;
        };
        let keep = vec![Edit::Keep; body.metrics.len()];
        let single_read = body.writes(path, &sent, None, keep.first());
        assert_eq!(single_read, Some(coalescer.clone()), "{text}");
        // Rendered with a renamed key, the same holds for the bytes that are sent.
        if let Some(first) = body.metrics.first() {
            let mut edits = keep.clone();
            edits[0] = Edit::Change {
                key: Some("renamed"),
                step: None,
                also_original: false,
            };
            let (target, out, spans) = body.render_spans(&edits);
            let out = bytes::Bytes::from(out);
            let single_read = body.writes(path, &out, Some((target, &spans)), edits.first());
            let path = if target == endpoint {
                path
            } else {
                "/api/2.0/mlflow/runs/log-batch"
            };
            assert_eq!(
                single_read,
                Some(writes::parse(path, &out)),
                "{text} with {} renamed",
                first.key
            );
        }
    }
}

/// A batch read in one pass gives what the general read gives, wherever the one pass takes it:
/// whitespace anywhere, brackets, braces and quotes inside strings, unknown and nested fields;
/// and the bodies it cannot place (an escaped first name, an empty array, `null`, a duplicate
/// field, a non-object element) are left to the general read, with its own answer.
#[test]
fn a_batch_read_in_one_pass_reads_as_the_general_read_does() {
    let taken = [
        BATCH,
        r#"{"metrics":[{"key":"a","value":1,"timestamp":1,"step":0}]}"#,
        " \n{ \"run_id\" : \"r\" ,\t\"metrics\" :\r\n [ { \"key\" : \"a\" , \"value\" : 1 } ,{\"value\":2,\"key\":\"b\"}\n ] \n} \n",
        r#"{"metrics":[{"key":"a]}\"[{","value":"}]","timestamp":1,"x":{"y":["]"]}}],"tags":[{"key":"t","value":"{"}]}"#,
        r#"{"metrics":[{"key":"a\\","value":1},{"step":"3","key":"b\u0041","value":"NaN"}]}"#,
        r#"{"params":[],"metrics":[{"key":"a","value":1,"run_id":"r","model_id":"m"}],"run_uuid":"r"}"#,
        r#"{"run_id":"r","metrics":[{"key":7,"value":1}]}"#,
        r#"{"run_id":"r","metrics":[{"value":1,"timestamp":2}]}"#,
        r#"{"run_id":"r","metrics":[{"key":"a","step":1.5}]}"#,
        r#"{"run_id":"r","run_uuid":"s","metrics":[{"key":"a","value":1}]}"#,
    ];
    for body in taken {
        assert_eq!(
            MetricsBody::one_pass_agrees(body.as_bytes()),
            Ok(true),
            "{body}"
        );
    }
    let left = [
        r#"{"metrics":[{"\u006bey":"a","value":1}]}"#,
        r#"{"metrics":[]}"#,
        r#"{"metrics":null}"#,
        r#"{"metrics":[{}]}"#,
        r#"{"metrics":[{"key":"a"},7]}"#,
        r#"{"metrics":{"key":"a"}}"#,
        r#"{"metrics":[{"key":"a","key":"b"}]}"#,
        r#"{"metrics":[{"key":"a"}],"metrics":[{"key":"a"}]}"#,
        r#"{"run_id":"r","run_id":"r","metrics":[{"key":"a"}]}"#,
        r#"{"metrics":[{"key":"a"}]} x"#,
        r#"{"metrics":[{"key":"a"}]"#,
    ];
    for body in left {
        assert_eq!(
            MetricsBody::one_pass_agrees(body.as_bytes()),
            Ok(false),
            "{body}"
        );
    }
    // What the general read answers for those, `parse` answers.
    assert!(matches!(
        MetricsBody::parse(left[6].as_bytes(), Endpoint::LogBatch),
        Err(BodyError::Unreadable(m)) if m.starts_with("metric: duplicate field")
    ));
    assert!(matches!(
        MetricsBody::parse(left[7].as_bytes(), Endpoint::LogBatch),
        Err(BodyError::Conflict(m)) if m.contains("`metrics` more than once")
    ));
    let escaped = MetricsBody::parse(left[0].as_bytes(), Endpoint::LogBatch).unwrap();
    assert_eq!(escaped.metrics[0].key, "a");
}

#[test]
fn a_timestamp_reads_as_an_int64_number_or_numeric_string_and_nothing_else() {
    let read = |timestamp: &str| {
        let text = format!(
            r#"{{"run_id":"r1","metrics":[{{"key":"loss","value":1,"timestamp":{timestamp},"step":0}}]}}"#
        );
        let body = MetricsBody::parse(text.as_bytes(), Endpoint::LogBatch).unwrap();
        body.metrics[0].timestamp_ms()
    };
    assert_eq!(read("1764950400000"), Some(1_764_950_400_000));
    assert_eq!(read("-3"), Some(-3));
    assert_eq!(read(r#""1764950400000""#), Some(1_764_950_400_000));
    assert_eq!(read(r#"" 7""#), None);
    assert_eq!(read("9223372036854775807"), Some(i64::MAX));
    assert_eq!(read("9223372036854775808"), None);
    for not_an_int in ["1.5", "1e3", "null", "true", r#""soon""#, r#""""#] {
        assert_eq!(read(not_an_int), None, "{not_an_int}");
    }
}

#[test]
fn a_batch_of_the_runs_own_metrics_is_told_from_every_other_body() {
    fn plain(body: &str) -> Option<Plain<'_>> {
        MetricsBody::scan(body.as_bytes()).plain()
    }
    let loss = r#"{"key":"loss","value":0.5,"timestamp":1700000000000,"step":3}"#;
    // MLflow's client (run first, empty lists left out or sent), serde_json's key order.
    for body in [
        format!(r#"{{"run_id":"r1","metrics":[{loss},{loss}]}}"#),
        format!(r#"{{"run_id": "r1", "metrics": [{loss}, {loss}], "params": [], "tags": []}}"#),
        format!(r#"{{"metrics":[{loss},{loss}],"params":null,"run_id":"r1"}}"#),
    ] {
        assert_eq!(
            plain(&body),
            Some(Plain {
                run_id: "r1",
                metrics: 2
            }),
            "{body}"
        );
    }
    for body in [
        // A param or tag: the run's order matters for it.
        format!(r#"{{"run_id":"r1","metrics":[{loss}],"params":[{{"key":"a","value":"b"}}]}}"#),
        format!(r#"{{"run_id":"r1","metrics":[{loss}],"tags":[{{"key":"a","value":"b"}}]}}"#),
        // The contract's keys, spelled out or escaped, and any escaped key.
        r#"{"run_id":"r1","metrics":[{"key":"system/cpu_utilization_percentage","value":1,"timestamp":1}]}"#
            .to_owned(),
        r#"{"run_id":"r1","metrics":[{"key":"sys\u0074em/cpu","value":1,"timestamp":1}]}"#.to_owned(),
        r#"{"run_id":"r1","metrics":[{"key":"lo\u0073s","value":1,"timestamp":1}]}"#.to_owned(),
        // The run in another spelling, twice, escaped, or not one MLflow takes.
        format!(r#"{{"run_uuid":"r1","metrics":[{loss}]}}"#),
        format!(r#"{{"run_id":"r1","runId":"r2","metrics":[{loss}]}}"#),
        format!(r#"{{"run_id":"r1","run_id":"r2","metrics":[{loss}]}}"#),
        format!(r#"{{"run_id":"r\u0031","metrics":[{loss}]}}"#),
        format!(r#"{{"run_id":"-r1","metrics":[{loss}]}}"#),
        format!(r#"{{"run_id":null,"metrics":[{loss}]}}"#),
        format!(r#"{{"metrics":[{loss}]}}"#),
        // A metric MLflow's parser does not take as written: it would not merge either.
        r#"{"run_id":"r1","metrics":[{"key":"loss","value":"abc","timestamp":1}]}"#.to_owned(),
        r#"{"run_id":"r1","metrics":[{"key":"loss","value":1,"timestamp":1,"step":1.5}]}"#
            .to_owned(),
        r#"{"run_id":"r1","metrics":[{"key":"loss","value":1,"timestamp":1,"step":"1"}]}"#
            .to_owned(),
        r#"{"run_id":"r1","metrics":[{"key":"loss","value":1}]}"#.to_owned(),
        // Fields this proxy does not know, at the top or in a metric; no metrics; not JSON.
        format!(r#"{{"run_id":"r1","metrics":[{loss}],"x":1}}"#),
        r#"{"run_id":"r1","metrics":[{"key":"loss","value":1,"timestamp":1,"x":1}]}"#.to_owned(),
        r#"{"run_id":"r1","metrics":[]}"#.to_owned(),
        r#"{"run_id":"r1"}"#.to_owned(),
        format!(r#"{{"run_id":"r1","metrics":[{loss}]"#),
    ] {
        assert_eq!(plain(&body), None, "{body}");
    }
    let many = vec![loss; 1001].join(",");
    assert_eq!(
        plain(&format!(r#"{{"run_id":"r1","metrics":[{many}]}}"#)),
        None
    );
}
