//! What GPU idleness is judged on, end to end against the real MLflow. A rank whose collector
//! measures SM activity (GPM) sends, for a GPU at 100 % utilisation whose SMs are 1 % active (one
//! thread spinning), a rising idle clock and the tag `mlscope/rank-<r>/gpu_idle_basis` =
//! `sm_active`; a rank without GPM sends neither tag nor SM series, as collectors before GPM did.
//! The bill counts the spinning GPU idle, and the run says on which basis each rank was judged.

use std::time::{Duration, Instant};

use mlscope_tests::TestStack;
use serde_json::json;

use crate::gpu_bill::{
    billed_tags, end_run, number, publish, publishes, run_started_at, send, send_rank,
    within_2_percent, MIN,
};
use crate::health::{health_proxy, health_view};
use crate::mlflow::{now_ms, run_tags};

/// One hour of two ranks with two GPUs each. Rank 0 (GPM): both GPUs at 100 % utilisation,
/// GPU 0 with 85 % of its SMs active, GPU 1 with 1 % (idle by SM activity: its clock rises).
/// Rank 1 (no GPM): both GPUs busy by utilisation. 4 GPU hours, 1 of them idle.
#[tokio::test(flavor = "multi_thread")]
async fn a_gpu_at_full_utilization_and_one_percent_sm_activity_is_billed_idle_with_its_basis() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "10m", &["--gpu-idle-after", "30m"]);
    let start = now_ms() - 90 * MIN;
    let run_id = run_started_at(mlflow, "bill-sm-active", start).await;
    // Rank 1 first, so the sweep that first names rank 0's idle GPU knows both ranks.
    send_rank(
        &proxy,
        &run_id,
        1,
        "node-h",
        &publishes(start, 60, &[false, false]),
    )
    .await;
    for (step, at, clocks) in publishes(start, 60, &[false, true]) {
        let mut body = publish(&run_id, 0, "node-g", step, at, &clocks);
        let metrics = body["metrics"].as_array_mut().unwrap();
        for metric in metrics.iter_mut() {
            if metric["key"]
                .as_str()
                .unwrap()
                .ends_with("_utilization_percentage")
            {
                metric["value"] = json!(100.0);
            }
        }
        for (gpu, sm_active) in [(0, 85.0), (1, 1.0)] {
            metrics.push(json!({"key": format!("system/rank-0/gpu_{gpu}_sm_active_percentage"), "value": sm_active, "timestamp": at, "step": step}));
        }
        // Sent once GPM has its first reading: with the second sample.
        if step == 1 {
            body["tags"] = json!([{"key": "mlscope/rank-0/gpu_idle_basis", "value": "sm_active"}]);
        }
        send(&proxy, 0, "node-g", &body).await;
    }

    // Live: the spinning GPU is named idle, and the tag beside it says on what.
    let mixed = "mixed (sm_active: rank 0; utilization: rank 1)";
    let deadline = Instant::now() + Duration::from_secs(30);
    let tags = loop {
        let tags = run_tags(mlflow, &run_id).await;
        if tags.contains_key("mlscope.gpus_idle") {
            break tags;
        }
        assert!(Instant::now() < deadline, "no mlscope.gpus_idle: {tags:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(tags["mlscope.gpus_idle"], "rank-0:gpu1", "{tags:?}");
    assert_eq!(tags["mlscope.gpu_idle_basis"], mixed, "{tags:?}");
    let (_, view) = health_view(&proxy, &run_id).await;
    assert_eq!(view["gpu_idle_basis"], mixed, "{view}");
    let bases: Vec<_> = view["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["rank"].as_i64(), r["gpu_idle_basis"].as_str()))
        .collect();
    assert_eq!(
        bases,
        [(Some(0), Some("sm_active")), (Some(1), Some("utilization"))],
        "{view}"
    );

    end_run(&proxy, &run_id, start + 60 * MIN).await;
    let tags = billed_tags(mlflow, &run_id).await;
    within_2_percent(&tags, "mlscope.gpu_hours", 4.0);
    within_2_percent(&tags, "mlscope.gpu_idle_hours", 1.0);
    within_2_percent(&tags, "mlscope/rank-0/gpu_idle_hours", 1.0);
    assert_eq!(number(&tags, "mlscope/rank-1/gpu_idle_hours"), 0.0);
    assert_eq!(tags["mlscope.gpu_idle_basis"], mixed, "{tags:?}");
}
