"""Chunk-attention probe: which kernel runs a prefill chunk's bottom-right causal attention fastest.

A chunk of t queries at the end of an L-token prefix (Llama-3-8B heads: 32 query, 8 KV, dim 128)
is timed with every way PyTorch offers on this host, against the whole-prompt square (t == L):
  ref        the engine's reference until 96f2282: KV heads repeated, SDPA with a lower-right
             causal mask (PyTorch runs it on FlashAttention-2)
  sdpa-lower-right-gqa   today's reference (torch_ref.attention): the same, KV heads shared
  split-*    the prefix part (no mask) and the diagonal square (top-left causal == bottom-right
             when square) as two calls, merged by their log-sum-exp; * = cudnn or flash;
             split-cudnn-gqa is the engine's CUDA default (cudnn_attention.split_attention)
  square-*   t == L with is_causal (what PP=1's whole prompt runs), per SDPA backend
Each output is checked against `ref` (max abs diff). Prints a table, writes JSON.

    python -m app.bench.attention --out attention.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from app.bench.standin import CYCLES_PER_MS
from stages.kernels import cudnn_attention, torch_ref

HQ, HKV, D = 32, 8, 128
# (q [t,Hq,D], k [L,Hkv,D], v [L,Hkv,D], scale) -> [t,Hq,D]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
CASES = [(4096, 8192), (4096, 32768), (8192, 16384), (8192, 65536), (8192, 131072)]
SQUARES = [8192, 16384, 32768]


def cuda_median_ms(fn: Callable[[], object], reps: int = 5, spin_ms: float = 0.0) -> float:
    """Median milliseconds of fn() over reps, CUDA events, after one warm-up call. spin_ms: each
    timing starts behind a spin that long on the stream (torch.cuda._sleep), so the host has
    queued the whole call before the clock starts: the GPU's time, not the launch's."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if spin_ms:
            torch.cuda._sleep(int(spin_ms * CYCLES_PER_MS))
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(statistics.median(times))


def _bhld(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [L, H, D] -> [1, H, L, D]


def _repeat(k: torch.Tensor) -> torch.Tensor:
    return k.repeat_interleave(HQ // k.shape[1], dim=1)


def sdpa_repeat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    from torch.nn.attention.bias import causal_lower_right

    t, length = q.shape[0], k.shape[0]
    out = F.scaled_dot_product_attention(
        _bhld(q),
        _bhld(_repeat(k)),
        _bhld(_repeat(v)),
        attn_mask=causal_lower_right(t, length),
        scale=scale,
    )
    return out[0].transpose(0, 1)


def _op_with_lse(
    kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [1,H,t,D], lse [1,H,t]) from the aten op that returns the log-sum-exp."""
    if kind == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
    out, lse = res[0], res[1]
    return out, lse.reshape(out.shape[:3]).float()


def split_variant(kind: str) -> Attention:
    """The split with KV heads repeated, on cuDNN or flash (variants the engine did not take)."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        t, length = q.shape[0], k.shape[0]
        q_, k_, v_ = _bhld(q), _bhld(_repeat(k)), _bhld(_repeat(v))
        diag, diag_lse = _op_with_lse(
            kind, q_, k_[:, :, length - t :], v_[:, :, length - t :], True, scale
        )
        if length == t:
            return diag[0].transpose(0, 1)
        pre, pre_lse = _op_with_lse(
            kind, q_, k_[:, :, : length - t], v_[:, :, : length - t], False, scale
        )
        out = cudnn_attention.merge_partials(pre, pre_lse, diag, diag_lse)
        return out.to(q.dtype)[0].transpose(0, 1)

    return run


def square(backend: SDPBackend | None) -> Attention:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        with sdpa_kernel([backend]) if backend is not None else nullcontext():
            out = F.scaled_dot_product_attention(
                _bhld(q), _bhld(_repeat(k)), _bhld(_repeat(v)), is_causal=True, scale=scale
            )
        return out[0].transpose(0, 1)

    return run


def flex_factory() -> Attention:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks: dict[tuple[int, int], Any] = {}

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        t, length = q.shape[0], k.shape[0]
        if (t, length) not in masks:
            off = length - t
            masks[(t, length)] = create_block_mask(
                lambda b, h, qi, ki: qi + off >= ki, None, None, t, length, device=q.device
            )
        out = compiled(
            _bhld(q),
            _bhld(k),
            _bhld(v),
            block_mask=masks[(t, length)],
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--flex", action="store_true", help="also time FlexAttention (compiles)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    scale = D**-0.5
    methods = {
        "ref": sdpa_repeat,
        "sdpa-lower-right-gqa": torch_ref.attention,
        "split-cudnn": split_variant("cudnn"),
        "split-cudnn-gqa": cudnn_attention.split_attention,
        "split-flash": split_variant("flash"),
    }
    if args.flex:
        methods["flex"] = flex_factory()
    rows = []
    shapes = [(t, L) for t, L in CASES] + [(L, L) for L in SQUARES]
    for t, length in shapes:
        q = torch.randn(t, HQ, D, device=dev, dtype=dt)
        k = torch.randn(length, HKV, D, device=dev, dtype=dt)
        v = torch.randn(length, HKV, D, device=dev, dtype=dt)
        ref = sdpa_repeat(q, k, v, scale)
        cands = dict(methods)
        if t == length:
            for name, be in (
                ("square-default", None),
                ("square-flash", SDPBackend.FLASH_ATTENTION),
                ("square-cudnn", SDPBackend.CUDNN_ATTENTION),
                ("square-efficient", SDPBackend.EFFICIENT_ATTENTION),
            ):
                cands[name] = square(be)
        flops = 4 * HQ * D * t * (length - t + (t + 1) / 2)
        for name, fn in cands.items():
            row = {"t": t, "L": length, "method": name}
            try:
                out = fn(q, k, v, scale)
                row["max_abs_diff"] = float((out.float() - ref.float()).abs().max())
                ms = cuda_median_ms(lambda: fn(q, k, v, scale))
                row["ms"] = round(ms, 3)
                row["tflops"] = round(flops / ms / 1e9, 1)
            except Exception as e:  # a backend that refuses this shape is a finding, not a crash
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "hardware": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "command": "python -m app.bench.attention " + " ".join(argv or sys.argv[1:]),
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
