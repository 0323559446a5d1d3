use super::*;

#[test]
fn the_run_of_a_write_is_its_run_id_else_its_run_uuid() {
    assert_eq!(
        run_of(br#"{"run_id": "a1", "key": "k", "value": "v"}"#).as_deref(),
        Some("a1")
    );
    assert_eq!(
        run_of(br#"{"run_id": "", "run_uuid": "b2"}"#).as_deref(),
        Some("b2")
    );
    assert_eq!(
        run_of(br#"{"run_uuid": "b2", "run_id": "a1"}"#).as_deref(),
        Some("a1")
    );
    assert_eq!(run_of(br#"{"run_id": "../x"}"#), None);
    assert_eq!(run_of(b"not json"), None);
    assert_eq!(run_of(br#"["a1"]"#), None);
}

#[test]
fn a_body_is_read_in_every_encoding_mlflow_decodes() {
    let json = r#"{"run_id": "r1", "metrics": [{"key": "loss", "value": 1, "timestamp": 1}]}"#;
    let read = |body: &[u8]| as_mlflow_reads(body).map(|b| String::from_utf8(b.to_vec()).unwrap());
    assert_eq!(read(json.as_bytes()), None, "plain UTF-8 is read as it is");
    let mut bom = b"\xef\xbb\xbf".to_vec();
    bom.extend_from_slice(json.as_bytes());
    assert_eq!(read(&bom).as_deref(), Some(json));
    let double = serde_json::to_string(json).unwrap();
    assert_eq!(read(double.as_bytes()).as_deref(), Some(json));
    let utf16le: Vec<u8> = json.encode_utf16().flat_map(u16::to_le_bytes).collect();
    assert_eq!(read(&utf16le).as_deref(), Some(json));
    let mut utf16be = vec![0xfe, 0xff];
    utf16be.extend(json.encode_utf16().flat_map(u16::to_be_bytes));
    assert_eq!(read(&utf16be).as_deref(), Some(json));
    let utf32le: Vec<u8> = json
        .chars()
        .flat_map(|c| u32::from(c).to_le_bytes())
        .collect();
    assert_eq!(read(&utf32le).as_deref(), Some(json));
    // A JSON string that is not JSON inside stays what it is.
    assert_eq!(read(br#""not json""#), None);
}

#[test]
fn every_spelling_of_the_run_is_read_as_mlflow_reads_it() {
    let run = |body: &str| run_of(body.as_bytes());
    // `runId` is `run_id` and wins over `run_uuid`: the run MLflow ends.
    assert_eq!(
        run(r#"{"runId": "a1", "run_uuid": "b2", "status": "FINISHED"}"#).as_deref(),
        Some("a1")
    );
    assert_eq!(run(r#"{"runUuid": "b2"}"#).as_deref(), Some("b2"));
    // Two spellings of one field: the later one in the object.
    assert_eq!(
        run(r#"{"run_id": "a1", "runId": "b2"}"#).as_deref(),
        Some("b2")
    );
    assert_eq!(
        run(r#"{"runId": "b2", "run_id": "a1"}"#).as_deref(),
        Some("a1")
    );
    // A key sent twice: its last value, at the place of its first.
    assert_eq!(
        run(r#"{"run_id": "a1", "run_id": "b2"}"#).as_deref(),
        Some("b2")
    );
    assert_eq!(
        run(r#"{"run_id": "a1", "runId": "c3", "run_id": "b2"}"#).as_deref(),
        Some("c3")
    );
    // `null` clears; a value of another type stops the reading where it stands.
    assert_eq!(
        run(r#"{"run_id": "a1", "runId": null, "run_uuid": "b2"}"#).as_deref(),
        Some("b2")
    );
    assert_eq!(
        run(r#"{"run_uuid": "b2", "run_id": 7, "runId": "a1"}"#).as_deref(),
        Some("b2")
    );
}

#[test]
fn run_ids_are_judged_by_mlflows_rule() {
    for valid in [
        "0123456789abcdef0123456789abcdef",
        "a",
        "A_b-c",
        "r1",
        "aé",
        &"a".repeat(256),
    ] {
        assert!(is_valid_run_id(valid), "{valid}");
    }
    for invalid in [
        "",
        "_a",
        "-a",
        "é",
        "a b",
        "a/b",
        "a.b",
        "a\0",
        &"a".repeat(257),
        &"x".repeat(100_000),
    ] {
        assert!(!is_valid_run_id(invalid), "{invalid:.40}");
    }
    // A made-up run id goes to MLflow alone, not into a run's queue.
    let long = format!(
        r#"{{"run_id": "{}", "metrics": [{{"key": "a", "value": 1, "timestamp": 5, "step": 0}}]}}"#,
        "x".repeat(300)
    );
    assert_eq!(
        parse("/api/2.0/mlflow/runs/log-batch", &Bytes::from(long)),
        Err(Alone::Shape)
    );
}

fn batch(body: &str) -> Result<Mergeable, Alone> {
    parse(
        "/api/2.0/mlflow/runs/log-batch",
        &Bytes::from(body.to_owned()),
    )
}

#[test]
fn metric_params_and_tags_batches_merge_with_their_elements_as_sent() {
    let parsed = batch(
        r#"{"run_id": "r1", "metrics": [{"key": "a", "value": "NaN", "timestamp": 5, "step": 0}],
                "params": [{"key": "lr", "value": "0.1"}], "tags": [{"key": "t", "value": "v"}]}"#,
    )
    .unwrap();
    assert_eq!(parsed.batch_path, "/api/2.0/mlflow/runs/log-batch");
    assert_eq!(parsed.run_id, "r1");
    assert_eq!(
        parsed.writes.metrics,
        [Bytes::from_static(
            br#"{"key": "a", "value": "NaN", "timestamp": 5, "step": 0}"#
        )]
    );
    assert_eq!(&*parsed.writes.params[0].key, "lr");
    assert_eq!(&*parsed.writes.tags[0].value, "v");
    assert!(parsed.writes.is_ordered());
}

#[test]
fn elements_mlflow_would_store_as_zeros_go_alone() {
    for element in [
        r#"{"key": "a", "value": "abc", "timestamp": 5, "step": 0}"#,
        r#"{"key": "a", "value": 1, "timestamp": 5, "step": 1.5}"#,
        r#"{"key": "a", "value": 1, "timestamp": "soon", "step": 0}"#,
        r#"{"key": "a", "value": 1, "timestamp": "5", "step": 0}"#,
        r#"{"key": "a", "value": 1e999, "timestamp": 5}"#,
        r#"{"key": "a", "value": "nan", "timestamp": 5}"#,
        r#"{"key": "a", "value": true, "timestamp": 5}"#,
        r#"{"key": "a", "value": null, "timestamp": 5}"#,
        r#"{"key": "a", "value": 1, "timestamp": 99999999999999999999}"#,
        r#"{"key": 7, "value": 1, "timestamp": 5}"#,
        r#"{"key": "a", "value": 1}"#,
        r#"{"key": "a", "value": 1, "timestamp": 5, "datasetName": "d"}"#,
        r#"{"key": "a", "value": 1, "timestamp": 5, "value": "abc"}"#,
        r#"{"key": "a", "value": 1, "timestamp": 5, "model_id": 3}"#,
        r#"[1]"#,
    ] {
        let body = format!(
            r#"{{"run_id": "r", "metrics": [{{"key": "ok", "value": 1, "timestamp": 1}}, {element}]}}"#
        );
        assert_eq!(batch(&body).unwrap_err(), Alone::Element, "{element}");
    }
    for pair in [
        r#"{"key": "p", "value": 5}"#,
        r#"{"key": "p", "value": null}"#,
        r#"{"key": "p"}"#,
        r#"{"key": "p", "value": "v", "extra": 1}"#,
    ] {
        assert_eq!(
            batch(&format!(r#"{{"run_id": "r", "params": [{pair}]}}"#)).unwrap_err(),
            Alone::Element,
            "{pair}"
        );
        assert_eq!(
            batch(&format!(r#"{{"run_id": "r", "tags": [{pair}]}}"#)).unwrap_err(),
            Alone::Element,
            "{pair}"
        );
    }
}

#[test]
fn envelopes_the_coalescer_does_not_know_go_alone() {
    for (body, why) in [
        (r#"{"run_uuid": "r1", "metrics": []}"#, Alone::Shape),
        (
            r#"{"run_id": "r1", "runId": "r2", "metrics": [{"key": "a", "value": 1, "timestamp": 1}]}"#,
            Alone::Shape,
        ),
        (r#"{"run_id": "r1"}"#, Alone::Shape),
        (
            r#"{"run_id": "", "tags": [{"key": "t", "value": "v"}]}"#,
            Alone::Shape,
        ),
        (r#"{"run_id": 7, "tags": []}"#, Alone::Shape),
        (
            r#"{"run_id": "r1", "run_id": "r2", "tags": [{"key": "t", "value": "v"}]}"#,
            Alone::Shape,
        ),
        ("not json", Alone::Shape),
        (
            r#"{"run_id": "r1", "params": [{"key": "p", "value": "1"}, {"key": "p", "value": "1"}]}"#,
            Alone::RepeatedParam,
        ),
    ] {
        assert_eq!(batch(body).unwrap_err(), why, "{body}");
    }
    let over: Vec<String> = (0..=MAX_BATCH_PARAMS)
        .map(|i| format!(r#"{{"key": "p{i}", "value": "v"}}"#))
        .collect();
    let over = format!(r#"{{"run_id": "r", "params": [{}]}}"#, over.join(","));
    assert_eq!(batch(&over).unwrap_err(), Alone::Limits);
}

#[test]
fn the_mlflow_clients_log_metric_becomes_the_element_mlflow_builds() {
    let body = Bytes::from_static(
            br#"{"run_id": "r1", "run_uuid": "r1", "key": "loss", "value": 0.1000000000000000055511151231257827, "timestamp": 7, "step": 3, "model_id": "m-1"}"#,
        );
    let parsed = parse("/ajax-api/2.0/mlflow/runs/log-metric", &body).unwrap();
    assert_eq!(parsed.batch_path, "/ajax-api/2.0/mlflow/runs/log-batch");
    let text = std::str::from_utf8(&parsed.writes.metrics[0]).unwrap();
    assert_eq!(
        text,
        r#"{"key":"loss","value":0.1000000000000000055511151231257827,"timestamp":7,"step":3,"model_id":"m-1","run_id":"r1"}"#
    );
    for refused in [
        r#"{"run_id": "r1", "run_uuid": "r2", "key": "loss", "value": 1, "timestamp": 7}"#,
        r#"{"run_uuid": "r1", "key": "loss", "value": 1, "timestamp": 7}"#,
        r#"{"run_id": "r1", "key": "loss", "value": "NaN", "timestamp": 7}"#,
        r#"{"run_id": "r1", "key": "loss", "value": 1, "timestamp": 7.5}"#,
        r#"{"run_id": "r1", "key": "loss", "value": 1, "timestamp": "7"}"#,
        r#"{"run_id": "r1", "key": "loss", "value": 1}"#,
        r#"{"run_id": "r1", "key": "loss", "value": 1, "timestamp": 7, "extra": 1}"#,
    ] {
        assert!(
            parse("/api/2.0/mlflow/runs/log-metric", &Bytes::from(refused)).is_err(),
            "{refused}"
        );
    }
}

#[test]
fn log_param_and_set_tag_become_batch_pairs() {
    let param = parse(
        "/api/2.0/mlflow/runs/log-parameter",
        &Bytes::from_static(br#"{"run_id":"r","run_uuid":"r","key":"lr","value":"0.1"}"#),
    )
    .unwrap();
    assert_eq!(param.writes.params[0].raw, r#"{"key":"lr","value":"0.1"}"#);
    let tag = parse(
        "/api/2.0/mlflow/runs/set-tag",
        &Bytes::from_static(br#"{"run_id":"r","key":"t","value":"x\"y"}"#),
    )
    .unwrap();
    assert_eq!(&*tag.writes.tags[0].value, "x\"y");
    assert!(parse(
        "/api/2.0/mlflow/runs/set-tag",
        &Bytes::from_static(br#"{"run_id":"r","key":"t","value":1}"#),
    )
    .is_err());
}

#[test]
fn a_json_string_is_decoded_and_borrowed_where_it_holds_no_escape() {
    let read = |json: &str| {
        let raw: Box<serde_json::value::RawValue> = serde_json::from_str(json).unwrap();
        string(raw.get()).map(|s| (s.to_string(), matches!(s, Cow::Borrowed(_))))
    };
    assert_eq!(read(r#""loss""#), Some(("loss".into(), true)));
    assert_eq!(read(r#""""#), Some((String::new(), true)));
    assert_eq!(read(r#""é/x y""#), Some(("é/x y".into(), true)));
    assert_eq!(read(r#""a\"b""#), Some(("a\"b".into(), false)));
    assert_eq!(read(r#""a\\""#), Some(("a\\".into(), false)));
    assert_eq!(read(r#""\u0041\/""#), Some(("A/".into(), false)));
    assert_eq!(read("7"), None);
    assert_eq!(read("null"), None);
    assert_eq!(read(r#"["a"]"#), None);
}

#[test]
fn a_metric_value_is_finite_exactly_when_it_converts_to_a_finite_double() {
    let long = |digits: usize| format!("9{}", "0".repeat(digits - 1));
    let mut numbers: Vec<String> = [
        "0",
        "-0",
        "1.5",
        "-2.25e3",
        "1E5",
        "1e308",
        "1e309",
        "-1e999",
        "2.5e-400",
        "123456789",
    ]
    .map(str::to_owned)
    .to_vec();
    // Around the largest double (about 1.8e308, 309 digits), without an exponent.
    for digits in [300, 308, 309, 310, 400] {
        numbers.push(long(digits));
        numbers.push(format!("-{}.5", long(digits)));
        numbers.push(format!("0.{}", long(digits)));
    }
    for text in &numbers {
        let converted = text.parse::<f64>().is_ok_and(f64::is_finite);
        assert_eq!(super::is_finite_number(text), converted, "{text}");
    }
}
