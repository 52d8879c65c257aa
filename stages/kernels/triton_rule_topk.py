"""The selection rule's top-k (indexer_select.top_k_positions: the highest scores first, among
equal ones the lower position) of lines that fit one program's registers, in one kernel:

1. the line's scores (-0.0 read as 0.0) as uint32 keys in the floats' order, and the k-th
   largest found a bit at a time from the top (32 counts over the keys, as triton_topk's theta);
2. every score above it kept, and the first of those equal to it (in position order) until k
   are kept;
3. the kept ones put in the rule's order by their int64 keys (the score's order, then the
   position reversed: distinct), sorted descending (SORT; else each one's place counted against
   the others, k x k comparisons), their positions stored in that order.

One launch where torch's path took about ten (the -0.0 fold, its radix top-k, the rule's keys,
their radix sort and the gathers): a decode step's CSA lines when they are short, and the
k + 8k candidates triton_topk's compaction leaves of a long one. Exact by construction: the
k-th largest key splits the kept set from the rest, ties at it go by position, and the keys of
step 3 are distinct. Lines wider than MAX_WIDTH, or k above MAX_K, are not taken (`fits`).
"""

from __future__ import annotations

import torch

from stages.kernels import pdl

MAX_WIDTH = 8192  # scores a program holds: 16 warps, 16 of each of its arrays a thread
MAX_K = 1024  # step 3's [k, CHUNK] comparisons stay in registers
CHUNK = 16  # kept keys compared a step: [K_POW2, CHUNK] int64 fits the registers (64 spilled)
# step 3 as tl.sort of the k kept keys (a bitonic network: k log2(k)^2 / 4 compare-swaps) rather
# than k x k comparisons of their ranks
SORT = True
# Lines given their live prefix (`lengths`): those whose prefix fits this many scores take a
# launch this wide, the others the line's. triton_topk's candidates (k + 8k slots a line) hold
# k + a little more than k live ones on a prompt's lines: 4 warps over 2,048 scores, not 16
# over 8,192.
PREFIX_BLOCK = 2048


def fits(width: int, k: int) -> bool:
    return 1 <= k <= min(width, MAX_K) and width <= MAX_WIDTH


def launch_shape(width: int, k: int) -> tuple[int, int]:
    """(BLOCK, K_POW2): the compiled launch a line of `width` scores picking k takes."""
    k_pow2 = max(16, triton.next_power_of_2(k))
    return max(k_pow2, triton.next_power_of_2(width)), k_pow2


