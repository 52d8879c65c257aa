"""DeepSeek-V3.2's indexer selection for every selecting row of a batch at once.

A forward builds one ``SelectPlan`` (host metadata, one copy to the device); each DSA layer then
scores all the plan's tokens against their own rows' keys in one call of the
``indexer_logits_rows`` op, into a [tokens, Lmax] buffer where keys a token does not see (the
future of its chunk, other rows' padding) are -inf, and ``topk_slots`` picks each token's top-k
in one batched top-k. No Python loop per row in a layer.

Ties: many keys score exactly 0 (the ReLU), so the k-th best score is often shared. Every
path selects by one rule, `top_k_positions`: the k highest scores, among equal ones the lower
position. A row's positions are the first columns of its tokens' lines and the padding after
them is -inf, so the batched selection is each row's own. The chunk rows' scores are computed
exactly as the per-row kernel (stages.kernels.triton_indexer.indexer_logits) computed them;
decode rows sum the heads in another order (bit-level differences only; exact zeros stay exact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from stages.kernels import fp8_indexer, torch_ref

# Tokens of one chunk row scored together by a program of the Triton kernel (the MMA's rows);
# rows of one token (decode) are tiles of their own, whose MMA rows are the index heads.
CHUNK_TILE = 64
# Scores per group whose maximum the long lines' top-k reads (stages/kernels/triton_topk.py):
# the scores op can write them as it scores, sparing the top-k a pass over the scores.
MAXIMA_GROUP = 8


def maxima_shape(lines: int, width: int) -> tuple[int, int]:
    return lines, -(-width // MAXIMA_GROUP)


def maxima_buffer(lines: int, width: int, device: torch.device) -> torch.Tensor:
    """The [lines, groups] fp32 buffer a scores op fills with its lines' group maxima."""
    return torch.empty(maxima_shape(lines, width), dtype=torch.float32, device=device)


