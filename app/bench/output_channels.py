"""Output channels on one GPU (issue 25, item 3): what each candidate's pending wait costs the
kernels of another stream, and the latency each adds to a PP=1 decode step.

Contention: FlashMLA's sparse FP8 decode, the persistent Triton GEMM (grid = SMs) and cuBLAS
are timed alone; with the one-CTA spin on a side stream (the stand-in for a pending NCCL recv,
docs/ARCHITECTURE.md#why-the-output-channel-matters); and with the copy channel's pending
wait: a side stream waits on an interprocess CUDA event that is recorded behind a long pinned
host-to-device copy (a copy engine busy, no SM), with the consumer's scatter queued behind the
wait. "blocked" says whether the measured kernel had to wait for that event. The host channel
leaves nothing pending on the device (its row is "alone"). cuStreamWaitValue32 is not
measured: the earlier probe ruled it out (it kept another stream's persistent GEMM from
finishing: docs/ARCHITECTURE.md#why-the-output-channel-matters).

Decode step: 64 rows through two 4096² bf16 layers, a 32K-vocabulary head and argmax; the ids
reach the next step's input by a local scatter (today's PP=1), by the copy channel's path
(cudaMemcpyAsync into a ring slot, an interprocess event recorded and waited on, the scatter),
or by the host (ids read back, the next input copied up from pinned memory). NCCL cannot run
two ranks on one GPU: its figure is the 2-GPU send/recv pair of
docs/ARCHITECTURE.md#why-the-output-channel-matters.

    python -m app.bench.output_channels --out docs/bench/output_channels.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from app.bench.standin import PendingRecvStandin, median_ms
from app.bench.target import environment

SPIN_MS = 40  # outlasts every timed kernel
PENDING_COPY_BYTES = 2 << 30  # ~40 ms at PCIe speed: the copy channel's wait stays pending


class _Pending:
    """The waits each candidate leaves pending on other streams while a kernel runs."""

    def __init__(self) -> None:
        self.standin = PendingRecvStandin()
        self.side = torch.cuda.Stream()
        self.copier = torch.cuda.Stream()
        self.host = torch.empty(PENDING_COPY_BYTES, dtype=torch.uint8).pin_memory()
        self.dev = torch.empty(PENDING_COPY_BYTES, dtype=torch.uint8, device="cuda")
        self.ring = torch.zeros(64, dtype=torch.long, device="cuda")
        self.next_tokens = torch.zeros(256, dtype=torch.long, device="cuda")
        self.slots = torch.arange(64, device="cuda")

    def spin(self) -> torch.cuda.Event:
        """One CTA spinning on a side stream: a pending NCCL recv's footprint
        (docs/ARCHITECTURE.md#why-the-output-channel-matters)."""
        return self.standin.post(SPIN_MS)

    def copy_engine_only(self) -> torch.cuda.Event:
        """The control of copy_wait: the same copy-engine transfer, nobody waiting on it."""
        done = torch.cuda.Event(interprocess=True)
        with torch.cuda.stream(self.copier):
            self.dev.copy_(self.host, non_blocking=True)
            done.record()
        return done

    def copy_wait(self) -> torch.cuda.Event:
        """The copy channel's consumer: a stream waiting on an interprocess event that the
        producer records late (here behind a long copy-engine transfer), then the scatter."""
        ready = torch.cuda.Event(interprocess=True)
        with torch.cuda.stream(self.copier):
            self.dev.copy_(self.host, non_blocking=True)
            ready.record()
        with torch.cuda.stream(self.side):
            self.side.wait_event(ready)
            self.next_tokens[self.slots] = self.ring
        return ready


def _kernels() -> dict[str, Callable[[], object]]:
    from stages.kernels import flash_mla, fp8_latent, triton_gemm

    g = torch.Generator(device="cuda").manual_seed(0)
    cases: dict[str, Callable[[], object]] = {}
    if flash_mla.is_available("cuda"):
        for rows, keys in ((1024, 16384), (512, 32768)):
            q = torch.randn(rows, 128, 576, generator=g, device="cuda").bfloat16()
            latent = (torch.randn(keys, 576, generator=g, device="cuda") / 4).bfloat16()
            pages = fp8_latent.quantize(latent).view(-1, 64, 1, fp8_latent.BYTES)
            idx = torch.randint(
                0, keys, (rows, 2048), generator=g, device="cuda", dtype=torch.int32
            )
            state: dict[str, Any] = {}
            name = (
                f"FlashMLA sparse FP8 decode, {rows} rows x top-2048 of {keys // 1024}K, 128 heads"
            )
            cases[name] = functools.partial(
                flash_mla.mla_sparse_fp8_decode, q, pages, idx, 512, 192**-0.5, state
            )
    a = torch.randn(8192, 8192, generator=g, device="cuda").bfloat16()
    w = torch.randn(8192, 8192, generator=g, device="cuda").bfloat16()
    if triton_gemm.is_available("cuda"):
        cases["Triton persistent GEMM 8192^3, grid = SMs"] = lambda: triton_gemm.linear(a, w)
    cases["cuBLAS GEMM 8192^3"] = lambda: a @ w.T
    return cases


def contention(reps: int) -> list[dict[str, Any]]:
    pending = _Pending()
    rows: list[dict[str, Any]] = []
    for name, fn in _kernels().items():
        alone = median_ms(fn, None, reps)
        spin = median_ms(fn, pending.spin, reps)
        copy = median_ms(fn, pending.copy_wait, reps)
        engine = median_ms(fn, pending.copy_engine_only, reps)
        row = {
            "kernel": name,
            "alone_ms": alone["ms"],
            "one_cta_spin_ms": spin["ms"],
            "one_cta_spin_x": round(spin["ms"] / alone["ms"], 3),
            "copy_wait_ms": copy["ms"],
            "copy_wait_x": round(copy["ms"] / alone["ms"], 3),
            "copy_wait_finished_while_pending": copy["covered"],
            "copy_engine_only_ms": engine["ms"],
            "copy_engine_only_x": round(engine["ms"] / alone["ms"], 3),
            "host_ms": alone["ms"],
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


class _DecodeStep:
    """A PP=1 decode step's shape: ids -> embedding -> 2 layers -> head -> argmax."""

    def __init__(self, rows: int = 64, hidden: int = 4096, vocab: int = 32768) -> None:
        g = torch.Generator(device="cuda").manual_seed(1)
        self.embed = torch.randn(vocab, hidden, generator=g, device="cuda").bfloat16()
        self.layers = [
            torch.randn(hidden, hidden, generator=g, device="cuda").bfloat16() / 64
            for _ in range(2)
        ]
        self.head = torch.randn(vocab, hidden, generator=g, device="cuda").bfloat16()
        self.slots = torch.arange(rows, device="cuda")
        self.next_tokens = torch.zeros(256, dtype=torch.long, device="cuda")
        self.ring = torch.zeros(64, 256, dtype=torch.long, device="cuda")
        self.ready = [torch.cuda.Event(interprocess=True) for _ in range(64)]
        self.consumed = [torch.cuda.Event(interprocess=True) for _ in range(64)]
        self.plain_ready = [torch.cuda.Event() for _ in range(64)]
        self.plain_consumed = [torch.cuda.Event() for _ in range(64)]
        self.pinned = torch.zeros(rows, dtype=torch.long).pin_memory()
        self.rows = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed[ids]
        for w in self.layers:
            h = torch.nn.functional.silu(h @ w.T)
        return (h @ self.head.T).argmax(-1)

    def loop(self, channel: str, steps: int) -> float:
        """ms per step over `steps` dependent steps (CUDA events around the loop)."""
        ids = self.next_tokens[self.slots]
        stream = torch.cuda.current_stream()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for t in range(steps):
            out = self.forward(ids)
            if channel == "local":
                self.next_tokens[self.slots] = out
            elif channel.startswith("copy"):
                slot = t % 64
                ready, consumed = self.ready[slot], self.consumed[slot]
                if channel == "copy, plain events":
                    ready, consumed = self.plain_ready[slot], self.plain_consumed[slot]
                if channel != "copy, no events":
                    stream.wait_event(consumed)
                if channel == "copy, by a kernel":
                    torch.add(out, 0, out=self.ring[slot, : self.rows])
                else:
                    self.ring[slot, : self.rows].copy_(out, non_blocking=True)
                if channel != "copy, no events":
                    ready.record(stream)
                    stream.wait_event(ready)
                self.next_tokens[self.slots] = self.ring[slot, : self.rows]
                if channel != "copy, no events":
                    consumed.record(stream)
            elif channel == "host":
                host_ids = out.tolist()  # the result travels to the host...
                self.pinned.copy_(torch.tensor(host_ids))  # ...and back in the next plan
                self.next_tokens[self.slots] = self.pinned.to("cuda", non_blocking=True)
            ids = self.next_tokens[self.slots]
        b.record()
        b.synchronize()
        ms: float = a.elapsed_time(b)
        return ms / steps


def decode_latency(steps: int, rounds: int) -> dict[str, Any]:
    step = _DecodeStep()
    out: dict[str, float] = {}
    # the copy path and its parts: plain (not interprocess) events, no events, a copy kernel
    variants = (
        "local",
        "copy",
        "copy, plain events",
        "copy, no events",
        "copy, by a kernel",
        "host",
    )
    for channel in variants:
        step.loop(channel, 20)
        out[channel] = round(statistics.median(step.loop(channel, steps) for _ in range(rounds)), 4)
    return {
        "ms_per_step": out,
        "added_ms": {c: round(v - out["local"], 4) for c, v in out.items()},
        "nccl": "not on one GPU (NCCL refuses two ranks on one device); docs/ARCHITECTURE.md: "
        "a 512-byte send/recv pair 40-60 us on 2 GPUs",
    }


def copy_is_a_memcpy() -> dict[str, Any]:
    """The profiler's view of the copy path: a cudaMemcpyAsync (Memcpy DtoD), no copy kernel."""
    from torch.profiler import ProfilerActivity, profile

    ring = torch.zeros(256, dtype=torch.long, device="cuda")
    ids = torch.arange(64, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ring[:64].copy_(ids, non_blocking=True)
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    return {"device_events": names}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args(argv)
    report: dict[str, Any] = {
        "command": "python -m app.bench.output_channels " + " ".join(sys.argv[1:]),
        "environment": environment(),
        "stand_in": "one-CTA torch.cuda._sleep (docs/ARCHITECTURE.md)",
    }
    parts: dict[str, Callable[[], object]] = {
        "copy_profile": copy_is_a_memcpy,
        "decode_step": lambda: decode_latency(a.steps, 5),
        "contention": lambda: contention(a.reps),
    }
    for name, part in parts.items():
        try:
            report[name] = part()
        except Exception as e:  # keep the other parts' figures
            report[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, json.dumps(report[name]), flush=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
