"""The candidates' top-k (stages/kernels/triton_topk.py) on the H200 over the compaction's
launch (group maxima a step, warps; written in session 14, its compaction reworked in session 15
to read only the groups that may hold a candidate) and theta found by torch or by the kernel,
at V4's CSA of the last 8K chunk of a 256K prompt: 8192 lines x 64K scores, k = 512, a causal
tail of -inf; each launch's picks checked against the default's. One JSON line a launch.

    python docs/bench/scripts/session15_topk_sweep.py --out topk.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch

from app.bench.moe import timed
from stages.kernels import triton_topk


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    lines, width, k = 8192, 65536, 512
    scores = torch.randn(lines, width, generator=g, device="cuda").relu_()  # ties at 0
    visible = width - lines + torch.arange(lines, device="cuda")[:, None] // 4
    scores.masked_fill_(torch.arange(width, device="cuda")[None, :] >= visible, float("-inf"))
    want = triton_topk.top_k_positions(scores, k)
    with open(a.out, "w") as out:
        launches = ((256, 8), (512, 8), (128, 4), (256, 4), (1024, 16), (64, 4))
        for compact, find in [(c, f) for f in (False, True) for c in launches]:
            row = {"compact": compact, "find_theta": find}

            def run(compact=compact, find=find):
                return triton_topk.top_k_positions(scores, k, compact=compact, find_theta=find)

            row["equal"] = bool(torch.equal(run(), want))
            row["ms"] = round(timed(run, reps=5), 3)
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
