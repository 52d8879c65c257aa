"""The index arithmetic of one DeepSeek-V4 microbatch, for every row at once and once per forward.

A layer then issues a fixed number of kernels whatever the number of rows: one gather of the
window latents and one of the compressed entries into the attention's key pool, one batched
completion of the compression groups whose last token is in the forward, and (CSA) one indexer
scoring of every token against its own row's entries followed by one top-k.

Everything here is computed on the host from the rows' positions and block tables (host lists
of the ForwardBatch) with vectorised numpy ops and copied to the device in one pinned,
non-blocking copy: nothing in a layer waits for the device.

The key pool of a layer is [every row's window latents, then every row's compressed entries];
`indices` address it, -1 where a query has no key.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stages.forward_batch import ForwardBatch, PagedDecodeBatch
from stages.kernels.indexer_select import CHUNK_TILE, SelectPlan
from stages.kernels.registry import Kernels

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
    # [G] bool: the groups that complete (a graphed decode step plans a group per row, most not
    # complete: their entries go to the scratch block, and group_pool reads nothing for them);
    # None: every group
    live: torch.Tensor | None = None


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
    # a decode-only microbatch's [B, max_entries] entry slots (V4Plan.paged): a CSA layer then
    # gathers only the entries its indexer picked, not every row's entries
    entry_table: torch.Tensor | None = None


@dataclass
class ChunkSplit:
    """A forward holding prefill chunks and decode rows: the chunks' tokens and the decode rows'
    tokens, and the key pool positions of the chunks' rows, so that over an FP8 cache the
    chunks attend on the bf16 prefill kernel to their keys gathered dequantized, as in a
    forward of chunks only, and the decode rows on the FP8 kernel reading the pages in place."""

    chunk_tokens: torch.Tensor  # [Tc] long
    decode_tokens: torch.Tensor  # [Td] long
    window_pool: torch.Tensor  # [Nw'] long: the chunks' rows' window latents in the pool
    entry_pool: dict[int, torch.Tensor]  # rate -> [Ne'] long: their entries, from the rate's 0
    entry_width: dict[int, int]  # rate -> the most entries one of the chunks' rows has (host)


@dataclass
class V4Plan:
    window_slots: torch.Tensor  # [Nw] long: KV slots of each row's window, rows concatenated
    window_indices: torch.Tensor  # [T, window] int32: pool index of each query's window keys
    rates: dict[int, RatePlan]
    # every row is a prefill chunk (more than one token): its keys may be gathered as a pool
    # (decode rows' pools would hold all their compressed entries)
    chunks_only: bool = False
    split: ChunkSplit | None = None  # chunks and decode rows alike in the forward
    # what a forward's layers share over an FP8 cache (V4Backend.fp8_slots): the window's slot
    # ids (every layer's) and the kernel's state derived from them; per rate, what the layers
    # that attend without selecting share (HCA at that rate, 0: sliding): their entries' slot
    # ids and the kernel's state derived from those; at minus a rate, the kernel's schedule
    # the selecting (CSA) layers of that rate share
    fp8_window: torch.Tensor | None = None  # [T, window] int32
    fp8_window_state: dict[str, Any] = field(default_factory=dict)
    fp8_shared: dict[int, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        window: int,
        rates: dict[int, tuple[bool, bool]],
        block_size: int,
        device: torch.device,
        split: bool = False,
    ) -> "V4Plan":
        """rates: rate -> (whether a layer attends to every entry, whether one selects by the
        indexer) among the stage's layers. split: plan a ChunkSplit where chunks and decode
        rows share the forward (an FP8 cache's)."""
        rows = _Rows(batch)
        w0 = np.maximum(rows.starts - window + 1, 0)
        win_rows, win_pos = _ragged(w0, rows.ends - w0)
        host = {"window_slots": rows.slots(win_rows, win_pos, block_size)}
        # a query at position p reads window key j (position p - window + 1 + j) at pool index
        # key - w0 + (its row's first window index)
        win_base = np.cumsum(rows.ends - w0) - (rows.ends - w0) - w0
        host["window_offset"] = win_base[rows.token_row]
        host["token_row"] = rows.token_row
        nw = int(host["window_slots"].size)
        chunk_rows = ~rows.decode
        mixed = split and bool(chunk_rows.any() and rows.decode.any())
        if mixed:
            host["split.chunk_tokens"] = np.flatnonzero(chunk_rows[rows.token_row])
            host["split.decode_tokens"] = np.flatnonzero(rows.decode[rows.token_row])
            win_len = rows.ends - w0
            host["split.window"] = _ragged((np.cumsum(win_len) - win_len)[chunk_rows],
                                           win_len[chunk_rows])[1]  # fmt: skip
        shapes: dict[int, dict[str, int]] = {}
        chunk_widths: dict[int, int] = {}
        tiles: dict[int, list[tuple[slice, list[tuple[int, int, int]], int, int]]] = {}
        for rate, (_, selects) in rates.items():
            per_block = block_size // rate
            counts = rows.ends // rate
            most = int(counts.max())
            e_rows, e_ids = _ragged(np.zeros_like(counts), counts)
            base = np.cumsum(counts) - counts + nw
            firsts = rows.starts // rate
            g_rows, g_ids = _ragged(firsts, counts - firsts)
            tokens = (g_ids[:, None] - 1) * rate + np.arange(2 * rate)[None, :]
            g_tok_rows = np.broadcast_to(g_rows[:, None], tokens.shape)
            host |= {
                f"{rate}.entry_slots": rows.slots(e_rows, e_ids, per_block),
                f"{rate}.key_dest": e_rows * most + e_ids,
                f"{rate}.token_base": base[rows.token_row],
                f"{rate}.input_slots": rows.slots(g_tok_rows, np.maximum(tokens, 0), block_size),
                f"{rate}.first": (g_ids == 0).astype(np.int64),
                f"{rate}.positions": g_ids * rate,
                f"{rate}.group_slots": rows.slots(g_rows, g_ids, per_block),
            }
            shapes[rate] = {"groups": int(g_ids.size), "max": most}
            if mixed:
                host[f"split.{rate}"] = _ragged((base - nw)[chunk_rows], counts[chunk_rows])[1]
                chunk_widths[rate] = int(counts[chunk_rows].max())
            if selects and most:
                tiles[rate] = []
                for i, (span, chunk, decode, row_tokens) in enumerate(
                    rows.select_tiles(most, rate)
                ):
                    host[f"{rate}.tile{i}"] = np.concatenate((chunk.ravel(), decode.ravel()))
                    tiles[rate].append((span, row_tokens, chunk.size, decode.size))
        names = list(host)
        flat = torch.from_numpy(np.concatenate([host[n].reshape(-1) for n in names]))
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        parts = dict(zip(names, flat.split([host[n].size for n in names])))
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
                token_row = parts["token_row"]
                for i, (span, row_tokens, nc, nd) in enumerate(tiles[rate]):
                    packed = parts[f"{rate}.tile{i}"].int()
                    plan = SelectPlan(
                        token_index=torch.arange(span.start, span.stop, device=flat.device),
                        token_row=token_row[span],
                        visible=visible[span].int(),
                        key_slots=key_slots.view(rows.count, most),
                        chunk_tiles=packed[:nc].view(-1, 3),
                        decode_tiles=packed[nc : nc + nd].view(-1, 2),
                        row_tokens=row_tokens,
                    )
                    select.append((span, plan))
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
        chunks_only = not any(batch.row_decode)
        chunk_split = None
        if mixed:
            chunk_split = ChunkSplit(
                parts["split.chunk_tokens"],
                parts["split.decode_tokens"],
                parts["split.window"],
                {rate: parts[f"split.{rate}"] for rate in rates},
                chunk_widths,
            )
        return cls(parts["window_slots"], window_indices, plans, chunks_only, chunk_split)

    @classmethod
    def paged(
        cls,
        batch: PagedDecodeBatch,
        window: int,
        rates: dict[int, tuple[bool, bool]],
        kernels: Kernels,
    ) -> "V4Plan":
        """A decode-only microbatch from its static buffers with device ops only (what a CUDA
        graph replays), every width fixed: the window padded to `window` keys, each rate's
        entries to what a row of batch.select_width tokens has, one compression group per row
        and rate (written to the scratch block unless the row's token completes it). Padding
        rows (length 0) see no key; their outputs are dropped. The index arithmetic is the
        kernels' v4_window_index / v4_rate_index (stages/kernels/v4_paged_index.py)."""
        if kernels.v4_window_index is None or kernels.v4_rate_index is None:
            raise RuntimeError("DeepSeek-V4 decode graphs need kernels.v4_*_index, unset here")
        n, dev = batch.num_tokens, batch.positions.device
        buffers = (batch.positions, batch.lengths, batch.table_rows, batch.block_tables)
        win = kernels.v4_window_index(*buffers, batch.block_size, window)
        plans = {}
        for rate, (dense, selects) in rates.items():
            most = -(-batch.select_width // rate)
            r = kernels.v4_rate_index(
                *buffers, batch.block_size, window, rate, most, dense, batch.scratch_slot
            )
            select: list[tuple[slice, SelectPlan]] = []
            if selects:
                rows = torch.arange(n, device=dev)
                plan = SelectPlan(
                    token_index=rows,
                    token_row=rows,
                    visible=r.visible.int(),
                    key_slots=r.table32,
                    chunk_tiles=torch.zeros(0, 3, dtype=torch.int32, device=dev),
                    decode_tiles=torch.stack((rows, rows), dim=1).int(),
                    row_tokens=[(i, 1, most) for i in range(n)],
                )
                select.append((slice(0, n), plan))
            plans[rate] = RatePlan(
                rate=rate,
                max_entries=most,
                entry_slots=r.table.reshape(-1),
                token_base=r.base,
                visible=r.visible,
                groups=GroupPlan(
                    n, r.input_slots, r.first, r.group_positions, r.entry_slots, r.completes
                ),
                dense_indices=r.dense,
                select=select,
                entry_table=r.table if selects else None,
            )
        return cls(win.slots, win.indices, plans)


class _Rows:
    """The forward's rows as host (numpy) arrays."""

    def __init__(self, batch: ForwardBatch):
        self.count = len(batch.row_starts)
        self.starts = np.array(batch.row_starts, dtype=np.int64)
        self.lens = np.array(batch.row_lens, dtype=np.int64)
        self.decode = np.array(batch.row_decode, dtype=bool)
        self.offsets = np.array(batch.row_offsets, dtype=np.int64)
        self.ends = self.starts + self.lens
        self.token_row = np.repeat(np.arange(self.count), self.lens)
        lengths = np.array([len(t) for t in batch.block_tables], dtype=np.int64)
        self.table_start = np.cumsum(lengths) - lengths
        self.tables = np.fromiter(
            itertools.chain.from_iterable(batch.block_tables),
            dtype=np.int64,
            count=int(lengths.sum()),
        )

    def slots(self, rows: np.ndarray, index: np.ndarray, per_block: int) -> np.ndarray:
        """Cache slots of entry `index` of each `rows`' request, blocks of `per_block` entries."""
        blocks = self.tables[self.table_start[rows] + index // per_block]
        slots: np.ndarray = blocks * per_block + index % per_block
        return slots

    def select_tiles(
        self, most: int, rate: int
    ) -> list[tuple[slice, np.ndarray, np.ndarray, list[tuple[int, int, int]]]]:
        """The indexer's token tiles of at most SCORE_TILE_BYTES of scores against `most`
        entries per row: (tokens, chunk tiles [n, 3], decode tiles [m, 2], row_tokens) each,
        the host parts of its SelectPlan (each row's entries are its keys, a token sees the
        entries before its position)."""
        total = int(self.lens.sum())
        step = max(1, SCORE_TILE_BYTES // (4 * most))
        step = max(CHUNK_TILE, step - step % CHUNK_TILE) if step >= CHUNK_TILE else step
        counts = (self.ends // rate).tolist()
        row_ids = np.arange(self.count)
        tiles = []
        for a in range(0, total, step):
            b = min(total, a + step)
            lo = np.maximum(a, self.offsets)
            hi = np.minimum(b, self.offsets + self.lens)
            inside = hi > lo
            one = inside & self.decode  # a prefill chunk of one token is scored as a chunk
            decode = np.stack((row_ids[one], lo[one] - a), axis=1)
            many = inside & ~self.decode
            # each chunk row's tokens in the tile, in CHUNK_TILE pieces
            pieces = -(-(hi[many] - lo[many]) // CHUNK_TILE)
            piece_rows, piece_ids = _ragged(np.zeros_like(pieces), pieces)
            t0 = lo[many][piece_rows] + piece_ids * CHUNK_TILE
            chunk = np.stack(
                (
                    row_ids[many][piece_rows],
                    t0 - a,
                    np.minimum(CHUNK_TILE, hi[many][piece_rows] - t0),
                ),
                axis=1,
            )
            row_tokens = list(zip((lo - a).tolist(), np.maximum(0, hi - lo).tolist(), counts))
            tiles.append((slice(a, b), chunk, decode, row_tokens))
        return tiles


def _ragged(first: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, value) of values first[r] .. first[r] + count[r] - 1 of every row r, concatenated."""
    rows = np.repeat(np.arange(count.size), count)
    starts = np.cumsum(count) - count
    return rows, np.arange(rows.size) - starts[rows] + first[rows]
