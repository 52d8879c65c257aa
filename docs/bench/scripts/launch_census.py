"""A CPU census of what a DeepSeek-V4 decode step launches, per part of a layer: one paged
decode step (the static buffers a CUDA graph replays, run eager) of the deepseek-v4-flash bench
shape's 8 leading layers at small widths, FP8 weights and FP8 KV, every op counted as the GPU
would launch it. Each kernel-registry call counts as its GPU backend's launches (GPU_LAUNCHES,
read off the backends' code: e.g. a W8A8 linear is its activation quantizer and cuBLASLt's
GEMM); every other aten op that is not a view counts one. An estimate to plan fusions with, not
a measurement: at 8b16e33 it counts 1,050 where the profiler counted 1,351 launches in a graphed
FP8 step of one row (session 14), so it misses about a fifth (cuBLAS's split-K reductions,
FlashMLA's and torch's top-k's inner kernels, counted here as GPU_LAUNCHES guesses).

    python docs/bench/scripts/launch_census.py [--rows 1] [--out census.json]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import fields, replace
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from app.bench.target import v4_flash_bench_config
from stages.decode_graphs import DecodeGraphs
from stages.forward_batch import ForwardBatch
from stages.kernels.registry import select_kernels
from stages.kv_cache import make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import ModelArgs
from stages.models.deepseek_v4 import moe as v4_moe
from stages.protocol import Row

# GPU launches of one call of each registry op's CUDA backend (the rest: 1)
GPU_LAUNCHES = {
    "fp8_linear": 2,  # the 1 x 128 quantizer, the decode kernel or cuBLASLt's GEMM
    "fp8_swiglu_linear": 2,  # the swiglu-quantizer, cuBLASLt's GEMM
    # a decode batch's: the quantizer, routing (count and plan in one program, the scatter with
    # the scales), the gate/up GEMM with the swiglu-quantizer in its epilogue, the down GEMM,
    # combine (session 14's: 19; session 16's: 9, with the counters' fill, the count and the
    # plan apart and the swiglu-quantizer its own kernel)
    "moe_experts_fp8": 6,
    "indexer_logits_rows": 3,  # query quantizer, scores, mask
    "index_topk": 1,  # a short line's rule top-k in one program (torch's path took ~10)
    "hc_mix": 2,  # _project, _finish
}
# FlashMLA's V4 FP8 call: its kernel and split combine each call; a set of ids packed (argsort,
# gather, sum, pad, its view; a CSA layer's picks, counted already: none) once per state
# that keeps it; the schedule once per state (or per schedule_state where given)
KERNEL_LAUNCHES, PACK_LAUNCHES, IN_ORDER_PACK_LAUNCHES, SCHEDULE_LAUNCHES = 2, 5, 0, 1
FREE = {"empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh", "_unsafe_view"}
SMALL = dict(
    hidden_size=512, moe_intermediate_size=128, n_routed_experts=16, num_attention_heads=16,
    o_groups=4, o_lora_rank=128, q_lora_rank=128, index_n_heads=8, vocab_size=512,
    expert_dtype="bf16",
)  # fmt: skip


class Census(TorchDispatchMode):
    """Counts the aten ops dispatched outside registry calls, per scope."""

    def __init__(self, launches: dict[str, int]) -> None:
        self.launches = launches  # GPU_LAUNCHES at this census's row count
        super().__init__()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.scope: list[str] = []
        self.muted = 0
        self.active = False

    def __enter__(self):  # type: ignore[no-untyped-def]
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if not self.muted and not func.is_view and name not in FREE:
            self.counts[(self.where(), name)] += 1
        return func(*args, **(kwargs or {}))

    def where(self) -> str:
        return "/".join(self.scope[-2:]) or "stage"


def fp8_attention_launches(kwargs: dict[str, Any]) -> int:
    """sparse_sink_attention_fp8's launches, what FlashMLA's backend keeps in its states
    (stages/kernels/flash_mla_v4.py) counted once per state."""
    schedule = kwargs.get("schedule_state")
    comp_pack = IN_ORDER_PACK_LAUNCHES if kwargs.get("comp_counts") is not None else PACK_LAUNCHES
    kept_things = (
        (kwargs.get("window_state"), PACK_LAUNCHES),
        (kwargs.get("state"), comp_pack + (SCHEDULE_LAUNCHES if schedule is None else 0)),
        (schedule, SCHEDULE_LAUNCHES if schedule is not None else 0),
    )
    launches = KERNEL_LAUNCHES
    for kept, packed in kept_things:
        if kept is None or not kept.get("census.seen"):
            launches += packed
        if kept is not None:
            kept["census.seen"] = True
    return launches


def counting(census: Census, op: str, fn: Any) -> Any:
    """fn counted as its GPU launches, the ops of its torch form muted."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if census.active and not census.muted:  # not inside another op's torch form
            launches = census.launches.get(op, 1)
            if op == "sparse_sink_attention_fp8":
                launches = fp8_attention_launches(kwargs)
            census.counts[(census.where(), f"[{op}]")] += launches
        census.muted += 1
        try:
            return fn(*args, **kwargs)
        finally:
            census.muted -= 1

    return call


