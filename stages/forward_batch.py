"""Per-microbatch metadata the model needs, built once per forward and passed as an argument."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class DecodeGroup:
    """Rows of one new token each whose attention runs as one padded call (one per layer instead
    of one per row: a decode batch of dozens of rows is otherwise bound by host overhead)."""

    token_index: torch.Tensor  # [R] long: each row's token in T
    slots: torch.Tensor  # [R, Lmax] long: KV slots of each row's prefix, padded with slot 0
    mask: torch.Tensor  # [R, Lmax] bool: True where the key is real


# Keys one decode group may pad to, summed over its rows: its gathered K/V is a temporary of
# MAX_GROUP_KEYS x Hkv x D x 2 per layer (1 GiB at Llama-8B's 8 x 128 in bf16), so long-context
# rows form small groups or none, instead of one tensor for all of them.
MAX_GROUP_KEYS = 1 << 18
# Rows with longer prefixes are never grouped: a group copies (and pads) every row's K/V per
# layer, while a lone row reads its K/V in place when its blocks are consecutive; past a few
# thousand keys the copy costs more than the per-row call it saves (docs/PERFORMANCE.md).
MAX_GROUP_ROW_KEYS = 4096


def decode_buckets(
    lengths: dict[int, int], max_keys: int = MAX_GROUP_KEYS, max_row_keys: int = MAX_GROUP_ROW_KEYS
) -> list[list[int]]:
    """Decode rows (row -> prefix length) grouped so padding at most doubles a group's keys:
    one power-of-two length bucket per group, split so rows x bucket width <= max_keys; rows
    longer than max_row_keys and groups of one are left to the per-row path."""
    buckets: dict[int, list[int]] = {}
    for row, length in lengths.items():
        if length <= max_row_keys:
            buckets.setdefault((length - 1).bit_length(), []).append(row)
    groups = []
    for bits, rows in sorted(buckets.items()):
        per_group = max(1, max_keys >> bits)  # the bucket's width is at most 2**bits
        groups += [rows[i : i + per_group] for i in range(0, len(rows), per_group)]
    return [g for g in groups if len(g) > 1]


# a decode group's host tensors: token index [R], padded prefix slots [R, Lmax], lengths [R]
GroupHost = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [T] long: position of every token
    slot_mapping: torch.Tensor  # [T] long: KV cache slot of every token
    row_starts: list[int]  # position of each row's first new token
    row_lens: list[int]  # new tokens per row
    row_offsets: list[int]  # where each row's tokens begin in T
    # a decode step (one token after the prompt), not a prefill chunk: a chunk of one token is
    # attended and scored as the chunk it would be part of in another batch
    row_decode: list[bool]
    block_tables: list[list[int]]
    sample_indices: torch.Tensor  # [R] long: index in T of the last token of each sampling row
    # Per row: KV slots of positions 0..start+n-1, the gather index of its attention prefix; a
    # slice when its blocks are consecutive (a lone long prompt's are), so attention reads in place.
    # Empty when built without prefixes (a family whose stage plans its own keys).
    prefix_slots: list[torch.Tensor | slice | None]  # None: the row is in a decode group
    decode_groups: list[DecodeGroup] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @classmethod
    def build(
        cls,
        rows: list[tuple[int, int, list[int], bool]],
        block_size: int,
        device: str | torch.device = "cpu",
        prefixes: bool = True,
        decode: Sequence[bool] | None = None,
    ) -> "ForwardBatch":
        """rows: (start, num_tokens, block_table, sample) per row, in token order. prefixes:
        also each row's prefix slots and the decode groups (the family's `attention_prefixes`).
        decode: which rows are decode steps (the plan's `not is_prefill`); by default every
        row of one token.

        Index tensors are made on the host with vectorised ops and copied once, pinned and
        non-blocking: a pageable copy per layer would make the host wait for the stream.
        """
        device = torch.device(device)
        starts = [r[0] for r in rows]
        lens = [r[1] for r in rows]
        tables = [list(r[2]) for r in rows]
        start_np = np.array(starts, dtype=np.int64)
        len_np = np.array(lens, dtype=np.int64)
        if rows and len_np.min() < 1:
            raise ValueError(f"a row needs at least one token, got {int(len_np.min())}")
        row_decode = [n == 1 for n in lens] if decode is None else list(decode)
        if len(row_decode) != len(rows) or any(d and n != 1 for d, n in zip(row_decode, lens)):
            raise ValueError("decode flags: one per row, and a decode row has one token")
        end_np = start_np + len_np
        need = -(-end_np // block_size)
        table_lens = np.array([len(t) for t in tables], dtype=np.int64)
        short = np.flatnonzero(need > table_lens)
        if short.size:
            r = int(short[0])
            raise ValueError(
                f"row ending at position {int(end_np[r])} needs {int(need[r])} blocks, "
                f"table has {int(table_lens[r])}"
            )
        offset_np = np.cumsum(len_np) - len_np
        total = int(len_np.sum())
        token_row = np.repeat(np.arange(len(rows)), len_np)
        position_np = np.arange(total) - offset_np[token_row] + start_np[token_row]
        table_start = np.cumsum(table_lens) - table_lens
        flat_tables = np.fromiter(
            itertools.chain.from_iterable(tables), dtype=np.int64, count=int(table_lens.sum())
        )
        blocks = flat_tables[table_start[token_row] + position_np // block_size]
        slot_np = blocks * block_size + position_np % block_size
        sample_np = (offset_np + len_np - 1)[np.array([r[3] for r in rows], dtype=bool)]
        host = [torch.from_numpy(a) for a in (position_np, slot_np, sample_np)]
        prefix: list[torch.Tensor | slice | None] = []
        group_host: list[GroupHost] = []
        if prefixes:
            prefix, group_host = _prefixes(
                starts, row_decode, offset_np.tolist(), tables, lens, block_size
            )
            # One pinned host buffer and one copy for every index of the batch: a pinned copy
            # per row (decode batches have dozens of rows) costs more host time than the step.
            host += [t.reshape(-1) for g in group_host for t in g]
            host += [p for p in prefix if isinstance(p, torch.Tensor)]
        flat = torch.cat(host)
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        parts = iter(flat.split([t.numel() for t in host]))
        positions_d, slots_d, samples_d = next(parts), next(parts), next(parts)
        decode_groups = []
        for _, padded, _ in group_host:
            token_index, slots_g, lengths = next(parts), next(parts), next(parts)
            width = padded.shape[1]
            mask = torch.arange(width, device=flat.device)[None, :] < lengths[:, None]
            decode_groups.append(DecodeGroup(token_index, slots_g.view(-1, width), mask))
        return cls(
            positions=positions_d,
            slot_mapping=slots_d,
            row_starts=starts,
            row_lens=lens,
            row_offsets=offset_np.tolist(),
            row_decode=row_decode,
            block_tables=tables,
            sample_indices=samples_d,
            prefix_slots=[next(parts) if isinstance(p, torch.Tensor) else p for p in prefix],
            decode_groups=decode_groups,
        )


def _prefixes(
    starts: list[int],
    decode: list[bool],
    offsets: list[int],
    tables: list[list[int]],
    lens: list[int],
    block_size: int,
) -> tuple[list[torch.Tensor | slice | None], list[GroupHost]]:
    """(each row's prefix slots on the host: a slice, a tensor, or None for a row of a decode
    group; each decode group's (token index, padded slots, lengths) on the host)."""
    prefix: list[torch.Tensor | slice] = []
    for start, n, table in zip(starts, lens, tables):
        end = start + n
        need = -(-end // block_size)
        first = table[0]
        if table[:need] == list(range(first, first + need)):
            prefix.append(slice(first * block_size, first * block_size + end))
        else:
            prefix.append(
                (
                    torch.tensor(table[:need], dtype=torch.long)[:, None] * block_size
                    + torch.arange(block_size, dtype=torch.long)[None, :]
                ).reshape(-1)[:end]
            )
    groups = decode_buckets({i: starts[i] + 1 for i, d in enumerate(decode) if d})
    group_host = []
    for rows_g in groups:
        full = [host_slots(prefix[i]) for i in rows_g]
        group_host.append(
            (
                torch.tensor([offsets[i] for i in rows_g], dtype=torch.long),
                torch.nn.utils.rnn.pad_sequence(full, batch_first=True),
                torch.tensor([len(f) for f in full], dtype=torch.long),
            )
        )
    grouped = {i for rows_g in groups for i in rows_g}
    # a grouped row's prefix is read through its group
    kept = [None if i in grouped else p for i, p in enumerate(prefix)]
    return kept, group_host


def host_slots(prefix: torch.Tensor | slice) -> torch.Tensor:
    """The host slot ids of a row's prefix, whichever form `build` kept it in."""
    if isinstance(prefix, slice):
        return torch.arange(prefix.start, prefix.stop, dtype=torch.long)
    return prefix


@dataclass
class PagedDecodeBatch:
    """A decode-only microbatch of one token per row, in the form a CUDA graph replays: static
    device tensors, K/V read in place through block tables (stages/decode_graphs.py fills them).
    Rows past the real ones are padding: length 0, KV written to a scratch slot."""

    positions: torch.Tensor  # [B] long
    slot_mapping: torch.Tensor  # [B] long: where each row's new K/V goes
    lengths: torch.Tensor  # [B] long: keys each row attends to (its position + 1)
    table_rows: torch.Tensor  # [B] long: each row's row in block_tables
    block_tables: torch.Tensor  # [N, max_blocks] int32, one row per request slot
    block_size: int
    num_splits: int  # fixed per captured shape: the kernel's grid must not change on replay
    # DSA: keys per row its indexer scores when some row has more than it keeps (a static
    # width, max_model_len rounded up); 0 when every row attends to its whole prefix.
    # DeepSeek-V4: the longest row the shape serves (its compressed entries' widths)
    select_width: int = 0
    scratch_slot: int = 0  # where padding rows write (DeepSeek-V4: also incomplete groups)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())
