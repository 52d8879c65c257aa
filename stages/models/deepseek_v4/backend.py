"""DeepSeek-V4's attention backend (stages/attention/base.py): one K=V head over each query's
sliding window of latents and, in compressed layers, the compressed entries of its rate (HCA:
every complete group; CSA: the indexer's top-k), with per-head sinks, over the stage's V4Cache.

Per forward it plans the index arithmetic every layer shares (V4Plan: window slots and indices,
each rate's entries and completing groups; a decode-only microbatch's from its static buffers).
Per layer it gathers the key pool (window latents, then compressed entries) and attends on
sparse_sink_attention, or over an FP8 cache reads the pages in place at the keys' traced
addresses on sparse_sink_attention_fp8: the bf16/FP8 choice is the backend's. Over FP8, prefill
chunks gather their keys dequantized for the bf16 prefill kernel (in a forward that also holds
decode rows, split from them: split_fp8) unless mla_prefill_fp8 chose FlashMLA's FP8 kernel
for every query (fp8_prefill_in_place).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from stages.attention.base import AnyBatch, AttentionBackend, on_torch
from stages.forward_batch import PagedDecodeBatch
from stages.kernels.fallbacks import Refusal
from stages.kernels.registry import fp8_prefill_in_place
from stages.models.deepseek_v4.cache import V4Cache
from stages.models.deepseek_v4.config import COMP, CSA, KV, V4Args
from stages.models.deepseek_v4.layers import Angles
from stages.models.deepseek_v4.plan import V4Plan
from stages.models.families import GraphSetting

if TYPE_CHECKING:
    from stages.models.deepseek_v4.attention import V4Attention
    from stages.stage_context import StageContext

# The longest rows a decode graph shape serves, as far as max_model_len allows: the indexer
# scores, and HCA layers attend to, a static number of compressed entries per row, so a short
# row's step is not sized for the longest context.
GRAPH_LENGTHS = (4096, 32768, 262144)
# Bytes of the decode graphs' temporaries per row and per token of its longest shape: the
# indexer's scores, top-k scratch and slot tables at rate 4 (16 bytes an entry), and an HCA
# layer's gathered entries and their concatenation (2 x 1 KiB at rate 128)
GRAPH_BYTES_PER_TOKEN = 20
SLOTS = "v4.comp_slots"  # V4Plan.fp8_shared's comp slot ids of an HCA rate


class V4Backend(AttentionBackend[V4Plan]):
    op = "sparse_sink_attention"

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        self.a: V4Args = ctx.args.family_args
        # compression rate -> (an HCA layer attends every entry, a CSA layer selects) of the
        # stage's compressed layers
        self.rates: dict[int, tuple[bool, bool]] = {}
        for i in ctx.layers:
            rate, csa = self.a.rate(i), self.a.layer_types[i] == CSA
            if rate:
                dense, selects = self.rates.get(rate, (False, False))
                self.rates[rate] = (dense or not csa, selects or csa)

    def prepare(self, batch: AnyBatch, cache: Any) -> V4Plan:
        """The index arithmetic of the forward, shared by the stage's layers (a decode-only
        microbatch's from its static buffers: what a CUDA graph replays)."""
        window = self.a.sliding_window
        if isinstance(batch, PagedDecodeBatch):
            return V4Plan.paged(batch, window, self.rates, self.ctx.kernels)
        device = batch.positions.device
        return V4Plan.build(batch, window, self.rates, cache.block_size, device, cache.fp8)

    @classmethod
    def capture_refusal(cls, setting: GraphSetting) -> tuple[str, Refusal] | None:
        """FlashMLA's V4 attention (the bf16 sparse prefill kernel over the gathered keys, or
        the sparse FP8 decode kernel over the pages in place) and the Triton indexer: their
        torch references loop or gather on the host."""
        fp8 = setting.kv_cache_dtype == "fp8"
        attention = "sparse_sink_attention_fp8" if fp8 else "sparse_sink_attention"
        if setting.dtype != "bfloat16":
            return attention, Refusal("dtype", f"{setting.dtype}: FlashMLA takes bfloat16")
        return on_torch(setting, [attention, "indexer_logits_rows"])

    def graph_variants(self, max_model_len: int) -> tuple[tuple[int, int], ...]:
        """One shape per bound on the rows' length (the PagedDecodeBatch's select_width: the
        compressed entries' widths), up to max_model_len."""
        bounds = sorted({min(n, max_model_len) for n in (*GRAPH_LENGTHS, max_model_len)})
        return tuple((n, n) for n in bounds)

    def graph_workspace(self, max_rows: int, max_model_len: int) -> int:
        return max_rows * max_model_len * GRAPH_BYTES_PER_TOKEN

    def forward(
        self,
        layer: V4Attention,
        x: torch.Tensor,
        q: torch.Tensor,
        q_resid: torch.Tensor,
        angles: Angles,
        plan: V4Plan,
        cache: V4Cache,
        local: int,
    ) -> torch.Tensor:
        """The rotated queries [T, H, D] over their window and compressed keys -> [T, H, D]
        (before the inverse rope)."""
        kernels, scale = layer.kernels, self.a.head_dim**-0.5
        in_place = fp8_prefill_in_place(kernels)
        if cache.fp8 and (not plan.chunks_only or in_place):
            if plan.split is not None and not in_place:
                traced, indices = self.keys(
                    layer, x, q_resid, angles, plan, cache.addresses(), local
                )
                return self.split_fp8(layer, q, traced, indices, plan, cache, local)
            window, comp, shared, counts = self.fp8_slots(
                layer, x, q_resid, angles, plan, cache, local
            )
            # a CSA layer's picks: -1 last in each row (the rule's order), counted, and as many
            # in each row as every CSA layer of the forward picks (min(k, visible)): one schedule
            extra: dict[str, Any] = {}
            if counts is not None:
                schedule = plan.fp8_shared.setdefault(-layer.rate, {})
                extra = dict(comp_counts=counts, schedule_state=schedule)
            out: torch.Tensor = _op(kernels.sparse_sink_attention_fp8)(
                q, cache.pages(local, KV), window, cache.pages(local, COMP), comp,
                layer.sinks, scale, state=shared, window_state=plan.fp8_window_state, **extra,
            )  # fmt: skip
            return out
        pool, indices = self.keys(layer, x, q_resid, angles, plan, cache, local)
        return _op(kernels.sparse_sink_attention)(q, pool, indices, layer.sinks, scale)

    def fp8_slots(
        self,
        layer: V4Attention,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        angles: Angles,
        plan: V4Plan,
        cache: V4Cache,
        local: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any] | None, torch.Tensor | None]:
        """(window [T, W], comp [T, E] or None) slot ids (-1: none) of the FP8 pages each query
        attends, the state the layers of its kind share this forward (the window slots every
        layer shares; an HCA layer's entries, every visible one, the same for each layer of its
        rate), and a CSA layer's count of picks in each row ([T] int32, its picks' slots first
        in comp; else None)."""
        window = self.window_slots(plan)
        rp = plan.rates.get(layer.rate)
        if rp is None or not rp.max_entries:  # sliding, or no entry yet: the window alone
            return window, None, plan.fp8_shared.setdefault(0, {}), None
        if layer.indexer is not None:
            table = rp.entry_table  # decode-only rows: each row's own entry table
            picked = layer.indexer.select(
                x, q_resid, angles, rp, cache, local, hide_unseen=table is None
            )
            if table is not None:
                slots, counts = _op(layer.kernels.v4_pick_slots)(picked, table, rp.visible)
                return window, slots, None, counts
            # entry e of the token's row at rp.entry_slots[token_base - Nw + e]
            first = rp.token_base[:, None] - plan.window_slots.shape[0]
            chosen = rp.entry_slots[(first + picked).clamp(min=0)]
            counts = (picked >= 0).sum(dim=1, dtype=torch.int32)
            return window, torch.where(picked < 0, -1, chosen).int(), None, counts
        shared = plan.fp8_shared.setdefault(layer.rate, {})
        if SLOTS not in shared:
            if rp.dense_indices is None:
                raise RuntimeError("the plan has no dense indices for an HCA layer's rate")
            pool = rp.dense_indices[:, plan.window_indices.shape[1] :]  # Nw + entry index
            at = (pool.long() - plan.window_slots.shape[0]).clamp(min=0)
            shared[SLOTS] = torch.where(pool >= 0, rp.entry_slots[at], -1).int()
        comp: torch.Tensor = shared[SLOTS]
        return window, comp, shared, None

    @staticmethod
    def window_slots(plan: V4Plan) -> torch.Tensor:
        """[T, window] int32: the KV slot of each query's window keys (-1: none), once a
        forward."""
        if plan.fp8_window is None:
            wi = plan.window_indices
            slots = plan.window_slots[wi.clamp(min=0).long()]
            plan.fp8_window = torch.where(wi >= 0, slots, -1).int()
        return plan.fp8_window

    def split_fp8(
        self,
        layer: V4Attention,
        q: torch.Tensor,
        traced: torch.Tensor,
        indices: torch.Tensor,
        plan: V4Plan,
        cache: V4Cache,
        local: int,
    ) -> torch.Tensor:
        """A forward of chunks and decode rows over the FP8 cache (plan.split): the chunks'
        queries on the bf16 prefill kernel over their rows' keys gathered dequantized, as a
        forward of chunks alone gathers them (so a chunk's rows do not depend on the decode
        rows beside it), the decode rows' on the FP8 kernel over the pages in place. traced
        [N, 1] / indices [T, K]: keys() over cache.addresses(), pool = [window latents, then
        the layer's rate entries]."""
        s, kernels, scale = plan.split, layer.kernels, self.a.head_dim**-0.5
        assert s is not None
        rp = plan.rates.get(layer.rate)
        pool_index, pool = s.window_pool, cache.read(local, KV, plan.window_slots[s.window_pool])
        if rp is not None and rp.max_entries:  # keys() put the rate's entries after the window
            entries = s.entry_pool[layer.rate]
            pool_index = torch.cat((pool_index, entries + plan.window_slots.shape[0]))
            pool = torch.cat((pool, cache.read(local, COMP, rp.entry_slots[entries])))
        # full pool position -> position among the chunks' rows' keys
        rank = torch.full((traced.shape[0],), -1, dtype=indices.dtype, device=q.device)
        rank[pool_index] = torch.arange(pool_index.shape[0], dtype=rank.dtype, device=q.device)
        mine = indices.index_select(0, s.chunk_tokens)
        if rp is not None and rp.dense_indices is not None and layer.indexer is None:
            # HCA: every entry a row has, padded to the forward's longest row (a decode row's,
            # maybe far longer); the bf16 kernel reads every column, so as wide as the chunks'
            mine = mine[:, : plan.window_indices.shape[1] + s.entry_width[layer.rate]]
        mine = torch.where(mine >= 0, rank[mine.clamp(min=0).long()], -1)
        out = q.new_empty(q.shape)
        out[s.chunk_tokens] = _op(kernels.sparse_sink_attention)(
            q.index_select(0, s.chunk_tokens), pool, mine, layer.sinks, scale
        )
        window, comp = cache.split_addresses(traced, indices.index_select(0, s.decode_tokens))
        out[s.decode_tokens] = _op(kernels.sparse_sink_attention_fp8)(
            q.index_select(0, s.decode_tokens), cache.pages(local, KV), window,
            cache.pages(local, COMP), comp, layer.sinks, scale,
        )  # fmt: skip
        return out

    @staticmethod
    def keys(
        layer: V4Attention,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        angles: Angles,
        plan: V4Plan,
        cache: V4Cache,
        local: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool [N, D]: every row's window latents, then every row's compressed entries;
        indices [T, K] int32 into it, -1 padded)."""
        window = cache.read(local, KV, plan.window_slots)
        rp = plan.rates.get(layer.rate)
        if rp is None or not rp.max_entries:
            return window, plan.window_indices
        if layer.indexer is None:
            if rp.dense_indices is None:
                raise RuntimeError("the plan has no dense indices for an HCA layer's rate")
            pool = torch.cat((window, cache.read(local, COMP, rp.entry_slots)))
            return pool, rp.dense_indices
        picked = layer.indexer.select(x, q_resid, angles, rp, cache, local)
        if rp.entry_table is not None:  # decode rows: only the picked entries join the pool
            t, k = picked.shape
            chosen = rp.entry_table.gather(1, picked.clamp(min=0))
            pool = torch.cat((window, cache.read(local, COMP, chosen.reshape(-1))))
            own = window.shape[0] + torch.arange(t * k, device=picked.device).view(t, k)
            comp = torch.where(picked < 0, -1, own).int()
        else:
            pool = torch.cat((window, cache.read(local, COMP, rp.entry_slots)))
            comp = torch.where(picked < 0, -1, picked + rp.token_base[:, None]).int()
        return pool, torch.cat((plan.window_indices, comp), dim=1)


def _op(fn: Callable[..., torch.Tensor] | None) -> Callable[..., torch.Tensor]:
    if fn is None:
        raise ValueError("the kernel registry selected no backend for a DeepSeek-V4 op")
    return fn
