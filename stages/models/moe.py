"""DeepSeek mixture of experts: a top-k router (V2 softmax, V3 sigmoid with the bias-corrected
score), routed experts stored stacked for grouped GEMMs, and always-on shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stages.deepseek_config import DeepseekArgs
from stages.kernels.registry import Kernels
from stages.model_config import ModelArgs
from stages.models.llama import Linear


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense layers' MLP and the shared experts."""

    def __init__(self, hidden: int, inter: int, bias: bool, kernels: Kernels, dtype, device):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias, kernels, dtype, device)
        self.up_proj = Linear(hidden, inter, bias, kernels, dtype, device)
        self.down_proj = Linear(inter, hidden, bias, kernels, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Checkpoint name `gate`; fp32 weights and scores, as transformers keeps them."""

    def __init__(self, args: ModelArgs, device):
        super().__init__()
        d: DeepseekArgs = args.deepseek
        self.d = d
        self.weight = nn.Parameter(torch.empty(d.n_routed_experts, args.hidden_size,
                                               dtype=torch.float32, device=device))
        if d.version == "v3":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(d.n_routed_experts, dtype=torch.float32, device=device))

    def _group_mask(self, scores: torch.Tensor, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, E] bool: experts in each token's topk_group best groups."""
        d = self.d
        best = group_scores.topk(d.topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return mask[:, :, None].expand(-1, -1, d.n_routed_experts // d.n_group).reshape(
            scores.shape)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k] long)."""
        d = self.d
        logits = F.linear(x.float(), self.weight)
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


class Experts(nn.Module):
    """Routed experts stacked: gate_up_proj [E, 2I, H] (gate rows, then up) and down_proj
    [E, H, I]; the loader fills them from the checkpoint's per-expert tensors."""

    def __init__(self, args: ModelArgs, dtype, device):
        super().__init__()
        d = args.deepseek
        e, h, i = d.n_routed_experts, args.hidden_size, d.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=device))

    def checkpoint_sources(self, prefix: str) -> dict[str, list[tuple[str, tuple]]]:
        """Parameter -> (checkpoint tensor, index into the parameter) for each piece."""
        i = self.down_proj.shape[2]
        gate_up, down = [], []
        for e in range(self.gate_up_proj.shape[0]):
            gate_up.append((f"{prefix}.{e}.gate_proj.weight", (e, slice(0, i))))
            gate_up.append((f"{prefix}.{e}.up_proj.weight", (e, slice(i, 2 * i))))
            down.append((f"{prefix}.{e}.down_proj.weight", (e,)))
        return {"gate_up_proj": gate_up, "down_proj": down}


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, kernels: Kernels, dtype, device):
        super().__init__()
        d = args.deepseek
        self.kernels = kernels
        self.gate = Router(args, device)
        self.experts = Experts(args, dtype, device)
        shared = d.moe_intermediate_size * d.n_shared_experts
        self.shared_experts = (SwiGLU(args.hidden_size, shared, args.mlp_bias, kernels, dtype,
                                      device) if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.kernels.moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj,
                                       ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
