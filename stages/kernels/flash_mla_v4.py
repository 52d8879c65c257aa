"""DeepSeek-V4 attention on FlashMLA's SM90 ("legacy") kernels (the sgl-flash-mla wheel, loaded
and checked by stages/kernels/flash_mla.py):

- ``sparse_sink_attention``: torch_ref.sparse_sink_attention on ``flash_mla_sparse_fwd`` (bf16,
  head dim 512, ``attn_sink``). It is query-wise sparse, so one call serves prefill and decode
  rows alike.
- ``sparse_sink_attention_fp8``: fp8_v4.sparse_sink_attention on the sparse FP8 decode kernel
  (``flash_mla_with_kvcache``) over the 584-byte pages in place, every query one batch row: the
  compressed entries are its main cache, the sliding window its ``extra_k_cache``.

The kernels take 64 or 128 query heads: fewer are zero-padded (their outputs dropped). A model
with more, or another dtype or head dim, is refused when the stage is built (``supports``); a
call that gets such an input anyway goes to the torch reference, counted and logged once
(stages/kernels/fallbacks.py).
"""

from __future__ import annotations

from typing import Any

import torch

from stages.kernels import flash_mla, fp8_v4, torch_ref
from stages.kernels.fallbacks import KernelTarget, Refusal, record_fallback
from stages.kernels.fp8_v4_layout import HEAD_DIM

is_available = flash_mla.is_available
MAX_HEADS = max(flash_mla.SPARSE_HEADS)
# sparse_sink_attention_fp8's entries in the caller's state: the packed ids, the schedule
PACKED, SCHEDULE = "flash_mla_v4.packed", "flash_mla_v4.schedule"


def supports(op: str, target: KernelTarget) -> Refusal | None:
    """Whether FlashMLA's V4 kernels serve `op` for the stage's model (None: they do)."""
    shape = target.shapes.get(op)
    if shape is None:  # the model never calls op
        return None
    if target.dtype != "bfloat16":
        return Refusal("dtype", f"the model runs in {target.dtype}; FlashMLA takes bfloat16")
    if shape.head_dim != HEAD_DIM:
        return Refusal("head_dim", f"heads {shape.head_dim} wide; FlashMLA's V4 kernels take 512")
    if shape.heads > MAX_HEADS:
        return Refusal("heads", f"{shape.heads} query heads; FlashMLA's kernels take {MAX_HEADS}")
    return None


def _fall_back(op: str, q: torch.Tensor, keys: torch.Tensor | None) -> bool:
    """Whether this call goes to the torch reference (counted, the first logged)."""
    if q.dtype != torch.bfloat16 or (keys is not None and keys.dtype != torch.bfloat16):
        held = f"queries in {q.dtype}" + ("" if keys is None else f", keys in {keys.dtype}")
        refusal = Refusal("dtype", f"{held} (FlashMLA takes bfloat16)")
    elif q.shape[-1] != HEAD_DIM:
        refusal = Refusal("head_dim", f"head dim {q.shape[-1]} (the V4 kernels take {HEAD_DIM})")
    elif q.shape[1] > MAX_HEADS:
        refusal = Refusal("heads", f"{q.shape[1]} query heads (the kernels take {MAX_HEADS})")
    else:
        return False
    record_fallback(op, "flash-mla", refusal.reason, f"{refusal.detail} -> torch reference")
    return True


def _pad_sinks(sinks: torch.Tensor, heads: int) -> torch.Tensor:
    """sinks [H] as the kernel's fp32 [heads]: the tensor itself where it already is (a pad of
    nothing is still a copy, a launch a layer in every decode step)."""
    if sinks.shape[0] == heads and sinks.dtype == torch.float32 and sinks.is_contiguous():
        return sinks
    return torch.nn.functional.pad(sinks.float(), (0, heads - sinks.shape[0])).contiguous()


