"""DeepSeek-V4's compression of a group of tokens into one entry (the `group_pool` op's torch
form): per channel, a softmax over the group's gates (each plus a learned per-slot bias) weights
the tokens' kv projections. With `overlap` (CSA) each token projected two series, and entry g
pools group g - 1's first series with group g's second (2 * rate slots; group 0 has no group
before it, so that half weighs nothing).

The tokens' projections are read in place from the cache component that holds them, rows
[kv series..., gate series...] of width `w` each, addressed by slot. The roundings are the
model's: the gate plus its fp32 bias in fp32, the softmax in fp32 rounded to the projections'
dtype, the products rounded to it, their sum in fp32 rounded once.

`live` (CUDA-graph decode, where every row has a group slot and most do not complete a group
this step): groups not live come out zero, and the kernel reads nothing for them.
"""

from __future__ import annotations

import torch


def pool_groups(
    inputs: torch.Tensor,
    slots: torch.Tensor,
    first: torch.Tensor,
    bias: torch.Tensor,
    rate: int,
    overlap: bool,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    """inputs [S, 2 * series * w] (series 2 with overlap, else 1); slots [G, 2 * rate] long: the
    token slots of groups g - 1 and g (without overlap only group g's are read); first [G] bool;
    bias [rate, series * w] fp32; live [G] bool or None (every group). Returns [G, w] in
    inputs' dtype."""
    g, r = slots.shape[0], rate
    used = slots if overlap else slots[:, r:]
    x = inputs.index_select(0, used.reshape(-1))
    kv, gate = x.view(g, -1, r, x.shape[-1]).chunk(2, dim=-1)
    gate = gate + bias
    if overlap:  # group g - 1's first series then group g's second
        w = kv.shape[-1] // 2
        none_before = first[:, None, None]  # entry 0: zero kv, gate -inf (weight 0)
        kv = torch.cat((kv[:, 0, :, :w].masked_fill(none_before, 0), kv[:, 1, :, w:]), dim=1)
        gate = torch.cat(
            (gate[:, 0, :, :w].masked_fill(none_before, float("-inf")), gate[:, 1, :, w:]), dim=1
        )
    else:
        kv, gate = kv[:, 0], gate[:, 0]
    pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    if live is not None:
        pooled = pooled.masked_fill(~live[:, None], 0)
    return pooled
