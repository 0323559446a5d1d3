"""Checks deploy/ offline: every Kubernetes manifest, the Grafana dashboard and the alert rules.

Usage: validate_deploy.py <repo root> <mlscope-proxy binary> <mlscope-collector binary> <exposition>

- Every document of every YAML file under deploy/kubernetes/ validates in strict mode against the
  Kubernetes 1.33 JSON schemas that the `kubernetes-validate` package ships. Kinds it has no schema
  for (the Prometheus Operator's ServiceMonitor and PrometheusRule, kustomize's Kustomization)
  are checked against the fields this project uses, written down below.
- The kustomization lists every manifest of its directory and nothing that does not exist.
- The proxy's ConfigMap TOML and every container's command line are accepted by the real binaries
  (`--check-config`), with the container's literal environment.
- Every metric name the alert rules and the dashboard query is one the proxy exports: the
  exposition file holds a running proxy's `/metrics` (its `# TYPE` lines name every family).

Prints one line per check and exits non-zero on the first failure.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

KUBERNETES_VERSION = "1.33.0"

# The fields of the kinds kubernetes-validate has no schema for, as this project writes them.
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "required": ["matchLabels"]},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        },
    },
}

PROMETHEUS_RULE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string"},
                            "rules": {
                                "type": "array",
                                "minItems": 1,
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["alert", "expr", "labels", "annotations"],
                                    "properties": {
                                        "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9]*$"},
                                        "expr": {"type": "string"},
                                        "for": {"type": "string", "pattern": "^[0-9]+(s|m|h)$"},
                                        "labels": {
                                            "type": "object",
                                            "required": ["severity"],
                                            "additionalProperties": {"type": "string"},
                                        },
                                        "annotations": {
                                            "type": "object",
                                            "required": ["summary", "description"],
                                            "additionalProperties": {"type": "string"},
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}

KUSTOMIZATION = {
    "type": "object",
    "required": ["apiVersion", "kind", "resources"],
    "properties": {
        "apiVersion": {"const": "kustomize.config.k8s.io/v1beta1"},
        "kind": {"const": "Kustomization"},
        "resources": {"type": "array", "items": {"type": "string"}},
        "namespace": {"type": "string"},
        "images": {"type": "array"},
        "labels": {"type": "array"},
    },
    "additionalProperties": False,
}

# cert-manager's Issuer and Certificate (cert-manager.io/v1), the fields the webhook's manifests use.
ISSUER = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "minProperties": 1,
            "maxProperties": 1,
            "properties": {"selfSigned": {"type": "object"}, "ca": {"type": "object"}},
        },
    },
}

CERTIFICATE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["secretName", "issuerRef"],
            "properties": {
                "secretName": {"type": "string"},
                "dnsNames": {"type": "array", "items": {"type": "string"}},
                "issuerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                        "group": {"type": "string"},
                    },
                },
                "duration": {"type": "string", "pattern": "^[0-9]+(h|m|s)$"},
                "renewBefore": {"type": "string", "pattern": "^[0-9]+(h|m|s)$"},
            },
        },
    },
}

OWN_SCHEMAS = {
    "ServiceMonitor": SERVICE_MONITOR,
    "PrometheusRule": PROMETHEUS_RULE,
    "Kustomization": KUSTOMIZATION,
    "Issuer": ISSUER,
    "Certificate": CERTIFICATE,
}

# Placeholder values for environment variables a manifest takes from Secrets or the downward API.
FROM_CLUSTER = {
    "MLSCOPE_DATABASE_URL": "postgres://mlscope@postgres.example/mlscope",
    "AWS_ACCESS_KEY_ID": "placeholder",
    "AWS_SECRET_ACCESS_KEY": "placeholder",
    "MLSCOPE_MLFLOW_SERVICE_TOKEN": "placeholder",
    "NODE_NAME": "gpu-node-1",
    "POD_NAME": "train-llm-0-abcde",
    "RANK": "0",
    "MLSCOPE_RANK": "0",
}


def fail(message):
    print(f"FAIL {message}", flush=True)
    sys.exit(1)


def ok(message):
    print(f"ok   {message}", flush=True)


def documents(root):
    for path in sorted((root / "deploy/kubernetes").rglob("*.yaml")):
        for index, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                yield path, index, doc


def validate_manifests(root):
    seen = 0
    for path, index, doc in documents(root):
        name = f"{path.relative_to(root)}#{index} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        schema = OWN_SCHEMAS.get(doc.get("kind"))
        try:
            if schema is not None:
                jsonschema.validate(doc, schema)
            else:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as e:
            fail(f"{name}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError:
            fail(f"{name}: no Kubernetes {KUBERNETES_VERSION} schema and no schema of ours")
        seen += 1
        ok(f"{name} valid ({'own schema' if schema else 'Kubernetes ' + KUBERNETES_VERSION + ', strict'})")
    if seen == 0:
        fail("no manifests found under deploy/kubernetes")


def check_kustomization(root):
    for base in [root / "deploy/kubernetes", root / "deploy/kubernetes/inject"]:
        kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
        listed = set(kustomization["resources"])
        present = {p.name for p in base.glob("*.yaml")} - {"kustomization.yaml", "secrets.example.yaml"}
        if listed != present:
            fail(f"{base.relative_to(root)}: kustomization resources {sorted(listed)} differ from the manifests {sorted(present)}")
        ok(f"{base.relative_to(root)}: kustomization lists all {len(listed)} manifests")


def containers(doc):
    spec = doc.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    return pod.get("initContainers", []) + pod.get("containers", [])


def literal_env(container):
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), FROM_CLUSTER.get(m.group(1), "")), item["value"])
            env[item["name"]] = value
        else:
            env[item["name"]] = FROM_CLUSTER.get(item["name"], "placeholder")
    return env


def check_binaries(root, proxy, collector):
    config_maps = {}
    for _, _, doc in documents(root):
        if doc.get("kind") == "ConfigMap":
            config_maps[doc["metadata"]["name"]] = doc["data"]
    checked = 0
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        for path, _, doc in documents(root):
            for container in containers(doc):
                argv = list(container.get("command", [])) + list(container.get("args", []))
                image = container["image"]
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **literal_env(container)}
                if "mlscope-proxy" in image:
                    binary = proxy
                    # The ConfigMap mounted at /etc/mlscope, written where the check can read it.
                    mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
                    volumes = doc["spec"]["template"]["spec"].get("volumes", [])
                    for volume in volumes:
                        if "configMap" in volume and volume["name"] in mounts:
                            data = config_maps[volume["configMap"]["name"]]
                            for key, text in data.items():
                                target = scratch / key
                                target.write_text(text)
                                argv = [a.replace(f"{mounts[volume['name']]}/{key}", str(target)) for a in argv]
                    args = argv
                elif argv and argv[0].endswith("mlscope-collector"):
                    binary, args = collector, argv[1:]
                elif "mlscope-collector" in image:
                    binary, args = collector, argv
                else:
                    continue
                # --check-config goes before a wrapped command's `--`.
                split = args.index("--") if "--" in args else len(args)
                command = [str(binary)] + args[:split] + ["--check-config"] + args[split:]
                result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
                label = f"{path.relative_to(root)} container {container['name']}"
                if result.returncode != 0:
                    fail(f"{label}: {' '.join(command)} exited {result.returncode}: {result.stderr.strip() or result.stdout.strip()}")
                ok(f"{label}: {result.stdout.strip()}")
                checked += 1
    if checked < 4:
        fail(f"only {checked} containers run mlscope binaries; expected the proxy, the webhook and both collector examples")


def exported_series(exposition_path):
    """Every series name the proxy can export, from the `# TYPE` lines of its exposition."""
    names = set()
    for line in Path(exposition_path).read_text().splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[:2] == ["#", "TYPE"]:
            name, kind = parts[2], parts[3]
            if kind == "counter":
                names.add(name if name.endswith("_total") else name + "_total")
            elif kind == "histogram":
                names.update({name + "_bucket", name + "_sum", name + "_count"})
            else:
                names.add(name)
    return names


def queried_metrics(text):
    return set(re.findall(r"\bmlscope_[a-z0-9_]+", text))


def check_queries(root, exposition_path):
    exported = exported_series(exposition_path)
    if not exported:
        fail("the exposition names no metric families")
    sources = {}
    for _, _, doc in documents(root):
        if doc.get("kind") == "PrometheusRule":
            for group in doc["spec"]["groups"]:
                for rule in group["rules"]:
                    sources[f"alert {rule['alert']}"] = rule["expr"]
    dashboards = sorted((root / "deploy/grafana").glob("*.json"))
    if not dashboards:
        fail("no Grafana dashboard in deploy/grafana")
    for dashboard in dashboards:
        board = json.loads(dashboard.read_text())
        panels = board.get("panels", [])
        if not panels:
            fail(f"{dashboard.name}: no panels")
        for panel in panels:
            for target in panel.get("targets", []):
                sources[f"{dashboard.name} panel {panel['title']!r} query {target['refId']}"] = target["expr"]
    for where, expr in sources.items():
        names = queried_metrics(expr)
        if not names:
            fail(f"{where}: queries no mlscope metric: {expr}")
        unknown = names - exported
        if unknown:
            fail(f"{where}: {sorted(unknown)} not exported by mlscope-proxy")
    ok(f"{len(sources)} queries (alerts and dashboard panels) name only metrics the proxy exports")


def main():
    root, proxy, collector, exposition = (Path(a) for a in sys.argv[1:5])
    validate_manifests(root)
    check_kustomization(root)
    check_binaries(root, proxy, collector)
    check_queries(root, exposition)
    print("all deploy checks passed", flush=True)


if __name__ == "__main__":
    main()
