"""The Ray Serve application (DESIGN §3): a thin OpenAI ingress in front of PipelineServer
replicas, each the coordinator of one whole pipeline.

`build_app(args)` is the entry point of `serve run deploy/serve_config.yaml`, of KubeRay's
serveConfigV2 and of `ppserve serve`. `args` holds EngineConfig options (dashes or underscores)
plus the server options in SERVER_KEYS.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import uuid

from ray import serve
from ray.serve import Application

from app.config import EngineConfig
from app.metrics import EngineMetrics
from app.openai.ingress import make_ingress
from app.request import InvalidRequest

log = logging.getLogger("ppserve.server")

SERVER_KEYS = ("api_key", "num_replicas", "autoscaling_config", "max_ongoing_requests",
               "ingress_num_cpus", "coordinator_cls", "max_request_bytes")
DEFAULT_MAX_REQUEST_BYTES = 32 << 20
DEFAULT_COORDINATOR = "app.coordinator:Coordinator"


def _import(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _error(e: InvalidRequest) -> dict:
    return {"error": str(e), "status": e.status, "param": e.param}


def _pipeline_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica (direct use in tests)
        return uuid.uuid4().hex[:8]


class PipelineServer:
    """One pipeline: the coordinator, its stage actors (in this replica's placement group), the
    tokenizer and chat template. Streams dicts to the ingress: a header once the request is
    queued (or an error), then {"out": RequestOutput, "pieces": {token id: text}} per delta
    (or, rarely, a late error)."""

    async def __init__(self, engine_args: dict, coordinator_cls: str = DEFAULT_COORDINATOR):
        self.config = EngineConfig.from_dict(engine_args)
        self.metrics = EngineMetrics(self.config.model_name, _pipeline_id(),
                                     self.config.pp_output_skip)
        self.coordinator = _import(coordinator_cls)(self.config, self.metrics)
        await self.coordinator.start()
        self.tokenizer = self.coordinator.tokenizer

    def _prompt(self, payload: dict):
        if "messages" in payload:
            try:
                return self.tokenizer.apply_chat_template(
                    payload["messages"], add_generation_prompt=payload["add_generation_prompt"])
            except Exception as e:  # a template that raises on these messages
                raise InvalidRequest(f"cannot apply the chat template: {e}",
                                     param="messages") from e
        return payload["prompt"]

    def _pieces(self, out) -> dict:
        if not out.logprobs:
            return {}
        ids = {t.token_id for t in out.logprobs} | {i for t in out.logprobs for i, _ in t.top}
        return {i: self.tokenizer.id_to_piece(i) for i in ids}

    async def generate(self, payload: dict):
        try:
            prompt = self._prompt(payload)
        except InvalidRequest as e:
            yield _error(e)
            return
        agen = self.coordinator.generate(prompt, payload["params"], payload.get("request_id"),
                                         payload.get("arrival_time"))
        first = asyncio.ensure_future(agen.__anext__())
        try:
            # One loop turn runs the generator up to its first wait: the request is validated
            # and queued (or refused) by then, so the client hears back before a long prefill.
            await asyncio.sleep(0)
            if first.done() and isinstance(first.exception(), InvalidRequest):
                yield _error(first.exception())
                return
            header = {}
            if payload.get("echo"):
                p = payload["prompt"]
                header["echo_text"] = p if isinstance(p, str) else self.tokenizer.decode(p)
            yield header
            try:
                out = await first
            except InvalidRequest as e:  # refused after a wait: still a clean error
                yield _error(e)
                return
            yield {"out": out, "pieces": self._pieces(out)}
            if not out.finished:
                async for out in agen:
                    yield {"out": out, "pieces": self._pieces(out)}
                    if out.finished:
                        break
        finally:
            # Closing the coordinator's generator (also on cancellation) aborts the request.
            if not first.done():
                first.cancel()
                with contextlib.suppress(BaseException):
                    await first
            await agen.aclose()

    async def info(self) -> dict:
        return {"model": self.config.model_name, "root": self.config.model,
                "max_model_len": self.coordinator.max_model_len}

    async def stats(self) -> dict:
        return self.coordinator.stats()

    async def health(self) -> bool:
        self.coordinator.stats()  # raises when the coordinator is broken
        return True

    async def check_health(self) -> None:  # Serve's periodic replica health check
        self.coordinator.stats()

    def __del__(self):
        coordinator = getattr(self, "coordinator", None)
        if coordinator is not None:
            try:
                coordinator.shutdown()
            except Exception:  # the stage actors may already be gone with the cluster
                pass


def build_app(args: dict | None = None) -> Application:
    """The Serve application for `args` (engine options + SERVER_KEYS)."""
    args = {k.replace("-", "_"): v for k, v in (args or {}).items() if v is not None}
    server = {k: args.pop(k) for k in SERVER_KEYS if k in args}
    config = EngineConfig.from_dict(args)  # validates early, in the driver
    coordinator_cls = _import(server.get("coordinator_cls", DEFAULT_COORDINATOR))
    bundles = coordinator_cls.placement_bundles(config)
    # Serve caps each replica's concurrent requests (default 5): let the scheduler batch.
    # With a waiting bound, every request must reach the coordinator to be counted against it,
    # not queue unseen in front of the replica.
    ongoing = int(server.get("max_ongoing_requests") or max(
        4 * config.max_num_seqs, 128, config.max_num_seqs + (config.max_waiting_requests or 0)))
    scaling = {"autoscaling_config": server["autoscaling_config"]} \
        if "autoscaling_config" in server else {"num_replicas": server.get("num_replicas", 1)}
    pipeline = serve.deployment(
        PipelineServer, name="PipelineServer", max_ongoing_requests=ongoing,
        ray_actor_options={"num_cpus": bundles[0].get("CPU", 0),
                           "num_gpus": bundles[0].get("GPU", 0)},
        placement_group_bundles=bundles, placement_group_strategy=config.placement_strategy,
        **scaling,
    ).bind(config.to_dict(), server.get("coordinator_cls", DEFAULT_COORDINATOR))
    # On KubeRay the key comes from a Secret as $PPSERVE_API_KEY on every Ray node.
    api_key = server.get("api_key") or os.environ.get("PPSERVE_API_KEY") or None
    max_bytes = int(server.get("max_request_bytes") or DEFAULT_MAX_REQUEST_BYTES)
    ingress_cls = make_ingress(config.model_name, api_key, max_bytes)
    ingress = serve.deployment(
        ingress_cls, name="OpenAIIngress", max_ongoing_requests=ongoing,
        ray_actor_options={"num_cpus": float(server.get("ingress_num_cpus", 0.1))},
    )
    return ingress.bind(pipeline)
