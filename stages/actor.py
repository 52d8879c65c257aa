"""The Ray actor of one pipeline stage: a thin shell over StageRunner.

Ray runs an actor's calls one at a time, in the order one caller submitted them, so every stage
sees the plans in dispatch order, which is what keeps the channels in step. StageShell holds the
serving methods; the bench's actor (app/bench/actors.py) adds its knobs to a subclass.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import ray

from stages.protocol import MicrobatchPlan, StageSpec, StepResult

if TYPE_CHECKING:  # torch-heavy: the control plane imports this module without torch
    from stages.channels import TCPStore
    from stages.runner import LaunchedStep


def _node_ip() -> str:
    ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # unannotated in ray
    return ip


def _assigned_gpu() -> int:
    """The index of Ray's GPU for this actor among the visible ones, when Ray leaves every GPU
    of the node visible (the copy output channel)."""
    gpu = str(ray.get_gpu_ids()[0])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",").index(gpu) if visible else int(gpu)


class StageShell:
    def __init__(self, spec: StageSpec, torch_threads: int = 1):
        import torch

        logging.basicConfig(level=logging.INFO)
        if spec.device == "cpu":
            torch.set_num_threads(max(1, torch_threads))
        elif os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
            torch.cuda.set_device(_assigned_gpu())
        from stages.runner import StageRunner

        self.spec = spec
        self._store: TCPStore | None = None  # stage 0 keeps the rendezvous store alive
        self._launched: LaunchedStep | None = None  # what the next advance() call returns
        # Kept for started(): an exception out of __init__ reaches the caller only as the text
        # of an ActorDiedError (a traceback), not as the error itself.
        self.start_error: Exception | None = None
        try:
            self.runner = StageRunner(spec)
        except Exception as e:
            logging.getLogger("ppserve.stage").exception(
                "stage %d could not start", spec.stage_index
            )
            self.start_error = e

    def started(self) -> bool:
        """Raises the error that stopped __init__, if any."""
        if self.start_error is not None:
            raise self.start_error
        return True

    def open_store(self) -> tuple[str, int]:
        from stages.channels import open_store

        host = _node_ip()
        self._store, port = open_store(host)
        return host, port

    def connect(self, host: str, port: int) -> bool:
        self.runner.connect(host, port, self._store)
        return True

    def close(self) -> bool:
        """Called by the pipeline's teardown before it kills the actor."""
        if self.start_error is None:
            self.runner.close()
        return True

    def kv_capacity(self) -> int:
        return self.runner.kv_capacity()

    def allocate_kv(self, num_blocks: int) -> bool:
        self.runner.allocate_kv(num_blocks)
        return True

    def warm_up(self, chunks: list[tuple[int, int]]) -> dict[str, Any]:
        return self.runner.warm_up(chunks)

    def step(self, plan: MicrobatchPlan) -> StepResult:
        return self.runner.step(plan)

    # A single stage (PP=1) is driven by advance instead of step: each call launches its
    # microbatch and then returns the previous one's result, so the device computes the next
    # step while a result travels back and the coordinator plans the one after.
    def advance(self, plan: MicrobatchPlan | None) -> StepResult | None:
        """Launch `plan` (None: launch nothing), then finish and return the microbatch
        launched by the previous call (None if there was none)."""
        previous, self._launched = self._launched, None
        if plan is not None:
            if previous is not None and self.runner.reads_sampled_history(plan):
                self.runner.finish(previous)  # its tokens first; the result is kept
            self._launched = self.runner.launch(plan)
        return self.runner.finish(previous) if previous is not None else None

    def describe(self) -> dict[str, Any]:
        from stages.kernels.fallbacks import FALLBACKS

        return {
            "stage": self.spec.stage_index,
            "tp_rank": self.spec.tp_rank,
            "tp_size": self.spec.tp_size,
            "layers": [self.spec.layer_start, self.spec.layer_end],
            "kernels": dict(self.runner.kernels.names),
            # op/backend/reason -> count, this process's (stages/kernels/fallbacks.py)
            "kernel_fallbacks": {"/".join(k): n for k, n in FALLBACKS.counts().items()},
            "pid": os.getpid(),
            "node_ip": _node_ip(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "decode_graphs": dict(self.runner.decode_graph_info),
        }


StageActor = ray.remote(StageShell)
