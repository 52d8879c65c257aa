"""Per-microbatch metadata the model needs, built once per forward and passed as an argument."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [T] long: position of every token
    slot_mapping: torch.Tensor  # [T] long: KV cache slot of every token
    row_starts: list[int]  # position of each row's first new token
    row_lens: list[int]  # new tokens per row
    row_offsets: list[int]  # where each row's tokens begin in T
    block_tables: list[list[int]]
    sample_indices: torch.Tensor  # [R] long: index in T of the last token of each sampling row

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @classmethod
    def build(cls, rows: list[tuple[int, int, list[int], bool]], block_size: int,
              device: str | torch.device = "cpu") -> "ForwardBatch":
        """rows: (start, num_tokens, block_table, sample) per row, in token order."""
        positions: list[int] = []
        slots: list[int] = []
        starts, lens, offsets, tables, samples = [], [], [], [], []
        for start, n, table, sample in rows:
            if n < 1:
                raise ValueError(f"a row needs at least one token, got {n}")
            end = start + n
            if -(-end // block_size) > len(table):
                raise ValueError(f"row ending at position {end} needs "
                                 f"{-(-end // block_size)} blocks, table has {len(table)}")
            offsets.append(len(positions))
            for p in range(start, end):
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
            starts.append(start)
            lens.append(n)
            tables.append(list(table))
            if sample:
                samples.append(len(positions) - 1)
        return cls(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            row_starts=starts, row_lens=lens, row_offsets=offsets, block_tables=tables,
            sample_indices=torch.tensor(samples, dtype=torch.long, device=device),
        )
