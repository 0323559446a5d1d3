//! The artifact gateway against a store with the quirks of the field notes (§4): SeaweedFS behind
//! the quirk-injecting shim of `mlscope_tests::s3shim`, which refuses `aws-chunked` bodies and
//! bodies without Content-Length (411), flexible checksums on PUTs (501) and object tagging
//! (400 MalformedXML), and leaves zero-byte directory markers behind every object written.
//!
//! An SDK with its default settings fails against it, while the same requests succeed against
//! SeaweedFS itself, so the failures are the quirks'. Uploads, multipart uploads, listings and copies
//! through the gateway (`--s3-quirks generic`) succeed, and the shim's counters show that it
//! forwarded them without injecting anything, while its markers are really in the store.
//!
//! One SeaweedFS and one MLflow serve every test here; each test has its own shim and gateway,
//! so that its counters count only its own requests.

use std::sync::OnceLock;
use std::time::Duration;

use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::operation::put_object::PutObjectError;
use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;
use mlscope_tests::s3shim::{InjectionCounts, Quirks, S3Shim};
use mlscope_tests::{proxy_binary, spawn_proxy, venv, ProxyProcess, TestStack};
use serde_json::{json, Value};

use crate::mlflow::{create_experiment_and_run, http, response_json, run_tags};
use crate::objects::{pattern, sha256, store_objects};

const MIB: usize = 1 << 20;

/// SeaweedFS and MLflow, no proxy: every test starts its own gateway in front of its own shim.
fn stack() -> &'static TestStack {
    static STACK: OnceLock<Result<TestStack, String>> = OnceLock::new();
    crate::module_stack(&STACK, "S3 quirks stack")
}

/// A shim in front of the stack's SeaweedFS and a gateway that stores artifacts through it.
struct QuirkyGateway {
    proxy: ProxyProcess,
    shim: S3Shim,
}

impl QuirkyGateway {
    fn start(stack: &TestStack) -> QuirkyGateway {
        let shim = S3Shim::start(&stack.s3.url, Quirks::default()).expect("starting the S3 shim");
        let args = generic_gateway_args(stack, &shim);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let proxy =
            spawn_proxy(&stack.mlflow.url, &args, stack.dir.path()).expect("starting the gateway");
        QuirkyGateway { proxy, shim }
    }

    /// `{proxy}/api/2.0/mlflow-artifacts`.
    fn api(&self) -> String {
        format!("{}/api/2.0/mlflow-artifacts", self.proxy.url)
    }

    fn assert_nothing_injected(&self) {
        let counts = self.shim.counts();
        let injected: Vec<_> = self
            .shim
            .exchanges()
            .into_iter()
            .filter(|e| e.injected.is_some())
            .collect();
        assert_eq!(
            counts.failures(),
            0,
            "the shim injected failures into the gateway's requests: {injected:#?}"
        );
    }
}

/// The gateway's S3 arguments for the store behind `shim`, with the quirks profile for an
/// unknown S3-compatible store, which is what the shim plays.
fn generic_gateway_args(stack: &TestStack, shim: &S3Shim) -> Vec<String> {
    let args: Vec<String> = stack
        .s3
        .gateway_args(&shim.url)
        .into_iter()
        .map(|arg| {
            if arg == "seaweedfs" {
                "generic".to_owned()
            } else {
                arg
            }
        })
        .collect();
    assert!(args.iter().any(|a| a == "generic"), "{args:?}");
    args
}

/// GETs `url`, asserting 200, and returns the body.
async fn download(url: &str) -> Bytes {
    let response = http().get(url).send().await.unwrap();
    let status = response.status();
    let body = response.bytes().await.unwrap();
    assert_eq!(
        status.as_u16(),
        200,
        "GET {url}: {}",
        String::from_utf8_lossy(&body[..body.len().min(500)])
    );
    body
}

