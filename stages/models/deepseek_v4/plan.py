"""The index arithmetic of one DeepSeek-V4 microbatch, for every row at once and once per forward.

A layer then issues a fixed number of kernels whatever the number of rows: one gather of the
window latents and one of the compressed entries into the attention's key pool, one batched
completion of the compression groups whose last token is in the forward, and (CSA) one indexer
scoring of every token against its own row's entries followed by one top-k.

Everything here is computed on the host from the rows' positions and block tables (host lists
of the ForwardBatch) with vectorised torch ops and copied to the device in one pinned,
non-blocking copy: nothing in a layer waits for the device.

The key pool of a layer is [every row's window latents, then every row's compressed entries];
`indices` address it, -1 where a query has no key.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from stages.forward_batch import ForwardBatch
from stages.kernels.indexer_select import CHUNK_TILE, SelectPlan

# Bytes of indexer scores ([tokens, entries] fp32) one call computes: a long prompt's chunk
# is scored in token tiles below it (an 8K chunk over a 256K prefix would need 2 GiB at once).
SCORE_TILE_BYTES = 512 << 20


@dataclass
class GroupPlan:
    """The compression groups of one rate whose last token is in this forward."""

    count: int  # groups (host)
    input_slots: torch.Tensor  # [G, 2 * rate] long: token slots of groups g - 1 and g
    first: torch.Tensor  # [G] bool: g == 0 (no group before it; its half is a dummy slot)
    positions: torch.Tensor  # [G] long: g * rate, where entry g's rope is taken
    entry_slots: torch.Tensor  # [G] long: where entry g goes


@dataclass
class RatePlan:
    """The compressed entries of one rate that the forward's rows attend to."""

    rate: int
    max_entries: int  # host: the most entries a row has
    entry_slots: torch.Tensor  # [Nc] long: each row's entries 0..count-1, rows concatenated
    token_base: torch.Tensor  # [T] long: pool index of the token's row's entry 0
    visible: torch.Tensor  # [T] long: entries before the token's position ((pos + 1) // rate)
    groups: GroupPlan
    # every visible entry (HCA layers): [T, window + max_entries] int32 pool indices, or None
    dense_indices: torch.Tensor | None
    # the indexer's scoring (CSA layers): token tiles with their SelectPlan, or empty
    select: list[tuple[slice, SelectPlan]]


@dataclass
class V4Plan:
    window_slots: torch.Tensor  # [Nw] long: KV slots of each row's window, rows concatenated
    window_indices: torch.Tensor  # [T, window] int32: pool index of each query's window keys
    rates: dict[int, RatePlan]

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        window: int,
        rates: dict[int, tuple[bool, bool]],
        block_size: int,
        device: torch.device,
    ) -> "V4Plan":
        """rates: rate -> (whether a layer attends to every entry, whether one selects by the
        indexer) among the stage's layers."""
        rows = _Rows(batch)
        w0 = (rows.starts - window + 1).clamp(min=0)
        win_rows, win_pos = _ragged(w0, rows.ends - w0)
        host = {"window_slots": rows.slots(win_rows, win_pos, block_size)}
        # a query at position p reads window key j (position p - window + 1 + j) at pool index
        # key - w0 + (its row's first window index)
        win_base = torch.cumsum(rows.ends - w0, 0) - (rows.ends - w0) - w0
        host["window_offset"] = win_base[rows.token_row]
        host["token_row"] = rows.token_row
        nw = int(host["window_slots"].numel())
        shapes: dict[int, dict[str, int]] = {}
        for rate in rates:
            per_block = block_size // rate
            counts = rows.ends // rate
            e_rows, e_ids = _ragged(torch.zeros_like(counts), counts)
            base = torch.cumsum(counts, 0) - counts + nw
            firsts = rows.starts // rate
            g_rows, g_ids = _ragged(firsts, counts - firsts)
            tokens = (g_ids[:, None] - 1) * rate + torch.arange(2 * rate)[None, :]
            g_tok_rows = g_rows[:, None].expand_as(tokens)
            host |= {
                f"{rate}.entry_slots": rows.slots(e_rows, e_ids, per_block),
                f"{rate}.key_dest": e_rows * int(counts.max()) + e_ids,
                f"{rate}.token_base": base[rows.token_row],
                f"{rate}.input_slots": rows.slots(g_tok_rows, tokens.clamp(min=0), block_size),
                f"{rate}.first": (g_ids == 0).long(),
                f"{rate}.positions": g_ids * rate,
                f"{rate}.group_slots": rows.slots(g_rows, g_ids, per_block),
            }
            shapes[rate] = {"groups": int(g_ids.numel()), "max": int(counts.max())}
        names = list(host)
        flat = torch.cat([host[n].reshape(-1) for n in names])
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        parts = dict(zip(names, flat.split([host[n].numel() for n in names])))
        positions = batch.positions
        keys = positions[:, None] - window + 1 + torch.arange(window, device=flat.device)
        window_indices = torch.where(keys < 0, -1, keys + parts["window_offset"][:, None]).int()
        plans = {}
        for rate, (dense, selects) in rates.items():
            groups, most = shapes[rate]["groups"], shapes[rate]["max"]
            visible = (positions + 1) // rate
            base = parts[f"{rate}.token_base"]
            dense_indices = None
            if dense and most:
                e = torch.arange(most, device=flat.device)[None, :]
                comp = torch.where(e < visible[:, None], e + base[:, None], -1).int()
                dense_indices = torch.cat((window_indices, comp), dim=1)
            select: list[tuple[slice, SelectPlan]] = []
            if selects and most:
                key_slots = torch.zeros(rows.count * most, dtype=torch.int32, device=flat.device)
                key_slots[parts[f"{rate}.key_dest"]] = parts[f"{rate}.entry_slots"].int()
                select = rows.select_tiles(
                    key_slots.view(rows.count, most), parts["token_row"], visible, rate
                )
            plans[rate] = RatePlan(
                rate=rate,
                max_entries=most,
                entry_slots=parts[f"{rate}.entry_slots"],
                token_base=base,
                visible=visible,
                groups=GroupPlan(
                    groups,
                    parts[f"{rate}.input_slots"].view(groups, 2 * rate),
                    parts[f"{rate}.first"].bool(),
                    parts[f"{rate}.positions"],
                    parts[f"{rate}.group_slots"],
                ),
                dense_indices=dense_indices,
                select=select,
            )
        return cls(parts["window_slots"], window_indices, plans)


