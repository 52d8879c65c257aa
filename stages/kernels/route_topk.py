"""DeepSeek-V4's router after its gate GEMM (the `route_topk` op's torch form): each expert's
score (sqrt(softplus(logit)) or sigmoid(logit), in the logits' dtype), the top k experts by the
score plus an fp32 correction bias (or, in hash layers, the experts the token's id names), their
scores renormalised to sum to one and times the routed scaling factor. transformers' steps and
roundings (DeepseekV4TopkRouter). `extra`: one more pick appended to every token's, weight 1
(the shared expert where it runs in the routed experts' stack, stages/models/moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_topk(
    logits: torch.Tensor,
    k: int,
    scoring: str,
    scale: float,
    bias: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    extra: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E]; bias [E] fp32 (ids None); ids [T, k] long (a hash layer's) -> (weights
    [T, k] in logits' dtype, ids [T, k] long); with `extra`, [T, k + 1] each, its last column
    `extra` with weight 1."""
    scores = F.softplus(logits).sqrt() if scoring == "sqrtsoftplus" else logits.sigmoid()
    if ids is None:
        if bias is None:
            raise ValueError("a router that picks its experts needs the correction bias")
        ids = torch.topk(scores + bias, k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights, ids = weights * scale, ids.long()
    if extra is not None:
        t = ids.shape[0]
        weights = torch.cat((weights, weights.new_ones(t, 1)), dim=1)
        ids = torch.cat((ids, ids.new_full((t, 1), extra)), dim=1)
    return weights, ids