/// Asserts that `path` reads back as `expected` through the gateway and through MLflow itself.
async fn assert_stored(gateway: &QuirkyGateway, path: &str, expected: &[u8]) {
    let via_gateway = download(&format!("{}/artifacts/{path}", gateway.api())).await;
    let via_mlflow = download(&format!(
        "{}/api/2.0/mlflow-artifacts/artifacts/{path}",
        stack().mlflow.url
    ))
    .await;
    assert_eq!(
        via_gateway.len(),
        expected.len(),
        "{path} through the gateway"
    );
    assert_eq!(
        sha256(&via_gateway),
        sha256(expected),
        "{path} through the gateway"
    );
    assert_eq!(
        sha256(&via_mlflow),
        sha256(expected),
        "{path} through MLflow"
    );
}

async fn put_artifact(gateway: &QuirkyGateway, path: &str, body: reqwest::Body) {
    let response = http()
        .put(format!("{}/artifacts/{path}", gateway.api()))
        .body(body)
        .send()
        .await
        .unwrap();
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    assert_eq!(
        status.as_u16(),
        200,
        "upload of {path} through the gateway: {text}"
    );
}

async fn list(gateway: &QuirkyGateway, path: &str) -> Value {
    let response = http()
        .get(format!("{}/artifacts", gateway.api()))
        .query(&[("path", path)])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200, "listing {path}");
    response.json().await.unwrap()
}

/// An S3 client with the SDK's default settings (request checksums "when supported", response
/// validation "when supported"). Only what reaching a store by IP address needs is set:
/// endpoint, region, static credentials and path-style addressing, and the HTTP client (the
/// project builds the SDK without its default one).
fn default_sdk_client(endpoint: &str) -> aws_sdk_s3::Client {
    let config = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .http_client(mlscope_proxy::capabilities::artifacts::s3::https_client())
        .endpoint_url(endpoint)
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new(
            "mlscope",
            "mlscope",
            None,
            None,
            "s3-quirks-test",
        ))
        .force_path_style(true)
        .build();
    aws_sdk_s3::Client::from_conf(config)
}

/// A PutObject with [`default_sdk_client`] through `shim`, which must fail: the error, and the
/// headers the SDK sent as the shim saw them. `what` names the body in messages.
async fn refused_default_sdk_put(
    shim: &S3Shim,
    bucket: &str,
    key: &str,
    body: ByteStream,
    what: &str,
) -> (SdkError<PutObjectError>, Vec<(String, String)>) {
    let result = default_sdk_client(&shim.url)
        .put_object()
        .bucket(bucket)
        .key(key)
        .body(body)
        .send()
        .await;
    let error = result.err().unwrap_or_else(|| {
        panic!("a default aws-sdk-s3 PutObject ({what}) must fail against the shim")
    });
    let sent = shim
        .exchanges()
        .last()
        .map(|e| e.headers.clone())
        .unwrap_or_default();
    println!(
        "aws-sdk-s3 PutObject ({what}) sent {sent:?} and got {:?}",
        error.code()
    );
    (error, sent)
}

/// What the venv's boto3 with its default configuration makes of `put_object(Body=b"...")`:
/// `{"ok": true}` or `{"ok": false, "code": ..., "status": ...}`.
fn boto3_put_object(endpoint: &str, bucket: &str, key: &str) -> Value {
    const SCRIPT: &str = r#"
import json, sys
import boto3, botocore.exceptions
endpoint, bucket, key = sys.argv[1:4]
s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                  aws_access_key_id="mlscope", aws_secret_access_key="mlscope")
try:
    s3.put_object(Bucket=bucket, Key=key, Body=b"boto3 with its default configuration")
    print(json.dumps({"ok": True}))
except botocore.exceptions.ClientError as e:
    print(json.dumps({"ok": False, "code": e.response["Error"].get("Code"),
                      "status": e.response["ResponseMetadata"]["HTTPStatusCode"]}))
