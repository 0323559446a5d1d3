// MLflow's log-batch workload as its own repository benchmarks it (dev/benchmarks): every virtual
// user posts `runs/log-batch` into ONE run, each batch TAGS tags, PARAMS params and METRICS
// metrics; tags and params repeat the same keys and values, metrics carry step 0 and the current
// time. One change, for counting back: each metric value is unique per (user, iteration, index)
// instead of random, so every acknowledged sample can be found in the run afterwards.
//
// Run by `mlscope-bench k6-log-batch`, which sets BASE_URL, RUN_ID, TAGS, PARAMS, METRICS and
// k6's --vus and --duration.
import http from "k6/http";
import { Counter } from "k6/metrics";

const acknowledged = new Counter("samples_acknowledged");
const failed = new Counter("requests_failed");

const url = `${__ENV.BASE_URL}/api/2.0/mlflow/runs/log-batch`;
const runId = __ENV.RUN_ID;
const shape = {
  tags: parseInt(__ENV.TAGS, 10),
  params: parseInt(__ENV.PARAMS, 10),
  metrics: parseInt(__ENV.METRICS, 10),
};
const headers = { "Content-Type": "application/json" };

function pairs(count, prefix) {
  const out = [];
  for (let i = 0; i < count; i++) {
    out.push({ key: `${prefix}_${i}`, value: `${prefix}_value_${i}` });
  }
  return out;
}

const tags = pairs(shape.tags, "tag");
const params = pairs(shape.params, "param");

export default function () {
  const now = Date.now();
  const metrics = [];
  for (let i = 0; i < shape.metrics; i++) {
    metrics.push({ key: `metric_${i}`, value: __VU * 1e7 + __ITER * 1e3 + i, timestamp: now, step: 0 });
  }
  const body = JSON.stringify({ run_id: runId, tags, params, metrics });
  const response = http.post(url, body, { headers, timeout: "120s" });
  if (response.status === 200) {
    acknowledged.add(shape.metrics);
  } else {
    failed.add(1);
  }
}