def wrapped(census: Census, kernels: Any) -> Any:
    """The kernels with each op counted as its GPU launches."""
    ops = {f.name: getattr(kernels, f.name) for f in fields(kernels) if f.name != "names"}
    return replace(
        kernels, **{op: counting(census, op, fn) for op, fn in ops.items() if callable(fn)}
    )


def count_writes(census: Census) -> None:
    """The FP8 cache writes, one Triton kernel each on CUDA (their torch forms here)."""
    from stages.kernels import triton_fp8_latent

    for name in ("write_v4", "write_indexer_key"):
        fn = getattr(triton_fp8_latent, name)
        setattr(triton_fp8_latent, name, counting(census, name, fn))


def scoped(census: Census, model: torch.nn.Module) -> None:
    def enter(module: torch.nn.Module, *_: Any) -> None:
        census.scope.append(type(module).__name__)

    def leave(*_: Any) -> None:
        census.scope.pop()

    for m in model.modules():
        if type(m).__name__ in ("V4Attention", "MoE", "HyperConnection", "V4Router", "SwiGLU",
                                "Linear", "V4RMSNorm", "Indexer", "GroupCompressor"):  # fmt: skip
            m.register_forward_pre_hook(enter)
            m.register_forward_hook(leave)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--out")
    a = p.parse_args()
    config = dict(v4_flash_bench_config(), **SMALL)
    config.pop("quantization_config", None)
    args = ModelArgs.from_hf_dict(config)
    census = Census(GPU_LAUNCHES)
    count_writes(census)
    kernels = wrapped(census, select_kernels("cpu", fp8_linear="torch"))
    layers = args.num_hidden_layers
    # as a CUDA stage builds it: the shared expert in the routed experts' stack
    with mock.patch.object(v4_moe, "shared_expert_in_stack", lambda *_: True):
        model = build_stage_model(args, None, 0, layers, True, True, kernels, "bfloat16", "cpu")
    scoped(census, model)
    block, length = 128, 600
    per_row = -(-(length + 8) // block)
    num_blocks = a.rows * per_row + 1
    kv = make_kv_cache(args, range(layers), num_blocks, block, torch.bfloat16, "cpu", "fp8")
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(a.rows)]
    with torch.inference_mode():
        batch = ForwardBatch.build([(0, length, t, True) for t in tables], block, "cpu",
                                   args.family.attention_prefixes)  # fmt: skip
        model(torch.randint(3, 500, (a.rows * length,)), batch, kv)
        graphs = DecodeGraphs(
            model, kv, num_slots=a.rows, max_model_len=2048, scratch_slot=(num_blocks - 1) * block,
            hidden_shape=args.family.hidden_shape(args), dtype=torch.bfloat16,
            device=torch.device("cpu"), is_first=True, max_rows=max(8, a.rows), eager=True,
        )  # fmt: skip
        graphs.update_tables([(i, 0, tuple(t)) for i, t in enumerate(tables)])
        rows = tuple(Row(str(i), i, length, 1, None, sample=True, is_prefill=False)
                     for i in range(a.rows))  # fmt: skip
        key = graphs.bucket_for(rows)
        by_req = {str(i): t for i, t in enumerate(tables)}
        with census:
            graphs.run(key, rows, torch.randint(3, 500, (a.rows,)), by_req)
    by_scope: Counter[str] = Counter()
    for (scope, _op), n in census.counts.items():
        by_scope[scope] += n
    report = {
        "layers": layers,
        "launches": sum(census.counts.values()),
        "by_scope": dict(by_scope.most_common()),
        "ops": {f"{s} {o}": n for (s, o), n in census.counts.most_common()},
    }
    print(json.dumps({k: report[k] for k in ("layers", "launches", "by_scope")}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
