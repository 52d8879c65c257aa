"""Server options: every option of `ppserve serve` and of build_app that is not the engine's,
declared once, on ServerConfig (as EngineConfig declares the engine's, app/config.py).

The CLI's flags and the README's flag table come from its fields (app/cli.py); build_app takes
its `app_arg` options beside the engine's (app/server.py); the deploy files and the Helm chart
are checked against it (tests/unit/test_deploy_files.py, tests/unit/test_helm_chart.py). The
others (`app_arg=False`) are read by `ppserve serve` itself: in a Serve config file they are
`http_options` and `ray start`'s flags. Names follow vLLM and Ray Serve where they mean the same.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from app.options import Options, option


def origins(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """CORS origins from a comma-separated string (the CLI) or a list (Serve config, Helm)."""
    items = value.split(",") if isinstance(value, str) else value
    return tuple(o.strip() for o in items if o.strip())


def json_object(value: str | dict[str, Any]) -> dict[str, Any]:
    """A dict from a Serve config, or JSON text from the CLI."""
    d = json.loads(value) if isinstance(value, str) else value
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, got {value!r}")
    return d


@dataclass(frozen=True)
class ServerConfig(Options):
    num_cpus: int | None = option(
        None,
        "Logical CPUs of the local Ray cluster ppserve starts (at least the machine's cores). "
        "Ignored with --address.",
        doc_default="enough for the stages",
        minimum=1,
        app_arg=False,
    )
    address: str | None = option(
        None,
        "Join an existing Ray cluster (e.g. 'auto' or 'ray://head:10001') instead of starting "
        "a local one.",
        doc_default="start a local cluster",
        app_arg=False,
    )
    host: str = option(
        "127.0.0.1",
        "Address the HTTP server binds to; 0.0.0.0 to accept other machines.",
        app_arg=False,
    )
    port: int = option(8000, "HTTP port of the API.", minimum=1, maximum=65535, app_arg=False)
    metrics_port: int = option(
        8080,
        "Ray's Prometheus metrics export port (http://HOST:PORT/metrics; names start with "
        "ray_ppserve_). Ignored with --address: the cluster's own port serves them.",
        minimum=1,
        maximum=65535,
        app_arg=False,
    )
    api_key: str | None = option(
        None,
        "Require 'Authorization: Bearer KEY' on /v1/*.",
        doc_default="$PPSERVE_API_KEY or none",
    )
    num_replicas: int = option(1, "Pipelines (Serve replicas of PipelineServer) to run.", minimum=1)
    autoscaling_config: dict[str, Any] | None = option(
        None,
        "Ray Serve's AutoscalingConfig of PipelineServer (JSON on the CLI), e.g. "
        '{"min_replicas": 1, "max_replicas": 4}; replaces --num-replicas. '
        "app/autoscaling.py's PipelineLoadPolicy scales on KV load instead of request counts.",
        doc_default="none: --num-replicas pipelines",
        parse=json_object,
    )
    max_ongoing_requests: int | None = option(
        None,
        "Requests one replica (a pipeline, and the ingress) takes at once; Serve queues the rest.",
        doc_default="max(4 x --max-num-seqs, 128, --max-num-seqs + --max-waiting-requests)",
        minimum=1,
    )
    ingress_num_cpus: float = option(
        0.1, "Logical Ray CPUs of each OpenAI ingress replica.", minimum=0
    )
    prefix_routing_max_queue: int | None = option(
        None,
        "With several pipelines, a request goes to the one most likely to hold its "
        "prompt's prefix in its prefix cache unless that one has this many requests "
        "already; then to the least loaded. 0 = Serve's default router.",
        doc_default="--max-num-seqs",
        minimum=0,
    )
    max_request_bytes: int = option(
        32 << 20,
        "Largest request body accepted; larger ones get a 413 (read no further).",
        doc_default="32 MiB",
        minimum=1,
    )
    allowed_origins: tuple[str, ...] = option(
        (),
        "Comma-separated origins (e.g. https://app.example.com, or *) whose browser pages may "
        "call the API: CORS headers and preflight answers for them.",
        doc_default="none (no CORS headers)",
        parse=origins,
    )

    def app_args(self) -> dict[str, Any]:
        """The options build_app takes that differ from their defaults (a Serve config's
        `args`, less the engine's)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata["app_arg"] and getattr(self, f.name) != f.default
        }


APP_KEYS = tuple(f.name for f in dataclasses.fields(ServerConfig) if f.metadata["app_arg"])
LAUNCH_KEYS = tuple(f.name for f in dataclasses.fields(ServerConfig) if not f.metadata["app_arg"])
