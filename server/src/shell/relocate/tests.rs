use super::*;

fn destination() -> Destination {
    Destination::parse("s3://mlflow/artifacts").unwrap()
}

fn object(key: &str, size: u64, etag: Option<&str>) -> StoredObject {
    StoredObject {
        key: key.into(),
        size,
        etag: etag.map(Into::into),
    }
}

#[test]
fn sources_are_s3_uris_or_prefixes_in_the_destination_bucket() {
    let d = destination();
    assert_eq!(
        parse_source("s3://mlflow/my-experiment/", Some(&d)).unwrap(),
        Location {
            bucket: "mlflow".into(),
            key: "my-experiment".into()
        }
    );
    assert_eq!(
        parse_source("s3://other/a/b", None).unwrap(),
        Location {
            bucket: "other".into(),
            key: "a/b".into()
        }
    );
    assert_eq!(
        parse_source("/my-experiment/", Some(&d)).unwrap(),
        Location {
            bucket: "mlflow".into(),
            key: "my-experiment".into()
        }
    );
    assert!(parse_source("my-experiment", None)
        .unwrap_err()
        .contains("--artifacts-destination"));
    assert!(parse_source("s3://mlflow", Some(&d))
        .unwrap_err()
        .contains("whole bucket"));
    assert!(parse_source("s3:///x", Some(&d))
        .unwrap_err()
        .contains("no bucket"));
    assert!(parse_source("gs://b/x", Some(&d))
        .unwrap_err()
        .contains("only s3://"));
}

#[test]
fn artifact_uris_map_to_keys_under_the_destination_or_their_own_bucket() {
    let d = destination();
    let at = |bucket: &str, key: &str| Location {
        bucket: bucket.into(),
        key: key.into(),
    };
    assert_eq!(
        artifact_root("mlflow-artifacts:/1/abc/artifacts", Some(&d)).unwrap(),
        at("mlflow", "artifacts/1/abc/artifacts")
    );
    assert_eq!(
        artifact_root("mlflow-artifacts://mlflow:5000/1/abc/artifacts/", Some(&d)).unwrap(),
        at("mlflow", "artifacts/1/abc/artifacts")
    );
    let root = Destination::parse("s3://bucket").unwrap();
    assert_eq!(
        artifact_root("mlflow-artifacts:/1/abc/artifacts", Some(&root)).unwrap(),
        at("bucket", "1/abc/artifacts")
    );
    assert_eq!(
        artifact_root("s3://runs/x/1/abc/artifacts", None).unwrap(),
        at("runs", "x/1/abc/artifacts")
    );
    assert!(artifact_root("mlflow-artifacts:/1/abc/artifacts", None)
        .unwrap_err()
        .contains("--artifacts-destination"));
    assert!(artifact_root("file:///mlruns/1/abc/artifacts", Some(&d))
        .unwrap_err()
        .contains("neither"));
    assert!(artifact_root("mlflow-artifacts:/", Some(&d))
        .unwrap_err()
        .contains("no path"));
}

#[test]
fn targets_keep_the_path_below_the_source_under_the_run_directory() {
    let root = Location {
        bucket: "mlflow".into(),
        key: "artifacts/1/abc/artifacts".into(),
    };
    let target = Location {
        bucket: "mlflow".into(),
        key: root.child(&validate_to("checkpoints/").unwrap()),
    };
    assert_eq!(
        target.child("epoch_1.pt"),
        "artifacts/1/abc/artifacts/checkpoints/epoch_1.pt"
    );
    assert_eq!(
        target.child("sub/epoch_2.pt"),
        "artifacts/1/abc/artifacts/checkpoints/sub/epoch_2.pt"
    );
    assert_eq!(
        root.child(&validate_to("").unwrap()),
        "artifacts/1/abc/artifacts"
    );
    assert_eq!(validate_to("/models/epochs/").unwrap(), "models/epochs");
    for bad in ["../other", "a/../b", "a//b", "./x", "a\\b"] {
        assert!(validate_to(bad).is_err(), "{bad}");
    }
    let mut existing = HashMap::new();
    existing.insert(
        "artifacts/1/abc/artifacts/checkpoints/a".to_owned(),
        object("artifacts/1/abc/artifacts/checkpoints/a", 3, Some("\"x\"")),
    );
    let tasks = plan(
        vec![
            ("a".into(), object("exp/a", 3, Some("\"x\""))),
            ("b".into(), object("exp/b", 10 << 20, None)),
        ],
        &target,
        &existing,
        8 << 20,
        5 << 20,
    );
    assert!(tasks[0].already_there);
    assert!(!tasks[1].already_there);
    assert_eq!(
        tasks[1].method,
        CopyMethod::Multipart {
            part_size: 5 << 20,
            parts: 2
        }
    );
}

