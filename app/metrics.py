"""Prometheus metrics of one pipeline, exported the Ray way (docs/ARCHITECTURE.md#metrics).

Ray prefixes every name with `ray_` and exports from each node's metrics export port every few
seconds (RAY_metrics_report_interval_ms). Counters are named with `_total` here; Ray 2.60 keeps
that suffix as is (it adds `_total` only to counters lacking it), so the scraped names are
`ray_ppserve_..._total` either way. Labels are fixed per pipeline: request ids go to logs, never to
labels. Across replicas the skip-hit ratio is a PromQL expression over the counters
(app/dashboard.py), since averaging per-pipeline gauges would weigh pipelines wrongly.

The output-channel counters are fed by the scheduler's ledger, one call per event as it happens
(`output_event`), so they match `Coordinator.stats()` exactly, preemptions and rebuilds included.

`kernel_fallbacks_total{op,backend,reason}` counts the calls a chosen kernel backend routed to
another implementation, and the backends declined when a stage was built (one each), as the
stages' StepResults report them (stages/kernels/fallbacks.py: `reason` is one of a few fixed
categories, so the labels stay bounded). Its label values are not known before the first
fallback, so, like a histogram, it appears with its first one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar

from ray.util.metrics import Counter, Gauge, Histogram, Metric

from app.dashboard import METRIC_PREFIX
from app.model_cost import PHASES, READS, PeakRates, StepWork

if TYPE_CHECKING:
    from stages.protocol import FallbackCount

# TTFT of a 1M-token prompt can take minutes: buckets reach 20 minutes.
# fmt: off
LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]
E2E_BUCKETS = LATENCY_BUCKETS + [2560.0, 3600.0]
FORWARD_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0]
# fmt: on

_TAGS = ("model_name", "pipeline")
# The finish reasons of request_success_total (RequestOutput.finish_reason).
FINISHED_REASONS = ("stop", "length", "abort", "error")
_M = TypeVar("_M", bound=Metric)


class EngineMetrics:
    """Every metric of one pipeline; the coordinator calls the methods below."""

    def __init__(
        self,
        model_name: str,
        pipeline_id: str,
        peaks: PeakRates,
        parallel: tuple[int, int] = (1, 1),
    ):
        """parallel: (pipeline stages, tensor-parallel ranks per stage)."""
        self._all: list[Metric] = []
        self.ttft = self._hist(
            "time_to_first_token_seconds",
            "Arrival at the ingress to the first token out",
            LATENCY_BUCKETS,
        )
        self.itl = self._hist(
            "inter_token_latency_seconds", "Time between two output tokens", ITL_BUCKETS
        )
        self.e2e = self._hist(
            "e2e_request_latency_seconds", "Arrival to the last token", E2E_BUCKETS
        )
        self.queue = self._hist(
            "request_queue_time_seconds", "Arrival to the first scheduled chunk", LATENCY_BUCKETS
        )
        self.stage_forward = self._hist(
            "stage_forward_seconds",
            "One stage's compute for one microbatch",
            FORWARD_BUCKETS,
            ("stage",),
        )
        self.running = self._gauge("num_requests_running", "Requests being prefilled or decoded")
        self.waiting = self._gauge("num_requests_waiting", "Requests queued for admission")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        self.skip_ratio = self._gauge(
            "pp_output_skip_hit_ratio", "This pipeline's skipped / (skipped + missed)"
        )
        self.prompt_tokens = self._counter("prompt_tokens_total", "Prompt tokens processed")
        self.generation_tokens = self._counter("generation_tokens_total", "Tokens generated")
        self.success = self._counter(
            "request_success_total", "Finished requests", ("finished_reason",)
        )
        self.comm = self._counter(
            "pp_output_comm_total", "Microbatches whose output was sent or skipped", ("decision",)
        )
        self.missed = self._counter(
            "pp_output_comm_missed_total", "Output sends the plan could have skipped at dispatch"
        )
        self.orphaned = self._counter(
            "pp_output_comm_orphaned_total", "Output sends whose consumer vanished after dispatch"
        )
        self.prefix_queries = self._counter(
            "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = self._counter(
            "prefix_cache_hits_total", "Prompt tokens found in the prefix cache"
        )
        self.rebuilds = self._counter(
            "pipeline_rebuilds_total", "Pipeline rebuilds after a stage failure"
        )
        # Distance to the hardware (app/model_cost.py): work / busy time, against the peaks.
        self.flops = self._counter(
            "model_flops_total",
            "FLOPs of the microbatches run, by the model's own count, by phase",
            ("phase",),
        )
        self.busy = self._counter(
            "stage_busy_seconds_total",
            "GPU-seconds of the microbatches run: each stage's compute times its "
            "tensor-parallel ranks, summed over the stages, by phase",
            ("phase",),
        )
        self.read_bytes = self._counter(
            "decode_read_bytes_total",
            "Bytes decode steps read, by the model's own count: weights once a step, KV a row",
            ("kind",),
        )
        self.peak_flops = self._gauge(
            "hardware_peak_flops_per_second", "One GPU's peak matmul rate, by dtype", ("dtype",)
        )
        self.peak_bandwidth = self._gauge(
            "hardware_peak_memory_bytes_per_second", "One GPU's peak memory bandwidth"
        )
        self._peaks = peaks
        self.parallel_size = self._gauge(
            "parallel_size",
            "The pipeline's shape: stages (dim=pipeline), GPUs per stage (dim=tensor)",
            ("dim",),
        )
        self._parallel = {"pipeline": parallel[0], "tensor": parallel[1]}
        self.fallbacks = self._counter(
            "kernel_fallbacks_total",
            "Kernel calls a chosen backend routed elsewhere, and backends declined at build",
            ("op", "backend", "reason"),
        )
        tags = {"model_name": model_name, "pipeline": pipeline_id}
        for metric in self._all:
            metric.set_default_tags(tags)
        self._skip_ratio = 0.0  # re-set with the load gauges
        self._export_zeros()

    def _export_zeros(self) -> None:
        """Every counter (each known label value) and gauge at zero from startup, as clients
        and dashboards expect: Ray exports a series only once it is recorded, and its public
        Counter.inc refuses 0, hence the private _record. (A histogram cannot be exported
        without an observation.)"""
        for counter, label, values in (
            (self.prompt_tokens, None, ()),
            (self.generation_tokens, None, ()),
            (self.success, "finished_reason", FINISHED_REASONS),
            (self.comm, "decision", ("sent", "skipped")),
            (self.missed, None, ()),
            (self.orphaned, None, ()),
            (self.prefix_queries, None, ()),
            (self.prefix_hits, None, ()),
            (self.rebuilds, None, ()),
            (self.flops, "phase", PHASES),
            (self.busy, "phase", PHASES),
            (self.read_bytes, "kind", READS),
        ):
            for tags in [{label: v} for v in values] if label else [None]:
                counter._record(0, tags=tags)
        self.set_load(0, 0, 0.0)

    def _hist(
        self, name: str, desc: str, buckets: list[float], extra: tuple[str, ...] = ()
    ) -> Histogram:
        return self._keep(
            Histogram(
                METRIC_PREFIX + name, description=desc, boundaries=buckets, tag_keys=_TAGS + extra
            )
        )

    def _gauge(self, name: str, desc: str, extra: tuple[str, ...] = ()) -> Gauge:
        return self._keep(Gauge(METRIC_PREFIX + name, description=desc, tag_keys=_TAGS + extra))

    def _counter(self, name: str, desc: str, extra: tuple[str, ...] = ()) -> Counter:
        return self._keep(Counter(METRIC_PREFIX + name, description=desc, tag_keys=_TAGS + extra))

    def _keep(self, metric: _M) -> _M:
        self._all.append(metric)
        return metric

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(max(seconds, 0.0))

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(max(seconds, 0.0))

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(max(seconds, 0.0))

    def observe_queue_time(self, seconds: float) -> None:
        self.queue.observe(max(seconds, 0.0))

    def observe_stage_forward(self, stage: int, seconds: float) -> None:
        self.stage_forward.observe(max(seconds, 0.0), tags={"stage": str(stage)})

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        """The gauges, also while idle (the coordinator calls this every LOAD_REPORT_S): Ray
        drops a gauge's series from its export when it goes unrecorded for two export
        intervals."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        self.skip_ratio.set(self._skip_ratio)
        for dtype, rate in self._peaks.flops.items():
            self.peak_flops.set(rate, tags={"dtype": dtype})
        self.peak_bandwidth.set(self._peaks.memory_bytes_per_s)
        for dim, size in self._parallel.items():
            self.parallel_size.set(size, tags={"dim": dim})

    def add_tokens(self, prompt: int = 0, generation: int = 0) -> None:
        if prompt > 0:
            self.prompt_tokens.inc(prompt)
        if generation > 0:
            self.generation_tokens.inc(generation)

    def model_work(self, work: StepWork, busy_s: float) -> None:
        """One retired microbatch: its model work (app/model_cost.py) and its stages' summed
        compute seconds."""
        if work.flops > 0:
            self.flops.inc(work.flops, tags={"phase": work.phase})
        if busy_s > 0:
            self.busy.inc(busy_s, tags={"phase": work.phase})
        for kind, n in zip(READS, (work.weight_bytes, work.kv_bytes)):
            if n > 0:
                self.read_bytes.inc(n, tags={"kind": kind})

    def request_finished(self, reason: str) -> None:
        self.success.inc(1, tags={"finished_reason": reason or "unknown"})

    def pipeline_rebuilt(self) -> None:
        self.rebuilds.inc(1)

    def kernel_fallbacks(self, counts: Iterable[FallbackCount]) -> None:
        """One stage's kernel fallbacks since its previous result."""
        for c in counts:
            if c.count > 0:
                tags = {"op": c.op, "backend": c.backend, "reason": c.reason}
                self.fallbacks.inc(c.count, tags=tags)

    def prefix_lookup(self, queried: int, hit: int) -> None:
        """One admission's prefix-cache lookup, in tokens (vLLM's queries / hits)."""
        if queried > 0:
            self.prefix_queries.inc(queried)
        if hit > 0:
            self.prefix_hits.inc(hit)

    def output_event(self, event: str, counts: Mapping[str, int]) -> None:
        """One output-channel event (state.OUTPUT_EVENTS) and the ledger's counts after it."""
        if event in ("sent", "skipped"):
            self.comm.inc(1, tags={"decision": event})
        elif event == "missed":
            self.missed.inc(1)
        elif event == "orphaned":
            self.orphaned.inc(1)
        chances = counts["skipped"] + counts["missed"]
        if chances:
            self._skip_ratio = counts["skipped"] / chances
            self.skip_ratio.set(self._skip_ratio)
