"""A load-aware Serve autoscaling policy for PipelineServer: scale on what the pipelines carry.

Request counts misjudge long-context load: one 64K-token prompt can fill a pipeline's KV cache
while 64 short chats barely touch it. Each replica reports its load (`record_autoscaling_stats`)
in units of its own KV capacity: running KV usage plus waiting prompt tokens over the cache's
size in tokens. The policy asks for enough pipelines to keep the average load at `target_load`.
The policy keeps within min/max_replicas; Serve applies the scaling factors and up/downscale
delays around it.

Opt in through the Serve config (target_ongoing_requests stays the default policy):

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      policy:
        policy_function: app.autoscaling:PipelineLoadPolicy
        policy_kwargs: {target_load: 0.8}
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

LOAD_METRIC = "pipeline_load"


def pipeline_load(waiting_prompt_tokens: int, kv_usage: float, kv_capacity_tokens: int) -> float:
    """One pipeline's load: 1.0 = as many tokens as its KV cache holds (running + waiting)."""
    return kv_usage + waiting_prompt_tokens / max(1, kv_capacity_tokens)


def desired_pipelines(loads: Iterable[float], target_load: float) -> int:
    """Pipelines that carry the reported loads at `target_load` each (0 when idle: Serve
    raises it to min_replicas)."""
    if target_load <= 0:
        raise ValueError(f"target_load must be > 0, got {target_load}")
    return math.ceil(round(sum(loads) / target_load, 9))


class PipelineLoadPolicy:
    """Serve's custom autoscaling policy hook (a class: Serve passes policy_kwargs to it)."""

    def __init__(self, target_load: float = 0.8):
        desired_pipelines([], target_load)  # validates target_load at deploy time
        self.target_load = target_load

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        loads = (ctx.aggregated_metrics or {}).get(LOAD_METRIC)
        if not loads:  # no replica has reported yet (starting): keep the current target
            return ctx.target_num_replicas, {}
        want = desired_pipelines(loads.values(), self.target_load)
        return min(max(want, ctx.capacity_adjusted_min_replicas),
                   ctx.capacity_adjusted_max_replicas), {}
