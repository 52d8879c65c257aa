"""DeepSeek-V4 attention over the paged cache (transformers' DeepseekV4Attention semantics).

Every query head (q LoRA, then a per-head unweighted RMSNorm) attends to one shared K=V head:
the last `sliding_window` tokens' latents (itself included) and, in compressed layers, entries
that each pool a group of `rate` tokens. HCA layers attend to every complete group before the
query; CSA layers to the top `index_topk` of them by the lightning indexer's score. Each head's
softmax includes a learned sink. The output's rope channels are rotated back by the query's
angle (K is also V), and a grouped low-rank projection maps the heads to the hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from stages.kernels.registry import Kernels
from stages.models.deepseek_v4.cache import V4Cache, entry_slots
from stages.models.deepseek_v4.config import (
    COMP,
    COMP_IN,
    CSA,
    INDEX_IN,
    INDEX_KEYS,
    KV,
    SLIDING,
    V4Args,
)
from stages.models.deepseek_v4.layers import Rotary, V4RMSNorm, apply_rope, unweighted_rms_norm
from stages.models.layers import Linear


@dataclass
class V4Row:
    """One request's tokens in the forward."""

    start: int  # position of its first token
    num_tokens: int
    offset: int  # its first token in T
    table: torch.Tensor  # [blocks] long, on the device

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class GroupCompressor(nn.Module):
    """Pools each group of `rate` tokens into one entry: a per-channel softmax over the group's
    gates (plus a learned per-slot bias) weights its kv projections; RMSNorm; rope at the
    group's first position. With `overlap` (CSA) each token projects two series and entry w
    pools group w - 1's first series with group w's second (2 * rate slots)."""

    def __init__(
        self,
        a: V4Args,
        width: int,
        rate: int,
        overlap: bool,
        kernels: Kernels,
        dtype: torch.dtype,
        device: str | torch.device,
    ):
        super().__init__()
        series = 2 if overlap else 1
        self.width, self.rate, self.overlap = width, rate, overlap
        self.kv_proj = Linear(a.hidden_size, series * width, False, kernels, dtype, device)
        self.gate_proj = Linear(a.hidden_size, series * width, False, kernels, dtype, device)
        self.position_bias = nn.Parameter(
            torch.empty(rate, series * width, dtype=torch.float32, device=device)
        )
        self.kv_norm = V4RMSNorm(width, a.rms_norm_eps, device)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2 * series * width]: what the cache keeps per token until its group completes."""
        return torch.cat((self.kv_proj(x), self.gate_proj(x)), dim=-1)

    def complete_groups(
        self,
        row: V4Row,
        cache: V4Cache,
        local: int,
        inputs_name: str,
        entries_name: str,
        rotary: Rotary,
        block_size: int,
    ) -> None:
        """Compute and store the entries of the groups whose last token is in `row`."""
        r = self.rate
        first, last = row.start // r, row.end // r  # new entries: first..last-1
        if last == first:
            return
        prior = self.overlap and first > 0  # entry `first` also reads group first - 1
        t0 = (first - prior) * r
        slots = entry_slots(row.table, t0, last * r - t0, block_size, row.table.device)
        inputs = cache.read(local, inputs_name, slots)
        kv, gate = inputs.view(-1, r, inputs.shape[-1]).chunk(2, dim=-1)
        gate = gate + self.position_bias
        if self.overlap:
            w = self.width
            prev_kv, prev_gate = kv[..., :w], gate[..., :w]
            cur_kv, cur_gate = kv[..., w:], gate[..., w:]
            if prior:
                prev_kv, prev_gate = prev_kv[:-1], prev_gate[:-1]
                cur_kv, cur_gate = cur_kv[1:], cur_gate[1:]
            else:  # entry 0 has no group before it: zero kv, gate -inf (weight 0)
                prev_kv = torch.cat((torch.zeros_like(prev_kv[:1]), prev_kv[:-1]))
                prev_gate = torch.cat(
                    (torch.full_like(prev_gate[:1], float("-inf")), prev_gate[:-1])
                )
            kv, gate = torch.cat((prev_kv, cur_kv), dim=1), torch.cat((prev_gate, cur_gate), dim=1)
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        positions = torch.arange(first, last, device=kv.device) * r
        cos, sin = rotary(positions, pooled.dtype)
        entries = apply_rope(self.kv_norm(pooled), cos, sin)
        cache.write(
            local,
            entries_name,
            entries,
            entry_slots(row.table, first, last - first, block_size // r, kv.device),
        )


class Scorer(nn.Module):
    """Holds the indexer's per-head weights projection (checkpoint name scorer.weights_proj)."""

    def __init__(self, weights_proj: Linear):
        super().__init__()
        self.weights_proj = weights_proj