"#;
    let output = std::process::Command::new(venv().join("bin/python"))
        .args(["-c", SCRIPT, endpoint, bucket, key])
        // The SDK's own defaults, whatever this machine's AWS configuration says.
        .env("AWS_CONFIG_FILE", "/dev/null")
        .env("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
        .env_remove("AWS_REQUEST_CHECKSUM_CALCULATION")
        .env_remove("AWS_RESPONSE_CHECKSUM_VALIDATION")
        .output()
        .expect("running the venv's python");
    assert!(
        output.status.success(),
        "boto3 script failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&output.stdout)))
}

// === an SDK with default settings ===

#[tokio::test]
async fn default_sdk_uploads_and_tag_reads_fail_against_the_quirky_store_but_not_against_seaweedfs()
{
    let stack = stack();
    let shim = S3Shim::start(&stack.s3.url, Quirks::default()).unwrap();
    let bucket = &stack.s3.bucket;
    let base = format!("sdk-defaults/{}", uuid::Uuid::new_v4().simple());

    // boto3 over http:// sends its CRC32 as `x-amz-checksum-crc32` with `x-amz-sdk-checksum-algorithm`.
    let refused = boto3_put_object(&shim.url, bucket, &format!("{base}/boto3.txt"));
    assert_eq!(
        refused,
        json!({"ok": false, "code": "NotImplemented", "status": 501})
    );
    assert_eq!(
        shim.counts().checksum_not_implemented,
        1,
        "{:#?}",
        shim.exchanges()
    );
    let stored = boto3_put_object(&stack.s3.url, bucket, &format!("{base}/boto3.txt"));
    assert_eq!(
        stored,
        json!({"ok": true}),
        "the same call straight to SeaweedFS"
    );

    // aws-sdk-s3 with an in-memory body sends its CRC32 as a header, too.
    let key = format!("{base}/rust.txt");
    let before = shim.counts();
    let body = ByteStream::from_static(b"aws-sdk-s3 with its default configuration");
    let (error, sent) = refused_default_sdk_put(&shim, bucket, &key, body, "in-memory body").await;
    assert_eq!(error.code(), Some("NotImplemented"), "{error:?}");
    assert_eq!(error.raw_response().map(|r| r.status().as_u16()), Some(501));
    assert_eq!(
        shim.counts().checksum_not_implemented,
        before.checksum_not_implemented + 1
    );
    assert!(
        sent.iter()
            .any(|(name, _)| name.starts_with("x-amz-checksum-")),
        "{sent:?}"
    );

    // A body streamed from a file goes out `aws-chunked`, signed chunks with the CRC32 in a trailer.
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), pattern(64 * 1024, 1)).unwrap();
    let before = shim.counts();
    let body = ByteStream::from_path(file.path()).await.unwrap();
    let (error, sent) = refused_default_sdk_put(
        &shim,
        bucket,
        &format!("{base}/streamed.bin"),
        body,
        "file body",
    )
    .await;
    assert_eq!(error.code(), Some("MissingContentLength"), "{error:?}");
    assert_eq!(error.raw_response().map(|r| r.status().as_u16()), Some(411));
    assert_eq!(
        shim.counts().missing_content_length,
        before.missing_content_length + 1
    );
    assert!(
        sent.contains(&("content-encoding".to_owned(), "aws-chunked".to_owned())),
        "{sent:?}"
    );

    // SeaweedFS itself decodes `aws-chunked` uploads. This one has no S3 identities, so it
    // refuses every signed streaming upload ("Signed request requires setting up SeaweedFS S3
    // authentication") and the SDK's own upload cannot be repeated against it; an anonymous one,
    // framed as boto3 frames it over https, is stored decoded. The shim refuses it like the SDK's.
    let framed = |endpoint: &str| {
        http()
            .put(format!("{endpoint}/{bucket}/{base}/framed.txt"))
            .header("content-encoding", "aws-chunked")
            .header("x-amz-content-sha256", "STREAMING-UNSIGNED-PAYLOAD-TRAILER")
            .header("x-amz-trailer", "x-amz-checksum-crc32")
            .header("x-amz-decoded-content-length", "5")
            .body("5\r\nhello\r\n0\r\nx-amz-checksum-crc32:NhCmhg==\r\n\r\n")
            .send()
    };
    let refused = framed(&shim.url).await.unwrap();
    assert_eq!(refused.status().as_u16(), 411);
    assert!(refused
        .text()
        .await
        .unwrap()
        .contains("<Code>MissingContentLength</Code>"));
    assert_eq!(
        shim.counts().missing_content_length,
        before.missing_content_length + 2
    );
    assert_eq!(
        framed(&stack.s3.url).await.unwrap().status().as_u16(),
        200,
        "aws-chunked straight to SeaweedFS"
    );
    assert_eq!(
        download(&format!("{}/{bucket}/{base}/framed.txt", stack.s3.url)).await,
        "hello",
        "stored decoded"
    );

    let direct = default_sdk_client(&stack.s3.url);
    direct
        .put_object()
        .bucket(bucket)
        .key(&key)
        .body(ByteStream::from_static(
            b"aws-sdk-s3 with its default configuration",
        ))
        .send()
        .await
        .expect("the same PutObject straight to SeaweedFS");

    // Tag reads: SeaweedFS answers them, the quirky store does not.
    direct
        .get_object_tagging()
        .bucket(bucket)
        .key(&key)
        .send()
        .await
        .expect("GetObjectTagging on SeaweedFS");
    let error = default_sdk_client(&shim.url)
        .get_object_tagging()
        .bucket(bucket)
        .key(&key)
        .send()
        .await
        .expect_err("GetObjectTagging must fail against the shim");
    assert_eq!(error.code(), Some("MalformedXML"), "{error:?}");
    assert_eq!(error.raw_response().map(|r| r.status().as_u16()), Some(400));
    let counts = shim.counts();
    println!("shim counts after the default SDK calls: {counts:?}");
    let expected = InjectionCounts {
        forwarded: 0,
        missing_content_length: 2,
        checksum_not_implemented: 2,
        tagging_malformed_xml: 1,
        markers_created: 0,
    };
    assert_eq!(counts, expected, "{:#?}", shim.exchanges());
}

