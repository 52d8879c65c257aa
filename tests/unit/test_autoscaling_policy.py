"""app/autoscaling.py against Ray Serve's own request-count policy: one 64K-token prompt scales a
pipeline out where the count (1 request) would not; 64 short prompts do not, where the count
(64 > target_ongoing_requests) would. Loads come from a real Scheduler holding the requests, the
decisions from Serve's AutoscalingContext and its policy wrapper (bounds and delays)."""

from __future__ import annotations

import pytest
from ray.serve.autoscaling_policy import (
    _apply_autoscaling_config,
    replica_queue_length_autoscaling_policy,
)
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from app.autoscaling import LOAD_METRIC, PipelineLoadPolicy, desired_pipelines, pipeline_load
from app.scheduler import SchedRequest, Scheduler
from tests.unit.scheduler_configs import scheduler_config

BLOCK, BLOCKS = 64, 1024  # a pipeline's KV cache: 65,536 tokens
CONFIG = AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=32,
                           upscale_delay_s=0, downscale_delay_s=0)


def _load_of(prompt_lens: list[int]) -> float:
    """The load one pipeline reports with these prompts waiting (none admitted yet)."""
    s = Scheduler(scheduler_config(block_size=BLOCK, num_blocks=BLOCKS, max_model_len=1 << 17))
    for i, n in enumerate(prompt_lens):
        s.add(SchedRequest(f"r{i}", tuple(range(n)), max_tokens=16))
    assert s.num_waiting == len(prompt_lens)
    return pipeline_load(s.waiting_prompt_tokens, s.kv_usage, BLOCKS * BLOCK)


def _ctx(num_requests: int, load: float, replicas: int = 1) -> AutoscalingContext:
    ids = [f"replica-{i}" for i in range(replicas)]
    return AutoscalingContext(
        deployment_id=None, deployment_name="PipelineServer", app_name="ppserve",
        current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=ids,
        total_num_requests=num_requests, total_queued_requests=0,
        aggregated_metrics={LOAD_METRIC: {i: load / replicas for i in ids}}, raw_metrics={},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=1000.0,
        config=CONFIG)


def _decide(policy, ctx) -> int:
    return _apply_autoscaling_config(policy)(ctx)[0]


def test_one_long_prompt_scales_where_the_request_count_does_not():
    load = _load_of([64_000])  # + max_tokens, as much as this pipeline's KV cache holds
    assert load == pytest.approx(64_000 / 65_536)
    assert _decide(replica_queue_length_autoscaling_policy, _ctx(1, load)) == 1
    assert _decide(PipelineLoadPolicy(target_load=0.8), _ctx(1, load)) == 2


def test_many_short_prompts_do_not_scale_where_the_request_count_does():
    load = _load_of([200] * 64)
    assert load == pytest.approx(64 * 200 / 65536)
    assert _decide(replica_queue_length_autoscaling_policy, _ctx(64, load)) == 2
    assert _decide(PipelineLoadPolicy(target_load=0.8), _ctx(64, load)) == 1


def test_scales_back_in_and_within_bounds():
    policy = PipelineLoadPolicy(target_load=0.8)
    assert _decide(policy, _ctx(0, 0.0, replicas=2)) == 1  # idle: down to min_replicas
    assert _decide(policy, _ctx(9, 10.0, replicas=2)) == 4  # capped at max_replicas
    assert _decide(policy, _ctx(3, 1.5, replicas=2)) == 2  # 0.75 each: under target, keep 2


def test_pure_decision():
    assert desired_pipelines([], 0.8) == 0
    assert desired_pipelines([0.4, 0.4], 0.8) == 1
    assert desired_pipelines([0.5, 0.4], 0.8) == 2
    assert desired_pipelines([1.6], 0.8) == 2  # exactly at target: no float round-up to 3
    with pytest.raises(ValueError, match="target_load"):
        PipelineLoadPolicy(target_load=0)


def test_no_reports_yet_keeps_the_current_target():
    ctx = _ctx(5, 0.0, replicas=2)
    ctx._aggregated_metrics_value = {}
    assert PipelineLoadPolicy()(ctx) == (2, {})


def test_build_app_accepts_the_policy():
    from app.server import build_app

    policy = {"policy_function": "app.autoscaling:PipelineLoadPolicy",
              "policy_kwargs": {"target_load": 0.8}}
    app = build_app({"pp": 2, "device": "cpu", "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 4, "policy": policy}})
    pipeline = app._bound_deployment.init_args[0]  # the ingress is bound to PipelineServer
    scaling = pipeline._bound_deployment._deployment_config.autoscaling_config
    assert scaling.policy.policy_function == policy["policy_function"]
    assert scaling.policy.policy_kwargs == {"target_load": 0.8}
