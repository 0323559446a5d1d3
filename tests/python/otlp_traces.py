"""OpenTelemetry traces sent to MLflow's OTLP endpoint as an OTel SDK exporter sends them:
`POST /v1/traces` with an ExportTraceServiceRequest in protobuf, gzip-compressed, naming the
experiment in `x-mlflow-experiment-id`; then a JSON-encoded export, and two malformed ones (a
body that is not gzip, a protobuf without spans). Prints one JSON object: each answer (status,
content type, body) and the traces MLflow stored, read back with the MLflow client, with the ids
that differ between two servers replaced by what they refer to.
"""
import base64
import gzip
import json
import os
import random

import mlflow
import requests
from google.protobuf.json_format import MessageToJson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

suffix = os.environ["SUFFIX"]
uri = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
experiment_id = mlflow.set_experiment(f"otlp-{suffix}").experiment_id
# Fresh ids for every run (a trace id is unique in one MLflow); ids are not printed.
rng = random.Random()
START = 1_764_547_200_000_000_000


def attribute(key, value):
    if isinstance(value, bool):
        any_value = AnyValue(bool_value=value)
    elif isinstance(value, int):
        any_value = AnyValue(int_value=value)
    elif isinstance(value, float):
        any_value = AnyValue(double_value=value)
    else:
        any_value = AnyValue(string_value=value)
    return KeyValue(key=key, value=any_value)


def export(names):
    """A request with one trace: a root span and a child per further name."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.append(attribute("service.name", "otlp-test"))
    scope = resource_spans.scope_spans.add()
    scope.scope.name = "mlscope.tests"
    trace_id = rng.randbytes(16)
    root_id = rng.randbytes(8)
    for i, name in enumerate(names):
        span = Span(
            trace_id=trace_id,
            span_id=root_id if i == 0 else rng.randbytes(8),
            parent_span_id=b"" if i == 0 else root_id,
            name=name,
            kind=Span.SPAN_KIND_INTERNAL,
            start_time_unix_nano=START + i * 1_000_000,
            end_time_unix_nano=START + 50_000_000 - i * 1_000_000,
            status=Status(code=Status.STATUS_CODE_OK),
        )
        span.attributes.extend(
            [
                attribute("step", i),
                attribute("temperature", 0.25 * (i + 1)),
                attribute("cached", i % 2 == 1),
                attribute("prompt", f"{name}: ünïcode ✓ " + "x" * 2000),
            ]
        )
        event = span.events.add()
        event.name = "token"
        event.time_unix_nano = START + i * 1_000_000 + 500
        event.attributes.append(attribute("index", i))
        scope.spans.append(span)
    return request


def otlp_json(request):
    """The request in OTLP's JSON encoding, which writes ids as hex where protobuf's JSON mapping
    writes base64."""
    data = json.loads(MessageToJson(request))
    for resource in data["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(data).encode()


def post(body, content_type, encoding=None):
    headers = {"Content-Type": content_type, "x-mlflow-experiment-id": experiment_id}
    if encoding:
        headers["Content-Encoding"] = encoding
    response = requests.post(f"{uri}/v1/traces", data=body, headers=headers, timeout=60)
    content = response.headers.get("content-type", "")
    try:
        answer = response.json()
    except ValueError:
        answer = response.content.hex()
    return {"status": response.status_code, "content_type": content, "body": answer}


answers = {
    "protobuf, gzip": post(
        gzip.compress(export(["request", "retrieve", "generate"]).SerializeToString()),
        "application/x-protobuf",
        "gzip",
    ),
    "json": post(otlp_json(export(["chat"])), "application/json"),
    "not gzip": post(b"\x00not gzip at all" * 64, "application/x-protobuf", "gzip"),
    "no spans": post(ExportTraceServiceRequest().SerializeToString(), "application/x-protobuf"),
}

traces = mlflow.search_traces(locations=[experiment_id], return_type="list")
stored = sorted(
    (
        {
            "state": str(trace.info.state),
            "spans": sorted(
                (
                    span.name,
                    span.parent_id is None,
                    span.start_time_ns,
                    span.end_time_ns,
                    {k: v for k, v in span.attributes.items() if not k.startswith("mlflow.")},
                    [(e.name, e.timestamp, e.attributes) for e in span.events],
                )
                for span in trace.data.spans
            ),
        }
        for trace in traces
    ),
    key=lambda t: json.dumps(t, sort_keys=True, default=str),
)
print(json.dumps({"answers": answers, "traces": stored}, sort_keys=True, default=str))
