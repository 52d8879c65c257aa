"""The Ray Serve application (docs/ARCHITECTURE.md#the-flow-of-one-request): a thin OpenAI ingress
in front of PipelineServer replicas, each the coordinator of one whole pipeline.

`build_app(args)` is the entry point of `serve run deploy/serve_config.yaml`, of KubeRay's
serveConfigV2 and of `ppserve serve`. `args` holds EngineConfig options (dashes or underscores)
plus ServerConfig's build_app options (app/server_config.py).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.autoscaling import LOAD_METRIC, pipeline_load
from app.config import EngineConfig
from app.coordinator import Coordinator
from app.merged import MergedStreams
from app.messages import Accepted, Delta, Failure, GenerateRequest, Reply, Tokenize, Tokenized
from app.metrics import EngineMetrics
from app.openai.ingress import make_ingress
from app.pipeline import placement_bundles
from app.prefix_router import ROUTER_CLASS
from app.request import InvalidRequest, RequestOutput, params_of_choice
from app.request_stream import RequestStream
from app.server_config import APP_KEYS, LAUNCH_KEYS, ServerConfig
from app.tool_parsers import chat_format

log = logging.getLogger("ppserve.server")


def _pipeline_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica (direct use in tests)
        return uuid.uuid4().hex[:8]


class PipelineServer:
    """One pipeline: the coordinator, its stage actors (in this replica's placement group), the
    tokenizer and chat template. Answers a GenerateRequest with the messages of
    app/messages.py."""

    # Serve awaits an async constructor; Python's typing has no such thing.
    async def __init__(self, engine_args: dict[str, Any]):  # type: ignore[misc]
        config = EngineConfig.from_dict(engine_args)
        self.metrics = EngineMetrics(
            config.model_name, _pipeline_id(), config.peak_rates, (config.pp_size, config.tp_size)
        )
        self.coordinator = Coordinator(config, self.metrics)
        self.config = self.coordinator.config  # with the model's block size
        await self.coordinator.start()
        self.tokenizer = self.coordinator.tokenizer

    def _prompt(self, req: GenerateRequest | Tokenize) -> str | list[int]:
        """A completion's prompt as given, or a chat's token ids from the chat template."""
        if req.messages is not None:
            try:
                return self.tokenizer.apply_chat_template(
                    req.messages,
                    add_generation_prompt=req.add_generation_prompt,
                    tools=req.tools,
                    continue_final_message=req.continue_final_message,
                    template_kwargs=req.template_kwargs,
                )
            except Exception as e:  # a template that raises on these messages
                raise InvalidRequest(
                    f"cannot apply the chat template: {e}", param="messages"
                ) from e
        if req.prompt is None:
            raise InvalidRequest("a request needs a prompt or messages.", param="prompt")
        return req.prompt

    def _delta(self, out: RequestOutput, index: int) -> Delta | Failure:
        if out.error:
            return Failure(out.error, 500)
        scored = [t for t in (out.logprobs or []) + (out.prompt_logprobs or []) if t]
        if not scored:
            return Delta(out, index=index)
        ids = {t.token_id for t in scored} | {i for t in scored for i, _ in t.top}
        if out.prompt_logprobs is not None and out.prompt_token_ids:
            ids.add(out.prompt_token_ids[0])  # unscored, yet echoed by name
        return Delta(out, {i: self.tokenizer.id_to_piece(i) for i in ids}, index)

    def _add_choice(
        self, prompt: str | list[int], req: GenerateRequest, index: int
    ) -> RequestStream:
        request_id = req.request_id if req.n == 1 else f"{req.request_id}-{index}"
        return self.coordinator.add_request(
            prompt, params_of_choice(req.params, index), request_id, req.arrival_time
        )

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Reply]:
        """Accepted, then the deltas of the request's n choices (tagged by index) as they come.
        With n > 1 and prefix caching, choice 0 runs alone until its first token, by when its
        prompt's full blocks are in the prefix cache; choices 1..n-1 are queued then and
        prefill only the prompt's last partial block (no fork of the scheduler's state needed,
        no n prefills). Without prefix caching, or with a prompt shorter than a block, all n
        are queued at once."""
        streams: list[RequestStream] = []
        merged: MergedStreams[int, RequestOutput] = MergedStreams()

        def add(prompt: str | list[int], index: int) -> None:
            stream = self._add_choice(prompt, req, index)
            streams.append(stream)
            merged.add(index, self.coordinator.outputs(stream))

        try:
            try:  # validated and queued (or refused) before the first reply
                add(self._prompt(req), 0)
                prompt_ids = streams[0].prompt_ids
                later = range(1, req.n)
                if not (
                    self.config.enable_prefix_caching
                    and len(prompt_ids) > self.config.kv_block_size
                ):
                    for i in later:
                        add(prompt_ids, i)
                    later = range(0)
            except InvalidRequest as e:
                yield Failure.of(e)
                return
            echo = None
            if req.echo and req.prompt is not None:  # echo is a completions option
                # token ids as the tokenizer decodes them, special tokens included (vLLM)
                echo = (
                    req.prompt
                    if isinstance(req.prompt, str)
                    else self.tokenizer.decode(req.prompt, skip_special_tokens=False)
                )
            chat = chat_format(self.tokenizer, prompt_ids) if req.messages is not None else {}
            yield Accepted(echo, prompt_tokens=len(prompt_ids), **chat)
            async for index, out in merged:
                yield self._delta(out, index)
                if later:  # choice 0's first delta: its prompt's blocks are cached now
                    try:
                        for i in later:
                            add(prompt_ids, i)
                    except InvalidRequest as e:  # e.g. overloaded since choice 0 came in
                        yield Failure.of(e)
                        return
                    later = range(0)
        finally:  # also on cancellation: every choice left unfinished is aborted
            await merged.aclose()
            for stream in streams:
                self.coordinator.abort(stream.req_id)

    async def tokenize(self, req: Tokenize) -> Tokenized | Failure:
        """The ids a completion of the same prompt or chat would run (and count in its usage)."""
        try:
            prompt = self._prompt(req)
        except InvalidRequest as e:
            return Failure.of(e)
        ids = (
            self.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
            if isinstance(prompt, str)
            else prompt
        )
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return Tokenized(ids, self.coordinator.max_model_len, strs)

    async def detokenize(self, tokens: list[int]) -> str | Failure:
        """The ids' text, special tokens spelled out (so /tokenize's ids come back as given)."""
        vocab = self.coordinator.args.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            return Failure(
                f"token id {bad} is out of range for a vocabulary of {vocab}.", 400, "tokens"
            )
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    async def info(self) -> dict[str, Any]:
        return {
            "model": self.config.model_name,
            "root": self.config.model,
            "max_model_len": self.coordinator.max_model_len,
        }

    async def stats(self) -> dict[str, Any]:
        return self.coordinator.stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom metrics hook, read by app/autoscaling.py's PipelineLoadPolicy."""
        s = self.coordinator.stats()
        return {
            LOAD_METRIC: pipeline_load(
                s["waiting_prompt_tokens"], s["kv_cache_usage"], s["kv_capacity_tokens"]
            )
        }

    async def health(self) -> dict[str, Any]:
        return self.coordinator.health()  # raises when the coordinator is broken

    async def check_health(self) -> None:  # Serve's periodic replica health check
        self.coordinator.stats()

    def __del__(self) -> None:
        coordinator = getattr(self, "coordinator", None)
        if coordinator is not None:
            try:
                coordinator.shutdown()
            except Exception:  # the stage actors may already be gone with the cluster
                pass


