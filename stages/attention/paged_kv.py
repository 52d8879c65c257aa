"""Paged K/V attention for GQA (Llama-family layers): each token's K and V per KV head in
blocks of the stage's PagedKVCache.

A decode-only microbatch (PagedDecodeBatch, what the decode graphs replay) reads K/V in place
through the block tables on the paged_decode op, one call for every row. A ForwardBatch's rows
attend to their gathered prefixes: a lone row (a long prompt's chunk) in one attention call with
no output copy, decode rows in padded groups (decode_attention, one call a group), every other
row in its own attention call. The metadata is the batch itself: ForwardBatch.build plans the
groups and prefix slots, the graphs' static buffers hold the rest.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.attention.base import AnyBatch, AttentionBackend, on_torch
from stages.forward_batch import PagedDecodeBatch
from stages.kernels.fallbacks import Refusal
from stages.kernels.triton_paged_decode import num_splits_for
from stages.kv_cache import PagedKVCache
from stages.models.families import GraphSetting


class PagedKVBackend(AttentionBackend[AnyBatch]):
    op = "paged_decode"

    @property
    def kv_heads(self) -> int:
        """The rank's KV heads (they size the paged kernel's split-KV grid); the layers refuse
        a share that does not divide when the stage is built."""
        return self.ctx.tp.part(self.ctx.args.num_key_value_heads, "num_key_value_heads")

    def prepare(self, batch: AnyBatch, cache: Any) -> AnyBatch:
        return batch

    @classmethod
    def capture_refusal(cls, setting: GraphSetting) -> tuple[str, Refusal] | None:
        """The paged Triton decode kernel: power-of-two blocks of at least 16."""
        bs = setting.block_size
        if bs < 16 or bs & (bs - 1):
            refusal = Refusal("page_size", f"block size {bs}: the paged kernel takes 2^k >= 16")
            return "paged_decode", refusal
        return on_torch(setting, ["paged_decode"])

    def graph_splits(self, bucket: int) -> int:
        """The paged kernel's splits per bucket fill the chip's SMs (one on the CPU)."""
        sms = None if self.ctx.device.type == "cuda" else 1
        return num_splits_for(bucket, self.kv_heads, sms)

    def forward(
        self,
        layer: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: AnyBatch,
        kv: PagedKVCache,
        local_layer: int,
    ) -> torch.Tensor:
        """q [T, Hq, D], the tokens' new k and v [T, Hkv, D] (written to the cache first, then
        each row attends to its whole prefix) -> [T, Hq, D]. `layer` holds the kernels and the
        scale."""
        kernels, scale, t = layer.kernels, layer.scale, q.shape[0]
        kv.write(local_layer, k, v, batch.slot_mapping)
        if isinstance(batch, PagedDecodeBatch):
            k_cache, v_cache = kv.kv[local_layer][0], kv.kv[local_layer][1]
            paged: torch.Tensor = kernels.paged_decode(
                q,
                k_cache,
                v_cache,
                batch.block_tables,
                batch.table_rows,
                batch.lengths,
                scale,
                batch.block_size,
                batch.num_splits,
            )
            return paged
        if len(batch.row_starts) == 1:  # a lone row (a long prompt's chunk): no output copy
            k_r, v_r = kv.gather(
                local_layer, batch.block_tables[0], batch.row_starts[0] + t, batch.prefix_slots[0]
            )
            lone: torch.Tensor = kernels.attention(q, k_r.to(q.dtype), v_r.to(q.dtype), scale)
            return lone
        o = torch.empty_like(q)
        for group in batch.decode_groups:
            k_g, v_g = kv.gather_padded(local_layer, group.slots)  # [R, Lmax, Hkv, D]
            o[group.token_index] = kernels.decode_attention(
                q[group.token_index], k_g.to(q.dtype), v_g.to(q.dtype), group.mask, scale
            )
        for start, n, off, table, idx in zip(
            batch.row_starts,
            batch.row_lens,
            batch.row_offsets,
            batch.block_tables,
            batch.prefix_slots,
        ):
            if idx is None:  # attended in its decode group above
                continue
            k_r, v_r = kv.gather(local_layer, table, start + n, idx)
            o[off : off + n] = kernels.attention(
                q[off : off + n], k_r.to(q.dtype), v_r.to(q.dtype), scale
            )
        return o