class _Rows:
    """The forward's rows as host tensors."""

    def __init__(self, batch: ForwardBatch):
        self.count = len(batch.row_starts)
        self.starts = torch.tensor(batch.row_starts, dtype=torch.long)
        self.lens = torch.tensor(batch.row_lens, dtype=torch.long)
        self.offsets = torch.tensor(batch.row_offsets, dtype=torch.long)
        self.ends = self.starts + self.lens
        self.token_row = torch.repeat_interleave(torch.arange(self.count), self.lens)
        lengths = [len(t) for t in batch.block_tables]
        self.table_start = torch.tensor([0] + lengths[:-1], dtype=torch.long).cumsum(0)
        self.tables = torch.tensor(
            list(itertools.chain.from_iterable(batch.block_tables)), dtype=torch.long
        )

    def slots(self, rows: torch.Tensor, index: torch.Tensor, per_block: int) -> torch.Tensor:
        """Cache slots of entry `index` of each `rows`' request, blocks of `per_block` entries."""
        blocks = self.tables[self.table_start[rows] + index // per_block]
        return blocks * per_block + index % per_block

    def select_tiles(
        self, key_slots: torch.Tensor, token_row: torch.Tensor, visible: torch.Tensor, rate: int
    ) -> list[tuple[slice, SelectPlan]]:
        """The indexer's SelectPlans over token tiles of at most SCORE_TILE_BYTES of scores:
        each row's entries are its keys, a token sees the entries before its position."""
        total, most = int(self.lens.sum()), key_slots.shape[1]
        step = max(1, SCORE_TILE_BYTES // (4 * most))
        step = max(CHUNK_TILE, step - step % CHUNK_TILE) if step >= CHUNK_TILE else step
        device = key_slots.device
        counts = (self.ends // rate).tolist()
        offsets, lens = self.offsets.tolist(), self.lens.tolist()
        tiles = []
        for a in range(0, total, step):
            b = min(total, a + step)
            chunk: list[int] = []
            decode: list[int] = []
            row_tokens = []
            for r, (off, n) in enumerate(zip(offsets, lens)):
                lo, hi = max(a, off), min(b, off + n)
                row_tokens.append((lo - a, max(0, hi - lo), counts[r]))
                if hi <= lo:
                    continue
                if n == 1:
                    decode += (r, lo - a)
                else:
                    for t0 in range(lo, hi, CHUNK_TILE):
                        chunk += (r, t0 - a, min(CHUNK_TILE, hi - t0))
            host = torch.tensor(chunk + decode, dtype=torch.int32)
            if device.type == "cuda":
                host = host.pin_memory().to(device, non_blocking=True)
            token_index = torch.arange(a, b, device=device)
            tiles.append(
                (
                    slice(a, b),
                    SelectPlan(
                        token_index=token_index,
                        token_row=token_row[a:b],
                        visible=visible[a:b].int(),
                        key_slots=key_slots,
                        chunk_tiles=host[: len(chunk)].view(-1, 3),
                        decode_tiles=host[len(chunk) :].view(-1, 2),
                        row_tokens=row_tokens,
                    ),
                )
            )
        return tiles


def _ragged(first: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, value) of values first[r] .. first[r] + count[r] - 1 of every row r, concatenated."""
    rows = torch.repeat_interleave(torch.arange(count.numel()), count)
    starts = torch.cumsum(count, 0) - count
    return rows, torch.arange(rows.numel()) - starts[rows] + first[rows]