def group_maxima(scores: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i, g] = the maximum of scores[i, g * MAXIMA_GROUP : (g + 1) * MAXIMA_GROUP]."""
    lines, width = scores.shape
    pad = out.shape[1] * MAXIMA_GROUP - width
    padded = torch.nn.functional.pad(scores, (0, pad), value=float("-inf")) if pad else scores
    return torch.amax(padded.view(lines, -1, MAXIMA_GROUP), dim=-1, out=out)


@dataclass
class SelectPlan:
    token_index: torch.Tensor  # [Ts] long: the selecting rows' tokens in the batch
    token_row: torch.Tensor  # [Ts] long: each token's row in the plan
    visible: torch.Tensor  # [Ts] int32: keys each token sees (its row's prefix up to itself)
    key_slots: torch.Tensor  # [R, Lmax] int32: cache slot of each row position (0 padded)
    chunk_tiles: torch.Tensor  # [n, 3] int32: (row, first token in Ts, tokens <= CHUNK_TILE)
    decode_tiles: torch.Tensor  # [m, 2] int32: (row, token in Ts) of each decode row
    row_tokens: list[tuple[int, int, int]]  # host copy: (first token in Ts, tokens, keys)

    @classmethod
    def build(
        cls, rows: list[tuple[int, int, int, torch.Tensor, bool]], device: torch.device
    ) -> "SelectPlan":
        """rows: (offset in the batch, tokens, first token's position, slots [start + n],
        whether it is a decode row). A prefill chunk of one token is scored as a chunk: its
        scores are then the bits it would get inside a longer chunk of another batch."""
        lmax = max(start + n for _, n, start, _, _ in rows)
        token_index: list[int] = []
        token_row: list[int] = []
        visible: list[int] = []
        dest: list[int] = []
        row_tokens: list[tuple[int, int, int]] = []
        chunk: list[tuple[int, int, int]] = []
        decode: list[tuple[int, int]] = []
        first = 0
        for r, (off, n, start, _slots, decode_row) in enumerate(rows):
            token_index += range(off, off + n)
            token_row += [r] * n
            visible += range(start + 1, start + n + 1)
            if decode_row:
                decode.append((r, first))
            else:
                chunk += [
                    (r, first + t0, min(CHUNK_TILE, n - t0)) for t0 in range(0, n, CHUNK_TILE)
                ]
            dest += range(r * lmax, r * lmax + start + n)
            row_tokens.append((first, n, start + n))
            first += n
        tiles = [x for t in chunk for x in t] + [x for t in decode for x in t]
        host = torch.tensor(token_index + token_row + visible + tiles + dest, dtype=torch.int64)
        if device.type == "cuda":  # one pinned copy: a pageable one makes the host wait
            host = host.pin_memory().to(device, non_blocking=True)
        ts, nc, nd = len(token_index), len(chunk), len(decode)
        t0 = 3 * ts
        key_slots = torch.zeros(len(rows) * lmax, dtype=torch.int32, device=device)
        key_slots[host[t0 + len(tiles) :]] = torch.cat([r[3] for r in rows]).int()
        return cls(
            host[:ts],
            host[ts : 2 * ts],
            host[2 * ts : t0].int(),
            key_slots.view(len(rows), lmax),
            host[t0 : t0 + 3 * nc].int().view(nc, 3),
            host[t0 + 3 * nc : t0 + 3 * nc + 2 * nd].int().view(nd, 2),
            row_tokens,
        )


def logits_rows_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    plan: SelectPlan,
    maxima: torch.Tensor | None = None,
) -> torch.Tensor:
    """The indexer_logits_rows contract, a row at a time on torch_ref.indexer_logits:
    q [Ts, Hi, D] and weights [Ts, Hi] of the plan's tokens, keys the layer's key pages
    ([blocks, E, D], or [blocks, E, D + 4] uint8: FP8 keys, stages/kernels/fp8_indexer.py, of
    which each row's are dequantized, scored by the FP8 queries) -> [Ts, Lmax] fp32, -inf where
    the token does not see the key; maxima (maxima_buffer) filled with the group maxima."""
    ts, lmax = q.shape[0], plan.key_slots.shape[1]
    out = torch.full((ts, lmax), float("-inf"), dtype=torch.float32, device=q.device)
    fp8 = keys.dtype == torch.uint8
    if fp8:  # FP8 keys: FP8 queries (fp8_indexer.quantize_queries)
        q8, q_scale = fp8_indexer.quantize_queries(q)
        q, weights = q8.float(), weights.float() * q_scale
    flat = None if fp8 else keys.reshape(-1, keys.shape[-1])
    for r, (first, n, length) in enumerate(plan.row_tokens):
        span = slice(first, first + n)
        slots = plan.key_slots[r, :length].long()
        k = fp8_indexer.read(keys, slots) if flat is None else flat.index_select(0, slots)
        out[span, :length] = torch_ref.indexer_logits(q[span], k, weights[span], scale)
    cols = torch.arange(lmax, device=q.device)
    out.masked_fill_(cols[None, :] >= plan.visible[:, None], float("-inf"))
    if maxima is not None:
        group_maxima(out, maxima)
    return out


def scores_with_maxima(
    score: Callable[..., torch.Tensor],
    q: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    plan: SelectPlan,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scores, their group maxima) from the kernels' indexer_logits_rows `score`, which
    writes both as it scores; index_topk takes the maxima with the scores. A plan of decode
    rows only gets none: for so few lines the decode kernel's maxima cost more than the
    top-k's own pass (512 rows x 64K keys on an H100: scores 3.37 -> 3.77 ms, the top-k
    0.35 -> 0.32; docs/bench/session26/call1)."""
    if not plan.chunk_tiles.shape[0]:
        return score(q, keys, weights, scale, plan), None
    maxima = maxima_buffer(q.shape[0], plan.key_slots.shape[1], q.device)
    return score(q, keys, weights, scale, plan, maxima=maxima), maxima


def topk_slots(
    logits: torch.Tensor,
    plan: SelectPlan,
    k: int,
    top_k: Callable[..., torch.Tensor] | None = None,
    maxima: torch.Tensor | None = None,
) -> torch.Tensor:
    """[Ts, k] int32 cache slots of each token's top k keys; -1 where a token sees fewer.
    top_k: the kernels' index_topk (the rule's positions), top_k_positions by default;
    maxima: the logits' group maxima where the scores op wrote them."""
    pos = (top_k or top_k_positions)(logits, k, maxima=maxima)
    slots = plan.key_slots[plan.token_row[:, None], pos]
    return slots.masked_fill(logits.gather(1, pos) == float("-inf"), -1).int()


def top_k_positions(
    scores: torch.Tensor, k: int, maxima: torch.Tensor | None = None
) -> torch.Tensor:
    """[..., k] long: the positions (last dim) of each line's k highest scores, among equal
    scores the lower position first, in that order -- what a stable descending sort keeps, and
    the one rule of every selection path (DSA, CSA; CPU, CUDA; batched or alone). torch leaves
    the choice among tied values to the implementation (on CPU it changed with the line's
    width, i.e. with the batch's padding), and the indexer's ReLU makes exact ties common.

    The scores' -0.0 become 0.0 in place (equal as floats, not as radix keys). On CPU every
    score becomes a distinct int64 key (`_rule_keys`) and any top-k over distinct keys is one
    answer. On CUDA torch's radix-select top-k already keeps the rule's set -- it gathers the
    values equal to the k-th in position order (tests/gpu/test_indexer_kernel.py checks it on
    one-block and multi-block lines) -- at a third of the int64 keys' cost; the k chosen are
    then put in the rule's order by the same keys. maxima (the lines' group maxima, which
    the index_topk contract passes on) are not needed here."""
    scores = scores.add_(0.0)
    if scores.is_cuda:
        return rule_order(scores, scores.topk(k, dim=-1, sorted=False).indices)
    width = scores.shape[-1]
    return _rule_keys(scores, torch.arange(width, device=scores.device), width).topk(k).indices


def rule_order(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The chosen positions of each line of `scores` (-0.0 read as 0.0) put in the rule's order:
    higher score first, among equal ones the lower position."""
    values = scores.gather(-1, positions).add_(0.0)
    keys = _rule_keys(values, positions, scores.shape[-1])
    return positions.gather(-1, keys.sort(dim=-1, descending=True).indices)


def _rule_keys(values: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """int64 keys ordered as the rule orders (value, then lower position): the float's order
    in the high 32 bits (two's-complement order of IEEE floats: negative ones have their
    magnitude bits flipped), the position reversed in the low ones."""
    ordered = values.float().view(torch.int32)
    ordered = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).long()
    return (ordered << 32) | ((width - 1) - positions)
