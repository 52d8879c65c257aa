"""DeepGEMM, built from source on the GPU host, beside our Triton FP8 kernels (issue 35's "FP8
GEMMs at FP8 rates") at DeepSeek-V4-Flash's shapes. Host run (DeepGEMM's source archive stays out
of git; the scripts are in .gpu-deepgemm/): here, `bash .gpu-deepgemm/pack_deepgemm.sh` packs the
fetched snapshots into .gpu-deepgemm/deepgemm-src.tar.xz; the device call carries
[".gpu-deepgemm"] and runs `bash .gpu-deepgemm/deepgemm_build.sh .gpu-deepgemm/deepgemm-src.tar.xz
/tmp/dg` (builds deep_gemm._C with Ubuntu's g++, writes /tmp/dg/env.sh), then `. /tmp/dg/env.sh;
python3 -m app.bench.deepgemm --out $OUT/deepgemm.json`. If deep_gemm does not import, or its
first kernel does not run (a child process tries one: probe_kernel), the JSON says why.

- Grouped W8A8 MoE GEMMs at 4K and 8K-token chunks (256 experts, top-6 on random router logits,
  hidden 4096, width 2048): ``m_grouped_fp8_gemm_nt_contiguous`` against
  ``triton_moe_fp8.grouped_gemm``, each on its own moe_routing layout (DeepGEMM's M alignment, 128
  on SM90; our tiles_for's BLOCK_M) of the same FP8 operands; DeepGEMM on the layout's sync-free
  row bound and (``deepgemm-trimmed``) on the rows in use. Then the whole routed-expert step:
  ``triton_moe_fp8.moe_experts`` against the deepgemm backend (stages/kernels/deepgemm_moe.py:
  DeepGEMM's GEMMs inside our quantizers, layout and combine), whose bits should be the same.
- Dense W8A8 linears (fp8.py's V4_DECODE_LINEARS at M = 4096, 8192): ``fp8_gemm_nt`` against the
  Triton persistent GEMM on the same FP8 operands, and from bf16 (our quantizer first) beside
  fp8_gemm.linear and linear_scaled_mm (cuBLASLt).

Per kernel: GPU time (gpu_ms), TFLOP/s on the real rows and its fraction of the H200's FP8 peak
(model_cost.H200_FP8_PEAK_TFLOPS); DeepGEMM's error against our kernel on the same operands
(rel_err: norm of the difference over the norm; max_rel_diff: largest difference over the largest
value); the dense GEMMs' error against the fp32 product of the dequantized operands. DeepGEMM
takes our scales (1 x 128 activations, 128 x 128 weights, fp32 on SM90) with the activations'
made MN-major by its get_mn_major_tma_aligned_tensor. Its kernels compile at first use (nvcc),
here in worker processes before the timings (--jit-workers).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from app.bench.attention import cuda_median_ms
from app.bench.deepgemm_probe import probe_kernel
from app.bench.fp8 import V4_DECODE_LINEARS
from app.bench.mxfp4 import V4_FLASH, batch, experts
from app.model_cost import H200_FP8_PEAK_TFLOPS, H200_FP8_TFLOPS
from stages.kernels import fp8_ref

CHUNKS = (4096, 8192)  # prefill chunk tokens (the MoE's rows are tokens x top-k); dense GEMMs' M
REPS = 10
SPIN_MS = 2.0  # each timed call waits behind a spin this long: its launch stays off the clock
# a kernel JIT-compiled ahead of the timings: ("dense", M, N, K, 1) or ("grouped", rows, N, K, E)
JitJob = tuple[str, int, int, int, int]


def by_pair(c: torch.Tensor, pair_of_row: torch.Tensor, pairs: int) -> torch.Tensor:
    """Rows of a routing layout [rows, N] -> [pairs, N] at their (token, k) slots (zeros where
    no row lands; padding rows go to a dropped slot)."""
    out = torch.zeros(pairs + 1, c.shape[1], dtype=c.dtype, device=c.device)
    out.index_copy_(0, torch.where(pair_of_row >= 0, pair_of_row, pairs).long(), c)
    return out[:pairs]


def gather(q: torch.Tensor, scale: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FP8 rows and their scales at `index` (the FP8 rows travel as bytes)."""
    rows = q.view(torch.uint8).index_select(0, index).view(q.dtype)
    return rows, scale.index_select(0, index)


