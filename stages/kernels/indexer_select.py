"""DeepSeek-V3.2's indexer selection for every selecting row of a batch at once.

A forward builds one ``SelectPlan`` (host metadata, one copy to the device); each DSA layer then
scores all the plan's tokens against their own rows' keys in one call of the
``indexer_logits_rows`` op, into a [tokens, Lmax] buffer where keys a token does not see (the
future of its chunk, other rows' padding) are -inf, and ``topk_slots`` picks each token's top-k
in one batched top-k. No Python loop per row in a layer.

Ties: many keys score exactly 0 (the ReLU), so the k-th best score is often shared. The pick is
defined, not left to torch.topk's kernel: higher score first, then the earlier position. Scores
are turned into int64 keys that order exactly so (canonical zero, IEEE order in 32 bits, the
reversed position in the low 32), so one top-k over distinct keys yields it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.kernels import torch_ref

# Tokens of one row scored together by a program of the Triton kernel (with 64 index heads, 2
# tokens make a 128-row MMA); rows of one token (decode) get tiles of one.
TOKENS_PER_TILE = 2


@dataclass
class SelectPlan:
    token_index: torch.Tensor  # [Ts] long: the selecting rows' tokens in the batch
    token_row: torch.Tensor  # [Ts] long: each token's row in the plan
    visible: torch.Tensor  # [Ts] int32: keys each token sees (its row's prefix up to itself)
    key_slots: torch.Tensor  # [R, Lmax] int32: cache slot of each row position (0 padded)
    tiles: torch.Tensor  # [n, 3] int32: (row, first token in Ts, tokens) of each tile
    group: int  # tokens per tile at most
    row_tokens: list[tuple[int, int, int]]  # host copy: (first token in Ts, tokens, keys)

    @classmethod
    def build(
        cls, rows: list[tuple[int, int, int, torch.Tensor]], device: torch.device
    ) -> "SelectPlan":
        """rows: (offset in the batch, tokens, first token's position, slots [start + n])."""
        group = TOKENS_PER_TILE if any(n > 1 for _, n, _, _ in rows) else 1
        lmax = max(start + n for _, n, start, _ in rows)
        token_index, token_row, visible, tiles, dest, row_tokens = [], [], [], [], [], []
        first = 0
        for r, (off, n, start, _slots) in enumerate(rows):
            token_index += range(off, off + n)
            token_row += [r] * n
            visible += range(start + 1, start + n + 1)
            tiles += [(r, first + t0, min(group, n - t0)) for t0 in range(0, n, group)]
            dest += range(r * lmax, r * lmax + start + n)
            row_tokens.append((first, n, start + n))
            first += n
        host = torch.tensor(
            token_index + token_row + visible + [x for t in tiles for x in t] + dest,
            dtype=torch.int64,
        )
        if device.type == "cuda":  # one pinned copy: a pageable one makes the host wait
            host = host.pin_memory().to(device, non_blocking=True)
        ts, nt = len(token_index), len(tiles)
        key_slots = torch.zeros(len(rows) * lmax, dtype=torch.int32, device=device)
        key_slots[host[3 * ts + 3 * nt :]] = torch.cat([s for *_, s in rows]).int()
        return cls(
            host[:ts],
            host[ts : 2 * ts],
            host[2 * ts : 3 * ts].int(),
            key_slots.view(len(rows), lmax),
            host[3 * ts : 3 * ts + 3 * nt].int().view(nt, 3),
            group,
            row_tokens,
        )


def logits_rows_reference(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float, plan: SelectPlan
) -> torch.Tensor:
    """The indexer_logits_rows contract, a row at a time on torch_ref.indexer_logits:
    q [Ts, Hi, D] and weights [Ts, Hi] of the plan's tokens, keys [slots, D] the flat cache ->
    [Ts, Lmax] fp32, -inf where the token does not see the key."""
    ts, lmax = q.shape[0], plan.key_slots.shape[1]
    out = torch.full((ts, lmax), float("-inf"), dtype=torch.float32, device=q.device)
    for r, (first, n, length) in enumerate(plan.row_tokens):
        span = slice(first, first + n)
        k = keys.index_select(0, plan.key_slots[r, :length].long())
        out[span, :length] = torch_ref.indexer_logits(q[span], k, weights[span], scale)
    cols = torch.arange(lmax, device=q.device)
    return out.masked_fill_(cols[None, :] >= plan.visible[:, None], float("-inf"))


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys of fp32 scores [.., L]: larger score first, then the smaller position."""
    bits = (scores + 0.0).contiguous().view(torch.int32)  # + 0.0: -0.0 becomes 0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    pos = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    return (ordered << 32) | (scores.shape[-1] - 1 - pos)


def topk_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[.., k] positions of the top k by (score desc, position asc), best first."""
    return ordered_keys(scores).topk(k, dim=-1).indices


def topk_slots(logits: torch.Tensor, plan: SelectPlan, k: int) -> torch.Tensor:
    """[Ts, k] int32 cache slots of each token's top k keys; -1 where a token sees fewer."""
    pos = topk_positions(logits, k)
    slots = plan.key_slots[plan.token_row[:, None], pos]
    return slots.masked_fill(logits.gather(1, pos) == float("-inf"), -1).int()