// === the gateway ===

#[tokio::test]
async fn uploads_of_every_size_and_framing_pass_the_quirky_store_through_the_gateway() {
    let gateway = QuirkyGateway::start(stack());
    let (experiment, run) =
        create_experiment_and_run(&stack().mlflow.url, "s3-quirks-uploads").await;
    let root = format!("{experiment}/{run}/artifacts");

    let small = b"a few bytes".to_vec();
    put_artifact(
        &gateway,
        &format!("{root}/dir/small.txt"),
        small.clone().into(),
    )
    .await;
    // Above the 8 MiB multipart threshold: a multipart upload.
    let big = pattern(40 * MIB, 2);
    put_artifact(&gateway, &format!("{root}/dir/big.bin"), big.clone().into()).await;
    // Chunked transfer encoding, no Content-Length: one small PutObject, and a multipart upload.
    let chunked = |data: Vec<u8>| {
        let chunks: Vec<Result<Bytes, std::io::Error>> = data
            .chunks(MIB)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        reqwest::Body::wrap_stream(futures_util::stream::iter(chunks))
    };
    let streamed_small = pattern(300 * 1024 + 7, 3);
    put_artifact(
        &gateway,
        &format!("{root}/dir/streamed-small.bin"),
        chunked(streamed_small.clone()),
    )
    .await;
    let streamed_big = pattern(12 * MIB + 7, 4);
    put_artifact(
        &gateway,
        &format!("{root}/dir/streamed-big.bin"),
        chunked(streamed_big.clone()),
    )
    .await;

    gateway.assert_nothing_injected();
    let exchanges = gateway.shim.exchanges();
    let parts = exchanges
        .iter()
        .filter(|e| e.method == "PUT" && e.target.contains("partNumber="))
        .count();
    // The gateway's default part size is 8 MiB.
    let expected_parts = big.len().div_ceil(8 * MIB) + streamed_big.len().div_ceil(8 * MIB);
    assert_eq!(
        parts, expected_parts,
        "UploadPart requests through the shim: {exchanges:#?}"
    );
    assert!(exchanges.iter().all(|e| e.status < 300), "{exchanges:#?}");
    let counts = gateway.shim.counts();
    assert!(counts.forwarded >= 4 + parts as u64, "{counts:?}");
    assert!(counts.markers_created > 0, "{counts:?}");
    println!("shim counts after the uploads: {counts:?}");

    assert_stored(&gateway, &format!("{root}/dir/small.txt"), &small).await;
    assert_stored(&gateway, &format!("{root}/dir/big.bin"), &big).await;
    assert_stored(
        &gateway,
        &format!("{root}/dir/streamed-small.bin"),
        &streamed_small,
    )
    .await;
    assert_stored(
        &gateway,
        &format!("{root}/dir/streamed-big.bin"),
        &streamed_big,
    )
    .await;
    gateway.assert_nothing_injected();
}

