"""The indexer's top-k over long lines: a threshold from group maxima, one compaction pass, and
the top-k of the few candidates left, under the one selection rule of
stages.kernels.indexer_select.top_k_positions (highest score, among equal ones the lower
position, in that order).

torch's top-k over a 256K prompt's ~64K compressed entries per query takes 8 ms a CSA layer
for an 8K chunk (docs/PERFORMANCE.md). Here:

1. the maxima of the line's groups of `group` scores: written by the indexer's scores kernels
   as they score (stages/kernels/triton_indexer.py), else a Triton pass reading the scores
   once (torch's amax over groups of 8 took 4 ms a layer);
2. theta, the k-th largest of those maxima: torch's top-k over a line `group` times shorter,
   or (find_theta) the next pass's kernel, 32 counts over the line's maxima held in
   registers, a bit of the answer each.
   k distinct scores are >= theta, so the line's k-th score is >= theta; and a score above
   theta lies in one of the at most k - 1 groups whose maximum is above theta, so at most
   group * (k - 1) scores are above it;
3. then one pass over each line's maxima keeps, in position order, every score above theta
   (they fit in group * k slots) and the first k equal to it (the rule takes equal ones by
   lower position), reading the scores only of the groups whose maximum reaches theta: about
   k groups of a 64K-score line's 8K, where the pass had read every score. The pass first
   writes those groups' indices (every group above theta and the first k equal to it: each
   holds an equal score), then reads their scores a few groups a step (GATHER), so its scans
   run over about k groups, not over every group of each step that takes one;
4. the rule's top-k of those k + group * k candidates (triton_rule_topk, one program a line,
   reading each line's live prefix only: the k slots of equal scores, then the ones above
   theta, which the compaction counts; torch's top_k_positions for a k it does not take):
   equal scores are in position order in each region, and the regions hold no equal scores,
   so the candidates' order breaks ties as the positions do.

Every step is a device op of fixed shape (no host sync): decode rows take it in CUDA graphs.
Lines too short to gain take step 4 alone over the whole line (torch's top-k where the rule's
kernel does not fit them). Imports cleanly without triton or CUDA.
"""

from __future__ import annotations

import torch

from stages.kernels import indexer_select, pdl, triton_paged_decode, triton_rule_topk

GROUP = indexer_select.MAXIMA_GROUP  # scores per group whose maximum bounds the threshold
# Without the candidates' live prefixes (CANDIDATE_PREFIX off, or a whole line's top-k), the
# one-program rule kernel up to this many lines, torch's top-k beyond: on an H100, with its
# step 3 a sort (triton_rule_topk.SORT), the kernel took 0.14 / 0.29 / 0.44 against torch's
# 0.32 / 0.51 / 0.45 ms at 512 / 1,024 / 2,048 lines of k + 8k candidates (k 512), but 1.69
# against 1.58 at 8,192 (an 8K prefill chunk's; `python -m app.bench.indexer_select --topk 512
# --rate 4`, docs/bench/session25/call5/indexer_select.json).
RULE_KERNEL_MAX_LINES = 2048
# The candidates' top-k reads each line's live prefix only (k + the scores above theta, which
# the compaction counts), on the rule's kernel at any line count (triton_rule_topk.PREFIX_BLOCK)
CANDIDATE_PREFIX = True
BLOCK = 2048  # scores a program reads per step
# the compaction's (group maxima a step, warps): a program walks one whole line's maxima, and
# reads the scores of a step's groups only if one of them may hold a candidate; theta found in
# the compaction kernel (a bit at a time over the maxima, one program a line) or by torch's
# top-k over the maxima. The fastest of the H200's sweep, the same picks in each: 4.37 ms for
# the last 8K chunk's CSA lines of a 256K prompt, 5.77 at (256, 8) with torch's theta
# (docs/bench/session16/call1/topk.jsonl)
COMPACT = (256, 4)
FIND_THETA = True
# a line's group maxima the kernel's select keeps in registers (a 256K prompt's CSA lines: 8K)
RESIDENT_KEYS = 8192
# the compaction's scores read over the indices of the groups it takes, this many a step (None:
# step by step of the maxima, reading the taken groups of each, with scans over every group of
# a step that takes any). On an H100 the whole top-k of the 256K last chunk's CSA lines (8,192
# lines of 64K scores, k 512) took 3.70 ms at 64, 3.82 at 32, 3.94 at 16, against 6.68 step by
# step, the same picks as torch's rule (`python -m app.bench.indexer_select --topk 512
# --no-loop --cases 1x8192:262144 --rate 4`, docs/bench/session24/call6)
GATHER: int | None = 64


