"""One pipeline stage of a Qwen3-MoE model: Qwen3's attention (q/k norms, GQA) and, on the
layers `decoder_sparse_step` and `mlp_only_layers` pick, routed experts chosen by a softmax
top-k (no shared expert); the other layers keep a dense SwiGLU MLP. Semantics follow
transformers' modeling_qwen3_moe."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stages.model_config import ModelArgs
from stages.models.families import Qwen3MoeArgs
from stages.models.layers import DecoderLayer, Device, SwiGLU
from stages.models.llama import Attention, LlamaStage
from stages.models.moe import Experts, MoE


class SoftmaxTopKRouter(nn.Module):
    """Checkpoint name `gate`: softmax over every expert in fp32, the top k kept, renormalised
    to sum to one when norm_topk_prob."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: Device):
        super().__init__()
        self.moe: Qwen3MoeArgs = args.family_args
        self.weight = nn.Parameter(
            torch.empty(self.moe.num_experts, args.hidden_size, dtype=dtype, device=device)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.moe.num_experts_per_tok, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class Qwen3MoeStage(LlamaStage):
    def build_layer(self, layer: int) -> nn.Module:
        a, moe = self.args, self.args.family_args
        kernels, dtype, device, tp = self.ctx.kernels, self.ctx.dtype, self.ctx.device, self.ctx.tp
        mlp: nn.Module
        if moe.is_moe_layer(layer):  # experts split whole over the ranks, the router on each
            experts = Experts(
                moe.num_experts, a.hidden_size, moe.moe_intermediate_size, dtype, device, tp=tp
            )
            mlp = MoE(SoftmaxTopKRouter(a, dtype, device), experts, None, kernels, tp=tp)
        else:
            mlp = SwiGLU(
                a.hidden_size, a.intermediate_size, a.mlp_bias, kernels, dtype, device, tp=tp
            )
        attention = Attention(a, kernels, dtype, device, tp, self.paged_kv)
        return DecoderLayer(a, attention, mlp, dtype, device)
