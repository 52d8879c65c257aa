"""The requests waiting for admission, in the order they are admitted: by priority (lower
first, vLLM's convention), then by arrival; a preempted request goes back in front of its
priority's others (the most recently preempted first). With every priority equal this is
plain FCFS with preempted requests first."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from .state import SchedRequest


class WaitingQueue:
    def __init__(self) -> None:
        self._reqs: dict[str, SchedRequest] = {}  # admission order
        self._keys: dict[str, tuple[int, int]] = {}  # (priority, rank): the order's key
        self._arrivals = itertools.count()
        self._requeues = itertools.count(-1, -1)  # ranks before every arrival's

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._reqs

    def __iter__(self) -> Iterator[SchedRequest]:
        return iter(self._reqs.values())

    def add(self, req: SchedRequest) -> None:
        self._insert(req, (req.priority, next(self._arrivals)))

    def requeue(self, req: SchedRequest) -> None:
        """A preempted request: ahead of the waiting requests of its priority."""
        self._insert(req, (req.priority, next(self._requeues)))

    def head(self) -> SchedRequest:
        return next(iter(self._reqs.values()))

    def pop(self, req_id: str) -> SchedRequest | None:
        self._keys.pop(req_id, None)
        return self._reqs.pop(req_id, None)

    def _insert(self, req: SchedRequest, key: tuple[int, int]) -> None:
        last = next(reversed(self._keys.values()), None)
        self._keys[req.req_id] = key
        self._reqs[req.req_id] = req
        if last is not None and key < last:  # not at the end: re-sort (arrivals mostly append)
            order = sorted(self._keys, key=self._keys.__getitem__)
            self._keys = {rid: self._keys[rid] for rid in order}
            self._reqs = {rid: self._reqs[rid] for rid in order}