def _prefix_router(config: EngineConfig, server: ServerConfig) -> RequestRouterConfig | None:
    """Prefix-aware routing (app/prefix_router.py) wherever more than one pipeline may run; a
    pipeline is saturated for it at `prefix_routing_max_queue` requests (default: all its
    running slots, --max-num-seqs), 0 = off (Serve's default power-of-two router)."""
    max_queue = server.prefix_routing_max_queue
    max_queue = config.max_num_seqs if max_queue is None else max_queue
    several = server.autoscaling_config is not None or server.num_replicas > 1
    if not several or max_queue == 0:
        return None
    return RequestRouterConfig(
        # Serve documents an import path here; its stubs type the field otherwise.
        request_router_class=ROUTER_CLASS,  # type: ignore[arg-type]
        request_router_kwargs={"max_queue": max_queue},
    )


def split_args(args: dict[str, Any] | None) -> tuple[EngineConfig, ServerConfig]:
    """build_app's args as the engine's options and the server's; None means the default."""
    args = {k.replace("-", "_"): v for k, v in (args or {}).items() if v is not None}
    launch = sorted(set(args) & set(LAUNCH_KEYS))
    if launch:
        raise ValueError(
            f"{launch} are not build_app args: `ppserve serve` reads them itself; a Serve "
            "config sets them under http_options and `ray start`"
        )
    server = ServerConfig.from_dict({k: args.pop(k) for k in APP_KEYS if k in args})
    return EngineConfig.from_dict(args), server


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The Serve application for `args` (EngineConfig options + ServerConfig's app options)."""
    # validates early, in the driver (not the model: only the replicas read it, and the
    # routing keys below only need a stable block size)
    config, server = split_args(args)
    bundles = placement_bundles(config)
    # Serve caps each replica's concurrent requests (default 5): let the scheduler batch.
    # With a waiting bound, every request must reach the coordinator to be counted against it,
    # not queue unseen in front of the replica.
    ongoing = server.max_ongoing_requests or max(
        4 * config.max_num_seqs, 128, config.max_num_seqs + (config.max_waiting_requests or 0)
    )
    options: dict[str, Any] = (
        {"autoscaling_config": server.autoscaling_config}
        if server.autoscaling_config is not None
        else {"num_replicas": server.num_replicas}
    )
    router = _prefix_router(config, server)
    if router is not None:
        options["request_router_config"] = router
    pipeline = serve.deployment(
        name="PipelineServer",
        max_ongoing_requests=ongoing,
        ray_actor_options={
            "num_cpus": bundles[0].get("CPU", 0),
            "num_gpus": bundles[0].get("GPU", 0),
        },
        placement_group_bundles=bundles,
        placement_group_strategy=config.placement_strategy,
        **options,
    )(PipelineServer).bind(config.to_dict())
    # On KubeRay the key comes from a Secret as $PPSERVE_API_KEY on every Ray node.
    api_key = server.api_key or os.environ.get("PPSERVE_API_KEY") or None
    ingress_cls = make_ingress(
        config.model_name,
        api_key,
        server.max_request_bytes,
        config.kv_block_size if router is not None else None,
        server.allowed_origins,
    )
    ingress = serve.deployment(
        name="OpenAIIngress",
        max_ongoing_requests=ongoing,
        ray_actor_options={"num_cpus": server.ingress_num_cpus},
    )(ingress_cls)
    return ingress.bind(pipeline)