#[tokio::test]
async fn listings_through_the_gateway_hide_the_directory_markers_the_store_holds() {
    let gateway = QuirkyGateway::start(stack());
    let (experiment, run) =
        create_experiment_and_run(&stack().mlflow.url, "s3-quirks-listings").await;
    let root = format!("{experiment}/{run}/artifacts");
    put_artifact(&gateway, &format!("{root}/dir/small.txt"), "small".into()).await;
    put_artifact(
        &gateway,
        &format!("{root}/dir/nested/deep.txt"),
        "deeper".into(),
    )
    .await;
    gateway.assert_nothing_injected();

    // The markers are really in the store: zero-byte keys ending in `/`.
    let run_prefix = format!("{}/{experiment}/{run}/", mlscope_tests::S3Store::PREFIX);
    let objects = store_objects(&stack().s3, &run_prefix).await;
    let markers: Vec<String> = objects
        .into_iter()
        .filter(|(key, size)| key.ends_with('/') && *size == 0)
        .map(|(key, _)| key)
        .collect();
    for dir in ["", "artifacts/", "artifacts/dir/", "artifacts/dir/nested/"] {
        assert!(
            markers.contains(&format!("{run_prefix}{dir}")),
            "no marker {run_prefix}{dir} in {markers:?}"
        );
    }
    assert!(gateway.shim.counts().markers_created >= 4);

    assert_eq!(
        list(&gateway, &format!("{experiment}/{run}")).await,
        json!({"files": [{"path": "artifacts", "is_dir": true}]})
    );
    assert_eq!(
        list(&gateway, &root).await,
        json!({"files": [{"path": "dir", "is_dir": true}]})
    );
    let dir = list(&gateway, &format!("{root}/dir")).await;
    assert_eq!(
        dir,
        json!({"files": [{"path": "nested", "is_dir": true}, {"path": "small.txt", "is_dir": false, "file_size": 5}]})
    );
    assert_eq!(
        list(&gateway, &format!("{root}/dir/nested")).await,
        json!({"files": [{"path": "deep.txt", "is_dir": false, "file_size": 6}]})
    );
    gateway.assert_nothing_injected();
}

