"""One pipeline stage of a DeepSeek-V2/V3/V3.2 model: MLA attention (V3.2: sparse, DSA), MoE (or
dense) MLP per layer, and DeepSeek's routers.

Parameter names are the checkpoint's minus `model.`, except the stacked routed experts, which
`checkpoint_sources` maps to the checkpoint's per-expert tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from stages.forward_batch import ForwardBatch, PagedDecodeBatch
from stages.model_config import ModelArgs
from stages.models.deepseek_config import DeepseekArgs
from stages.models.dsa import DSAttention, SparseRows
from stages.models.layers import DecoderLayer, Device, SwiGLU
from stages.models.mla import MLADecodeRows, MLAttention, rope_tables
from stages.models.mla_cache import LatentKVCache
from stages.models.moe import Experts, MoE
from stages.models.stage import Stage
from stages.stage_context import StageContext


class DeepseekRouter(nn.Module):
    """Top-k experts: V2 a softmax (greedy or group-limited), V3 a sigmoid with the
    bias-corrected score choosing groups and experts. Checkpoint name `gate`; fp32 weights and
    scores, as transformers keeps them."""

    def __init__(self, args: ModelArgs, device: Device):
        super().__init__()
        d: DeepseekArgs = args.family_args
        self.d = d
        self.weight = nn.Parameter(
            torch.empty(d.n_routed_experts, args.hidden_size, dtype=torch.float32, device=device)
        )
        if d.version == "v3":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(d.n_routed_experts, dtype=torch.float32, device=device)
            )

    def _group_mask(self, scores: torch.Tensor, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, E] bool: experts in each token's topk_group best groups."""
        d = self.d
        best = group_scores.topk(d.topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return (
            mask[:, :, None].expand(-1, -1, d.n_routed_experts // d.n_group).reshape(scores.shape)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k] long)."""
        d = self.d
        logits = nn.functional.linear(x.float(), self.weight)
        scores_shape = (x.shape[0], d.n_group, d.n_routed_experts // d.n_group)
        if d.version == "v2":
            scores = logits.softmax(dim=-1)
            if d.topk_method == "group_limited_greedy":
                grouped = scores.view(scores_shape).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(scores, grouped), 0.0)
            weights, ids = scores.topk(d.num_experts_per_tok, dim=-1, sorted=False)
        else:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            grouped = choice.view(scores_shape).topk(2, dim=-1).values.sum(dim=-1)
            choice = choice.masked_fill(~self._group_mask(choice, grouped), float("-inf"))
            ids = choice.topk(d.num_experts_per_tok, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
            if d.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * d.routed_scaling_factor, ids


class DeepseekStage(Stage):
    inv_freq: torch.Tensor  # a buffer: registered in __init__

    def __init__(self, ctx: StageContext):
        if not isinstance(ctx.args.family_args, DeepseekArgs):
            raise ValueError(f"{ctx.args.model_type} is not a DeepSeek model")
        super().__init__(ctx)
        inv_freq, self.rope_scale = rope_tables(ctx.args)
        self.register_buffer("inv_freq", inv_freq.to(ctx.device), persistent=False)

    def build_layer(self, layer: int) -> nn.Module:
        """On a tensor-parallel stage: the attention's query heads split (the latent and V3.2's
        indexer whole on every rank), the routed experts split whole, the shared experts' and
        dense MLPs' columns split, the router whole; one all-reduce per block."""
        a, d = self.args, self.args.family_args
        kernels, dtype, device, tp = self.ctx.kernels, self.ctx.dtype, self.ctx.device, self.ctx.tp
        attention = MLAttention if d.indexer is None else DSAttention
        mlp: nn.Module
        if d.is_moe_layer(layer):
            shared = d.moe_intermediate_size * d.n_shared_experts
            mlp = MoE(
                DeepseekRouter(a, device),
                Experts(
                    d.n_routed_experts,
                    a.hidden_size,
                    d.moe_intermediate_size,
                    dtype,
                    device,
                    fp8=kernels.fp8_linear is not None,
                    tp=tp,
                ),
                SwiGLU(a.hidden_size, shared, a.mlp_bias, kernels, dtype, device, tp=tp)
                if shared
                else None,
                kernels,
                tp=tp,
            )
        else:
            mlp = SwiGLU(
                a.hidden_size, a.intermediate_size, a.mlp_bias, kernels, dtype, device, tp=tp
            )
        attn = attention(a, kernels, dtype, device, tp, self.attention)
        return DecoderLayer(a, attn, mlp, dtype, device)

    def layer_context(
        self, batch: ForwardBatch | PagedDecodeBatch, kv: LatentKVCache, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, MLADecodeRows | SparseRows | None]:
        """(cos, sin [T, rope / 2], the attention's row metadata: MLADecodeRows or
        SparseRows). A decode-only microbatch's comes from its static buffers (what a CUDA
        graph replays); over an FP8 latent every DSA row attends through the sparse kernel."""
        freqs = batch.positions[:, None].float() * self.inv_freq[None, :]
        cos = (freqs.cos() * self.rope_scale).to(h.dtype)
        sin = (freqs.sin() * self.rope_scale).to(h.dtype)
        return cos, sin, self.attention.prepare(batch, kv)
