"""The DeepSeek kernels (V4, V2/V3/V3.2, FP8) alone and under the one-GPU pending-recv stand-in
(app.bench.standin): a table of kernel calls at the bench shapes' sizes, each timed alone and
with the one-CTA spin posted on a side stream just before it. Grid = SMs kernels are expected
to lose a wave, their SMs - 1 variants not. The stage-level view (every kernel of a prefill
chunk and a decode step, grouped by op) is `python -m app.bench.deepseek_breakdown --standin`.

    python -m app.bench.standin_kernels --out docs/bench/standin_kernels.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from app.bench.standin import PendingRecvStandin, alone_and_contended
from app.bench.target import environment

Case = Callable[[], object]


def _randn(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()


def _ids(rows: int, width: int, keys: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, keys, (rows, width), generator=g, device="cuda", dtype=torch.int32)


def v4_cases(g: torch.Generator) -> dict[str, Case]:
    """V4-Flash: 64 heads of 512, window 128, CSA top-512 (rate 4), HCA every entry (rate 128),
    the FP8 cache's 584-byte pages (the window as FlashMLA's extra cache)."""
    from stages.kernels import flash_mla_v4, fp8_v4, triton_fp8_latent

    heads, scale = 64, 512**-0.5
    cases: dict[str, Case] = {}
    sinks = torch.randn(heads, generator=g, device="cuda")
    for name, comp in (("CSA top-512", 512), ("HCA 2,048 entries (256K)", 2048)):
        keys = 128 + comp + 4096
        kv = _randn(keys, 512, g=g, scale=0.25)
        q = _randn(4096, heads, 512, g=g)
        idx = _ids(4096, 128 + comp, keys, g)
        cases[f"V4 FlashMLA sparse prefill bf16, 4K queries, window + {name}"] = functools.partial(
            flash_mla_v4.sparse_sink_attention, q, kv, idx, sinks, scale
        )
    blocks = 2048
    window_pages = fp8_v4.allocate(blocks, 128, "cuda")
    values = _randn(blocks * 128, 512, g=g, scale=0.25)
    triton_fp8_latent.write_v4(window_pages, values, torch.arange(blocks * 128, device="cuda"))
    comp_pages = fp8_v4.allocate(blocks, 32, "cuda")
    triton_fp8_latent.write_v4(
        comp_pages, values[: blocks * 32], torch.arange(blocks * 32, device="cuda")
    )
    for rows in (64, 512):
        q = _randn(rows, heads, 512, g=g)
        window, picked = _ids(rows, 128, blocks * 128, g), _ids(rows, 512, blocks * 32, g)
        cases[f"V4 FlashMLA sparse FP8 decode, {rows} rows, window + CSA top-512"] = (
            functools.partial(
                flash_mla_v4.sparse_sink_attention_fp8,
                q,
                window_pages,
                window,
                comp_pages,
                picked,
                sinks,
                scale,
            )
        )
    return cases


def mla_cases(g: torch.Generator) -> dict[str, Case]:
    """V2-Lite / V3.2: FlashMLA's dense decode (bf16 latent pages of 64) and sparse kernels,
    cuDNN's MLA chunk attention (q/k 192, v 128), the Triton indexer's decode rows."""
    from stages.kernels import cudnn_attention, flash_mla, fp8_latent, triton_indexer

    cases: dict[str, Case] = {}
    ctx, rows = 4096, 512
    pages = _randn(rows * ctx // 64, 64, 1, 576, g=g, scale=0.25)
    table = torch.arange(rows * ctx // 64, device="cuda", dtype=torch.int32).view(rows, -1)
    lengths = torch.full((rows,), ctx, device="cuda", dtype=torch.int32)
    for heads in (16, 128):
        q = _randn(rows, heads, 576, g=g)
        state: dict[str, Any] = {}
        cases[f"FlashMLA dense decode bf16, {rows} rows x 4K, {heads} heads"] = functools.partial(
            flash_mla.mla_decode, q, pages, table, lengths, 512, 192**-0.5, state
        )
    keys = 32768
    latent = _randn(keys, 576, g=g, scale=0.25)
    q = _randn(4096, 128, 576, g=g)
    idx = _ids(4096, 2048, keys, g)
    cases["V3.2 FlashMLA sparse prefill bf16, 4K queries x top-2048, 128 heads"] = (
        functools.partial(flash_mla.mla_sparse, q, latent.view(keys, 1, 576), idx, 512, 0.07)
    )
    fp8_pages = fp8_latent.quantize(latent).view(-1, 64, 1, fp8_latent.BYTES)
    qd, idx_d = _randn(rows, 128, 576, g=g), _ids(rows, 2048, keys, g)
    cases[f"V3.2 FlashMLA sparse FP8 decode, {rows} rows x top-2048, 128 heads"] = (
        functools.partial(flash_mla.mla_sparse_fp8_decode, qd, fp8_pages, idx_d, 512, 0.07, {})
    )
    q, k, v = _randn(4096, 16, 192, g=g), _randn(keys, 16, 192, g=g), _randn(keys, 16, 128, g=g)
    cases["cuDNN MLA chunk attention, 4K queries x 32K keys, 16 heads"] = functools.partial(
        cudnn_attention.split_attention, q, k, v, 192**-0.5
    )
    qi, ki = _randn(rows, 64, 128, g=g), _randn(keys, 128, g=g)
    wi = torch.randn(rows, 64, generator=g, device="cuda")
    cases[f"Triton indexer scores, {rows} rows x 32K keys"] = functools.partial(
        triton_indexer.indexer_logits, qi, ki, wi, 128**-0.5
    )
    return cases


def fp8_cases(g: torch.Generator) -> dict[str, Case]:
    """V3.2's W8A8 linears (4K tokens) on each backend, and its routed experts (32 of them,
    top-8) on the grouped FP8 GEMM, with grid = SMs and SMs - 1."""
    from stages.kernels import fp8_gemm, fp8_ref, triton_moe_fp8

    cases: dict[str, Case] = {}
    for layer, n, k in (("o_proj", 7168, 16384), ("dense gate_up", 36864, 7168)):
        x = _randn(4096, k, g=g)
        wq, ws = fp8_ref.quantize_weight(torch.randn(n, k, generator=g, device="cuda") / 30)
        for backend, fn in (
            ("scaled-mm", fp8_gemm.linear_scaled_mm),
            ("Triton grid = SMs", fp8_gemm.linear),
            ("Triton grid = SMs - 1", fp8_gemm.linear_sm1),
        ):
            cases[f"W8A8 {layer} 4K x {n} x {k}, {backend}"] = functools.partial(fn, x, wq, ws)
    tokens, experts, top, h, inter = 4096, 32, 8, 7168, 2048
    gq, gs = fp8_ref.quantize_weight(
        torch.randn(experts, 2 * inter, h, generator=g, device="cuda") / 60
    )
    dq, ds = fp8_ref.quantize_weight(
        torch.randn(experts, h, inter, generator=g, device="cuda") / 40
    )
    x = _randn(tokens, h, g=g)
    ids = torch.rand(tokens, experts, generator=g, device="cuda").topk(top, dim=-1).indices
    w = torch.rand(tokens, top, generator=g, device="cuda")
    for label, moe in (
        ("grid = SMs", triton_moe_fp8.moe_experts),
        ("grid = SMs - 1", triton_moe_fp8.moe_experts_sm1),
    ):
        cases[f"FP8 grouped MoE, 4K tokens x top-8 of 32 experts, {label}"] = functools.partial(
            moe, x, gq, gs, dq, ds, ids, w
        )
    return cases


def hyper_cases(g: torch.Generator) -> dict[str, Case]:
    """V4-Flash's hyper-connections (4 streams of 4096, 20 Sinkhorn iterations) on Triton: the
    mix with each projection precision, and the merge, for an 8K chunk and 512 decode rows."""
    from stages.kernels import triton_hyper

    cases: dict[str, Case] = {}
    n, d = 4, 4096
    fn = torch.randn((2 + n) * n, n * d, generator=g, device="cuda") * (n * d) ** -0.5
    base = torch.randn((2 + n) * n, generator=g, device="cuda") * 0.1
    scale = torch.rand(3, generator=g, device="cuda") + 0.5
    for rows in (8192, 512):
        streams = _randn(rows, n, d, g=g)
        for precision in triton_hyper.PRECISIONS:
            cases[f"V4 hyper-connection mix, {rows} tokens, {precision}"] = functools.partial(
                triton_hyper.mix, streams, fn, base, scale, 20, 1e-6, 1e-6, precision=precision
            )
        post, comb, out = triton_hyper.mix(streams, fn, base, scale, 20, 1e-6, 1e-6)
        cases[f"V4 hyper-connection merge, {rows} tokens"] = functools.partial(
            triton_hyper.merge, streams, out, post, comb
        )
    return cases


GROUPS: dict[str, Callable[[torch.Generator], dict[str, Case]]] = {
    "hyper": hyper_cases,
    "v4": v4_cases,
    "mla": mla_cases,
    "fp8": fp8_cases,
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--groups", default=",".join(GROUPS))
    p.add_argument("--reps", type=int, default=15)
    a = p.parse_args(argv)
    report: dict[str, Any] = {
        "command": "python -m app.bench.standin_kernels " + " ".join(sys.argv[1:]),
        "environment": environment(),
        "stand_in": "one-CTA torch.cuda._sleep on a side stream (app/bench/standin.py)",
        "rows": [],
    }
    standin = PendingRecvStandin()
    for group in a.groups.split(","):
        g = torch.Generator(device="cuda").manual_seed(0)
        try:
            cases = GROUPS[group](g)
        except Exception as e:  # a group whose kernels do not load here is a result too
            report["rows"].append({"group": group, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        for name, fn in cases.items():
            try:
                row = {"group": group, "kernel": name, **alone_and_contended(fn, standin, a.reps)}
            except Exception as e:
                row = {"group": group, "kernel": name, "error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
        del cases
        torch.cuda.empty_cache()
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
