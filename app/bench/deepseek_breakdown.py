"""Per-kernel breakdown (torch profiler, CUDA time) of one DeepSeek prefill chunk and one decode
step on a stage of a few layers with random weights (V2-Lite / V3.2: the first layer dense, the
rest MoE; V4: the shape's leading layers, their layer types and hash / routed MoE kept).

    python -m app.bench.deepseek_breakdown --out docs/bench/deepseek_breakdown.json
    python -m app.bench.deepseek_breakdown --cases deepseek-v4-flash:8:65536:8192:64:1024 \
        --out docs/bench/deepseek_v4_breakdown.json
    python -m app.bench.deepseek_breakdown --standin --quantization fp8 --kv-cache-dtype fp8 \
        --cases deepseek-v32-bench:4:65536:4096:512:4096 --out docs/bench/fp8_standin.json

Prefill: the last chunk of a prompt in fixed chunks (the earlier ones fill the cache).
Decode: rows of one token at a given context length (the cache's content does not matter for
the time). Kernels are grouped by name into the ops of a layer; DeepSeek-V4's ops (whose
kernels are generic torch ones) are also timed by CUDA events around each op (V4_OPS), and the
hidden channel's bytes and one device copy of a chunk's [tokens, hc_mult, hidden] are measured.
With --standin each profile is taken twice, alone and under the one-CTA pending-recv stand-in
(app.bench.standin), and every op group gets its ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from app.bench.attention import cuda_median_ms
from app.bench.memory import leading_layers
from app.bench.moe import expert_loads
from app.bench.standin import SPIN_KERNEL, PendingRecvStandin
from app.bench.target import kv_block_size, shape_config, stage_args
from stages.forward_batch import ForwardBatch
from stages.kernels import pdl
from stages.kernels.registry import Kernels, fp8_backend_for, moe_backend_for, select_kernels
from stages.kv_cache import make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import ModelArgs
from stages.protocol import (
    KV_CACHE_DTYPES,
    MXFP4_EXPERTS,
    MXFP4_EXPERTS_DEFAULT,
    QUANTIZATIONS,
)
from stages.stage_context import StageModel

# DeepSeek-V4's ops timed by CUDA events: (module or attention backend class, method, label).
# Nested ones are timed each (the indexer's selection inside the key selection, inside the
# attention, inside the layer).
V4_OPS = (
    ("V4DecoderLayer", "forward", "layer"),
    ("HyperConnection", "forward", "hyper-connection weights"),
    ("V4Attention", "forward", "attention"),
    ("GroupCompressor", "complete_groups", "attention/compressor groups"),
    ("Indexer", "complete_groups", "attention/indexer groups"),
    ("V4Backend", "keys", "attention/key pool + selection"),
    ("Indexer", "select", "attention/key selection/indexer"),
    ("MoE", "forward", "moe"),
)
# kernel-registry ops of V4 timed the same way
V4_KERNEL_OPS = (
    ("sparse_sink_attention", "attention/sparse sink attention"),
    ("indexer_logits_rows", "attention/key selection/indexer/scores"),
)
# first matching substring of a kernel's name -> the op it belongs to
GROUPS = [
    ("_route_topk", "moe routing"),
    ("_combine", "moe combine"),
    ("_pool_groups", "compressor pooling"),
    ("compact_kernel", "top-k (Triton)"),
    ("maxima_kernel", "top-k (Triton)"),
    ("_rule_top_k", "top-k (Triton)"),
    ("_gate_up_silu", "moe gate/up"),
    ("_down_scatter", "moe down"),
    ("_grouped_w8a8", "moe (FP8)"),  # _grouped_w8a8_swiglu too: its quantizer is the MoE's
    ("_grouped_w4a16", "moe (MXFP4)"),
    ("_quantize_1x128", "fp8 activation quantizer"),
    ("_scatter", "moe routing"),
    ("_count", "moe routing"),
    ("_plan", "moe routing"),
    ("rows_kernel", "indexer scores"),
    ("chunk_kernel", "indexer scores"),
    ("deep_gemm::sm90_fp8_gemm", "moe GEMMs (DeepGEMM)"),
    ("_project", "hyper-connections (Triton)"),
    ("_finish", "hyper-connections (Triton)"),
    ("_merge", "hyper-connections (Triton)"),
    ("sparse_attn", "attention"),
    ("_quantize_write", "cache writes"),
    ("catarray", "copies (cat)"),
    ("copy_kernel", "copies"),
    ("topk", "top-k"),
    ("radix", "top-k"),
    ("sort", "sort"),
    ("cudnn", "attention"),
    ("fmha", "attention"),
    ("flash", "attention"),
    ("_gemm_tma", "gemm (Triton)"),
    ("_gemm_ptr", "gemm (Triton)"),
    ("sm90_xmma", "gemm (cuBLAS)"),
    ("nvjet", "gemm (cuBLAS)"),
    ("gemm", "gemm (cuBLAS)"),
]


def group_of(name: str) -> str:
    lowered = name.lower()
    for key, group in GROUPS:
        if key.lower() in lowered:
            return group
    return "other"


def add_no_pdl_flag(p: argparse.ArgumentParser) -> None:
    """--no-pdl: the benches that profile (this one, v4_decode) with plain launches, read as
    `pdl.ENABLED = not a.no_pdl` before anything runs."""
    p.add_argument(
        "--no-pdl",
        action="store_true",
        help="plain launches: each profiled kernel's time its own (with PDL it includes the "
        "kernel's wait for the one before, stages/kernels/pdl.py)",
    )


def profiled(fn: Callable[[], object], standin: PendingRecvStandin | None = None) -> dict[str, Any]:
    """fn's kernels from the profiler, grouped by op; with a stand-in, the spin (sized to
    outlast fn) is posted just before fn and left out of the table."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pending = standin.post(2 * wall_ms + 50) if standin is not None else None
        start.record()
        fn()
        end.record()
        end.synchronize()
        covered = pending is None or not pending.query()
        torch.cuda.synchronize()
    kernels: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", 0.0) or getattr(evt, "cuda_time_total", 0.0)
        if us and evt.key and not evt.key.startswith("cuda") and SPIN_KERNEL not in evt.key:
            kernels[evt.key] += us
    counts: dict[str, int] = defaultdict(int)
    for evt in prof.key_averages():
        if evt.key in kernels:
            counts[evt.key] += evt.count
    launches = sum(counts.values())
    groups: dict[str, float] = defaultdict(float)
    group_launches: dict[str, int] = defaultdict(int)
    for name, us in kernels.items():
        groups[group_of(name)] += us
        group_launches[group_of(name)] += counts[name]
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    most_launched = sorted(counts.items(), key=lambda kv: -kv[1])[:40]
    return {
        "wall_ms": round(start.elapsed_time(end), 3),
        "standin_covered": covered,
        "total_ms": round(sum(kernels.values()) / 1e3, 3),
        "kernel_launches": launches,
        "groups_ms": {
            g: round(us / 1e3, 3) for g, us in sorted(groups.items(), key=lambda x: -x[1])
        },
        "top_kernels_ms": [(name[:240], round(us / 1e3, 3)) for name, us in top],
        # what the launches are (against docs/bench/scripts/launch_census.py's estimate)
        "launches_by_group": dict(sorted(group_launches.items(), key=lambda x: -x[1])),
        "most_launched": [(name[:240], n) for name, n in most_launched],
    }