class Indexer(GroupCompressor):
    """CSA's lightning indexer: its own overlapping compressor at index_head_dim, and queries
    from the q LoRA scored against its compressed keys: sum_h w_h relu(q_h . k) / sqrt(d)."""

    def __init__(
        self, a: V4Args, rate: int, kernels: Kernels, dtype: torch.dtype, device: str | torch.device
    ):
        super().__init__(a, a.index_head_dim, rate, True, kernels, dtype, device)
        self.heads, self.topk, self.kernels = a.index_n_heads, a.index_topk, kernels
        self.q_b_proj = Linear(
            a.q_lora_rank, a.index_n_heads * a.index_head_dim, False, kernels, dtype, device
        )
        self.scorer = Scorer(Linear(a.hidden_size, a.index_n_heads, False, kernels, dtype, device))

    def select(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        row: V4Row,
        cache: V4Cache,
        local: int,
        block_size: int,
    ) -> torch.Tensor:
        """[n, k] entry ids each query of `row` attends to (-1: none), k <= index_topk."""
        r, n = self.rate, row.num_tokens
        count = row.end // r
        span = slice(row.offset, row.offset + n)
        q = self.q_b_proj(q_resid[span]).view(n, self.heads, self.width)
        q = apply_rope(q, cos[span], sin[span])
        weights = self.scorer.weights_proj(x[span]).float() * self.heads**-0.5
        keys = cache.read(
            local, INDEX_KEYS, entry_slots(row.table, 0, count, block_size // r, x.device)
        )
        scores: torch.Tensor = _op(self.kernels.indexer_logits)(q, keys, weights, self.width**-0.5)
        visible = (torch.arange(row.start, row.end, device=x.device) + 1) // r  # [n]
        entries = torch.arange(count, device=x.device)
        scores = scores.masked_fill(entries[None, :] >= visible[:, None], float("-inf"))
        picked = scores.topk(min(self.topk, count), dim=-1).indices
        out: torch.Tensor = picked.masked_fill(picked >= visible[:, None], -1)
        return out


class V4Attention(nn.Module):
    def __init__(
        self,
        a: V4Args,
        layer: int,
        kernels: Kernels,
        dtype: torch.dtype,
        device: str | torch.device,
    ):
        super().__init__()
        self.a, self.kernels = a, kernels
        self.kind, self.rate = a.layer_types[layer], a.rate(layer)
        h, heads, d = a.hidden_size, a.num_heads, a.head_dim
        self.q_a_proj = Linear(h, a.q_lora_rank, False, kernels, dtype, device)
        self.q_a_norm = V4RMSNorm(a.q_lora_rank, a.rms_norm_eps, device)
        self.q_b_proj = Linear(a.q_lora_rank, heads * d, False, kernels, dtype, device)
        self.kv_proj = Linear(h, d, False, kernels, dtype, device)
        self.kv_norm = V4RMSNorm(d, a.rms_norm_eps, device)
        # grouped output projection: o_groups blocks of heads * d / o_groups -> o_lora_rank
        self.o_a_proj = Linear(
            heads * d // a.o_groups, a.o_groups * a.o_lora_rank, False, kernels, dtype, device
        )
        self.o_b_proj = Linear(a.o_groups * a.o_lora_rank, h, False, kernels, dtype, device)
        self.sinks = nn.Parameter(torch.empty(heads, dtype=torch.float32, device=device))
        self.compressor: GroupCompressor | None = None
        if self.kind != SLIDING:
            self.compressor = GroupCompressor(
                a, d, self.rate, self.kind == CSA, kernels, dtype, device
            )
            if self.kind == CSA:
                self.compressor.indexer = Indexer(a, self.rate, kernels, dtype, device)

    @property
    def indexer(self) -> Indexer | None:
        return getattr(self.compressor, "indexer", None)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        rows: list[V4Row],
        slot_mapping: torch.Tensor,
        cache: V4Cache,
        local: int,
    ) -> torch.Tensor:
        a, t = self.a, x.shape[0]
        cos, sin = rotary(positions, x.dtype)
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(t, a.num_heads, a.head_dim)
        q = apply_rope(unweighted_rms_norm(q, a.rms_norm_eps), cos, sin)
        cache.write(local, KV, apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin), slot_mapping)
        bs = cache.block_size
        if self.compressor is not None:
            cache.write(local, COMP_IN, self.compressor.inputs(x), slot_mapping)
            if self.indexer is not None:
                cache.write(local, INDEX_IN, self.indexer.inputs(x), slot_mapping)
            for row in rows:
                self.compressor.complete_groups(row, cache, local, COMP_IN, COMP, rotary, bs)
                if self.indexer is not None:
                    self.indexer.complete_groups(
                        row, cache, local, INDEX_IN, INDEX_KEYS, rotary, bs
                    )
        if cache.fp8:  # the FP8 pages read in place, at the keys' traced addresses
            traced, indices = self._keys(x, q_resid, cos, sin, rows, cache.addresses(), local)
            window, comp = cache.split_addresses(traced, indices)
            out = _op(self.kernels.sparse_sink_attention_fp8)(
                q, cache.pages(local, KV), window, cache.pages(local, COMP), comp,
                self.sinks, a.head_dim**-0.5,
            )  # fmt: skip
        else:
            pool, indices = self._keys(x, q_resid, cos, sin, rows, cache, local)
            attend = _op(self.kernels.sparse_sink_attention)
            out = attend(q, pool, indices, self.sinks, a.head_dim**-0.5)
        out = apply_rope(out, cos, -sin)
        g = a.o_groups
        w = self.o_a_proj.weight.view(g, a.o_lora_rank, -1)
        grouped = torch.einsum("tgi,goi->tgo", out.reshape(t, g, -1), w)
        result: torch.Tensor = self.o_b_proj(grouped.reshape(t, -1))
        return result

    def _keys(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: list[V4Row],
        cache: V4Cache,
        local: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool [N, D] of every row's keys, indices [T, K] into it, -1 padded)."""
        win, r, bs, dev = self.a.sliding_window, self.rate, cache.block_size, x.device
        pools, parts, base = [], [], 0
        for row in rows:
            w0 = max(0, row.start - win + 1)
            pools.append(cache.read(local, KV, entry_slots(row.table, w0, row.end - w0, bs, dev)))
            pos = torch.arange(row.start, row.end, device=dev)
            keys = pos[:, None] - win + 1 + torch.arange(win, device=dev)[None, :]  # [n, win]
            idx = (keys - w0 + base).masked_fill(keys < 0, -1)
            base += row.end - w0
            count = row.end // r if r else 0
            if count:
                pools.append(
                    cache.read(local, COMP, entry_slots(row.table, 0, count, bs // r, dev))
                )
                if self.indexer is not None:
                    picked = self.indexer.select(x, q_resid, cos, sin, row, cache, local, bs)
                else:
                    entries = torch.arange(count, device=dev)[None, :]
                    picked = entries.expand(row.num_tokens, -1).masked_fill(
                        entries >= ((pos + 1) // r)[:, None], -1
                    )
                idx = torch.cat((idx, (picked + base).masked_fill(picked < 0, -1)), dim=1)
                base += count
            parts.append(idx)
        width = max(p.shape[1] for p in parts)
        indices = torch.cat(
            [torch.nn.functional.pad(p, (0, width - p.shape[1]), value=-1) for p in parts]
        )
        return torch.cat(pools), indices


def _op(fn: Callable[..., torch.Tensor] | None) -> Callable[..., torch.Tensor]:
    if fn is None:
        raise ValueError("the kernel registry selected no backend for a DeepSeek-V4 op")
    return fn
