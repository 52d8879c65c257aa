"""The indexer's chunk-row scores on DeepGEMM's ``fp8_mqa_logits`` (SM90, FP8 queries against
FP8 keys): the indexer_logits_rows contract of stages/kernels/triton_indexer.py over an FP8
indexer cache. DeepGEMM is built from its source (stages/kernels/deepgemm.py).

The kernel reads keys contiguous ([L, D] e4m3, a float32 scale each) and a [start, end) range
per query: the chunk rows' keys are gathered out of the pages (fp8_indexer's block layout) one
row after another, each padded to Lmax, so a token's range starts at its row's place and spans
the keys it sees. Its "compressed" output (max_seqlen_k = Lmax) is then the contract's
[Ts, Lmax] lines, a token's scores at its row's positions; the columns past what a token sees
are left unwritten, and one Triton pass (`_finish_lines`) sets them to -inf and writes the group
maxima the top-k reads, as the Triton chunk kernel does while scoring.

The arithmetic is the Triton kernel's: queries quantized by the same kernel (their scales and
the softmax scale folded into the head weights), relu of each head's product times its weight,
summed over the heads, times the key's power-of-two scale. The heads are summed in another
order, so the scores differ from the Triton kernel's in their last bits (the -inf pattern is
the same); a token's scores do not depend on the other rows of its batch. Decode rows (one
token each, CUDA graphs) are the Triton decode kernel's by design, in a mixed plan into the same
lines; bf16 keys (a bf16 cache) go to the Triton kernels, logged once and counted.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from stages.kernels import deepgemm, fp8_indexer, indexer_select, triton_indexer
from stages.kernels.fallbacks import KernelTarget, Refusal, record_fallback

BACKEND = "deepgemm"
HEADS = (32, 64)  # index heads the SM90 kernel takes
HEAD_DIMS = (32, 64, 128)
FINISH_BLOCK = 128  # columns a program of the finishing pass takes


def is_available(device: str) -> bool:
    return triton_indexer.is_available(device) and deepgemm.sm90_loaded(device)


def supports(op: str, target: KernelTarget) -> Refusal | None:
    """DeepGEMM's SM90 kernel takes 32 or 64 index heads of 32, 64 or 128 values; decode rows
    go to the Triton kernel, whose own limits hold too."""
    shape = target.shapes.get(op)
    if shape is None:
        return None
    if shape.heads not in HEADS:
        return Refusal("heads", f"{shape.heads} index heads (DeepGEMM's SM90 kernel: 32, 64)")
    if shape.head_dim not in HEAD_DIMS:
        return Refusal("head_dim", f"index heads {shape.head_dim} wide (DeepGEMM: 32, 64, 128)")
    return triton_indexer.supports(op, target)


def indexer_logits_rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    plan: Any,
    maxima: torch.Tensor | None = None,
) -> torch.Tensor:
    declined = _declined(q, keys, plan)
    if declined is not None:
        if declined[0]:
            record_fallback("indexer_logits_rows", BACKEND, *declined)
        return triton_indexer.indexer_logits_rows(q, keys, weights, scale, plan, maxima=maxima)
    lmax = plan.key_slots.shape[1]
    values, scales, start, end = gathered_keys(keys, plan)
    q8, scaled = triton_indexer.quantize_queries(q, weights, scale)
    dg = deepgemm.load()
    out: torch.Tensor = dg.fp8_mqa_logits(q8, (values, scales), scaled, start, end, False, lmax)
    _finish_lines(out, plan, maxima)
    if plan.decode_tiles.shape[0]:
        triton_indexer.indexer_logits_rows(
            q, keys, weights, scale, plan, maxima=maxima, out=out, chunks=False
        )
    return out


def _declined(q: torch.Tensor, keys: torch.Tensor, plan: Any) -> tuple[str, str] | None:
    """(reason, detail) where the Triton kernels take the whole call (reason "": no chunk rows,
    nothing to count), else None."""
    if not plan.chunk_tiles.shape[0]:
        return "", ""
    if keys.dtype != torch.uint8:
        return "dtype", f"indexer keys in {keys.dtype} (DeepGEMM scores FP8 keys) -> triton"
    if q.shape[1] not in HEADS or q.shape[2] not in HEAD_DIMS or not q.is_cuda:
        return "shape", f"queries {tuple(q.shape)} on {q.device} -> triton"
    return None


def gathered_keys(
    pages: torch.Tensor, plan: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [Rc * Lmax, D] e4m3, scales [Rc * Lmax] fp32, start [Ts], end [Ts] int32): the
    keys of the plan's Rc chunk rows one row after another (each Lmax long), and each token's
    range among them (decode rows' tokens: empty)."""
    rows = plan.chunk_rows
    if rows is None:  # a plan built without its host list
        rows = torch.unique(plan.chunk_tiles[:, 0]).tolist()
    lmax = plan.key_slots.shape[1]
    values, scales = fp8_indexer.split(pages)
    # the chunk rows, then each row's first key among the gathered (-1: not gathered)
    place = torch.full((plan.key_slots.shape[0],), -1, dtype=torch.long)
    place[rows] = torch.arange(len(rows)) * lmax
    host = torch.cat((torch.tensor(rows, dtype=torch.long), place))
    if pages.is_cuda:  # one pinned copy: a pageable one makes the host wait
        host = host.pin_memory().to(pages.device, non_blocking=True)
    chunk_rows, place = host[: len(rows)], host[len(rows) :]
    slots = plan.key_slots.index_select(0, chunk_rows).view(-1).long()
    block, entry = slots // pages.shape[1], slots % pages.shape[1]
    first = place[plan.token_row]
    scored = first >= 0
    start = torch.where(scored, first, 0).int()
    end = torch.where(scored, first + plan.visible, 0).int()
    return values[block, entry], scales[block, entry].contiguous(), start, end