def host_view(fn: Callable[[], object]) -> dict[str, Any]:
    """fn from the host's side: the milliseconds its call takes to return (launches, planning,
    any wait on the device) and until the device is done, and where it synchronises with the
    device (torch's sync debug mode: the caller's file:line of each synchronising op, counted).
    A forward that waits on the device mid-way leaves it idle while the host launches on."""
    import time
    import warnings

    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            start = time.perf_counter()
            fn()
            returned = time.perf_counter()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    done = time.perf_counter()
    syncs: dict[str, int] = defaultdict(int)
    for w in caught:
        if str(w.message).startswith("called a synchronizing CUDA operation"):
            syncs[f"{w.filename}:{w.lineno}"] += 1
    return {
        "returned_ms": round((returned - start) * 1e3, 3),
        "done_ms": round((done - start) * 1e3, 3),
        "syncs": sorted(syncs.items(), key=lambda kv: -kv[1]),
    }


class OpTimer:
    """CUDA events around ops of a model (instance methods wrapped) while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.events[label].append((start, end))
            return out

        return timed

    def kernels(self, kernels: Kernels) -> Kernels:
        wrapped: dict[str, Any] = {
            op: self.wrap(label, getattr(kernels, op))
            for op, label in V4_KERNEL_OPS
            if getattr(kernels, op) is not None
        }
        return dataclasses.replace(kernels, **wrapped)

    def instrument(self, model: StageModel) -> None:
        for part in (*model.modules(), model.attention):
            for cls, method, label in V4_OPS:
                if type(part).__name__ == cls:
                    setattr(part, method, self.wrap(label, getattr(part, method)))

    def measure(self, fn: Callable[[], object]) -> dict[str, Any]:
        """Per op: milliseconds summed over its calls in one fn(), and its calls."""
        self.events.clear()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.on = True
        start.record()
        fn()
        end.record()
        self.on = False
        torch.cuda.synchronize()
        ops = {
            label: {
                "ms": round(sum(a.elapsed_time(b) for a, b in pairs), 3),
                "calls": len(pairs),
            }
            for label, pairs in sorted(self.events.items())
        }
        return {"forward_ms": round(start.elapsed_time(end), 3), "ops": ops}


class RoutingLoads:
    """expert_loads of each route_topk call (one a MoE layer) while `on`."""

    def __init__(self, experts: int) -> None:
        self.on, self.experts = False, experts
        self.layers: list[dict[str, float]] = []

    def kernels(self, kernels: Kernels) -> Kernels:
        route = kernels.route_topk
        if route is None:
            return kernels

        def routed(*args: Any, **kwargs: Any) -> Any:
            out = route(*args, **kwargs)
            if self.on:
                self.layers.append(expert_loads(out[1], self.experts))
            return out

        return dataclasses.replace(kernels, route_topk=routed)

    def measure(self, fn: Callable[[], object]) -> list[dict[str, float]]:
        self.layers, self.on = [], True
        fn()
        self.on = False
        return self.layers


def hidden_channel(args: ModelArgs, chunk: int) -> dict[str, Any]:
    """Bytes of one chunk's hidden state between stages and one device copy of it (the
    stage-to-stage send needs two GPUs)."""
    shape = (chunk, *args.family.hidden_shape(args))
    src = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_median_ms(lambda: dst.copy_(src), 20)
    nbytes = src.numel() * src.element_size()
    return {"shape": list(shape), "bytes": nbytes, "device_copy_ms": round(ms, 4)}


def alone_and_standin(
    fn: Callable[[], object], standin: PendingRecvStandin | None
) -> dict[str, Any]:
    """fn's profile; with a stand-in also its profile under it and each group's ratio."""
    alone = profiled(fn)
    if standin is None:
        return alone
    busy = profiled(fn, standin)
    ratios = {
        group: round(busy["groups_ms"].get(group, 0.0) / ms, 3)
        for group, ms in alone["groups_ms"].items()
        if ms > 0
    }
    ratios["total"] = round(busy["total_ms"] / alone["total_ms"], 3)
    ratios["wall"] = round(busy["wall_ms"] / alone["wall_ms"], 3)
    return {**alone, "standin": busy, "standin_x": ratios}


@dataclasses.dataclass(frozen=True)
class Setting:
    """The stage's kernels and data types: the engine's --linear, --quantization,
    --kv-cache-dtype and --mxfp4-experts; `standin` profiles everything a second time under
    the stand-in."""

    linear: str = "auto"
    fp8_weights: bool = False
    kv_cache_dtype: str = "auto"
    standin: bool = False
    fp8_prefill_attention: str = "auto"
    mxfp4_experts: str = MXFP4_EXPERTS_DEFAULT


def run(
    shape: str,
    layers: int,
    prompt: int,
    chunk: int,
    decode_rows: int,
    decode_ctx: int,
    setting: Setting = Setting(),
) -> dict[str, Any]:
    config = leading_layers(shape_config(shape), layers)
    args = stage_args(config, setting.mxfp4_experts)
    block = kv_block_size(config)
    is_v4 = config["model_type"] == "deepseek_v4"
    timer = OpTimer()
    loads = RoutingLoads(int(config.get("n_routed_experts") or 0))
    kernels = select_kernels(
        "cuda",
        setting.linear,
        moe_experts=moe_backend_for(setting.linear),
        fp8_linear=fp8_backend_for(setting.linear) if setting.fp8_weights else None,
        mla_prefill_fp8=setting.fp8_prefill_attention,
    )
    standin = PendingRecvStandin() if setting.standin else None
    model = build_stage_model(
        args,
        None,
        0,
        layers,
        True,
        True,
        loads.kernels(timer.kernels(kernels)),
        "bfloat16",
        "cuda",
    )
    if is_v4:
        timer.instrument(model)
    blocks_prompt = -(-prompt // block)
    blocks_decode = decode_rows * -(-(decode_ctx + 1) // block)
    kv = make_kv_cache(
        args,
        layers,
        blocks_prompt + blocks_decode + 1,
        block,
        torch.bfloat16,
        "cuda",
        setting.kv_cache_dtype,
    )
    table = list(range(blocks_prompt))
    tokens = torch.randint(0, args.vocab_size, (prompt,), device="cuda")
    with torch.inference_mode():
        for start in range(0, prompt - chunk, chunk):
            batch = ForwardBatch.build([(start, chunk, table, False)], block, "cuda")
            model(tokens[start : start + chunk], batch, kv)
        last = ForwardBatch.build([(prompt - chunk, chunk, table, True)], block, "cuda")
        out: dict[str, Any] = {
            "shape": shape,
            "layers": layers,
            "kernels": kernels.names,
            "setting": dataclasses.asdict(setting),
            "prefill": {
                "prompt": prompt,
                "chunk": chunk,
                **alone_and_standin(lambda: model(tokens[-chunk:], last, kv), standin),
            },
        }
        out["prefill"]["host"] = host_view(lambda: model(tokens[-chunk:], last, kv))
        if is_v4:
            out["prefill"]["v4_ops"] = timer.measure(lambda: model(tokens[-chunk:], last, kv))
        if loads.experts:
            out["prefill"]["expert_loads"] = loads.measure(lambda: model(tokens[-chunk:], last, kv))
        per_row = -(-(decode_ctx + 1) // block)
        rows = [
            (
                decode_ctx,
                1,
                list(range(blocks_prompt + r * per_row, blocks_prompt + (r + 1) * per_row)),
                True,
            )
            for r in range(decode_rows)
        ]
        batch = ForwardBatch.build(rows, block, "cuda")
        ids = tokens[:decode_rows]
        out["decode"] = {
            "rows": decode_rows,
            "context": decode_ctx,
            **alone_and_standin(lambda: model(ids, batch, kv), standin),
        }
        out["decode"]["host"] = host_view(lambda: model(ids, batch, kv))
        if is_v4:
            out["decode"]["v4_ops"] = timer.measure(lambda: model(ids, batch, kv))
    if is_v4:
        del model, kv
        torch.cuda.empty_cache()
        out["hidden_channel"] = hidden_channel(args, chunk)
    print(json.dumps(out)[:3000], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--cases",
        default="deepseek-v2-lite:4:32768:4096:512:4096,deepseek-v32-bench:4:32768:4096:512:4096",
    )
    p.add_argument("--out", required=True)
    p.add_argument("--linear", default="auto")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none", help="auto: none")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument("--standin", action="store_true", help="also profile under the stand-in")
    p.add_argument("--fp8-prefill-attention", default="auto")
    p.add_argument("--mxfp4-experts", choices=MXFP4_EXPERTS, default=MXFP4_EXPERTS_DEFAULT)
    add_no_pdl_flag(p)
    a = p.parse_args()
    pdl.ENABLED = not a.no_pdl
    setting = Setting(
        a.linear,
        a.quantization == "fp8",
        a.kv_cache_dtype,
        a.standin,
        a.fp8_prefill_attention,
        a.mxfp4_experts,
    )
    results: list[dict[str, Any]] = []
    for case in a.cases.split(","):
        shape, *nums = case.split(":")
        layers, prompt, chunk, rows, ctx = map(int, nums)
        results.append(run(shape, layers, prompt, chunk, rows, ctx, setting))
    with open(a.out, "w") as f:
        # kernel times include PDL's waits when pdl is on (stages/kernels/pdl.py)
        env = {"torch": torch.__version__, "pdl": pdl.ENABLED}
        json.dump({"env": env, "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
