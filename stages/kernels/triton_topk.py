"""The indexer's top-k over long lines: a threshold from group maxima, one compaction pass, and
the top-k of the few candidates left, under the one selection rule of
stages.kernels.indexer_select.top_k_positions (highest score, among equal ones the lower
position, in that order).

torch's top-k over a 256K prompt's ~64K compressed entries per query takes 8 ms a CSA layer
for an 8K chunk (docs/PERFORMANCE.md). Here:

1. the maxima of the line's groups of `group` scores (a Triton pass reading the scores once;
   torch's amax over groups of 8 took 4 ms a layer);
2. theta, the k-th largest of those maxima (torch's top-k over a line `group` times shorter).
   k distinct scores are >= theta, so the line's k-th score is >= theta; and a score above
   theta lies in one of the at most k - 1 groups whose maximum is above theta, so at most
   group * (k - 1) scores are above it;
3. one Triton pass (a block without a candidate costs its read and two sums) keeps, in
   position order, every score above theta (they fit in group * k slots) and the first k
   equal to it (the rule takes equal ones by lower position);
4. the rule's top-k of those k + group * k candidates (indexer_select.top_k_positions): equal
   scores are in position order in each region, and the regions hold no equal scores, so
   the candidates' order breaks ties as the positions do.

Every step is a device op of fixed shape (no host sync): decode rows take it in CUDA graphs.
Lines too short to gain go to torch's top-k directly. Imports cleanly without triton or CUDA.
"""

from __future__ import annotations

import torch

from stages.kernels import indexer_select, triton_paged_decode

GROUP = 8  # scores per group whose maximum bounds the threshold
BLOCK = 2048  # scores a program reads per step
# the compaction's (scores a step, warps): a program walks one whole line, so its steps'
# reads are what hides the memory's latency (session 14 sweeps it)
COMPACT = (2048, 8)


def is_available(device: str) -> bool:
    return triton_paged_decode.is_available(device)


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def maxima_kernel(S, M, L, G, stride_s, stride_m, GROUP: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """Each group of GROUP scores' maximum (the line's tail past L as -inf)."""
        line = tl.program_id(0).to(tl.int64)
        groups = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
        offs = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        s = tl.load(S + line * stride_s + offs, mask=offs < L, other=float("-inf"))
        tl.store(M + line * stride_m + groups, tl.max(s, 1), mask=groups < G)

    @triton.jit  # type: ignore[untyped-decorator]
    def compact_kernel(S, THETA, VAL, POS, L, K, stride_s, stride_c, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """A line's scores above theta to slots K.. and its first K equal to theta to slots
        0..K-1, each region in position order (values and positions)."""
        line = tl.program_id(0).to(tl.int64)
        theta = tl.load(THETA + line)
        above = 0
        equal = 0
        for start in range(0, L, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < L
            s = tl.load(S + line * stride_s + offs, mask=valid, other=float("-inf"))
            gt = valid & (s > theta)
            eq = valid & (s == theta)
            n_gt = tl.sum(gt.to(tl.int32))
            n_eq = tl.sum(eq.to(tl.int32))
            if n_gt + n_eq > 0:  # most blocks hold no candidate: one read, no scan
                gt_slot = K + above + tl.cumsum(gt.to(tl.int32), 0) - 1
                eq_slot = equal + tl.cumsum(eq.to(tl.int32), 0) - 1
                slot = tl.where(gt, gt_slot, eq_slot)
                keep = gt | (eq & (eq_slot < K))
                tl.store(VAL + line * stride_c + slot, s, mask=keep)
                tl.store(POS + line * stride_c + slot, offs.to(tl.int64), mask=keep)
            above += n_gt
            equal += n_eq
    # fmt: on


def top_k_positions(
    scores: torch.Tensor, k: int, group: int = GROUP, compact: tuple[int, int] = COMPACT
) -> torch.Tensor:
    """indexer_select.top_k_positions's contract: [..., L] fp32 -> [..., k] long, the rule's
    positions in the rule's order. compact: the compaction's launch (benches sweep it)."""
    width = scores.shape[-1]
    if width < 2 * (k + group * k):  # short lines: no fewer candidates to gain
        return indexer_select.top_k_positions(scores, k)
    flat = scores.reshape(-1, width).float().contiguous()
    lines, groups = flat.shape[0], -(-width // group)
    slots = k + group * k
    values = torch.full((lines, slots), float("-inf"), device=flat.device)
    positions = torch.zeros(lines, slots, dtype=torch.long, device=flat.device)
    if lines:
        maxima = torch.empty(lines, groups, device=flat.device)
        maxima_kernel[(lines, triton.cdiv(groups * group, BLOCK))](
            flat, maxima, width, groups, flat.stride(0), maxima.stride(0), GROUP=group,
            BLOCK=BLOCK, num_warps=4,
        )  # fmt: skip
        theta = maxima.topk(k, dim=-1, sorted=False).values.amin(-1).contiguous()
        compact_kernel[(lines,)](
            flat, theta, values, positions, width, k, flat.stride(0), values.stride(0),
            BLOCK=compact[0], num_warps=compact[1],
        )  # fmt: skip
    picked = positions.gather(-1, indexer_select.top_k_positions(values, k))
    return picked.view(*scores.shape[:-1], k)
