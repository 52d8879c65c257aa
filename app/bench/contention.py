"""Kernel-level contention table (docs/ARCHITECTURE.md#why-the-output-channel-matters), and the
Triton GEMM tuning sweep.

On rank 1 of a 2-process NCCL group, each kernel is timed alone and then with one NCCL irecv
pending on the same GPU (posted before the timed loop; rank 0 issues the matching send only after
rank 1 has finished timing). Times come from CUDA events around each launch; the table reports
medians of ``--iters`` launches per round and of all rounds pooled. The device is never
synchronised while the recv is posted (only the last timing event is waited on).

    python -m app.bench.contention --out docs/bench/contention.json
    python -m app.bench.contention --tune docs/bench/triton_gemm_tuning.json

Standalone: imports torch, triton and stages.kernels.triton_gemm only (no Ray). Needs 2 GPUs for
the contention table, 1 for the sweep. NCCL_NVLS_ENABLE=0 is kept (set if absent).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

from stages.kernels import triton_gemm as tg

# Llama-3-8B linear layers: name -> (N, K) of weight [N, K].
LLAMA8B_LINEARS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
TOKENS = (4096, 8192)
TUNE_MEDIUM_M = 512
SDPA_TOKENS, SDPA_HEADS, SDPA_HEAD_DIM = 16384, 32, 128


def _command() -> str:
    return "python -m app.bench.contention " + " ".join(sys.argv[1:])


def _environment() -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    return {
        "gpu": props.name,
        "gpu_count": torch.cuda.device_count(),
        "sm_count": props.multi_processor_count,
        "compute_capability": f"{props.major}.{props.minor}",
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        "python": sys.version.split()[0],
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
        "PPSERVE_TRITON_GEMM_TUNING": os.environ.get("PPSERVE_TRITON_GEMM_TUNING"),
    }


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float(((out - ref).norm() / ref.norm()).item())


# ---------------------------------------------------------------------------------------------
# Tuning sweep (one GPU)


def candidate_configs(m: int) -> list[tg.GemmConfig]:
    c = tg.GemmConfig
    configs = [
        c(128, 256, 64, 8, 3, 8),
        c(128, 256, 64, 16, 3, 8),
        c(128, 256, 64, 8, 4, 8, subtile=True),
        c(128, 256, 64, 8, 3, 8, subtile=True),
        c(256, 128, 64, 8, 3, 8),
        c(128, 128, 64, 8, 4, 8),
        c(128, 128, 64, 8, 4, 4),
        c(128, 128, 128, 8, 3, 8),
        c(128, 256, 64, 8, 3, 8, warp_specialize=True),
        c(128, 256, 64, 8, 3, 8, tma=False),
    ]
    if m < 1024:
        configs += [c(64, 256, 64, 8, 4, 4), c(64, 128, 64, 8, 4, 4)]
    return configs


def tune(path: str) -> dict[str, Any]:
    import triton.testing

    dev = torch.device("cuda", 0)
    sms = tg.num_sms(dev)
    shapes = [("gemm8192", 8192, 8192, 8192)]
    shapes += [(name, m, n, k) for m in TOKENS for name, (n, k) in LLAMA8B_LINEARS.items()]
    shapes += [(name, TUNE_MEDIUM_M, n, k) for name, (n, k) in LLAMA8B_LINEARS.items()]
    report: dict[str, Any] = {"command": _command(), "environment": _environment(), "grid": sms,
              "timing": "triton.testing.do_bench median (warmup 25 ms, rep 100 ms, L2 flushed)",
              "check": "rel. Frobenius error vs cuBLAS bf16 output < 1e-2",
              "shapes": [], "best": []}
    torch.manual_seed(0)
    for name, m, n, k in shapes:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, w)
        flops = 2.0 * m * n * k
        def cublas(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
            return F.linear(x, w)

        cublas_ms = [triton.testing.do_bench(cublas, return_mode="median")]
        rows: list[dict[str, Any]] = []
        for cfg in candidate_configs(m):
            out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
            row: dict[str, Any] = {"config": cfg.as_dict()}
            try:
                tg.launch(x, w, None, out, sms, cfg)
                torch.cuda.synchronize()
                row["rel_err"] = _rel_err(out, ref)
                if row["rel_err"] < 1e-2:
                    def run(x: torch.Tensor = x, w: torch.Tensor = w, out: torch.Tensor = out,
                            cfg: tg.GemmConfig = cfg) -> Any:
                        return tg.launch(x, w, None, out, sms, cfg)

                    ms = triton.testing.do_bench(run, return_mode="median")
                    row["ms"] = ms
                    row["tflops"] = flops / ms / 1e9
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is data
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
        cublas_ms.append(triton.testing.do_bench(cublas, return_mode="median"))
        timed = [r for r in rows if "ms" in r]
        best = min(timed, key=lambda r: r["ms"]) if timed else None
        cub = statistics.median(cublas_ms)
        entry = {"name": name, "M": m, "N": n, "K": k, "cublas_ms": cublas_ms,
                 "cublas_tflops": flops / cub / 1e9, "configs": rows}
        report["shapes"].append(entry)
        if best is not None:
            report["best"].append({"name": name, "M": m, "N": n, "K": k, "config": best["config"],
                                   "ms": best["ms"], "tflops": best["tflops"],
                                   "cublas_ms": cub, "vs_cublas": cub / best["ms"]})
            print(f"{name:9s} M={m:5d} N={n:5d} K={k:5d}  cuBLAS {cub:.3f} ms "
                  f"({flops / cub / 1e9:.0f} TF/s)  best triton {best['ms']:.3f} ms "
                  f"({best['tflops']:.0f} TF/s) {best['config']}", flush=True)
        for r in rows:
            print(f"    {r.get('ms', float('nan')):.3f} ms err={r.get('rel_err', -1):.2e} "
                  f"{r['config']} {r.get('error', '')}", flush=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        del x, w, ref
        torch.cuda.empty_cache()
    return report


# ---------------------------------------------------------------------------------------------
# Contention table (two processes, NCCL)


BACKENDS = ("cublas", "triton", "triton-sm1")  # triton: grid = SMs; triton-sm1: SMs - 1


def _cases() -> list[tuple[str, str, int, int, int]]:
    """(name, backend, M, N, K) of every case, in the order both ranks walk them."""
    shapes = [("gemm8192", 8192, 8192, 8192)]
    shapes += [(f"{layer}_m{m}", m, n, k) for m in TOKENS
               for layer, (n, k) in LLAMA8B_LINEARS.items()]
    cases = [(f"{b}_{label}", b, m, n, k) for label, m, n, k in shapes for b in BACKENDS]
    sdpa = (SDPA_TOKENS, SDPA_HEADS, SDPA_HEAD_DIM)
    cases.append(("sdpa_flash_causal_16k_32h", "sdpa-flash", *sdpa))
    cases.append(("sdpa_default_causal_16k_32h", "sdpa-default", *sdpa))  # torch's own pick
    return cases


def _build_case(backend: str, m: int, n: int, k: int,
                dev: torch.device) -> tuple[Callable[[], torch.Tensor], float, dict[str, Any]]:
    """Return (fn, flops, info) for one case of _cases()."""
    if backend.startswith("sdpa"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        shape = (1, n, m, k)  # batch, heads, tokens, head dim
        q, kk, v = (torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(3))
        def sdpa() -> torch.Tensor:
            if backend == "sdpa-default":
                return F.scaled_dot_product_attention(q, kk, v, is_causal=True)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, kk, v, is_causal=True)

        flops = 4.0 * n * m * m * k / 2  # QK^T and PV, half of the square (causal)
        return sdpa, flops, {"shape": list(shape), "backend": backend, "causal": True}
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    info: dict[str, Any] = {"M": m, "N": n, "K": k, "backend": backend}
    fn: Callable[[], torch.Tensor]
    if backend == "cublas":
        fn = functools.partial(F.linear, x, w)
    else:
        sm1 = backend == "triton-sm1"
        fn = (lambda: tg.linear_sm1(x, w)) if sm1 else (lambda: tg.linear(x, w))
        info["grid"] = tg.num_sms(dev) - (1 if sm1 else 0)
        info["config"] = tg.pick_config(m, n, k).as_dict()
        info["rel_err_vs_cublas"] = _rel_err(fn(), F.linear(x, w))
    return fn, 2.0 * m * n * k, info


def _time(fn: Callable[[], object], iters: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    ends[-1].synchronize()  # an event wait, not a device synchronisation
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _worker(rank: int, port: int, iters: int, rounds: int, result_path: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=600))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=dev)
    msg = torch.zeros(64, dtype=torch.int64, device=dev)  # 512 bytes: a microbatch's token ids
    if rank == 0:
        dist.send(msg + 1, dst=1)
    else:
        dist.recv(msg, src=0)
    torch.cuda.synchronize()
    results = []
    torch.manual_seed(1)
    for i, (name, backend, m, n, k) in enumerate(_cases()):
        if rank == 0:
            for r in range(rounds):
                store.get(f"go/{i}/{r}")  # blocks until rank 1 has finished timing
                dist.send(msg + r, dst=1)
            continue
        fn, flops, info = _build_case(backend, m, n, k, dev)
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        alone, contended, pending = [], [], []
        for r in range(rounds):
            alone.append(_time(fn, iters))
            req = dist.irecv(msg, src=0)
            if req is None:
                raise RuntimeError("irecv gave no work handle")
            time.sleep(0.002)  # let the recv kernel reach the GPU before the timed launches
            contended.append(_time(fn, iters))
            pending.append(not req.is_completed())
            store.set(f"go/{i}/{r}", "1")
            req.wait()
            torch.cuda.synchronize()
        a = statistics.median(t for ts in alone for t in ts)
        c = statistics.median(t for ts in contended for t in ts)
        row = {"name": name, **info, "flops": flops, "iters": iters, "rounds": rounds,
               "alone_ms": a, "contended_ms": c, "ratio": c / a,
               "alone_ms_rounds": [statistics.median(ts) for ts in alone],
               "contended_ms_rounds": [statistics.median(ts) for ts in contended],
               "alone_tflops": flops / a / 1e9, "recv_pending_during_timing": pending}
        results.append(row)
        print(f"{name:30s} alone {a:7.3f} ms  with pending recv {c:7.3f} ms  x{c / a:.2f}  "
              f"rounds {row['alone_ms_rounds']} / {row['contended_ms_rounds']} "
              f"pending={pending}", flush=True)
        del fn
        torch.cuda.empty_cache()
    if rank == 1:
        with open(result_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def contention(out: str, iters: int, rounds: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        raise SystemExit("the contention table needs 2 GPUs (one NCCL send/recv pair)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    tmp = out + ".rank1.tmp"
    mp.spawn(_worker,  # type: ignore[attr-defined,no-untyped-call]
             args=(_free_port(), iters, rounds, tmp), nprocs=2, join=True)
    with open(tmp) as f:
        rows = json.load(f)
    os.remove(tmp)
    by_name = {r["name"]: r for r in rows}
    speed = []
    for label in ["gemm8192"] + [f"{layer}_m{m}" for m in TOKENS for layer in LLAMA8B_LINEARS]:
        cub, tri = by_name[f"cublas_{label}"], by_name[f"triton_{label}"]
        speed.append({"shape": label, "M": cub["M"], "N": cub["N"], "K": cub["K"],
                      "cublas_ms": cub["alone_ms"], "triton_ms": tri["alone_ms"],
                      "cublas_tflops": cub["alone_tflops"], "triton_tflops": tri["alone_tflops"],
                      "triton_vs_cublas": cub["alone_ms"] / tri["alone_ms"]})
    report = {"command": _command(), "environment": _environment(),
              "method": ("rank 1 of a 2-process NCCL group; CUDA events around each launch; "
                         f"median of {iters} launches x {rounds} rounds, alone then with one "
                         "pending 512-byte irecv whose send is issued after timing"),
              "cases": rows, "persistent_vs_cublas": speed}
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{'kernel on the receiving GPU':32s} {'alone':>9s} {'w/ recv':>9s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['name']:32s} {r['alone_ms']:8.3f}ms {r['contended_ms']:8.3f}ms "
              f"x{r['ratio']:.2f}")
    print(f"\n{'shape':12s} {'cuBLAS TF/s':>11s} {'Triton TF/s':>11s} {'speed':>6s}")
    for s in speed:
        print(f"{s['shape']:12s} {s['cublas_tflops']:11.0f} {s['triton_tflops']:11.0f} "
              f"{s['triton_vs_cublas']:6.2f}")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the contention table's JSON here")
    parser.add_argument("--tune", metavar="PATH", help="run the Triton GEMM sweep, JSON here")
    parser.add_argument("--iters", type=int, default=30, help="timed launches per round")
    parser.add_argument("--rounds", type=int, default=2, help="alone/contended rounds")
    args = parser.parse_args(argv)
    if not tg.is_available("cuda"):
        raise SystemExit("needs CUDA and triton")
    if args.tune:
        tune(args.tune)
    if args.out:
        contention(args.out, args.iters, args.rounds)
    if not (args.tune or args.out):
        parser.error("give --out PATH.json and/or --tune PATH.json")


if __name__ == "__main__":
    main()
