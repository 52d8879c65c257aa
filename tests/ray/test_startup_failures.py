"""Startup failures: a bad model directory raises at once, in the driver, before Ray or any actor
starts, with the cause as the message; a stage that fails in __init__ fails the Engine with its
own error (not Ray's ActorDiedError text) and the failed construction gives back its placement
group, its actors and the Ray cluster it started, so a second Engine in the same process works.
Serve's replica start fails the same clear way, in the application's status, and `ppserve serve`
/ `generate` on a local cluster check the model before starting anything."""

from __future__ import annotations

import json

import pytest
import ray

from app import Engine, EngineConfig, SamplingParams
from app.pipeline import STAGE_NAMESPACE, StageStartError
from stages.model_config import BUILTIN_CONFIG

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _model_dir(tmp_path, config: dict | None) -> str:
    path = tmp_path / "model"
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("case,error,message", [
    ("missing", FileNotFoundError, "does not exist"),
    ("no-config", FileNotFoundError, "no config.json"),
    ("mamba", ValueError, "unsupported model_type 'mamba'"),
])
def test_bad_model_directory_raises_before_ray_starts(tmp_path, case, error, message):
    assert not ray.is_initialized()
    if case == "missing":
        model = str(tmp_path / "nowhere")
    else:
        model = _model_dir(tmp_path, None if case == "no-config"
                           else {**BUILTIN_CONFIG, "model_type": case})
    with pytest.raises(error, match=message) as info:
        Engine(EngineConfig(model=model, pp_size=2, device="cpu", stage_num_cpus=0.5))
    assert "ActorDiedError" not in str(info.value)
    assert not ray.is_initialized()  # nothing was started


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cli_exits_with_the_cause(tmp_path, command):
    from app.cli import main

    model = _model_dir(tmp_path, {**BUILTIN_CONFIG, "model_type": "mamba"})
    argv = [command, *(["hi"] if command == "generate" else []), "--model", model]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert str(info.value).startswith("ppserve: unsupported model_type 'mamba'")
    assert not ray.is_initialized()


def _ppserve_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == STAGE_NAMESPACE]


def _live_placement_groups() -> list[str]:
    return [pg_id for pg_id, pg in ray.util.placement_group_table().items()
            if pg["state"] != "REMOVED"]


def test_failed_start_releases_everything(tmp_path):
    """config.json is fine, the weights are missing: the stages fail in __init__."""
    no_weights = _model_dir(tmp_path, dict(BUILTIN_CONFIG))
    bad = EngineConfig(model=no_weights, pp_size=2, device="cpu", stage_num_cpus=1.0,
                       placement_timeout_s=30)

    # 1. The Engine started the Ray cluster: a failed start stops it again.
    with pytest.raises(StageStartError, match=r"stage \d of 2 could not start: "
                       r"FileNotFoundError: no model.safetensors") as info:
        Engine(bad, num_cpus=3)
    assert "ActorDiedError" not in str(info.value) and "Traceback" not in str(info.value)
    assert not ray.is_initialized()

    # 2. A cluster of the caller's, just big enough for one pipeline (2 x 1 CPU + 0.1): a
    # placement group leaked by the failed start would leave the next Engine waiting for it.
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        with pytest.raises(StageStartError, match="no model.safetensors"):
            Engine(bad)
        assert ray.is_initialized()  # not the Engine's to stop
        assert _live_placement_groups() == []
        assert _ppserve_actors() == []
        good = EngineConfig(pp_size=2, device="cpu", stage_num_cpus=1.0, placement_timeout_s=30)
        with Engine(good) as engine:
            [out] = engine.generate([[1, 2, 3, 4, 5]], GREEDY)
            assert out.finish_reason == "length" and len(out.token_ids) == 4
        assert _live_placement_groups() == []
    finally:
        ray.shutdown()


@pytest.mark.slow  # Serve retries the replica a few times before it gives up (about a minute)
def test_serve_replica_start_fails_clearly(tmp_path):
    """The application's status carries the replica's error: the missing config.json."""
    from ray import serve

    from app.server import build_app
    from tests.serve.conftest import free_port

    model = _model_dir(tmp_path, None)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        with pytest.raises(RuntimeError, match="Deploying application broken failed"):
            serve.run(build_app({"model": model, "pp": 2, "stage_num_cpus": 0.5}),
                      name="broken", route_prefix="/")
        app_status = serve.status().applications["broken"]
        assert app_status.status == "DEPLOY_FAILED"
        message = app_status.deployments["PipelineServer"].message
        assert f"FileNotFoundError: no config.json in model directory {model!r}" in message
        print(f"deployment message: {message}")
    finally:
        serve.shutdown()
        ray.shutdown()
