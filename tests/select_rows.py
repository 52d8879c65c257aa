"""SelectPlan over the tests' rows (offset, tokens, start, slots): a row of one token is a
decode row, which is what the tests' batches mean by it (the engine passes the plan's flags).
Kept apart from the hypothesis-based tests so the GPU host, which lacks hypothesis, imports it."""

from __future__ import annotations

import torch

from stages.kernels.indexer_select import SelectPlan


def decode_plan(rows, device: str) -> SelectPlan:
    return SelectPlan.build([(*r, r[1] == 1) for r in rows], torch.device(device))
