"""DeepSeek-V3.2 sparse attention (DSA): MLA over the keys a lightning indexer selects.

For every query, the indexer scores each key of the query's whole prefix (all cached tokens plus
the causal part of its own chunk) with a few small heads and keeps the top index_topk; MLA then
attends to those keys only, in the absorbed form (one latent head shared by every query head),
through the `mla_sparse` op (FlashMLA's sparse contract: slot ids into the flat latent cache, -1
for none). A row whose prefix fits in index_topk keys attends to all of it (dense), as in
transformers. The indexer's key (index_head_dim values per token, after its LayerNorm and rope)
is a second component of the latent cache, under the same block ids.

On a tensor-parallel stage the sparse attention's query heads are split like MLA's
(stages/models/mla.py) and the indexer is replicated: every rank holds its whole weights, scores
with all its heads and caches its whole key (index_head_dim values per token per layer on every
rank, beside the whole latent). Its inputs (the layer's hidden state, whole after the previous
all-reduce, the replicated q LoRA's output, the cached keys) are bitwise equal on every rank and
its computation deterministic (no atomics), so every rank selects the same keys with no
collective. Splitting its heads would save little (a few small heads) and cost an all-reduce of
every query's scores before the top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stages.forward_batch import ForwardBatch, PagedDecodeBatch
from stages.kernels.indexer_select import SelectPlan
from stages.kernels.registry import Kernels
from stages.model_config import ModelArgs
from stages.models.deepseek_config import INDEXER_KEY, IndexerArgs
from stages.models.layers import Device, Linear, apply_rope
from stages.models.mla import MLADecodeRows, MLAttention
from stages.models.mla_cache import LatentKVCache
from stages.tensor_parallel import TensorParallel


@dataclass
class SparseRows:
    """What every DSA layer of a forward shares: the indices of rows that attend densely (fixed
    for the whole forward) and the selecting rows' plan (None: no row selects)."""

    dense: torch.Tensor  # [T, topk] int32 slot ids, -1 padded; selecting rows' are overwritten
    plan: SelectPlan | None
    state: dict[Any, Any] = field(
        default_factory=dict
    )  # a kernel's per-batch plan, shared by layers
    # the prefill chunks' rows (any number of tokens): each one's prefix slots (what its
    # queries may select) and, beside decode rows, the chunks' and the decode rows' tokens
    prefixes: list[torch.Tensor] = field(default_factory=list)
    split: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def chunked(self) -> bool:
        return bool(self.prefixes)

    def prefix_keys(self, cache_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the chunks' prefix slots concatenated [S], position [cache_slots] int32 of each slot
        among them, -1 elsewhere): what a kernel dequantizing only the chunks' keys needs.
        Chunks sharing a slot (a cached prefix) share its key, so any of its positions serves."""
        slots = torch.cat([p.long() for p in self.prefixes])
        position = torch.full((cache_slots,), -1, dtype=torch.int32, device=slots.device)
        position[slots] = torch.arange(slots.numel(), dtype=torch.int32, device=slots.device)
        return slots, position

    @classmethod
    def build(
        cls, batch: ForwardBatch, block_size: int, topk: int, device: torch.device
    ) -> "SparseRows":
        # Rows of a decode group have no prefix index: theirs from their block tables, copied
        # in one transfer (a pageable copy per row would make the host wait for the stream).
        missing = [i for i, p in enumerate(batch.prefix_slots) if p is None]
        host = []
        for i in missing:
            table = torch.tensor(batch.block_tables[i], dtype=torch.long)
            pos = torch.arange(batch.row_starts[i] + 1)
            host.append(table[pos // block_size] * block_size + pos % block_size)
        built = {}
        if host:
            flat = torch.cat(host)
            if device.type == "cuda":
                flat = flat.pin_memory().to(device, non_blocking=True)
            built = dict(zip(missing, flat.split([h.numel() for h in host])))
        dense = torch.full((batch.num_tokens, topk), -1, dtype=torch.int32, device=device)
        selecting, prefixes = [], []
        for i, (start, n, off, one) in enumerate(
            zip(batch.row_starts, batch.row_lens, batch.row_offsets, batch.row_decode)
        ):
            length = start + n
            prefix = batch.prefix_slots[i]
            if prefix is None:
                prefix = slots = built[i]
            elif isinstance(prefix, slice):
                slots = torch.arange(prefix.start, prefix.stop, device=device)
            else:
                slots = prefix
            if not one:  # a prefill chunk, of one token too
                prefixes.append(slots)
            if length <= topk:
                row = slots[None, :].repeat(n, 1)
                if n > 1:  # keys of the chunk after the query
                    future = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
                    row[:, start:] = row[:, start:].masked_fill(future, -1)
                dense[off : off + n, :length] = row.int()
            else:
                selecting.append((off, n, start, slots, one))
        plan = SelectPlan.build(selecting, device) if selecting else None
        split = None
        if prefixes and len(prefixes) < len(batch.row_lens):
            chunk = torch.zeros(batch.num_tokens, dtype=torch.bool)
            for off, n, one in zip(batch.row_offsets, batch.row_lens, batch.row_decode):
                chunk[off : off + n] = not one
            tokens = torch.arange(batch.num_tokens)
            both = torch.cat((tokens[chunk], tokens[~chunk]))
            if device.type == "cuda":  # one transfer the host does not wait for, as above
                both = both.pin_memory().to(device, non_blocking=True)
            n_chunk = int(chunk.sum())
            split = (both[:n_chunk], both[n_chunk:])
        return cls(dense, plan, prefixes=prefixes, split=split)

    @classmethod
    def paged(cls, batch: PagedDecodeBatch, topk: int) -> "SparseRows":
        """A decode-only microbatch with a select width (some row has more keys than topk),
        from its static buffers with device ops only (what a CUDA graph replays): every row's
        indexer scores select_width keys (its own, then -inf) and its top-k are kept; a row
        with fewer keys than topk keeps them all, as the dense rule would. Padding rows see one
        key; their outputs are dropped."""
        width = batch.select_width
        if width < topk:
            raise ValueError(f"a select width of {width} is below index_topk {topk}")
        slots = _table_slots(batch, width)
        rows = torch.arange(batch.num_tokens, device=slots.device)
        plan = SelectPlan(
            token_index=rows,
            token_row=rows,
            visible=batch.lengths.clamp(min=1).int(),
            key_slots=slots,
            chunk_tiles=torch.zeros(0, 3, dtype=torch.int32, device=slots.device),
            decode_tiles=torch.stack((rows, rows), dim=1).int(),
            row_tokens=[(r, 1, width) for r in range(batch.num_tokens)],
        )
        return cls(slots.new_full((batch.num_tokens, topk), -1), plan)

    @classmethod
    def paged_dense(cls, batch: PagedDecodeBatch, topk: int) -> "SparseRows":
        """A decode-only microbatch whose rows all fit in topk keys, for a latent only the
        sparse kernel reads (FP8: SM90 has no dense decode of it): each row's indices are the
        slots of its whole prefix, -1 past its length, from the static block tables with
        device ops only. The width is topk or, when shorter, what the tables can hold (no row
        is longer). Padding rows see one key; their outputs are dropped."""
        width = min(topk, batch.block_tables.shape[1] * batch.block_size)
        slots = _table_slots(batch, width)
        pos = torch.arange(width, device=slots.device)
        beyond = pos[None, :] >= batch.lengths.clamp(min=1)[:, None]
        return cls(slots.masked_fill(beyond, -1), None)


def _table_slots(batch: PagedDecodeBatch, width: int) -> torch.Tensor:
    """[B, width] int32: the cache slots of positions 0..width-1 of every row (through its
    block-table row; positions past the table read its last block, for the caller to mask)."""
    bs = batch.block_size
    pos = torch.arange(width, device=batch.positions.device)
    tables = batch.block_tables.index_select(0, batch.table_rows)  # [B, max_blocks]
    cols = (pos // bs).clamp(max=tables.shape[1] - 1)
    slots: torch.Tensor = tables[:, cols] * bs + (pos % bs).int()
    return slots


class Indexer(nn.Module):
    """transformers' DeepseekV32Indexer: queries from the q LoRA's output, one shared key per
    token (LayerNorm, then half-split rope on its first qk_rope_head_dim values), per-head
    weights from the hidden state (an fp32 projection, as transformers keeps it). Whole on
    every rank of a tensor-parallel stage (the module docstring says why)."""

    def __init__(self, args: ModelArgs, kernels: Kernels, dtype: torch.dtype, device: Device):
        super().__init__()
        d = args.family_args
        ix: IndexerArgs = d.indexer
        self.ix, self.rope_dim = ix, d.qk_rope_head_dim
        self.scale = ix.head_dim**-0.5
        self.wq_b = Linear(d.q_lora_rank, ix.n_heads * ix.head_dim, False, kernels, dtype, device)
        self.wk = Linear(args.hidden_size, ix.head_dim, False, kernels, dtype, device)
        self.k_norm = nn.LayerNorm(ix.head_dim, eps=1e-6, dtype=dtype, device=device)
        self.weights_proj = nn.Linear(
            args.hidden_size, ix.n_heads, bias=False, dtype=torch.float32, device=device
        )

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x.split([self.rope_dim, x.shape[-1] - self.rope_dim], dim=-1)
        return torch.cat((apply_rope(rot, cos, sin, interleave=False), rest), dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, head_dim]: what the cache keeps per token."""
        return self._rope(self.k_norm(self.wk(x)), cos, sin)

    def queries(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [T, n_heads, head_dim], head weights [T, n_heads] fp32)."""
        q = self.wq_b(q_resid).view(x.shape[0], self.ix.n_heads, self.ix.head_dim)
        weights = F.linear(x.float(), self.weights_proj.weight) * self.ix.n_heads**-0.5
        return self._rope(q, cos[:, None], sin[:, None]), weights


class DSAttention(MLAttention):
    """MLA whose every row attends, in the absorbed form, to the keys its indexer selects; on a
    tensor-parallel stage the rank's heads over the keys the replicated indexer selects."""

    def __init__(
        self,
        args: ModelArgs,
        kernels: Kernels,
        dtype: torch.dtype,
        device: Device,
        tp: TensorParallel | None = None,
        backend: Any = None,
    ):
        super().__init__(args, kernels, dtype, device, tp, backend)
        self.indexer = Indexer(args, kernels, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: MLADecodeRows | SparseRows | None,
        batch: ForwardBatch | PagedDecodeBatch,
        kv: LatentKVCache,
        local_layer: int,
    ) -> torch.Tensor:
        """rows: the stage's attention backend's metadata (MLASparseBackend.prepare), which
        selects the keys and attends on bf16 or FP8 pages."""
        q_nope, q_pe, q_resid = self.project(x, cos, sin, batch, kv, local_layer)
        kv.write(local_layer, self.indexer.keys(x, cos, sin), batch.slot_mapping, INDEXER_KEY)
        o = self.backend.forward(
            self, x, q_nope, q_pe, q_resid, cos, sin, rows, batch, kv, local_layer
        )
        return self._project_out(o, x.shape[0])