def errors(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    got, want = got.float(), want.float()
    diff = got - want
    return {
        "rel_err": round(float(diff.norm() / want.norm()), 6),
        "max_rel_diff": round(float(diff.abs().max() / want.abs().max()), 6),
    }


def failed(err: Exception) -> dict[str, str]:
    return {"error": f"{type(err).__name__}: {err}"[:300]}


def rate_of(flops: float, ms: float) -> dict[str, float]:
    tflops = flops / ms / 1e9
    return {
        "us": round(ms * 1e3, 1),
        "tflops": round(tflops, 1),
        "of_fp8_peak": round(tflops / H200_FP8_PEAK_TFLOPS, 3),
    }


def gpu_ms(fn: Callable[[], object], reps: int = REPS) -> float:
    """fn's GPU time behind a SPIN_MS spin (cuda_median_ms): not the host's launch time
    (DeepGEMM's heuristics and descriptors, Triton's launcher, the torch glue), which a small
    GEMM can take longer for."""
    return cuda_median_ms(fn, reps, spin_ms=SPIN_MS)


def rate(flops: float, fn: Callable[[], object], reps: int = REPS) -> dict[str, Any]:
    """us, TFLOP/s and fraction of the FP8 peak of fn (gpu_ms); an error is a result."""
    try:
        return rate_of(flops, gpu_ms(fn, reps))
    except Exception as err:  # a kernel that refuses a shape, or fails to compile
        return failed(err)


def first_call(fn: Callable[[], object]) -> dict[str, Any]:
    """Runs fn once: its seconds (a JIT compile, or the cache's load) or its error."""
    start = time.perf_counter()
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as err:
        return failed(err)
    return {"first_call_s": round(time.perf_counter() - start, 2)}


def load_deep_gemm() -> tuple[Any, dict[str, Any]]:
    info: dict[str, Any] = {"build": os.environ.get("DEEPGEMM_BUILD", "unknown")}
    try:
        dg = importlib.import_module("deep_gemm")
    except Exception as err:  # not built here, or built against another torch or CUDA
        info["import_error"] = f"{type(err).__name__}: {err}"[:2000]
        return None, info
    info.update(version=getattr(dg, "__version__", "?"), file=dg.__file__)
    return dg, info


def _dg_call(dg: Any, kind: str, a: Any, b: Any, d: torch.Tensor, m_idx: Any = None) -> None:
    if kind == "dense":
        dg.fp8_gemm_nt(a, b, d)
    else:
        dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_idx)


