"""DeepSeek-V4's hyper-connection kernels (stages/kernels/triton_hyper.py) on a prefill chunk's
streams: the mix (projection + finish, the block input's norm folded in) and the merge, at each
of a few `_finish` tiles against the one `finish_tile` picks, with whether each tile's outputs
keep the default's bits.

    python -m app.bench.hyper --tokens 8192,2048 --out /tmp/hyper.json

V4-Flash's shape: 4 streams of 4096, 20 Sinkhorn iterations. At 8K tokens `finish_tile` gives
one token a program (its whole 4 x 4096 row in registers, 16 warps), chosen for decode rows;
a long chunk may prefer several tokens a program, whose Sinkhorn steps then share the warps.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from app.bench.moe import timed
from stages.kernels import triton_hyper

STREAMS, HIDDEN, ITERS = 4, 4096, 20
# (tokens a program, hidden slice a step, warps) of _finish; None: finish_tile's choice
FINISH_TILES: list[tuple[int, int, int] | None] = [
    None, (1, 4096, 8), (2, 4096, 16), (16, 256, 4), (16, 512, 8), (8, 512, 4), (4, 1024, 8),
]  # fmt: skip


def _inputs(tokens: int) -> tuple[Any, ...]:
    g = torch.Generator(device="cuda").manual_seed(tokens)
    streams = torch.randn(tokens, STREAMS, HIDDEN, generator=g, device="cuda").bfloat16()
    m = (2 + STREAMS) * STREAMS
    fn = torch.randn(m, STREAMS * HIDDEN, generator=g, device="cuda") * 0.01
    base = torch.randn(m, generator=g, device="cuda")
    scale = torch.rand(3, generator=g, device="cuda")
    norm = (torch.rand(HIDDEN, generator=g, device="cuda") + 0.5, 1e-6)
    out = torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16()
    return streams, fn, base, scale, norm, out


def row(tokens: int) -> dict[str, Any]:
    streams, fn, base, scale, norm, out = _inputs(tokens)
    default_tile = triton_hyper.finish_tile

    def mix() -> tuple[torch.Tensor, ...]:
        return triton_hyper.mix(streams, fn, base, scale, ITERS, 1e-6, 1e-6, norm)

    first = mix()
    result: dict[str, Any] = {"tokens": tokens, "default_tile": default_tile(tokens, 4, HIDDEN)}
    tiles = []
    for tile in FINISH_TILES:
        if tile is not None:
            triton_hyper.finish_tile = lambda _t, _n, _d, tile=tile: tile  # type: ignore[misc]
        try:
            got = mix()
            tiles.append(
                {
                    "tile": tile or "default",
                    "mix_ms": timed(mix),
                    "same_bits": all(torch.equal(a, b) for a, b in zip(got, first, strict=True)),
                }
            )
        finally:
            triton_hyper.finish_tile = default_tile
    post, comb, _collapsed = first
    result["tiles"] = tiles
    result["merge_ms"] = timed(lambda: triton_hyper.merge(streams, out, post, comb))
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="8192,2048")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rows = [row(int(t)) for t in a.tokens.split(",")]
    with open(a.out, "w") as f:
        json.dump({"env": {"torch": torch.__version__}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
