"""The engine's side of a pipeline stage's module: what it is built for (StageContext) and what
the engine calls of it (StageModel). A family's stage class (stages/models/stage.py's Stage and
its subclasses) takes the one and is the other; the loader (build_stage_model) makes the
context, and the runner holds the model. Both live outside stages/models/, which the engine
reaches only through the family table (tests/unit/test_import_rules.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import nn

from stages.forward_batch import ForwardBatch, PagedDecodeBatch
from stages.kernels.registry import Kernels
from stages.kv_cache import KVCache
from stages.model_config import ModelArgs
from stages.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from stages.attention.base import AttentionBackend


class Piece(NamedTuple):
    """One checkpoint tensor (or its `source` slice, on a tensor-parallel rank) and where it
    goes in a parameter (`at`, an index). `shape` is the whole checkpoint tensor's, given with a
    source slice: the random init draws the whole tensor, so every split gets the same
    weights."""

    name: str
    at: tuple[Any, ...] = ()
    source: tuple[Any, ...] = ()
    shape: tuple[int, ...] = ()


# Parameter -> the pieces it is loaded from (a fused, stacked or split parameter).
Sources = dict[str, list[Piece]]


@dataclass(frozen=True)
class StageContext:
    """One stage's place in the model and what it computes with.

    `layers` are the global indices of the layers the stage holds, a contiguous, non-empty
    range within the model's (checked here, once for every family). The first stage embeds
    token ids; the last applies the final norm and LM head (and holds the embedding too when
    the model ties them). `tp` is the tensor-parallel group the stage's layers are split over
    (one rank unless --tp > 1): each rank builds the context of its own slice."""

    args: ModelArgs
    layers: range
    is_first: bool
    is_last: bool
    kernels: Kernels
    dtype: torch.dtype
    device: torch.device
    tp: TensorParallel = field(default_factory=TensorParallel)

    def __post_init__(self) -> None:
        n, r = self.args.num_hidden_layers, self.layers
        if r.step != 1 or not 0 <= r.start < r.stop <= n:
            raise ValueError(
                f"bad layer range {_show(r)} for a model with {n} layers: a stage holds "
                f"layers [start, end) with 0 <= start < end <= {n}"
            )

    @property
    def layer_start(self) -> int:
        return self.layers.start

    @property
    def layer_end(self) -> int:
        return self.layers.stop

    @property
    def num_local_layers(self) -> int:
        return len(self.layers)

    @property
    def holds_embedding(self) -> bool:
        """The first stage embeds; the last uses the embedding as its head when tied."""
        return self.is_first or (self.is_last and self.args.tie_word_embeddings)


def _show(r: range) -> str:
    return f"[{r.start}, {r.stop})" + (f" step {r.step}" if r.step != 1 else "")


class StageModel(Protocol):
    """A family's stage module as the engine uses it: the runner calls it, the loader fills
    its parameters, the bench swaps its modules' kernels. Every Stage is one."""

    @property
    def ctx(self) -> StageContext: ...

    def __call__(
        self,
        inputs: torch.Tensor,
        batch: ForwardBatch | PagedDecodeBatch,
        kv: KVCache,
        *token_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Token ids [T] (first stage) or hidden [T, *hidden_shape] -> hidden, before the final
        norm; token_ids only for a later stage whose layers route by them (hash MoE)."""
        ...

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor: ...

    # the attention backend of the stage's cache kind (stages/attention/base.py)
    attention: AttentionBackend[Any]

    def decode_graph_variants(self, max_model_len: int) -> tuple[tuple[int, int], ...]: ...

    def decode_graph_workspace(self, max_rows: int, max_model_len: int) -> int: ...

    def checkpoint_sources(self) -> Sources: ...

    def warm_up_experts(
        self, lengths: list[int], dtype: torch.dtype, device: torch.device
    ) -> dict[str, float]: ...

    # the nn.Module parts the loader and the bench read
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def buffers(self) -> Iterator[torch.Tensor]: ...

    def modules(self) -> Iterator[nn.Module]: ...