def warm_job(job: JitJob) -> float:
    """One DeepGEMM call at a job's shape on placeholder operands (a worker process's part of the
    JIT warm-up: the kernel it compiles depends on M, N, K and the experts, not on the values;
    every row of a grouped job is padding, so the kernel skips them all). Returns seconds."""
    start = time.perf_counter()
    dg = importlib.import_module("deep_gemm")
    kind, m, n, k, groups = job
    a = torch.empty(m, k, dtype=fp8_ref.FP8, device="cuda")
    sa = dg.get_mn_major_tma_aligned_tensor(torch.ones(m, k // 128, device="cuda"))
    lead = (groups,) if kind == "grouped" else ()
    b = torch.empty(*lead, n, k, dtype=fp8_ref.FP8, device="cuda")
    sb = torch.ones(*lead, -(-n // 128), k // 128, device="cuda")
    d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    m_idx = torch.full((m,), -1, dtype=torch.int32, device="cuda")
    _dg_call(dg, kind, (a, sa), (b, sb), d, m_idx)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def moe_layouts(dg: Any, chunks: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """Per chunk: its batch (mxfp4.batch: x, ids, weights) and the routing layouts of both
    kernels (ours at tiles_for's BLOCK_M, DeepGEMM's at its alignment)."""
    from stages.kernels import triton_moe_fp8
    from stages.kernels.moe_routing import route_and_gather

    e, k = V4_FLASH[:2]
    dg_block = int(dg.get_mk_alignment_for_contiguous_layout())
    out = {}
    for t in chunks:
        x, ids, wt = batch(t, V4_FLASH)
        tiles = triton_moe_fp8.tiles_for(t * k, e)
        blocks = {"triton": tiles[0], "deepgemm": dg_block}
        layouts = {who: route_and_gather(x, ids, wt, e, bm)[0] for who, bm in blocks.items()}
        used = int(layouts["deepgemm"].num_tiles.item()) * dg_block
        out[t] = {"x": x, "ids": ids, "wt": wt, "tiles": tiles, "used": used, **layouts}
    return out


def jit_jobs(layouts: dict[int, dict[str, Any]]) -> list[JitJob]:
    e, _k, hidden, inter = V4_FLASH
    jobs: list[JitJob] = []
    for lay in layouts.values():
        rows = lay["deepgemm"].pair_of_row.numel()
        for n, k in ((2 * inter, hidden), (hidden, inter)):
            jobs += [("grouped", rows, n, k, e), ("grouped", lay["used"], n, k, e)]
    for m in layouts:
        jobs += [("dense", m, n, k, 1) for _name, n, k in V4_DECODE_LINEARS]
    return sorted(set(jobs))


def moe_rows(
    dg: Any, layouts: dict[int, dict[str, Any]], w: dict[str, Any], rows: list[Any]
) -> list[Any]:
    """Appends to rows, per chunk: each grouped GEMM, both together, the whole step."""
    from stages.kernels import triton_fp8_act

    _e, k, _hidden, inter = V4_FLASH
    (gq, gs), (dq, ds) = w["gate_up"]["fp8"], w["down"]["fp8"]
    for t, lay in layouts.items():
        g = torch.Generator("cuda").manual_seed(t)
        h = torch.randn(t * k, inter, generator=g, device="cuda").bfloat16()
        # gate/up reads each pair's token row, down one row per pair
        gate_up = (triton_fp8_act.quantize_act(lay["x"]), k, gq, gs)
        down = (triton_fp8_act.quantize_act(h), 1, dq, ds)
        pair_rows = [grouped_row(dg, lay, "gate_up", *gate_up), grouped_row(dg, lay, "down", *down)]
        rows += [*pair_rows, sum_row(t, pair_rows), moe_step_row(dg, lay, (gq, gs, dq, ds))]
    return rows


def grouped_row(
    dg: Any,
    lay: dict[str, Any],
    name: str,
    act: tuple[torch.Tensor, torch.Tensor],
    per: int,
    wq: torch.Tensor,
    ws: torch.Tensor,
) -> dict[str, Any]:
    """One grouped GEMM on both kernels, each on its routing layout: row i of the layout reads
    act's row pair_of_row[i] // per."""
    from stages.kernels import triton_moe_fp8
    from stages.kernels.moe_routing import contiguous_layout
    from stages.kernels.triton_gemm import num_sms

    t, pairs = lay["x"].shape[0], lay["ids"].numel()
    n, k = wq.shape[1:]
    flops = 2.0 * pairs * n * k
    row: dict[str, Any] = {"tokens": t, "pairs": pairs, "gemm": name, "N": n, "K": k}
    r, (_bm, warps, stages) = lay["triton"], lay["tiles"]
    q, qs = gather(*act, r.pair_of_row.clamp(min=0).long() // per)

    def ours() -> torch.Tensor:
        cfg = dict(num_warps=warps, num_stages=stages)
        return triton_moe_fp8.grouped_gemm(q, qs, wq, ws, r, num_sms("cuda"), torch.bfloat16, **cfg)

    row["triton-persistent"] = {**rate(flops, ours), "block_m": r.block_m, "rows": q.shape[0]}
    want = by_pair(ours(), r.pair_of_row, pairs)
    rd, used = lay["deepgemm"], lay["used"]
    qd, qds = gather(*act, rd.pair_of_row.clamp(min=0).long() // per)
    m_idx = contiguous_layout(rd.pair_of_row, rd.tile_expert, rd.block_m)
    c = torch.empty(qd.shape[0], n, dtype=torch.bfloat16, device="cuda")
    try:  # DeepGEMM's own transpose of the activation scales to MN-major, TMA-aligned
        sfa = dg.get_mn_major_tma_aligned_tensor(qds)
        sfa_used = dg.get_mn_major_tma_aligned_tensor(qds[:used].contiguous())
    except Exception as err:
        row["deepgemm"] = failed(err)
        print(json.dumps(row), flush=True)
        return row
    runs = {
        "deepgemm": (lambda: _dg_call(dg, "grouped", (qd, sfa), (wq, ws), c, m_idx), qd.shape[0]),
        "deepgemm-trimmed": (
            lambda: _dg_call(
                dg, "grouped", (qd[:used], sfa_used), (wq, ws), c[:used], m_idx[:used]
            ),
            used,
        ),
    }
    for label, (fn, n_rows) in runs.items():
        row[label] = first_call(fn)
        if "error" not in row[label]:
            row[label].update(rate(flops, fn), block_m=rd.block_m, rows=n_rows)
    if "error" not in row["deepgemm"]:
        row["deepgemm_vs_triton"] = errors(by_pair(c, rd.pair_of_row, pairs), want)
    print(json.dumps(row), flush=True)
    return row


def sum_row(t: int, gemm_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Both grouped GEMMs of a chunk together, per kernel."""
    pairs = gemm_rows[0]["pairs"]
    flops = sum(2.0 * pairs * r["N"] * r["K"] for r in gemm_rows)
    row: dict[str, Any] = {"tokens": t, "pairs": pairs, "gemm": "gate_up + down"}
    for label in ("triton-persistent", "deepgemm", "deepgemm-trimmed"):
        us = [r.get(label, {}).get("us") for r in gemm_rows]
        if all(u is not None for u in us):
            row[label] = rate_of(flops, sum(us) / 1e3)
    print(json.dumps(row), flush=True)
    return row


def moe_step_row(dg: Any, lay: dict[str, Any], w8: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """The whole routed-expert step (bf16 in, bf16 out) on each moe_experts_fp8 backend: the
    same bits expected (deepgemm_vs_triton's rel_err 0)."""
    from stages.kernels import deepgemm_moe, triton_moe_fp8

    _e, k, hidden, inter = V4_FLASH
    gq, gs, dq, ds = w8
    x, ids, wt = lay["x"], lay["ids"], lay["wt"]
    t = x.shape[0]
    flops = 2.0 * t * k * 3 * hidden * inter
    fns: dict[str, Callable[[], torch.Tensor]] = {
        "triton-persistent": lambda: triton_moe_fp8.moe_experts(x, gq, gs, dq, ds, ids, wt),
        "deepgemm": lambda: deepgemm_moe.moe_experts(x, gq, gs, dq, ds, ids, wt),
    }
    row: dict[str, Any] = {"tokens": t, "pairs": t * k, "moe_step": "bf16 -> bf16"}
    for label, fn in fns.items():
        row[label] = first_call(fn)
        if "error" not in row[label]:
            row[label].update(rate(flops, fn))
    if all("error" not in row[label] for label in fns):
        ours, theirs = (fn() for fn in fns.values())
        row["deepgemm_vs_triton"] = errors(theirs, ours)
        row["same_bits"] = bool(torch.equal(ours.view(torch.int16), theirs.view(torch.int16)))
    print(json.dumps(row), flush=True)
    return row


def dense_rows(dg: Any, rows: list[Any], chunks: tuple[int, ...] = CHUNKS) -> list[Any]:
    """Appends to rows fp8.py's V4 linears at M = each chunk: the GEMMs alone on the same FP8
    operands, and from bf16 (the activations' quantizer included)."""
    from stages.kernels import fp8_gemm, triton_fp8_act, triton_gemm
    from stages.kernels.triton_gemm import num_sms

    for m in chunks:
        for name, n, k in V4_DECODE_LINEARS:
            g = torch.Generator("cuda").manual_seed(m + n + k)
            x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
            wq, ws = fp8_ref.quantize_weight(torch.randn(n, k, generator=g, device="cuda") / 30)
            q, s = triton_fp8_act.quantize_act(x)
            ref = fp8_ref.dequantize_act(q, s) @ fp8_ref.dequantize_weight(wq, ws).T
            flops = 2.0 * m * n * k
            out, d = (torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            wsf = ws.float().contiguous()

            def ours() -> None:
                triton_gemm.launch_ptr(q, wq, None, out, num_sms("cuda"), fp8_gemm.TILES, s, wsf)

            # our quantizer writes the scales MN-major (group_major), the layout DeepGEMM reads
            # on SM90 (its get_mn_major_tma_aligned_tensor returns them as they are)
            qg, sg = triton_fp8_act.quantize_act(x, rows_multiple=4, group_major=True)

            def dg_gemm() -> None:
                _dg_call(dg, "dense", (qg, sg), (wq, ws), d[: qg.shape[0]])

            def dg_bf16_in() -> None:
                qq, ss = triton_fp8_act.quantize_act(x, rows_multiple=4, group_major=True)
                _dg_call(dg, "dense", (qq, ss), (wq, ws), d[: qq.shape[0]])

            row: dict[str, Any] = {"layer": name, "M": m, "N": n, "K": k}
            tri = row["triton-persistent"] = {"gemm": rate(flops, ours)}
            ours_ok = "error" not in tri["gemm"]
            tri.update(errors(out, ref) if ours_ok else {})
            tri["bf16_in"] = rate(flops, lambda: fp8_gemm.linear(x, wq, ws))
            scaled_mm = rate(flops, lambda: fp8_gemm.linear_scaled_mm(x, wq, ws))
            row["scaled-mm"] = {"bf16_in": scaled_mm}
            theirs = row["deepgemm"] = first_call(dg_gemm)
            if "error" not in theirs:
                theirs.update(gemm=rate(flops, dg_gemm), **errors(d, ref))
                theirs.update({"vs_triton": errors(d, out)} if ours_ok else {})
                theirs["bf16_in"] = rate(flops, dg_bf16_in)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """DeepGEMM's TFLOP/s beside our Triton kernel's per shape (the grouped GEMMs together, the
    MoE step from bf16, each dense GEMM alone) and how many times faster DeepGEMM is."""
    picks = []
    for r in result.get("moe", []):
        if r.get("gemm") == "gate_up + down" or "moe_step" in r:
            what = f"moe {r.get('gemm', 'step')} @ {r['tokens']}"
            picks.append((what, r.get("deepgemm"), r["triton-persistent"]))
    for r in result.get("dense", []):
        what = f"dense {r['layer']} M={r['M']}"
        picks.append((what, r["deepgemm"].get("gemm"), r["triton-persistent"]["gemm"]))
    out = []
    for what, theirs, ours in picks:
        dg_tf, our_tf = (theirs or {}).get("tflops"), ours.get("tflops")
        entry: dict[str, Any] = {"what": what, "deepgemm": dg_tf, "triton": our_tf}
        if dg_tf and our_tf:
            entry["deepgemm_speedup"] = round(dg_tf / our_tf, 2)
        out.append(entry)
    return out


def jit_warmup(jobs: list[JitJob], workers: int) -> dict[str, Any]:
    """Compiles DeepGEMM's kernels for `jobs` in worker processes (nvcc runs one per kernel;
    the JIT's on-disk cache, DG_JIT_CACHE_DIR, serves the timings after)."""
    start = time.perf_counter()
    if workers <= 0 or not jobs:
        return {"workers": 0}
    workers = min(workers, len(jobs))
    try:
        ctx = torch.multiprocessing.get_context("spawn")
        # by its module's name: under `python -m` this module is __main__ (a worker's is not)
        job = importlib.import_module("app.bench.deepgemm").warm_job
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            each = list(pool.map(job, jobs))
    except Exception as err:  # the timings then compile at their first call
        return {"jobs": len(jobs), **failed(err)}
    wall = round(time.perf_counter() - start, 1)
    return {"jobs": len(jobs), "workers": workers, "wall_s": wall, "max_job_s": round(max(each), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    p.add_argument("--jit-workers", type=int, default=min(12, os.cpu_count() or 1))
    p.add_argument("--skip-moe", action="store_true")
    p.add_argument("--skip-dense", action="store_true")
    a = p.parse_args(argv)
    result: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}

    def save() -> None:  # after each part: a run cut short keeps what it measured
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)

    dg, result["deep_gemm"] = load_deep_gemm()
    print(json.dumps(result["deep_gemm"]), flush=True)
    if dg is not None and torch.cuda.is_available():
        result["probe"] = probe_kernel()
        print(json.dumps({"probe": result["probe"]}), flush=True)
        save()
        if not result["probe"]["ok"]:
            result["error"] = "DeepGEMM's probe kernel did not run (see probe)"
            save()
            return 1
        result["device"] = torch.cuda.get_device_name()
        result["peak_tflops"] = {
            "fp8_datasheet": H200_FP8_PEAK_TFLOPS,
            "fp8_model_cost": H200_FP8_TFLOPS,
        }
        result["moe_shape"] = dict(zip(("experts", "top_k", "hidden", "width"), V4_FLASH))
        try:
            layouts = moe_layouts(dg, CHUNKS)
            skip = {"dense"} if a.skip_dense else set()
            skip |= {"grouped"} if a.skip_moe else set()
            jobs = [job for job in jit_jobs(layouts) if job[0] not in skip]
            result["jit_warmup"] = jit_warmup(jobs, a.jit_workers)
            print(json.dumps({"jit_warmup": result["jit_warmup"]}), flush=True)
            save()
            if not a.skip_moe:
                w = experts(V4_FLASH, formats=("fp8",))
                moe_rows(dg, layouts, w, result.setdefault("moe", []))
                del w
                save()
            if not a.skip_dense:
                dense_rows(dg, result.setdefault("dense", []))
        except Exception as err:  # what was measured before it stays in the JSON and the log
            result["error"] = f"{type(err).__name__}: {err}"[:2000]
        result["summary"] = summary(result)
        print(json.dumps({"summary": result["summary"]}), flush=True)
    elif dg is not None:
        result["error"] = "no CUDA device"
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