def sparse_sink_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [T, H, 512] bf16, kv [N, 512] bf16, indices [T, K] (-1: none), sinks [H] fp32 ->
    [T, H, 512]."""
    if _fall_back("sparse_sink_attention", q, kv) or (qp := flash_mla.pad_heads(q)) is None:
        return torch_ref.sparse_sink_attention(q, kv, indices, sinks, scale)
    out, _max, _lse = flash_mla.wheel().flash_mla_sparse_fwd(
        qp.contiguous(),
        kv.contiguous().view(-1, 1, HEAD_DIM),
        flash_mla.pad_topk(indices).unsqueeze(1),
        scale,
        HEAD_DIM,
        attn_sink=_pad_sinks(sinks, qp.shape[1]),
        use_legacy=True,
        return_log2_lse=False,
    )
    attended: torch.Tensor = out[:, : q.shape[1]]
    return attended


def _valid_first(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's valid ids moved first, order kept, padded with -1 to the kernel's step,
    [T, 1, K'] int32; each row's count [T] int32): the kernel reads only a row's first
    `count` ids (topk_length), so padding costs it nothing."""
    valid = indices >= 0
    counts = valid.sum(dim=1, dtype=torch.int32)
    order = (~valid).to(torch.int8).argsort(dim=1, stable=True)
    return flash_mla.pad_topk(indices.gather(1, order)).unsqueeze(1), counts


def sparse_sink_attention_fp8(
    q: torch.Tensor,
    window_pages: torch.Tensor,
    window: torch.Tensor,
    comp_pages: torch.Tensor | None,
    comp: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    state: dict[str, Any] | None = None,
    window_state: dict[str, Any] | None = None,
    schedule_state: dict[str, Any] | None = None,
    comp_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp8_v4.sparse_sink_attention's contract: q [T, H, 512] bf16, pages [blocks, P, 1, 584],
    window [T, W] / comp [T, E] slot ids (-1: none), sinks [H] fp32 -> [T, H, 512]. state: a
    dict the caller passes again only with the same window and comp (the layers of one kind in
    one forward), window_state one passed again only with the same window (every layer of a
    forward): the ids packed for the kernel and its schedule, derived from them, are kept there
    for the next call. schedule_state (else state): where the schedule is kept, a dict passed
    again only with the same window and the same count of comp ids in each row (V4's CSA
    layers of a forward: each picks min(k, visible) of the same entries). comp_counts [T] int32:
    each row of comp holds this many ids first, then only -1 (the indexer's picks, in the
    rule's order, counted where they were made): nothing to move or count here."""
    if _fall_back("sparse_sink_attention_fp8", q, None) or (qp := flash_mla.pad_heads(q)) is None:
        return fp8_v4.sparse_sink_attention(q, window_pages, window, comp_pages, comp, sinks, scale)
    fm = flash_mla.wheel()
    state = {} if state is None else state
    window_state = {} if window_state is None else window_state
    window_packed = window_state.get(PACKED)
    if window_packed is None:
        window_packed = window_state[PACKED] = _valid_first(window)
    packed = state.get(PACKED)
    if packed is None:
        comp_ids = None
        if comp is not None and comp_pages is not None:
            if comp_counts is not None:
                comp_ids = flash_mla.pad_topk(comp).unsqueeze(1), comp_counts
            else:
                comp_ids = _valid_first(comp)
        packed = state[PACKED] = (window_packed, comp_ids)
    (window_ids, window_counts), comp_packed = packed
    extra = {}
    if comp_pages is None or comp_packed is None:  # sliding only: the window is the cache
        pages, ids, counts = window_pages, window_ids, window_counts
    else:
        pages, (ids, counts) = comp_pages, comp_packed
        extra = dict(
            extra_k_cache=window_pages,
            extra_indices_in_kvcache=window_ids,
            extra_topk_length=window_counts,
        )
    # the schedule depends on the rows' counts: shared only through `state` or schedule_state
    kept = state if schedule_state is None else schedule_state
    meta = kept.get(SCHEDULE)
    if meta is None:
        meta = kept[SCHEDULE] = fm.get_mla_metadata()[0]
    out, _lse = fm.flash_mla_with_kvcache(
        qp.unsqueeze(1).contiguous(),
        pages,
        None,
        None,
        HEAD_DIM,
        meta,
        softmax_scale=scale,
        causal=False,
        is_fp8_kvcache=True,
        indices=ids,
        attn_sink=_pad_sinks(sinks, qp.shape[1]),
        topk_length=counts,
        use_legacy=True,
        **extra,
    )
    decoded: torch.Tensor = out[:, 0, : q.shape[1]]
    return decoded
