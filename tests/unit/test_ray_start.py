"""tests/ray_start.init_local_ray: a node that misses Ray's start-up wait is stopped and started
once more; any other failure is raised as it was."""

from __future__ import annotations

import pytest


def test_a_start_up_timeout_is_retried_once_and_other_errors_raise(monkeypatch):
    import subprocess

    import ray

    from tests import ray_start

    calls: list[str] = []
    failures = [Exception("The current node timed out during startup. This could happen")]

    def init(**kwargs):
        calls.append(f"init {kwargs['address']} {kwargs['num_cpus']}")
        if failures:
            raise failures.pop()

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: calls.append(" ".join(argv[-2:])))
    ray_start.init_local_ray(num_cpus=8)
    assert calls == ["init local 8", "shutdown", "stop --force", "init local 8"]

    calls.clear()
    failures.append(ValueError("num_cpus must be positive"))
    with pytest.raises(ValueError, match="num_cpus"):
        ray_start.init_local_ray(num_cpus=-1)
    assert calls == ["init local -1"]