#[test]
fn a_target_inside_the_source_or_the_reverse_is_refused() {
    let at = |bucket: &str, key: &str| Location {
        bucket: bucket.into(),
        key: key.into(),
    };
    assert!(check_overlap(
        &at("b", "exp"),
        &at("b", "artifacts/1/r/artifacts/checkpoints")
    )
    .is_ok());
    assert!(check_overlap(&at("b", "exp"), &at("b", "exp-2/r")).is_ok());
    assert!(check_overlap(
        &at("b", "artifacts"),
        &at("b", "artifacts/1/r/artifacts/checkpoints")
    )
    .unwrap_err()
    .contains("inside the source"));
    assert!(check_overlap(
        &at("b", "artifacts/1/r/artifacts/checkpoints/x"),
        &at("b", "artifacts/1/r/artifacts/checkpoints")
    )
    .is_err());
    assert!(check_overlap(&at("a", "artifacts"), &at("b", "artifacts/1")).is_ok());
}

#[test]
fn equal_size_means_already_there_unless_content_md5s_differ() {
    let a = object("a", 5, Some("\"d41d8cd98f00b204e9800998ecf8427e\""));
    assert!(same_content(
        &a,
        &object("b", 5, Some("\"D41D8CD98F00B204E9800998ECF8427E\""))
    ));
    assert!(same_content(&a, &object("b", 5, Some("\"abc-3\""))));
    assert!(same_content(&a, &object("b", 5, None)));
    assert!(!same_content(&a, &object("b", 5, Some("\"0123\""))));
    assert!(!same_content(&a, &object("b", 6, None)));
}

#[test]
fn large_objects_are_copied_in_ranges_that_cover_every_byte_once() {
    assert_eq!(copy_method(1 << 30, 1 << 30, 64 << 20), CopyMethod::Single);
    assert_eq!(
        copy_method((1 << 30) + 1, 1 << 30, 64 << 20),
        CopyMethod::Multipart {
            part_size: 64 << 20,
            parts: 17
        }
    );
    assert_eq!(part_ranges(12, 5), vec![(0, 4), (5, 9), (10, 11)]);
    assert_eq!(part_ranges(10, 5), vec![(0, 4), (5, 9)]);
    let huge = 1u64 << 40;
    let CopyMethod::Multipart { parts, .. } = copy_method(huge, 5 << 30, 64 << 20) else {
        panic!("multipart")
    };
    assert!(parts <= 10_000);
}

#[test]
fn mlflow_answers_become_run_infos_or_clear_errors() {
    let parse_run_answer = |status: StatusCode, body: &[u8], run_id: &str, upstream: &str| {
        run_info(
            mlflow::run_answer(status, "/runs/get", body),
            run_id,
            upstream,
        )
    };
    let ok = br#"{"run": {"info": {"run_id": "abc", "experiment_id": "1", "artifact_uri": "mlflow-artifacts:/1/abc/artifacts", "lifecycle_stage": "active"}}}"#;
    let run = parse_run_answer(StatusCode::OK, ok, "abc", "http://m").unwrap();
    assert_eq!(run.experiment_id, "1");
    assert_eq!(run.artifact_uri, "mlflow-artifacts:/1/abc/artifacts");
    let missing =
        br#"{"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "Run with id=nope not found"}"#;
    let err = parse_run_answer(StatusCode::NOT_FOUND, missing, "nope", "http://m").unwrap_err();
    assert!(
        err.contains("has no run \"nope\"") && err.contains("not found"),
        "{err}"
    );
    let err = parse_run_answer(StatusCode::UNAUTHORIZED, b"", "abc", "http://m").unwrap_err();
    assert!(err.contains("MLFLOW_TRACKING_TOKEN"), "{err}");
    let err = parse_run_answer(StatusCode::OK, b"<html>", "abc", "http://m").unwrap_err();
    assert!(
        err.contains("is http://m an MLflow tracking server"),
        "{err}"
    );
    let err =
        parse_run_answer(StatusCode::BAD_GATEWAY, b"upstream down", "abc", "http://m").unwrap_err();
    assert!(
        err.contains("502") && err.contains("upstream down"),
        "{err}"
    );
}
