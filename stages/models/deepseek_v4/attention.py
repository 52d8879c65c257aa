"""DeepSeek-V4 attention over the paged cache (transformers' DeepseekV4Attention semantics).

Every query head (q LoRA, then a per-head unweighted RMSNorm) attends to one shared K=V head:
the last `sliding_window` tokens' latents (itself included) and, in compressed layers, entries
that each pool a group of `rate` tokens. HCA layers attend to every complete group before the
query; CSA layers to the top `index_topk` of them by the lightning indexer's score. Each head's
softmax includes a learned sink. The output's rope channels are rotated back by the query's
angle (K is also V), and a grouped low-rank projection maps the heads to the hidden size.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from stages.kernels.indexer_select import scores_with_maxima
from stages.kernels.registry import Kernels
from stages.models.deepseek_v4.cache import V4Cache
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
from stages.models.deepseek_v4.layers import Angles, ForwardAngles, V4RMSNorm, apply_rope
from stages.models.deepseek_v4.plan import GroupPlan, RatePlan, V4Plan
from stages.models.layers import Linear
from stages.stage_context import Piece, Sources
from stages.tensor_parallel import TensorParallel, one_rank_unless


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
        device: str | torch.device,
    ):
        super().__init__()
        series = 2 if overlap else 1
        self.width, self.rate, self.overlap = width, rate, overlap
        # its kv_proj and gate_proj (what the cache keeps per token until the group completes)
        # are rows of the attention's x_proj
        self.input_width = 2 * series * width
        self.position_bias = nn.Parameter(
            torch.empty(rate, series * width, dtype=torch.float32, device=device)
        )
        self.kv_norm = V4RMSNorm(width, a.rms_norm_eps, device)
        self.kernels = kernels

    def complete_groups(
        self,
        groups: GroupPlan,
        cache: V4Cache,
        local: int,
        inputs_name: str,
        entries_name: str,
        angles: Angles,
    ) -> None:
        """Compute and store the entries of every group whose last token is in the forward."""
        if not groups.count:
            return
        if self.kernels.group_pool is None:
            raise RuntimeError("DeepSeek-V4 layers need kernels.group_pool, unset here")
        inputs = cache.flat(local, inputs_name)  # read in place, by slot
        pooled = self.kernels.group_pool(
            inputs, groups.input_slots, groups.first, self.position_bias, self.rate,
            self.overlap, groups.live,
        )  # fmt: skip
        entries = apply_rope(pooled, angles, self.kernels, norm=self.kv_norm)
        cache.write(local, entries_name, entries, groups.entry_slots)


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
        super().__init__(a, a.index_head_dim, rate, True, kernels, device)
        self.heads, self.topk, self.kernels = a.index_n_heads, a.index_topk, kernels
        self.q_b_proj = Linear(
            a.q_lora_rank, a.index_n_heads * a.index_head_dim, False, kernels, dtype, device
        )
        # the head weights stay in dtype, as DeepSeek's code and V3.2's indexer keep them
        self.scorer = Scorer(
            Linear(a.hidden_size, a.index_n_heads, False, kernels, dtype, device, fp8=False)
        )

    def select(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        angles: Angles,
        plan: RatePlan,
        cache: V4Cache,
        local: int,
        hide_unseen: bool = True,
    ) -> torch.Tensor:
        """[T, k] entry ids each query attends to (-1: none), k <= index_topk: every token
        scored against its own row's entries, in token tiles of bounded memory. hide_unseen
        False: picks at or past a row's visible entries (a row that sees fewer than k) are left
        for the caller to drop (v4_pick_slots does, in its one launch)."""
        t = x.shape[0]
        q = self.q_b_proj(q_resid).view(t, self.heads, self.width)
        q = apply_rope(q, angles, self.kernels)
        weights = self.scorer.weights_proj(x)
        keys = cache.component(local, INDEX_KEYS)  # scored in place, FP8 or not
        score, top_k = _op(self.kernels.indexer_logits_rows), _op(self.kernels.index_topk)
        k, scale = min(self.topk, plan.max_entries), self.width**-0.5
        head_scale = self.heads**-0.5
        if math.frexp(head_scale)[0] == 0.5:  # a power of two (64 heads: 1/8) rides on the
            scale *= head_scale  # softmax scale exactly: no cast and product launched for it
        else:
            weights = weights.float() * head_scale
        if len(plan.select) == 1 and plan.select[0][0] == slice(0, t):  # decode: one tile
            logits, maxima = scores_with_maxima(score, q, keys, weights, scale, plan.select[0][1])
            picked = top_k(logits, k, maxima=maxima)
        else:
            picked = torch.empty(t, k, dtype=torch.long, device=x.device)
            for tokens, select in plan.select:
                logits, maxima = scores_with_maxima(
                    score, q[tokens], keys, weights[tokens], scale, select
                )
                picked[tokens] = top_k(logits, k, maxima=maxima)
        if not hide_unseen:
            return picked
        return picked.masked_fill_(picked >= plan.visible[:, None], -1)


class V4Attention(nn.Module):
    """On a tensor-parallel stage each rank holds whole output groups (o_groups / size) and
    their query heads: its rows of q_b_proj and o_a_proj, its heads' sinks, its groups'
    columns of o_b_proj, whose all-reduce is the layer's one collective. What every head
    shares stays whole on every rank: x_proj (q_a_proj, also the indexer's input, the K=V
    latent's kv_proj, the compressors' inputs), the compressor, the indexer (its score sums
    over its heads before a top-k: split, every score would need an all-reduce, whose order of
    addition could change which entries tie into the top-k) and the cache, whose entries
    every rank's heads read."""

    def __init__(
        self,
        a: V4Args,
        layer: int,
        kernels: Kernels,
        dtype: torch.dtype,
        device: str | torch.device,
        tp: TensorParallel | None = None,
        backend: Any = None,
    ):
        """backend: the stage's V4Backend, which the forward calls (required to run)."""
        super().__init__()
        self.a, self.kernels, self._backend = a, kernels, backend
        self.kind, self.rate = a.layer_types[layer], a.rate(layer)
        self.tp = tp = one_rank_unless(tp)
        # the rank's output groups and their heads (all of them on one rank)
        self.groups = tp.part(a.o_groups, "o_groups")
        self.heads = a.num_heads // a.o_groups * self.groups
        h, heads, d = a.hidden_size, a.num_heads, a.head_dim
        self.q_a_norm = V4RMSNorm(a.q_lora_rank, a.rms_norm_eps, device, kernels)
        self.q_b_proj = Linear(
            a.q_lora_rank, heads * d, False, kernels, dtype, device, tp=tp, split="column"
        )
        self.kv_norm = V4RMSNorm(d, a.rms_norm_eps, device)
        # grouped output projection: o_groups blocks of heads * d / o_groups -> o_lora_rank, one
        # batched matmul over the groups, so held in dtype (an FP8 checkpoint's is dequantized)
        o_in, o_out = heads * d // a.o_groups, a.o_groups * a.o_lora_rank
        self.o_a_proj = Linear(
            o_in, o_out, False, kernels, dtype, device, fp8=False, tp=tp, split="column"
        )
        self.o_b_proj = Linear(o_out, h, False, kernels, dtype, device, tp=tp, split="row")
        self.sinks = nn.Parameter(torch.empty(self.heads, dtype=torch.float32, device=device))
        self.compressor: GroupCompressor | None = None
        if self.kind != SLIDING:
            self.compressor = GroupCompressor(a, d, self.rate, self.kind == CSA, kernels, device)
            if self.kind == CSA:
                self.compressor.indexer = Indexer(a, self.rate, kernels, dtype, device)
        # every projection of the layer's input in one GEMM (one quantizer, one launch): the
        # checkpoint's q_a_proj, kv_proj and the compressors' kv_proj and gate_proj, as rows
        rows = [("q_a_proj", a.q_lora_rank), ("kv_proj", d)]
        self.x_widths = [a.q_lora_rank, d]  # q_a, the latent, then each compressor's inputs
        for path, c in (("compressor", self.compressor), ("compressor.indexer", self.indexer)):
            if c is not None:
                half = c.input_width // 2
                rows += [(f"{path}.kv_proj", half), (f"{path}.gate_proj", half)]
                self.x_widths.append(c.input_width)
        self.x_proj = Linear(h, sum(self.x_widths), False, kernels, dtype, device, tuple(rows))

    def checkpoint_sources(self, name: str) -> Sources:
        """On a tensor-parallel rank: its heads' sinks."""
        if not self.tp.enabled:
            return {}
        span = slice(self.tp.rank * self.heads, (self.tp.rank + 1) * self.heads)
        return {"sinks": [Piece(f"{name}.sinks", (), (span,), (self.a.num_heads,))]}

    @property
    def backend(self) -> Any:
        if self._backend is None:
            raise RuntimeError("this attention was built without its stage's backend")
        return self._backend

    @property
    def indexer(self) -> Indexer | None:
        return getattr(self.compressor, "indexer", None)

    def forward(
        self,
        x: torch.Tensor,
        angles: ForwardAngles,
        plan: V4Plan,
        slot_mapping: torch.Tensor,
        cache: V4Cache,
        local: int,
    ) -> torch.Tensor:
        a, t = self.a, x.shape[0]
        parts = self.x_proj(x).split(self.x_widths, dim=-1)
        q_resid = self.q_a_norm(parts[0])
        q = self.q_b_proj(q_resid).view(t, self.heads, a.head_dim)
        q = apply_rope(q, angles.tokens, self.kernels, norm_eps=a.rms_norm_eps)
        kv = apply_rope(parts[1], angles.tokens, self.kernels, norm=self.kv_norm)
        rows = {KV: kv}
        if self.compressor is not None:
            rows[COMP_IN] = parts[2]
            if self.indexer is not None:
                rows[INDEX_IN] = parts[3]
        cache.write_token_rows(local, rows, slot_mapping)  # one launch on FP8 pages
        if self.compressor is not None:
            groups = plan.rates[self.rate].groups
            if groups.count:
                group_angles = angles.groups[self.rate]
                self.compressor.complete_groups(groups, cache, local, COMP_IN, COMP, group_angles)
                if self.indexer is not None:
                    self.indexer.complete_groups(
                        groups, cache, local, INDEX_IN, INDEX_KEYS, group_angles
                    )
        # the window and compressed keys, on bf16 or FP8 pages: the stage's backend
        out = self.backend.forward(self, x, q, q_resid, angles.tokens, plan, cache, local)
        out = apply_rope(out, angles.inverse, self.kernels)
        g = self.groups
        w = self.o_a_proj.weight.view(g, a.o_lora_rank, -1)
        # one batched GEMM over the groups (einsum "tgi,goi->tgo"), written straight into the
        # [t, g, o] rows o_b_proj reads: einsum's [g, t, o] result took a copy to get there
        grouped = out.new_empty(t, g, a.o_lora_rank)
        torch.bmm(out.reshape(t, g, -1).transpose(0, 1), w.transpose(1, 2),
                  out=grouped.transpose(0, 1))  # fmt: skip
        result: torch.Tensor = self.o_b_proj(grouped.view(t, -1))
        return result


def _op(fn: Callable[..., torch.Tensor] | None) -> Callable[..., torch.Tensor]:
    if fn is None:
        raise ValueError("the kernel registry selected no backend for a DeepSeek-V4 op")
    return fn
