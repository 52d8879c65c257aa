"""Percentiles and the decode's lockstep window over streamed token arrival times (`bench
load`'s decode part)."""

from __future__ import annotations

import math
from typing import Any


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def steady_decode(times: list[list[float]]) -> dict[str, Any]:
    """The decode in lockstep: from the last request's first token (every prefill behind) to
    the first request's last token (none finished), output tokens per second and the gaps
    between a request's tokens (inter-token latency) p50 / p99 in milliseconds. None where the
    run has no such window (too few output tokens to outlast the prompts' prefill), or one that
    holds no whole gap of a request (shorter than a step: its rate would be noise)."""
    start = max(t[0] for t in times)
    stop = min(t[-1] for t in times)
    inside = sum(1 for t in times for x in t if start < x <= stop)
    gaps = [g for t in times for g in token_gaps_ms(t) if start <= g[0] and g[1] <= stop]
    return {
        "steady_tokens_per_s": inside / (stop - start) if stop > start and gaps else None,
        "itl_p50_ms": percentile([g[2] for g in gaps], 50) if gaps else None,
        "itl_p99_ms": percentile([g[2] for g in gaps], 99) if gaps else None,
    }


def stream_shape(times: list[list[float]], t0: float) -> dict[str, Any]:
    """Where the lockstep window comes from, in seconds after t0: the requests' first and last
    tokens (min / median / max) and the deltas a request received (min / median): a window
    that closed has its cause here (a request started late, one finished early, a consumer
    behind merging deltas)."""

    def spread(xs: list[float]) -> list[float]:
        return [round(min(xs) - t0, 4), round(percentile(xs, 50) - t0, 4), round(max(xs) - t0, 4)]

    deltas = [len(set(t)) for t in times]
    return {
        "first_token_s": spread([t[0] for t in times]),
        "last_token_s": spread([t[-1] for t in times]),
        "deltas_min_p50": [min(deltas), percentile([float(d) for d in deltas], 50)],
    }


def token_gaps_ms(times: list[float]) -> list[tuple[float, float, float]]:
    """(previous arrival, arrival, ms per token) for each token after a request's first
    delta: a delta of n tokens (--stream-interval, or a consumer behind) shares its gap from
    the previous delta among its n tokens."""
    arrivals: list[list[float]] = []  # [time, tokens]
    for x in times:
        if arrivals and arrivals[-1][0] == x:
            arrivals[-1][1] += 1
        else:
            arrivals.append([x, 1])
    return [
        (a, b, (b - a) * 1e3 / n)
        for (a, _), (b, n) in zip(arrivals, arrivals[1:])
        for _ in range(int(n))
    ]
