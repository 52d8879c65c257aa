"""The grouped FP8 MoE's kernels on one GPU (`python -m app.bench.fp8` runs them by flag):
the tile sweep of its two grouped GEMMs at prefill and decode batches (`--moe-tiles`,
`--moe-decode-tiles`), and the gate/up GEMM with the SwiGLU and quantizer in its epilogue against
the GEMM then the quantizer (`--moe-swiglu`), and the prefill GEMMs at several programs an SM
(`--moe-loops`).

    python -m app.bench.fp8 --moe-swiglu --out docs/bench/moe_swiglu.json
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import torch

from stages.kernels import fp8_ref

# (name, tokens, experts, top-k, hidden, width): V4-Flash's routed experts at an 8K chunk and
# V3.2-bench's (V2-Lite's) at a 4K one
MOE_TILE_SHAPES = [("v4-flash", 8192, 256, 6, 4096, 2048), ("v32-bench", 4096, 64, 6, 2048, 1408)]


# decode batches: V4-Flash's experts at 1 to 512 rows (the weights' read is the floor)
MOE_DECODE_SHAPES = [
    ("v4-flash-512", 512, 256, 6, 4096, 2048),
    ("v4-flash-64", 64, 256, 6, 4096, 2048),
    ("v4-flash-16", 16, 256, 6, 4096, 2048),
    ("v4-flash-1", 1, 256, 6, 4096, 2048),
]
# 16-row tiles and 3 or 6 stages lost in session 6's and 14's sweeps
DECODE_TILE_SWEEP = ((32, 64), (4, 8), (4, 5))
PREFILL_TILE_SWEEP = ((64, 128), (4, 8), (3, 4))


def _moe_operands(
    t: int, e: int, k: int, h: int, inter: int, skew: float = 0.0
) -> tuple[torch.Tensor, ...]:
    """A t-token chunk's MoE operands on the GPU: the experts' gate/up and down weights in FP8
    with their block scales, the bf16 tokens, their top-k experts (uniform random router
    logits, plus skew times a random popularity an expert: 0 routes evenly, a few units crowd
    the rows onto some experts) and weights, and the tokens quantized in 1 x 128 groups with
    their scales."""
    from stages.kernels import triton_fp8_act

    gq, gs = fp8_ref.quantize_weight(torch.randn(e, 2 * inter, h, device="cuda") / 60)
    dq, ds = fp8_ref.quantize_weight(torch.randn(e, h, inter, device="cuda") / 40)
    x = torch.randn(t, h, device="cuda").bfloat16()
    logits = torch.rand(t, e, device="cuda")
    if skew:
        logits += skew * torch.randn(e, device="cuda")
    ids = logits.topk(k, dim=-1).indices
    w = torch.rand(t, k, device="cuda")
    xq, xs = triton_fp8_act.quantize_act(x)
    return gq, gs, dq, ds, x, ids, w, xq, xs


def moe_tile_rows(
    shapes: list[tuple[str, int, int, int, int, int]] = MOE_TILE_SHAPES,
    sweep: tuple[tuple[int, ...], ...] = PREFILL_TILE_SWEEP,
) -> list[dict[str, Any]]:
    """The grouped FP8 GEMMs (gate/up, then down) per tile configuration: BLOCK_M (the routing
    layout's), warps, pipeline stages and pointer loads or TMA; BLOCK_N and BLOCK_K are the
    128 x 128 scale blocks.
    Each row also gives the expert weights' read rate (the experts the tokens touch, FP8)."""
    import triton.testing

    from stages.kernels import triton_fp8_act, triton_moe_fp8
    from stages.kernels.moe_routing import route_and_gather
    from stages.kernels.triton_gemm import num_sms

    rows = []
    block_ms, warps_list, stages_list = sweep
    for name, t, e, k, h, inter in shapes:
        gq, gs, dq, ds, x, ids, w, xq, xs = _moe_operands(t, e, k, h, inter)
        touched = int(ids.unique().numel())
        gate_bytes, down_bytes = touched * 2 * inter * h, touched * h * inter
        for block_m in block_ms:
            r, a = route_and_gather(xq.view(torch.uint8), ids, w, e, block_m)
            a = a.view(fp8_ref.FP8)
            a_s = xs.index_select(0, (r.pair_of_row.clamp(min=0) // k).long())
            h_in, h_s = triton_fp8_act.quantize_act(
                torch.randn(a.shape[0], inter, device="cuda").bfloat16()
            )
            for warps, stages, tma in itertools.product(warps_list, stages_list, (False, True)):
                cfg: dict[str, Any] = dict(num_warps=warps, num_stages=stages, tma=tma)
                grid = num_sms(x.device)
                try:
                    gu = triton.testing.do_bench(
                        lambda: triton_moe_fp8.grouped_gemm(a, a_s, gq, gs, r, grid, x.dtype, **cfg)
                    )
                    dn = triton.testing.do_bench(
                        lambda: triton_moe_fp8.grouped_gemm(
                            h_in, h_s, dq, ds, r, grid, x.dtype, pairs=t * k, **cfg
                        )
                    )
                    flops = 2 * t * k * h * inter  # the down GEMM's; gate/up's twice that
                    row = {
                        "gate_up_ms": round(gu, 3),
                        "down_ms": round(dn, 3),
                        "gate_up_tflops": round(2 * flops / gu / 1e9, 1),
                        "down_tflops": round(flops / dn / 1e9, 1),
                        "gate_up_tb_s": round(gate_bytes / gu / 1e9, 2),
                        "down_tb_s": round(down_bytes / dn / 1e9, 2),
                    }
                except Exception as err:  # a configuration that does not compile
                    row = {"error": f"{type(err).__name__}: {err}"[:160]}
                row = {"shape": name, "block_m": block_m, **cfg, **row}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


# V4-Flash's routed experts at 1-512 decode rows (UNFUSED_SWIGLU_FROM's crossover) and an 8K chunk
MOE_SWIGLU_TOKENS = (1, 8, 16, 32, 64, 512, 8192)


# (warps, stages) of the fused gate/up at a few decode rows besides its SWIGLU_LAUNCH
# (`--moe-swiglu-launches`): gate and up side by side on 8 warps at 4 stages took a one-row
# V4-Flash FP8 step 0.09 ms under gate then up on 4 warps at 5 (docs/PERFORMANCE.md, session 28)
SWIGLU_LAUNCH_TOKENS = (1, 4, 16)
SWIGLU_LAUNCHES = ((8, 3), (8, 5), (8, 6), (16, 4))


def moe_swiglu_rows(
    tokens: tuple[int, ...] = MOE_SWIGLU_TOKENS,
    launches: tuple[tuple[int, int], ...] = (),
) -> list[dict[str, Any]]:
    """V4-Flash's gate/up GEMM with the SwiGLU and the down GEMM's quantizer in its epilogue
    (triton_moe_fp8.gate_up_swiglu) against the GEMM then the fused quantizer over the layout
    (the path before it), at the tiles the MoE picks; each row says whether their bytes agree.
    launches: (warps, stages) to time the fused kernel at besides its own (SWIGLU_LAUNCH), each
    row with its time and whether its bytes equal the own launch's."""
    import triton.testing

    from stages.kernels import triton_fp8_act, triton_moe_fp8
    from stages.kernels.moe_routing import route_and_gather_scaled
    from stages.kernels.triton_gemm import num_sms

    e, k, h, inter, limit = 256, 6, 4096, 2048, 10.0
    gq, gs = fp8_ref.quantize_weight(torch.randn(e, 2 * inter, h, device="cuda") / 60)
    grid = num_sms("cuda")
    rows = []
    for t in tokens:
        x = torch.randn(t, h, device="cuda").bfloat16()
        ids = torch.rand(t, e, device="cuda").topk(k, dim=-1).indices
        w = torch.rand(t, k, device="cuda")
        block_m, warps, stages = triton_moe_fp8.tiles_for(t * k, e)
        xq, xs = triton_fp8_act.quantize_act(x)
        r, a, a_s = route_and_gather_scaled(xq.view(torch.uint8), xs, ids, w, e, block_m)
        a = a.view(fp8_ref.FP8)

        def unfused() -> tuple[torch.Tensor, torch.Tensor]:
            c = triton_moe_fp8.grouped_gemm(a, a_s, gq, gs, r, grid, x.dtype, None, warps, stages)
            return triton_fp8_act.swiglu_quantize_act(c, limit, live=r.pair_of_row)

        def fused() -> tuple[torch.Tensor, torch.Tensor]:
            return triton_moe_fp8.gate_up_swiglu(a, a_s, gq, gs, r, grid, x.dtype, limit)

        real = r.pair_of_row >= 0
        (uq, us), (fq, fs) = unfused(), fused()
        same = torch.equal(uq[real].view(torch.uint8), fq[real].view(torch.uint8)) and (
            torch.equal(us[real], fs[real])
        )
        row = {
            "tokens": t,
            "block_m": block_m,
            "unfused_ms": round(triton.testing.do_bench(unfused), 4),
            "fused_ms": round(triton.testing.do_bench(fused), 4),
            "same_bits": same,
        }
        for lw, ls in launches:

            def other(lw: int = lw, ls: int = ls) -> tuple[torch.Tensor, torch.Tensor]:
                return triton_moe_fp8.gate_up_swiglu(
                    a, a_s, gq, gs, r, grid, x.dtype, limit, lw, ls
                )

            oq, os_ = other()
            row[f"fused_ms_{lw}w{ls}s"] = round(triton.testing.do_bench(other), 4)
            row[f"same_bits_{lw}w{ls}s"] = torch.equal(
                oq[real].view(torch.uint8), fq[real].view(torch.uint8)
            ) and torch.equal(os_[real], fs[real])
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# (BLOCK_M, warps, stages, programs an SM) of the grouped GEMMs through TMA: each program waits
# on its own MMAs, so two or three 64-row ones an SM may fill each other's waits. The first is
# the one-program launch the tile sweep had picked (PREFILL_TILES), the last session 23's.
MOE_LOOP_SWEEP: list[tuple[int, int, int, int]] = [
    (128, 8, 4, 1),
    (128, 8, 3, 1),
    (64, 4, 4, 1),
    (64, 4, 4, 2),
    (64, 4, 3, 2),
    (64, 4, 3, 3),
]


def moe_loop_rows(
    sweep: list[tuple[int, int, int, int]] = MOE_LOOP_SWEEP,
    shapes: list[tuple[str, int, int, int, int, int]] = MOE_TILE_SHAPES[:1],
    skew: float = 0.0,
) -> list[dict[str, Any]]:
    """The two grouped FP8 GEMMs of each shape (V4-Flash's at an 8K chunk by default) through
    TMA, per launch of sweep (tiles, programs an SM), routed evenly or with `skew`
    (_moe_operands; each row gives the experts' load): times, rates, and whether each output's
    bits (per pair, so layouts of other BLOCK_M compare) are the first launch's."""
    rows = []
    for shape in shapes:
        rows += _moe_loop_rows(sweep, *shape, skew=skew)
    return rows


def _moe_loop_rows(
    sweep: list[tuple[int, int, int, int]],
    name: str,
    t: int,
    e: int,
    k: int,
    h: int,
    inter: int,
    skew: float,
) -> list[dict[str, Any]]:
    import triton.testing

    from app.bench.moe import expert_loads
    from stages.kernels import triton_fp8_act, triton_moe_fp8
    from stages.kernels.moe_routing import route_and_gather
    from stages.kernels.triton_gemm import num_sms

    gq, gs, dq, ds, x, ids, w, xq, xs = _moe_operands(t, e, k, h, inter, skew)
    loads = expert_loads(ids, e)
    hq, hs = triton_fp8_act.quantize_act(torch.randn(t * k, inter, device="cuda").bfloat16())
    flops = 2 * t * k * h * inter  # the down GEMM's; gate/up's twice that
    rows, want = [], None
    for block_m, warps, stages, per_sm in sweep:
        r, a = route_and_gather(xq.view(torch.uint8), ids, w, e, block_m)
        a = a.view(fp8_ref.FP8)
        live = r.pair_of_row >= 0
        pair = r.pair_of_row[live].long()
        a_s = xs.index_select(0, (r.pair_of_row.clamp(min=0) // k).long())
        h_in = torch.zeros(a.shape[0], inter, dtype=torch.uint8, device="cuda")
        h_in[live] = hq.view(torch.uint8)[pair]
        h_in = h_in.view(fp8_ref.FP8)
        h_s = hs.new_ones(a.shape[0], inter // 128)
        h_s[live] = hs[pair]
        cfg: dict[str, Any] = dict(num_warps=warps, num_stages=stages, tma=True)
        grid = per_sm * num_sms(x.device)

        def gate_up() -> torch.Tensor:
            return triton_moe_fp8.grouped_gemm(a, a_s, gq, gs, r, grid, x.dtype, **cfg)

        def down() -> torch.Tensor:
            return triton_moe_fp8.grouped_gemm(h_in, h_s, dq, ds, r, grid, x.dtype, t * k, **cfg)

        row: dict[str, Any] = {"shape": name, "block_m": block_m, "warps": warps}
        row.update(stages=stages, per_sm=per_sm, skew=skew, loads=loads)
        try:
            by_pair = gate_up().new_empty(t * k, 2 * inter)
            by_pair[pair] = gate_up()[live]
            got = (by_pair, down())
            want = want or got
            gu, dn = triton.testing.do_bench(gate_up), triton.testing.do_bench(down)
            row.update(
                gate_up_ms=round(gu, 3),
                down_ms=round(dn, 3),
                gate_up_tflops=round(2 * flops / gu / 1e9, 1),
                down_tflops=round(flops / dn / 1e9, 1),
                same_bits=all(torch.equal(g, w_) for g, w_ in zip(got, want)),
            )
        except Exception as err:  # a launch that does not compile or run
            row["error"] = f"{type(err).__name__}: {err}"[:200]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows
