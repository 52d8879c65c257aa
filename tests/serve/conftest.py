"""One local Ray cluster and one Serve app per test module, reached over real HTTP."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import pytest

# Small and fast on 2 cores: the built-in random model, 2 stages, short chunks so that a prompt
# of a few hundred bytes is a long prompt of many chunks.
ENGINE_ARGS = {"pp": 2, "max_model_len": 512, "chunk_size": 32, "block_size": 16,
               "num_kv_blocks": 96, "max_num_seqs": 16, "channel_check": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    base_url: str  # http://127.0.0.1:PORT
    metrics_url: str
    app_name: str

    def client(self, api_key: str = "unused", prefix: str = ""):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}{prefix}/v1", api_key=api_key,
                             max_retries=0, timeout=120)

    def async_client(self, api_key: str = "unused"):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key,
                                  max_retries=0, timeout=120)

    def stats(self, app_name: str | None = None) -> dict:
        from ray import serve

        handle = serve.get_deployment_handle("PipelineServer", app_name or self.app_name)
        return handle.stats.remote().result(timeout_s=60)


def start_cluster(apps: dict[str, tuple[str, dict]]) -> Served:
    """`apps`: name -> (route prefix, build_app args). The first one is the main app."""
    from ray import serve

    from app.server import build_app
    from tests.ray_start import init_local_ray

    metrics_port, http_port = free_port(), free_port()
    init_local_ray(num_cpus=8, include_dashboard=False, log_to_driver=False,
                   _metrics_export_port=metrics_port,
                   runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    for name, (prefix, args) in apps.items():
        serve.run(build_app(args), name=name, route_prefix=prefix)
    return Served(f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics",
                  next(iter(apps)))


def stop_cluster() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def fast_metrics():
    """Ray exports metrics every 10 s by default; every 0.5 s here (read by every process the
    cluster starts, so it must be set before ray.init)."""
    old = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "500"
    yield
    if old is None:
        os.environ.pop("RAY_metrics_report_interval_ms", None)
    else:
        os.environ["RAY_metrics_report_interval_ms"] = old


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