def warps_for(block: int) -> int:
    """16 scores a thread at most; fewer warps meet at each of the 32 counts' barriers."""
    return max(4, min(16, block // 512))


def rule_top_k(
    scores: torch.Tensor,
    k: int,
    sort: bool | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """indexer_select.top_k_positions's contract for lines that fit (`fits`): [..., L] ->
    [..., k] long, the rule's positions in the rule's order. scores is not modified. sort:
    step 3 as a sort of the kept keys, else their ranks counted (None: SORT; benches compare).
    lengths ([lines] int32): each line's live prefix, at least k long, past which every score
    is -inf, so the rule never picks past it: a line whose prefix fits PREFIX_BLOCK is read
    that far only (a launch of that width; the others take the line's), the same positions."""
    width = scores.shape[-1]
    if not fits(width, k):
        raise ValueError(f"rule_top_k takes lines of up to {MAX_WIDTH} and k up to {MAX_K}")
    flat = scores.reshape(-1, width).float().contiguous()
    lines = flat.shape[0]
    out = torch.empty(lines, k, dtype=torch.long, device=flat.device)
    kept = torch.empty(lines, launch_shape(width, k)[1], dtype=torch.long, device=flat.device)
    # (widest line read, lines whose prefix is in (low, high]): one launch, or two by prefix
    launches = [(width, -1, width)]
    if lengths is not None:
        short = launch_shape(min(width, PREFIX_BLOCK), k)[0]
        launches = [(short, -1, short)] + ([(width, short, width)] if width > short else [])
    if lines:
        for widest, low, high in launches:
            block, k_pow2 = launch_shape(widest, k)
            _rule_top_k[(lines,)](
                flat, out, kept, out if lengths is None else lengths, width, k, low, high,
                flat.stride(0), out.stride(0), kept.stride(0), BLOCK=block, K_POW2=k_pow2,
                CHUNK=CHUNK, SORT=SORT if sort is None else sort,
                HAS_LENGTHS=lengths is not None, num_warps=warps_for(block), **pdl.options(out),
            )  # fmt: skip
    return out.view(*scores.shape[:-1], k)


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.pdl import enter

    # fmt: off
    # one compile per (BLOCK, K_POW2), whatever the line's width and k divide by
    @triton.jit(do_not_specialize=["W", "K", "LOW", "HIGH", "stride_s", "stride_o"])  # type: ignore[untyped-decorator]
    def _rule_top_k(  # type: ignore[no-untyped-def]
        S, OUT, KEPT, LENGTHS, W, K, LOW, HIGH, stride_s, stride_o, stride_k,
        BLOCK: tl.constexpr, K_POW2: tl.constexpr, CHUNK: tl.constexpr, SORT: tl.constexpr,
        HAS_LENGTHS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """The line's first W scores (HAS_LENGTHS: its live prefix, LENGTHS[line], and only
        if LOW < it <= HIGH: another launch takes the others)."""
        enter(PDL)
        line = tl.program_id(0).to(tl.int64)
        if HAS_LENGTHS:
            W = tl.load(LENGTHS + line)
        if (W > LOW) & (W <= HIGH):
            _rule_line(S, OUT, KEPT, line, W, K, stride_s, stride_o, stride_k, BLOCK, K_POW2,
                       CHUNK, SORT)

    @triton.jit  # type: ignore[untyped-decorator]
    def _rule_line(  # type: ignore[no-untyped-def]
        S, OUT, KEPT, line, W, K, stride_s, stride_o, stride_k, BLOCK: tl.constexpr,
        K_POW2: tl.constexpr, CHUNK: tl.constexpr, SORT: tl.constexpr,
    ):
        offs = tl.arange(0, BLOCK)
        live = offs < W
        v = tl.load(S + line * stride_s + offs, mask=live, other=float("-inf")) + 0.0
        bits = v.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # the floats' order, signed
        keys = (ordered ^ -2147483648).to(tl.uint32, bitcast=True)  # and unsigned
        found = tl.zeros((), dtype=tl.uint32)
        one = tl.full((), 1, dtype=tl.uint32)
        for bit in tl.static_range(32):  # the largest key with at least K keys >= it
            trial = found | (one << (31 - bit))
            enough = tl.sum(((keys >= trial) & live).to(tl.int32)) >= K
            found = tl.where(enough, trial, found)
        above = live & (keys > found)
        equal = live & (keys == found)
        need = K - tl.sum(above.to(tl.int32))
        keep = above | (equal & (tl.cumsum(equal.to(tl.int32), 0) <= need))
        slot = tl.cumsum(keep.to(tl.int32), 0) - 1
        # the rule's key: the score's order, then the position reversed (distinct)
        rule = (ordered.to(tl.int64) << 32) | (BLOCK - 1 - offs).to(tl.int64)
        tl.store(KEPT + line * stride_k + slot, rule, mask=keep)
        tl.debug_barrier()  # the kept keys, written by every thread, read by every thread
        j = tl.arange(0, K_POW2)
        lowest = -9223372036854775807 - 1
        mine = tl.load(KEPT + line * stride_k + j, mask=j < K, other=lowest)
        if SORT:  # the kept keys sorted (a bitonic network), the padding's lowest ones last
            ordered_keys = tl.sort(mine, 0, descending=True)
            position = (BLOCK - 1) - (ordered_keys & 0x7FFFFFFF)
            tl.store(OUT + line * stride_o + j, position, mask=j < K)
        else:  # each key's rank counted against the others, CHUNK of them a step
            rank = tl.zeros((K_POW2,), dtype=tl.int32)
            for start in range(0, K, CHUNK):
                c = start + tl.arange(0, CHUNK)
                theirs = tl.load(KEPT + line * stride_k + c, mask=c < K, other=lowest)
                rank += tl.sum((theirs[None, :] > mine[:, None]).to(tl.int32), 1)
            position = (BLOCK - 1) - (mine & 0x7FFFFFFF)  # the low word: BLOCK - 1 - position
            tl.store(OUT + line * stride_o + rank, position, mask=j < K)
    # fmt: on
