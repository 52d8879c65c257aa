"""What every attention backend is: one object per stage and cache kind, modelled on
mini-sglang's BaseAttnBackend.

A stage builds its backend once (Stage.__init__, from its StageContext: the chosen kernels,
dtype, device, tensor-parallel share) from the class its family names for the model
(Family.attention_backend). Per forward, the stage calls ``prepare(batch, cache)`` once and hands
the metadata it returns (decode rows, selection plans, key pools' indices) to every layer; each
layer's attention module calls its backend's ``forward`` with its projected queries and keys
instead of branching on the batch's kind or the cache's dtype itself. A backend's forward reads
the kernels of the layer that calls it (``layer.kernels``: the bench and tests swap a module's
kernels), so the ops it calls are the registry's choice (stages/kernels/registry.py).

CUDA graphs (stages/decode_graphs.py): ``capture_refusal(setting)`` says whether the backend's
decode step captures under the chosen kernels, block size and dtypes (the family's
paged_decode_graphs asks every backend it may choose, beside its non-attention ops);
``graph_variants`` and ``graph_workspace`` size the graphs; ``static_batch`` builds the static
metadata buffers of one graph (init_capture_graph); ``replay_meta`` the host rows copied into
them before a replay (prepare_for_replay). Capture and replay run ``prepare`` on the static batch
inside the graph (prepare_for_capture): a backend's metadata for a PagedDecodeBatch is built with
device ops only.

A backend that cannot serve an input says so, logged once and counted (stages/kernels/
fallbacks.py): a kernel refusing the model's shapes when the stage is built (the registry's
``supports``), a decode step that cannot be captured when the runner allocates its cache
(``announce_eager``), a call a kernel routes elsewhere (``record_fallback`` in the kernel).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

from stages.forward_batch import ForwardBatch, PagedDecodeBatch
from stages.kernels.fallbacks import Refusal, record_fallback
from stages.models.families import GraphSetting

if TYPE_CHECKING:
    from stages.protocol import Row
    from stages.stage_context import StageContext

Meta = TypeVar("Meta")
AnyBatch = ForwardBatch | PagedDecodeBatch


def on_torch(setting: GraphSetting, ops: list[str]) -> tuple[str, Refusal] | None:
    """The first of `ops` on its torch reference in `setting` (or unset), refused: the torch
    references sync with the host or size tensors from device values, so a step calling them
    is not captured."""
    for op in ops:
        if setting.kernels.get(op, "torch") == "torch":
            return op, Refusal("eager", f"{op} on the torch reference syncs with the host")
    return None


class AttentionBackend(ABC, Generic[Meta]):
    """One cache kind's attention for a stage. ``op`` names the registry op whose backend the
    kind's refusals are counted under; a subclass defines ``forward`` with its model's tensors
    (the kinds' layers hand over different projections)."""

    op: ClassVar[str]

    def __init__(self, ctx: StageContext):
        self.ctx = ctx

    # -- per forward -------------------------------------------------------------------------
    @abstractmethod
    def prepare(self, batch: AnyBatch, cache: Any) -> Meta:
        """The batch's attention metadata, shared by every layer of the forward (a
        PagedDecodeBatch's from its static buffers with device ops only: what a graph
        replays)."""

    # -- CUDA graphs -------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def capture_refusal(cls, setting: GraphSetting) -> tuple[str, Refusal] | None:
        """The op that keeps this kind's decode step from being captured under `setting` and
        why (None: it captures)."""

    @classmethod
    def can_capture(cls, setting: GraphSetting) -> bool:
        return cls.capture_refusal(setting) is None

    def announce_eager(self, setting: GraphSetting) -> bool:
        """On a device with graphs: say (log once, count) that this stage's decode steps run
        eager because of its attention, when they do. Returns whether it said so."""
        refused = self.capture_refusal(setting)
        if refused is None:
            return False
        op, refusal = refused
        backend = setting.kernels.get(op, "torch")
        record_fallback(op, backend, refusal.reason, f"decode steps run eager: {refusal.detail}")
        return True

    def graph_variants(self, max_model_len: int) -> tuple[tuple[int, int], ...]:
        """The decode-graph shapes of one batch-size bucket: (longest prefix it serves, the
        PagedDecodeBatch's select_width), shortest first. One shape serves every length unless
        the attention changes form with it (DSA's indexer, V4's entry widths)."""
        return ((max_model_len, 0),)

    def graph_workspace(self, max_rows: int, max_model_len: int) -> int:
        """Bytes of the graphs' attention temporaries that grow with max_model_len."""
        return 0

    def graph_splits(self, bucket: int) -> int:
        """The split-KV count of a bucket's kernel grid (fixed per captured shape)."""
        return 1

    def static_batch(
        self,
        bucket: int,
        width: int,
        meta: torch.Tensor,
        tables: torch.Tensor,
        block_size: int,
        scratch_slot: int,
    ) -> PagedDecodeBatch:
        """One graph's batch over the static buffers: meta [4, bucket] (positions, slot mapping,
        lengths, block-table rows) and the device block tables."""
        return PagedDecodeBatch(
            positions=meta[0],
            slot_mapping=meta[1],
            lengths=meta[2],
            table_rows=meta[3],
            block_tables=tables,
            block_size=block_size,
            num_splits=self.graph_splits(bucket),
            select_width=width,
            scratch_slot=scratch_slot,
        )

    @staticmethod
    def replay_meta(
        rows: tuple[Row, ...],
        bucket: int,
        block_tables: dict[str, list[int]],
        block_size: int,
        scratch_slot: int,
    ) -> list[list[int]]:
        """The host rows static_batch's meta is filled with before a replay; rows past the real
        ones pad the bucket (length 0, KV written to the scratch slot)."""
        pad, bs = bucket - len(rows), block_size
        return [
            [r.start for r in rows] + [0] * pad,
            [block_tables[r.req_id][r.start // bs] * bs + r.start % bs for r in rows]
            + [scratch_slot] * pad,
            [r.start + 1 for r in rows] + [0] * pad,
            [r.slot for r in rows] + [0] * pad,
        ]
