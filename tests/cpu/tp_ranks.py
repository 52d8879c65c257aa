"""A tensor-parallel group of CPU processes (gloo) for tests of split stages: `RankPool(size)`
starts the ranks once, `run(fn, *args)` calls the module-level `fn(tp, *args)` on every rank
(tp: the rank's TensorParallel, attached to the group) and returns the results in rank order."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from typing import Any, Callable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _serve(rank: int, size: int, port: int, tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from stages.tensor_parallel import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    tp = TensorParallel(rank, size, dist.group.WORLD)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(tp, *args)))
        except Exception:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, size: int):
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.size = size
        self.tasks = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_serve, args=(r, size, port, self.tasks[r], self.results))
            for r in range(size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> list[Any]:
        for q in self.tasks:
            q.put((fn, args))
        out: dict[int, Any] = {}
        errors = []
        for _ in range(self.size):
            rank, ok, value = self.results.get(timeout=timeout)
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return [out[r] for r in range(self.size)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
