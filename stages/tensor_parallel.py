"""The tensor-parallel group of one pipeline stage (`--tp N`): N ranks hold slices of the
stage's layers and meet in one collective per block.

Every rank runs the same plan on the same hidden state: column-parallel linears give each rank
its own heads or intermediate columns, row-parallel ones a partial sum that `all_reduce` adds up,
so the hidden state between blocks is whole (and bitwise equal) on every rank. The embedding and
the LM head split the vocabulary; the experts of a MoE are split whole (expert parallelism).

The sizes are known when the stage is built (the loader reads each rank's slices); the process
group is attached when the stage joins its channels (stages/channels.py), before any forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(eq=False)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: ProcessGroup | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of {self.size}")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def part(self, n: int, what: str) -> int:
        """This rank's share of `n` things split evenly (heads, columns, experts)."""
        if n % self.size:
            raise ValueError(
                f"{what} ({n}) is not divisible by the tensor-parallel size {self.size}"
            )
        return n // self.size

    def span(self, n: int, what: str) -> slice:
        """This rank's slice of `n` things split evenly."""
        p = self.part(n, what)
        return slice(self.rank * p, (self.rank + 1) * p)

    def vocab_span(self, vocab: int) -> slice:
        """This rank's rows of a vocabulary split in ceil(vocab / size) rows per rank (the last
        rank's slice may be shorter; its module pads to the common width)."""
        rows = self.vocab_rows(vocab)
        return slice(min(self.rank * rows, vocab), min((self.rank + 1) * rows, vocab))

    def vocab_rows(self, vocab: int) -> int:
        return -(-vocab // self.size)

    def attach(self, group: ProcessGroup | None) -> None:
        self.group = group

    def _group(self) -> ProcessGroup:
        if self.group is None:
            raise RuntimeError(
                "the stage's tensor-parallel group is not joined: connect() before a forward"
            )
        return self.group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place (`x` itself when the stage is one rank)."""
        if self.size > 1:
            dist.all_reduce(x, group=self._group())
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` (equal shapes) concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self._group())
        return torch.cat(parts, dim=dim)


def one_rank_unless(tp: TensorParallel | None) -> TensorParallel:
    """A module's group: `tp`, or a fresh group of one rank (collectives are the identity)."""
    return tp if tp is not None else TensorParallel()
