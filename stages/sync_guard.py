"""Check mode on CUDA: fail loudly if anything synchronises the device while a recv is posted.

A posted NCCL recv only completes when its peer sends; a device-wide synchronise (or
empty_cache) behind it can wait on the very work that would trigger that send
(docs/ARCHITECTURE.md#channels). Installed per stage process, only when the pipeline runs with
channel_check.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class SyncWhileRecvPosted(RuntimeError):
    pass


def install_sync_guard(recv_posted: Callable[[], bool]) -> None:
    def guarded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if recv_posted():
                raise SyncWhileRecvPosted(f"torch.cuda.{name}() called while an output recv "
                                          "is posted on this stage")
            return fn(*args, **kwargs)
        return wrapper

    for name in ("synchronize", "empty_cache"):
        setattr(torch.cuda, name, guarded(name, getattr(torch.cuda, name)))