@functools.lru_cache(maxsize=None)
def _finish_kernel() -> Any:  # a Triton JITFunction (untyped)
    import triton
    import triton.language as tl

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def finish_kernel(S, M, VISIBLE, TILES, LMAX, stride_s, stride_m,  # type: ignore[no-untyped-def]
                      BT: tl.constexpr, BL: tl.constexpr, GROUP: tl.constexpr):
        """A chunk tile's tokens x BL columns: -inf past what each token sees (DeepGEMM left
        them unwritten); GROUP > 0: M gets each GROUP columns' maximum."""
        tile = tl.program_id(0)
        first = tl.load(TILES + tile * 3 + 1)
        count = tl.load(TILES + tile * 3 + 2)
        rel = tl.arange(0, BT)
        t_mask = rel < count
        offs_t = (first + rel).to(tl.int64)
        visible = tl.load(VISIBLE + offs_t, mask=t_mask, other=0)
        offs_l = tl.program_id(1) * BL + tl.arange(0, BL)
        ptrs = S + offs_t[:, None] * stride_s + offs_l[None, :]
        line = t_mask[:, None] & (offs_l[None, :] < LMAX)
        seen = offs_l[None, :] < visible[:, None]
        s = tl.load(ptrs, mask=line & seen, other=float("-inf"))
        tl.store(ptrs, s, mask=line & ~seen)
        if GROUP:
            groups = tl.program_id(1) * (BL // GROUP) + tl.arange(0, BL // GROUP)
            tl.store(M + offs_t[:, None] * stride_m + groups[None, :],
                     tl.max(tl.reshape(s, (BT, BL // GROUP, GROUP)), 2),
                     mask=t_mask[:, None] & (groups[None, :] * GROUP < LMAX))
    # fmt: on

    return finish_kernel


def _finish_lines(out: torch.Tensor, plan: Any, maxima: torch.Tensor | None) -> None:
    """The chunk tokens' lines of `out` completed: -inf past what each sees, group maxima."""
    lines, lmax = out.shape
    group = indexer_select.MAXIMA_GROUP if maxima is not None else 0
    if maxima is None:
        maxima = out  # not written: GROUP 0 compiles the maxima out
    elif maxima.shape != indexer_select.maxima_shape(lines, lmax) or maxima.stride(1) != 1:
        raise ValueError(f"maxima {tuple(maxima.shape)} for {lines} lines of {lmax} scores")
    grid = (plan.chunk_tiles.shape[0], -(-lmax // FINISH_BLOCK))
    _finish_kernel()[grid](
        out, maxima, plan.visible, plan.chunk_tiles, lmax, out.stride(0), maxima.stride(0),
        BT=indexer_select.CHUNK_TILE, BL=FINISH_BLOCK, GROUP=group,
    )  # fmt: skip
