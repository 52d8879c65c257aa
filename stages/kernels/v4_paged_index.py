"""The index arithmetic of a DeepSeek-V4 decode-only microbatch on its static buffers (the
`v4_window_index`, `v4_rate_index` and `v4_pick_slots` ops' torch forms; V4Plan.paged assembles the
plan from the first two, a CSA layer's FP8 attention takes its picks' slots from the third): every
width fixed, so a CUDA graph replays it. Slot s of a component whose blocks hold E entries is entry
s % E of block s // E; a row's entry i lives in block table column i // E (past the table's last
column: its last block, for the caller to mask).

The torch forms take a few dozen small kernels a step (the Triton ones, one a call)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class WindowIndex(NamedTuple):
    indices: torch.Tensor  # [B, window] int32: row b key j at b * window + j (-1: none)
    slots: torch.Tensor  # [B * window] long: the window keys' KV slots (position 0's where none)


class RateIndex(NamedTuple):
    table: torch.Tensor  # [B, most] long: the slots of each row's entries 0..most-1
    table32: torch.Tensor  # the same, int32
    visible: torch.Tensor  # [B] long: entries before the row's position + 1 (0: padding)
    base: torch.Tensor  # [B] long: the pool index of the row's entry 0
    input_slots: torch.Tensor  # [B, 2 * rate] long: the token slots of groups g - 1 and g
    first: torch.Tensor  # [B] bool: the row's group is group 0
    group_positions: torch.Tensor  # [B] long: g * rate, where entry g's rope is taken
    entry_slots: torch.Tensor  # [B] long: where entry g goes (the scratch slot unless it completes)
    completes: torch.Tensor  # [B] bool: the row's token completes its group
    dense: torch.Tensor | None  # [B, window + most] int32: window then every visible entry


def _slots(tables: torch.Tensor, index: torch.Tensor, per_block: int) -> torch.Tensor:
    cols = (index // per_block).clamp(max=tables.shape[1] - 1)
    found: torch.Tensor = tables.gather(1, cols) * per_block + index % per_block
    return found


def _window(
    positions: torch.Tensor, lengths: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's window key positions [B, window], their pool indices [B, window] long: row b
    key j at b * window + j, -1 where the key is before position 0 or the row is padding)."""
    n, dev = positions.shape[0], positions.device
    keys = positions[:, None] - window + 1 + torch.arange(window, device=dev)
    own = torch.arange(n * window, device=dev).view(n, window)
    return keys, torch.where((keys >= 0) & (lengths > 0)[:, None], own, -1)


def window_index(
    positions: torch.Tensor,
    lengths: torch.Tensor,
    table_rows: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    window: int,
) -> WindowIndex:
    tables = block_tables.index_select(0, table_rows).long()
    keys, indices = _window(positions, lengths, window)
    return WindowIndex(indices.int(), _slots(tables, keys.clamp(min=0), block_size).reshape(-1))


def rate_index(
    positions: torch.Tensor,
    lengths: torch.Tensor,
    table_rows: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    window: int,
    rate: int,
    most: int,
    dense: bool,
    scratch_slot: int,
) -> RateIndex:
    n, dev = positions.shape[0], positions.device
    tables = block_tables.index_select(0, table_rows).long()
    per_block = block_size // rate
    live = lengths > 0
    entries = torch.arange(most, device=dev).expand(n, most)
    table = _slots(tables, entries, per_block)
    visible = torch.where(live, (positions + 1) // rate, 0)
    base = n * window + torch.arange(n, device=dev) * most
    group = torch.where(live, positions // rate, 0)
    completes = live & ((positions + 1) % rate == 0)
    tokens = (group[:, None] - 1) * rate + torch.arange(2 * rate, device=dev)
    entry = _slots(tables, group[:, None], per_block)[:, 0]
    scratch_entry = scratch_slot // block_size * per_block
    dense_indices = None
    if dense:
        comp = torch.where(entries < visible[:, None], entries + base[:, None], -1)
        dense_indices = torch.cat((_window(positions, lengths, window)[1], comp), dim=1).int()
    return RateIndex(
        table,
        table.int(),
        visible,
        base,
        _slots(tables, tokens.clamp(min=0), block_size),
        group == 0,
        group * rate,
        torch.where(completes, entry, scratch_entry),
        completes,
        dense_indices,
    )


def pick_slots(
    picked: torch.Tensor, table: torch.Tensor, visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, k] int32: the cache slot of each entry a decode row's indexer picked, -1 for none
    and for a pick the row does not see; [T] int32: each row's count of slots) of picked [T, k]
    entry ids in [-1, E), table [T, E] long (each row's entry slots), visible [T] (how many of
    them the row sees)."""
    chosen = table.gather(1, picked.clamp(min=0).long())
    seen = (picked >= 0) & (picked < visible[:, None])
    return torch.where(seen, chosen, -1).int(), seen.sum(dim=1, dtype=torch.int32)
