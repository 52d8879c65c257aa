"""The Ray actor of one pipeline stage: a thin shell over StageRunner.

Ray runs an actor's calls one at a time, in the order one caller submitted them, so every stage
sees the plans in dispatch order, which is what keeps the channels in step.
"""

from __future__ import annotations

import logging
import os

import ray

from stages.protocol import MicrobatchPlan, StageSpec, StepResult


@ray.remote
class StageActor:
    def __init__(self, spec: StageSpec, torch_threads: int = 1):
        import torch

        logging.basicConfig(level=logging.INFO)
        if spec.device == "cpu":
            torch.set_num_threads(max(1, torch_threads))
        from stages.runner import StageRunner

        self.spec = spec
        self._store = None  # stage 0 keeps the rendezvous store alive
        self._launched: dict = {}  # mb_id -> LaunchedStep not yet collected (launch/collect)
        # Kept for started(): an exception out of __init__ reaches the caller only as the text
        # of an ActorDiedError (a traceback), not as the error itself.
        self.start_error: Exception | None = None
        try:
            self.runner = StageRunner(spec)
        except Exception as e:
            logging.getLogger("ppserve.stage").exception(
                "stage %d could not start", spec.stage_index)
            self.start_error = e

    def started(self) -> bool:
        """Raises the error that stopped __init__, if any."""
        if self.start_error is not None:
            raise self.start_error
        return True

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def open_store(self) -> tuple[str, int]:
        from stages.channels import open_store

        host = ray.util.get_node_ip_address()
        self._store, port = open_store(host)
        return host, port

    def connect(self, host: str, port: int) -> bool:
        self.runner.connect(host, port, self._store)
        return True

    def kv_capacity(self) -> int:
        return self.runner.kv_capacity()

    def allocate_kv(self, num_blocks: int) -> bool:
        self.runner.allocate_kv(num_blocks)
        return True

    def warm_up(self, chunks: list[tuple[int, int]]) -> dict:
        return self.runner.warm_up(chunks)

    def step(self, plan: MicrobatchPlan) -> StepResult:
        return self.runner.step(plan)

    # A single stage (PP=1) is driven by launch/collect instead of step: the pipeline collects a
    # microbatch's result after launching the next one, so the device computes the next step
    # while this result travels back and the coordinator plans the one after.
    def launch(self, plan: MicrobatchPlan) -> None:
        if self._launched and self.runner.reads_sampled_history(plan):
            for launched in self._launched.values():  # their tokens first (kept for collect)
                self.runner.finish(launched)
        self._launched[plan.mb_id] = self.runner.launch(plan)

    def collect(self, mb_id: int) -> StepResult:
        launched = self._launched.pop(mb_id, None)
        if launched is None:
            raise RuntimeError(f"microbatch {mb_id} was not launched on this stage")
        return self.runner.finish(launched)

    def set_policy(self, output_post: str | None = None,
                   linear_backend: str | None = None) -> dict:
        return self.runner.set_policy(output_post, linear_backend)

    def flush_timings(self) -> tuple:
        """(mb_id, seconds) of forwards not yet reported: the last microbatches of a run on the
        stages before the last one complete after their step returned."""
        return self.runner.timer.flush()

    def describe(self) -> dict:
        return {"stage": self.spec.stage_index, "layers": [self.spec.layer_start,
                self.spec.layer_end], "kernels": dict(self.runner.kernels.names),
                "pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "decode_graphs": dict(self.runner.decode_graph_info)}

    def close(self) -> bool:
        self.runner.close()
        return True