#[tokio::test]
async fn mlflow_multipart_uploads_with_presigned_parts_pass_the_quirky_store() {
    let gateway = QuirkyGateway::start(stack());
    let (experiment, run) = create_experiment_and_run(&stack().mlflow.url, "s3-quirks-mpu").await;
    let root = format!("{experiment}/{run}/artifacts");
    let data = pattern(6 * MIB + 3, 5);
    let parts = [&data[..5 * MIB], &data[5 * MIB..]];

    let created = response_json(
        http()
            .post(format!("{}/mpu/create/{root}", gateway.api()))
            .json(&json!({"path": "/local/big.bin", "num_parts": 2})),
    )
    .await;
    let upload_id = created["upload_id"]
        .as_str()
        .unwrap_or_else(|| panic!("{created}"))
        .to_owned();
    let credentials = created["credentials"]
        .as_array()
        .unwrap_or_else(|| panic!("{created}"));
    assert_eq!(credentials.len(), 2, "{created}");

    let mut completed = Vec::new();
    for (credential, part) in credentials.iter().zip(parts) {
        let url = credential["url"].as_str().unwrap();
        assert!(
            url.starts_with(&gateway.shim.url),
            "the part must go through the shim: {url}"
        );
        let lower = url.to_ascii_lowercase();
        assert!(
            !lower.contains("x-amz-checksum") && !lower.contains("x-amz-sdk-checksum-algorithm"),
            "{url}"
        );
        let response = http().put(url).body(part.to_vec()).send().await.unwrap();
        let status = response.status();
        let etag = response
            .headers()
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        assert_eq!(
            status.as_u16(),
            200,
            "part {}: {}",
            credential["part_number"],
            response.text().await.unwrap_or_default()
        );
        completed.push(json!({"part_number": credential["part_number"], "etag": etag.expect("an ETag for the part")}));
    }
    let response = http()
        .post(format!("{}/mpu/complete/{root}", gateway.api()))
        .json(&json!({"path": "/local/big.bin", "upload_id": upload_id, "parts": completed}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status().as_u16(),
        200,
        "{}",
        response.text().await.unwrap_or_default()
    );

    gateway.assert_nothing_injected();
    assert_stored(&gateway, &format!("{root}/big.bin"), &data).await;
    let counts = gateway.shim.counts();
    assert!(
        counts.markers_created > 0,
        "CompleteMultipartUpload leaves markers: {counts:?}"
    );
    println!("shim counts after the multipart upload: {counts:?}");
}

#[tokio::test]
async fn relocate_copies_stray_objects_into_a_run_through_the_quirky_store_without_reading_tags() {
    let stack = stack();
    let shim = S3Shim::start(&stack.s3.url, Quirks::default()).unwrap();
    let (experiment, run) =
        create_experiment_and_run(&stack.mlflow.url, "s3-quirks-relocate").await;
    let stray = format!("stray-{}", uuid::Uuid::new_v4().simple());
    let objects = [
        ("notes.txt", b"written outside MLflow's layout".to_vec()),
        ("ckpt/model.bin", pattern(9 * MIB, 6)),
    ];
    for (name, data) in &objects {
        let url = format!("{}/{}/{stray}/{name}", stack.s3.url, stack.s3.bucket);
        let status = http()
            .put(&url)
            .body(data.clone())
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status.as_u16(), 200, "writing the stray object {url}");
    }

    let mut command = tokio::process::Command::new(proxy_binary());
    command
        // `--upstream` and `--database-url` are flags of the proxy itself, so they come before
        // the subcommand; the S3 flags are global.
        .args(["--upstream", &stack.mlflow.url])
        .args([
            "--database-url",
            &format!(
                "sqlite://{}",
                stack
                    .dir
                    .path()
                    .join(format!("relocate-{stray}.db"))
                    .display()
            ),
        ])
        .arg("relocate")
        .arg(format!("s3://{}/{stray}", stack.s3.bucket))
        .args(["--run-id", &run])
        // The 9 MiB checkpoint is copied part by part (UploadPartCopy, where copies read tags),
        // the note with one CopyObject.
        .args(["--max-single-copy", "8MiB", "--part-size", "5MiB"])
        .args(generic_gateway_args(stack, &shim))
        .env("AWS_ACCESS_KEY_ID", "mlscope")
        .env("AWS_SECRET_ACCESS_KEY", "mlscope")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .current_dir(stack.dir.path())
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(180), command.output())
        .await
        .expect("relocate did not finish within 3 minutes")
        .expect("running mlscope-proxy relocate");
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    println!("mlscope-proxy relocate: {}\n{log}", output.status);
    assert!(
        output.status.success(),
        "relocate failed ({}):\n{log}\nshim saw: {:#?}",
        output.status,
        shim.exchanges()
    );

    let counts = shim.counts();
    println!("shim counts after relocate: {counts:?}");
    assert_eq!(
        counts.tagging_malformed_xml,
        0,
        "relocate read or wrote tags: {:#?}",
        shim.exchanges()
    );
    assert_eq!(counts.failures(), 0, "{:#?}", shim.exchanges());
    let exchanges = shim.exchanges();
    let copies = |part: bool| {
        exchanges
            .iter()
            .filter(|e| e.method == "PUT" && e.target.contains("partNumber=") == part)
            .filter(|e| {
                e.headers
                    .iter()
                    .any(|(name, _)| name == "x-amz-copy-source")
            })
            .count()
    };
    assert_eq!(
        (copies(false), copies(true)),
        (1, 2),
        "CopyObject and UploadPartCopy through the shim: {exchanges:#?}"
    );
    // Wherever under the run's artifacts relocate puts them, each object arrives whole.
    let run_prefix = format!(
        "{}/{experiment}/{run}/artifacts/",
        mlscope_tests::S3Store::PREFIX
    );
    let keys = store_objects(&stack.s3, &run_prefix).await;
    for (name, data) in &objects {
        let key = keys
            .iter()
            .map(|(key, _)| key)
            .find(|key| key.ends_with(&format!("/{name}")))
            .unwrap_or_else(|| panic!("{name} did not arrive under {run_prefix}: {keys:?}"));
        let stored = download(&format!("{}/{}/{key}", stack.s3.url, stack.s3.bucket)).await;
        assert_eq!(sha256(&stored), sha256(data), "{key}");
    }
}

