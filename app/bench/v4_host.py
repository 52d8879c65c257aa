"""Host cost of one DeepSeek-V4 decode step, on the CPU: the deepseek-v4-flash bench shape's layer
pattern (its 8 leading layers: types, hash / routed MoE, window, rates, top-k, streams, Sinkhorn
iterations, experts per token) at tiny widths, so the work that is a GPU kernel on the device
is small and what remains is mostly the host's: Python and one dispatch per op.

    python -m app.bench.v4_host --rows 512 --context 512 [--dtype bfloat16] [--reps 7] \
        [--out FILE] [--profile FILE]

Per part, the median over reps of its own CPU time in milliseconds (a part's time less the parts
inside it): ForwardBatch.build, V4Plan.build, each layer's forward, the rest of the stage's
forward, and the kernel-registry ops (on the device one kernel each, on the CPU their torch
references: reported apart, not host cost); with the aten ops each part dispatches that
compute (a proxy for its kernel launches on the device; views and no-op casts left out).
--profile writes cProfile's top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import dataclasses
import io
import json
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from app.bench.memory import leading_layers
from app.bench.target import kv_block_size, stage_args, v4_flash_bench_config
from stages.forward_batch import ForwardBatch
from stages.kernels.registry import select_kernels
from stages.kv_cache import make_kv_cache
from stages.loader import build_stage_model, resolve_dtype

# Widths shrunk; every field that sets the step's index arithmetic and op count kept.
TINY_WIDTHS = dict(
    vocab_size=1024,
    hidden_size=32,
    moe_intermediate_size=16,
    num_attention_heads=2,
    head_dim=16,  # 2 rope dims at V4-Flash's partial_rotary_factor
    q_lora_rank=16,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=2,
    index_head_dim=16,
    n_routed_experts=16,
)
KERNEL_OPS = ("sparse_sink_attention", "indexer_logits_rows", "moe_experts")
KERNEL = "kernel stand-ins"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
REST = "stage forward (rest)"


def tiny_flash_config(layers: int) -> dict[str, Any]:
    config = dict(leading_layers(v4_flash_bench_config(), layers), **TINY_WIDTHS)
    config.pop("qk_rope_head_dim", None)  # the rope dims follow head_dim * partial_rotary_factor
    return config


class Parts:
    """Labelled parts of a step: each one's own CPU time (less the parts it calls; the thread's
    CPU time, not the wall clock, as other processes share the machine) and, while
    an OpCounter runs, the aten ops it dispatches itself."""

    def __init__(self) -> None:
        self.own_ms: dict[str, float] = defaultdict(float)
        self.stack: list[list[Any]] = [["outside", 0.0]]  # [label, time of the parts inside]

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.stack.append([label, 0.0])
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                took = (time.thread_time() - t0) * 1e3
                _, inner = self.stack.pop()
                self.own_ms[label] += took - inner
                self.stack[-1][1] += took

        return run

    @property
    def current(self) -> str:
        return str(self.stack[-1][0])


class OpCounter(TorchDispatchMode):
    """aten ops that compute (on the device: a kernel each), by the innermost part running;
    views and no-op casts are not counted."""

    def __init__(self, parts: Parts) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.parts = parts
        self.counts: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        aliased = func.is_view or any(out is a for a in args)  # a view, a cast to its dtype
        if func._schema.is_mutable or not aliased:
            self.counts[self.parts.current] += 1
        return out


def build_step(
    rows: int, context: int, layers: int, dtype: str, parts: Parts
) -> Callable[[], None]:
    """One decode step of `rows` rows at about `context` keys, instrumented by `parts`."""
    torch.manual_seed(0)
    config = tiny_flash_config(layers)
    args = stage_args(config)
    block = kv_block_size(config)
    base = select_kernels("cpu")
    stand_ins: dict[str, Any] = {op: parts.wrap(KERNEL, getattr(base, op)) for op in KERNEL_OPS}
    kernels = dataclasses.replace(base, **stand_ins)
    model: Any = build_stage_model(args, None, 0, layers, True, True, kernels, dtype, "cpu")
    for i, layer in enumerate(model.layers.values()):
        label = f"layer {i} ({config['layer_types'][i]}, {config['mlp_layer_types'][i]})"
        layer.forward = parts.wrap(label, layer.forward)
    model.plan = parts.wrap("V4Plan.build", model.plan)
    forward = parts.wrap(REST, model)
    build = parts.wrap("ForwardBatch.build", ForwardBatch.build)
    # row r decodes its token context + r % max_rate, so the rows complete compression groups
    # as a steady decode does (a quarter of them CSA groups at rate 4), on blocks of its own
    # interleaved with the other rows' (the engine's tables are not consecutive either)
    rate = args.family_args.max_rate
    per_row = -(-(context + rate) // block)
    kv = make_kv_cache(args, layers, rows * per_row + 1, block, resolve_dtype(dtype), "cpu")
    batch_rows = [
        (context + r % rate, 1, [r + rows * b for b in range(per_row)], True) for r in range(rows)
    ]
    ids = torch.randint(0, args.vocab_size, (rows,))
    prefixes = args.family.attention_prefixes

    def step() -> None:
        with torch.inference_mode():
            forward(ids, build(batch_rows, block, "cpu", prefixes), kv)

    return step


def run(
    rows: int, context: int, layers: int, dtype: str, reps: int, profile: str | None
) -> dict[str, Any]:
    parts = Parts()
    step = build_step(rows, context, layers, dtype, parts)
    step()  # warm-up
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(reps):
        parts.own_ms.clear()
        step()
        for label, ms in parts.own_ms.items():
            samples[label].append(ms)
        samples["host total"].append(sum(v for k, v in parts.own_ms.items() if k != KERNEL))
    counter = OpCounter(parts)
    with counter:
        step()
    if profile:
        prof = cProfile.Profile()
        prof.runcall(step)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(40)
        with open(profile, "w") as f:
            f.write(out.getvalue())
    return {
        "rows": rows,
        "context": context,
        "layers": layers,
        "dtype": dtype,
        "reps": reps,
        "torch": torch.__version__,
        "own_ms": {k: round(statistics.median(v), 2) for k, v in samples.items()},
        "aten_ops": dict(counter.counts),
    }


def heap_allocations() -> None:
    """Serve the CPU's large temporaries from the heap (glibc's mallopt), not fresh mmaps: their
    page faults would count as host time and vary with the heap's history (on the device the
    layers' tensors are not host memory)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--context", type=int, default=512, help="about the keys of each row")
    p.add_argument("--dtype", default="bfloat16", help="the model's (the bench shape's: bf16)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", help="write the result as JSON")
    p.add_argument("--profile", help="write cProfile's top functions (by own time) here")
    a = p.parse_args()
    torch.set_num_threads(1)  # the host thread of one stage
    heap_allocations()
    text = json.dumps(run(a.rows, a.context, a.layers, a.dtype, a.reps, a.profile), indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