def is_available(device: str) -> bool:
    return triton_paged_decode.is_available(device)


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.pdl import enter

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def maxima_kernel(S, M, L, G, stride_s, stride_m, GROUP: tl.constexpr, BLOCK: tl.constexpr,  # type: ignore[no-untyped-def]
                      PDL: tl.constexpr = False):
        """Each group of GROUP scores' maximum (the line's tail past L as -inf)."""
        enter(PDL)
        line = tl.program_id(0).to(tl.int64)
        groups = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
        offs = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        s = tl.load(S + line * stride_s + offs, mask=offs < L, other=float("-inf"))
        tl.store(M + line * stride_m + groups, tl.max(s, 1), mask=groups < G)

    @triton.jit
    def _keys(M, groups, G):  # type: ignore[no-untyped-def]
        """The maxima M[groups] as uint32 keys in the floats' order (-inf past G)."""
        m = tl.load(M + groups, mask=groups < G, other=float("-inf"))
        bits = m.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return (ordered ^ -2147483648).to(tl.uint32, bitcast=True)

    @triton.jit  # type: ignore[untyped-decorator]
    def _kth_largest(M, G, K, SELECT: tl.constexpr, RESIDENT: tl.constexpr):  # type: ignore[no-untyped-def]
        """The K-th largest of M[0..G) counting repeats (what topk(K).values.amin() gives; of
        equal zeros either sign): the largest key t with at least K keys >= t, found a bit at
        a time from the top over the floats' order-preserving uint32 keys. RESIDENT (G <=
        SELECT): the line's keys stay in registers for the 32 counts; else each count walks
        the line in SELECT-key steps."""
        found = tl.zeros((), dtype=tl.uint32)
        one = tl.full((), 1, dtype=tl.uint32)
        if RESIDENT:
            keys = _keys(M, tl.arange(0, SELECT), G)
            for bit in tl.static_range(32):
                trial = found | (one << (31 - bit))
                found = tl.where(tl.sum((keys >= trial).to(tl.int32)) >= K, trial, found)
        else:
            for bit in tl.static_range(32):
                trial = found | (one << (31 - bit))
                n = 0
                for start in range(0, G, SELECT):
                    keys = _keys(M, start + tl.arange(0, SELECT), G)
                    n += tl.sum((keys >= trial).to(tl.int32))
                found = tl.where(n >= K, trial, found)
        ordered = (found ^ 0x80000000).to(tl.int32, bitcast=True)
        bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _keep(S, VAL, POS, line, offs, valid, theta, above, equal, K, stride_s, stride_c):  # type: ignore[no-untyped-def]
        """Of the scores at offs (position order; valid: may hold a candidate) those above
        theta to slots K + above.., the first equal ones to slots equal.. while under K.
        Returns the new (above, equal)."""
        s = tl.load(S + line * stride_s + offs, mask=valid, other=float("-inf"))
        gt = valid & (s > theta)
        eq = valid & (s == theta)
        gt_slot = K + above + tl.cumsum(gt.to(tl.int32), 0) - 1
        eq_slot = equal + tl.cumsum(eq.to(tl.int32), 0) - 1
        slot = tl.where(gt, gt_slot, eq_slot)
        keep = gt | (eq & (eq_slot < K))
        tl.store(VAL + line * stride_c + slot, s, mask=keep)
        tl.store(POS + line * stride_c + slot, offs.to(tl.int64), mask=keep)
        return above + tl.sum(gt.to(tl.int32)), equal + tl.sum(eq.to(tl.int32))

    @triton.jit  # type: ignore[untyped-decorator]
    def compact_kernel(  # type: ignore[no-untyped-def]
        S, M, THETA, VAL, POS, TAKEN, LIVE, L, G, K, stride_s, stride_m, stride_c,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr, FIND_THETA: tl.constexpr, SELECT: tl.constexpr,
        RESIDENT: tl.constexpr, GATHER: tl.constexpr, GATHER_G: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """theta, the K-th largest of a line's group maxima M (FIND_THETA: found here and
        written to THETA; else read from it); then the line's scores above theta to slots
        K.. and its first K equal to theta to slots 0..K-1, each region in position order
        (values and positions). It walks the maxima and reads the scores only of groups whose
        maximum reaches theta (no other group holds a candidate): those above it (at most
        K - 1), and those equal to it while fewer than K equal scores are kept (a later one's
        are past the first K).
        GATHER: first the indices of those groups (in position order, to TAKEN: every group
        above theta and the first K equal to it, each of which holds an equal score), then
        their scores GATHER_G groups a step: the scans run over the groups taken, not over
        every group of a step that takes any. The same slots either way. LIVE: K + the count
        above theta, the slots' live prefix (every later one stays -inf)."""
        enter(PDL)
        line = tl.program_id(0).to(tl.int64)
        if FIND_THETA:
            theta = _kth_largest(M + line * stride_m, G, K, SELECT, RESIDENT)
            tl.store(THETA + line, theta)
        else:
            theta = tl.load(THETA + line)
        above = 0
        equal = 0
        if GATHER:
            taken = 0
            equal_groups = 0
            for start in range(0, G, BLOCK_G):
                groups = start + tl.arange(0, BLOCK_G)
                m = tl.load(M + line * stride_m + groups, mask=groups < G, other=float("-inf"))
                tie = (groups < G) & (m == theta)
                rank = equal_groups + tl.cumsum(tie.to(tl.int32), 0)
                take = (groups < G) & ((m > theta) | (tie & (rank <= K)))
                slot = taken + tl.cumsum(take.to(tl.int32), 0) - 1
                tl.store(TAKEN + line * 2 * K + slot, groups, mask=take)
                taken += tl.sum(take.to(tl.int32))
                equal_groups += tl.sum(tie.to(tl.int32))
            tl.debug_barrier()  # TAKEN's stores seen by every thread of the program
            for start in range(0, taken, GATHER_G):
                index = start + tl.arange(0, GATHER_G)
                group = tl.load(TAKEN + line * 2 * K + index, mask=index < taken, other=0)
                offs = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
                valid = (index < taken)[:, None] & (offs < L)
                above, equal = _keep(
                    S, VAL, POS, line, tl.reshape(offs, (GATHER_G * GROUP,)),
                    tl.reshape(valid, (GATHER_G * GROUP,)), theta, above, equal, K, stride_s,
                    stride_c,
                )
        else:
            for start in range(0, G, BLOCK_G):
                groups = start + tl.arange(0, BLOCK_G)
                m = tl.load(M + line * stride_m + groups, mask=groups < G, other=float("-inf"))
                take = (groups < G) & ((m > theta) | ((m == theta) & (equal < K)))
                if tl.sum(take.to(tl.int32)) > 0:  # most steps: the maxima read, nothing else
                    offs = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
                    valid = take[:, None] & (offs < L)
                    above, equal = _keep(
                        S, VAL, POS, line, tl.reshape(offs, (BLOCK_G * GROUP,)),
                        tl.reshape(valid, (BLOCK_G * GROUP,)), theta, above, equal, K,
                        stride_s, stride_c,
                    )
        tl.store(LIVE + line, K + above)
    # fmt: on


def _select_launch(groups: int) -> dict[str, int | bool]:
    """theta's select: a line's maxima in registers up to RESIDENT_KEYS of them, else walked in
    steps of that many for each of its 32 counts. One width either way, so a prompt's growing
    lines meet two compiled launches, not one per power of two (each compile took a second or
    two of a 64K prompt's TTFT)."""
    return {"SELECT": RESIDENT_KEYS, "RESIDENT": groups <= RESIDENT_KEYS}


def warm_widths(k: int, widest: int) -> list[int]:
    """Line widths that meet every compiled launch of top_k_positions on lines of up to
    `widest` scores picking k (or fewer, on a line narrower than k): lines whose maxima fit
    the registers and longer ones, each with the width and the group count divisible by 16 or
    not (Triton compiles a launch per such pattern of its integer arguments), and a short line
    of each launch the rule's kernel compiles (a power of two of scores)."""
    first = 2 * (k + GROUP * k)  # the narrowest line the kernels take
    widths: set[int] = set()
    seen: set[tuple[bool, bool, bool]] = set()
    for base in (first, GROUP * RESIDENT_KEYS, widest):  # the resident lines' and the others'
        # the first width near it of each pattern: width and groups divisible by 16 or not
        for w in range(max(first, base - 256), min(widest, base + 256) + 1):
            groups = -(-w // GROUP)
            pattern = (w % 16 == 0, groups % 16 == 0, groups <= RESIDENT_KEYS)
            if pattern not in seen:
                seen.add(pattern)
                widths.add(w)
    shapes = set()
    widest_short = min(first - 1, widest)
    short = 16
    while k <= triton_rule_topk.MAX_K and widest_short >= 1:
        width = min(short, widest_short)
        if triton_rule_topk.fits(width, min(k, width)):
            shape = triton_rule_topk.launch_shape(width, min(k, width))
            if shape not in shapes:
                shapes.add(shape)
                widths.add(width)
        if short >= widest_short:
            break
        short *= 2
    return sorted(widths)


def warm_up(k: int, widest: int, device: torch.device | str) -> int:
    """Compiles top_k_positions' launches for lines of up to `widest` scores (warm_widths, one
    line of zeros each) before a prompt's TTFT would pay for them, given the group maxima as
    the models' scores op gives them (its maxima pass is not compiled). Returns the widths run."""
    widths = warm_widths(k, widest)
    for width in widths:
        scores = torch.zeros(1, width, device=device)
        maxima = indexer_select.maxima_buffer(1, width, scores.device)
        top_k_positions(scores, min(k, width), maxima=indexer_select.group_maxima(scores, maxima))
    return len(widths)


def top_k_positions(
    scores: torch.Tensor,
    k: int,
    group: int = GROUP,
    compact: tuple[int, int] = COMPACT,
    find_theta: bool = FIND_THETA,
    gather: int | None = GATHER,
    maxima: torch.Tensor | None = None,
) -> torch.Tensor:
    """indexer_select.top_k_positions's contract: [..., L] fp32 -> [..., k] long, the rule's
    positions in the rule's order. maxima: the lines' group maxima ([lines, groups], as
    indexer_select.group_maxima), when the scores op wrote them; else a pass over the scores
    finds them. compact: the compaction's launch; find_theta: theta found by the compaction
    kernel, else by torch's top-k of the maxima; gather: the compaction's scores read over the
    groups it takes, this many a step, else step by step of the maxima (benches sweep them)."""
    width = scores.shape[-1]
    if width < 2 * (k + group * k):  # short lines: no fewer candidates to gain
        return _rule(scores, k)
    flat = scores.reshape(-1, width).float().contiguous()
    lines, groups = flat.shape[0], -(-width // group)
    slots = k + group * k
    values = torch.full((lines, slots), float("-inf"), device=flat.device)
    positions = torch.zeros(lines, slots, dtype=torch.long, device=flat.device)
    live = torch.empty(lines, dtype=torch.int32, device=flat.device)  # the slots' live prefix
    if maxima is not None and (group != GROUP or maxima.shape != (lines, groups)):
        raise ValueError(f"maxima {tuple(maxima.shape)} for {lines} lines of {width} scores")
    if lines:
        if maxima is None:
            maxima = torch.empty(lines, groups, device=flat.device)
            maxima_kernel[(lines, triton.cdiv(groups * group, BLOCK))](
                flat, maxima, width, groups, flat.stride(0), maxima.stride(0), GROUP=group,
                BLOCK=BLOCK, num_warps=4, **pdl.options(maxima),
            )  # fmt: skip
        if find_theta:
            theta = torch.empty(lines, device=flat.device)
        else:
            theta = maxima.topk(k, dim=-1, sorted=False).values.amin(-1).contiguous()
        taken = torch.empty(lines, 2 * k if gather else 1, dtype=torch.int32, device=flat.device)
        compact_kernel[(lines,)](
            flat, maxima, theta, values, positions, taken, live, width, groups, k, flat.stride(0),
            maxima.stride(0), values.stride(0), GROUP=group, BLOCK_G=compact[0],
            FIND_THETA=find_theta, **_select_launch(groups), GATHER=bool(gather),
            GATHER_G=gather or 1, num_warps=compact[1], **pdl.options(values),
        )  # fmt: skip
    picked = positions.gather(-1, _rule(values, k, live if CANDIDATE_PREFIX else None))
    return picked.view(*scores.shape[:-1], k)


def _rule(scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The rule's top-k of whole lines: one program a line where it fits and either the
    lines' live prefixes are known (`lengths`, triton_rule_topk.rule_top_k's) or the lines are
    few (RULE_KERNEL_MAX_LINES), else torch's."""
    lines = scores.numel() // max(1, scores.shape[-1])
    if triton_rule_topk.fits(scores.shape[-1], k):
        if lengths is not None:
            return triton_rule_topk.rule_top_k(scores, k, lengths=lengths)
        if lines <= RULE_KERNEL_MAX_LINES:
            return triton_rule_topk.rule_top_k(scores, k)
    return indexer_select.top_k_positions(scores, k)
