"""Serve autoscaling of whole pipelines on a local multi-node Ray cluster, driven by the
load-aware policy (app/autoscaling.py): sustained long-prompt load takes PipelineServer from 1 to
2 replicas, the new pipeline's placement group lands on the free node, and when only a trickle of
short requests is left it goes back to 1 with every request answered (the replica removed drains
its requests, none dropped)."""

from __future__ import annotations

import random
import socket
import threading
import time

import httpx
import pytest

from tests.ray.local_cluster import LocalCluster

TIMEOUT = 300  # seconds: bounds every wait so a stuck scale-up fails instead of hanging
APP = "scaling"
MODEL = "ppserve-random"  # the built-in random model's served name
# One pipeline = 0.1 + 2 x 0.9 CPUs with STRICT_PACK: exactly one fits on each 2-CPU worker and
# none on the 1-CPU head, so each pipeline has a node of its own.
ARGS = {"pp": 2, "device": "cpu", "stage_num_cpus": 0.9, "placement_strategy": "STRICT_PACK",
        "chunk_size": 32, "block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 2,
        "max_model_len": 512, "ingress_num_cpus": 0.05,
        "autoscaling_config": {
            "min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
            "upscale_delay_s": 1, "downscale_delay_s": 4, "metrics_interval_s": 0.5,
            "look_back_period_s": 2,
            "policy": {"policy_function": "app.autoscaling:PipelineLoadPolicy",
                       "policy_kwargs": {"target_load": 0.5}}}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    from ray import serve

    from app.server import build_app

    cluster = LocalCluster(head_cpus=1, worker_cpus=[2, 2])
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    proxy_location="HeadOnly")
        serve.run(build_app(dict(ARGS)), name=APP, route_prefix="/")
        yield cluster, f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            cluster.shutdown()


def _replicas() -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments["PipelineServer"]
    return status.replica_states.get("RUNNING", 0)


def _wait_replicas(n: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while _replicas() != n:
        assert time.monotonic() < deadline, f"PipelineServer never reached {n} replicas"
        time.sleep(0.5)


def _pipeline_nodes(cluster) -> dict[str, set[str]]:
    """Pipeline id -> the names of the nodes its stage actors run on."""
    import ray

    names = cluster.node_names()
    out: dict[str, set[str]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == "ppserve" and actor["name"].startswith("ppserve-"):
            try:
                handle = ray.get_actor(actor["name"], namespace="ppserve")
                node = ray.get(handle.describe.remote(), timeout=60)["node_id"]
            except (ValueError, ray.exceptions.RayActorError):
                continue  # a drained pipeline's stage, gone since it was listed
            pid = actor["name"].rsplit("-stage", 1)[0]
            out.setdefault(pid, set()).add(names[node])
    return out


class Load:
    """Threads sending long-prompt completions back to back until stopped; every status kept."""

    def __init__(self, base_url: str, threads: int, prompt_len: int, max_tokens: int):
        self.base_url, self.stop = base_url, threading.Event()
        self.prompt_len, self.max_tokens = prompt_len, max_tokens
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.base_url, timeout=TIMEOUT) as client:
            while not self.stop.is_set():
                prompt = [rng.randrange(0, 256) for _ in range(self.prompt_len)]
                r = client.post("/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": self.max_tokens,
                    "temperature": 0})
                self.statuses.append(r.status_code)
                if r.status_code != 200:
                    self.errors.append(r.text)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(TIMEOUT)


def test_load_scales_pipelines_out_and_back_in(served):
    cluster, base_url = served
    models = httpx.get(f"{base_url}/v1/models", timeout=60).json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    assert _replicas() == 1
    [first] = _pipeline_nodes(cluster).values()

    with Load(base_url, threads=6, prompt_len=400, max_tokens=32) as load:
        _wait_replicas(2)
        placed = _pipeline_nodes(cluster)
        # Each pipeline packed on one worker; the new one on the node the first left free.
        assert len(placed) == 2 and all(len(nodes) == 1 for nodes in placed.values()), placed
        assert set.union(*placed.values()) == {"w0", "w1"} and first in placed.values()
        answered_at_two = len(load.statuses)
    assert load.errors == [] and set(load.statuses) == {200}, load.errors[:3]
    assert len(load.statuses) > answered_at_two  # requests ran while both pipelines served

    # A trickle of short requests (far below target_load) runs through the scale-in: the
    # replica being removed drains its requests instead of dropping them.
    with Load(base_url, threads=2, prompt_len=16, max_tokens=48) as trickle:
        _wait_replicas(1)  # light load: back to min_replicas after the downscale delay
        answered_at_one = len(trickle.statuses)
        deadline = time.monotonic() + TIMEOUT
        while len(trickle.statuses) < answered_at_one + 2:  # and still served after it
            assert time.monotonic() < deadline, trickle.errors[:3]
            time.sleep(0.2)
    assert trickle.errors == [] and set(trickle.statuses) == {200}, trickle.errors[:3]
    deadline = time.monotonic() + TIMEOUT
    while len(_pipeline_nodes(cluster)) != 1:  # the drained pipeline's stages are gone
        assert time.monotonic() < deadline, _pipeline_nodes(cluster)
        time.sleep(0.5)
    r = httpx.post(f"{base_url}/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