/// The wrong profile for the store (`aws`: the SDK's default CRC32 checksums) against a store
/// without flexible checksums: the store refuses the upload, the client gets 502 with the store's
/// error, and the run carries the failure as tags.
#[tokio::test]
async fn a_store_that_refuses_uploads_gives_502_and_leaves_the_failure_on_the_run() {
    let stack = stack();
    let shim = S3Shim::start(&stack.s3.url, Quirks::default()).expect("starting the S3 shim");
    let args: Vec<String> = stack
        .s3
        .gateway_args(&shim.url)
        .into_iter()
        .map(|arg| {
            if arg == "seaweedfs" {
                "aws".to_owned()
            } else {
                arg
            }
        })
        .chain(["--s3-path-style".to_owned(), "true".to_owned()])
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy =
        spawn_proxy(&stack.mlflow.url, &args, stack.dir.path()).expect("starting the gateway");
    let (experiment, run_id) = create_experiment_and_run(&stack.mlflow.url, "refused").await;
    let path = format!("{experiment}/{run_id}/artifacts/images/sample_0.png");
    let response = http()
        .put(format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{path}",
            proxy.url
        ))
        .body(vec![1u8; 2048])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 502);
    let body: Value = response.json().await.unwrap();
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("NotImplemented") && message.contains(&path),
        "{body}"
    );
    assert!(shim.counts().failures() > 0, "the shim refused the upload");

    let tags = run_tags(&stack.mlflow.url, &run_id).await;
    assert_eq!(
        tags.get("mlscope.artifacts.upload_failures")
            .map(String::as_str),
        Some("1"),
        "{tags:?}"
    );
    assert_eq!(tags.get("mlscope.artifacts.last_failed_path"), Some(&path));
    assert!(
        tags.get("mlscope.artifacts.last_upload_error")
            .is_some_and(|e| e.contains("NotImplemented")),
        "{tags:?}"
    );
}
