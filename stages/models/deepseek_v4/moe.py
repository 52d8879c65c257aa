"""DeepSeek-V4's MoE: sqrtsoftplus (or sigmoid) scores, top-k by the bias-corrected score or, in
hash layers, the frozen `tid2eid[token id]` table; weights renormalised and scaled by
routed_scaling_factor; gate and up clamped at swiglu_limit in the experts and the shared one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stages.kernels.registry import Kernels
from stages.models.deepseek_v4.config import V4Args
from stages.models.llama import Linear


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    def __init__(self, a: V4Args, kernels: Kernels, dtype: torch.dtype,
                 device: str | torch.device):
        super().__init__()
        h, i = a.hidden_size, a.moe_intermediate_size
        self.limit = a.swiglu_limit
        self.gate_proj = Linear(h, i, a.mlp_bias, kernels, dtype, device)
        self.up_proj = Linear(h, i, a.mlp_bias, kernels, dtype, device)
        self.down_proj = Linear(i, h, a.mlp_bias, kernels, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class V4Router(nn.Module):
    """Checkpoint name `gate`: its weight, and the bias correction or the hash table."""

    def __init__(self, a: V4Args, is_hash: bool, dtype: torch.dtype,
                 device: str | torch.device):
        super().__init__()
        self.a, self.is_hash = a, is_hash
        self.weight = nn.Parameter(torch.empty(a.n_routed_experts, a.hidden_size, dtype=dtype,
                                               device=device))
        if is_hash:
            self.tid2eid = nn.Parameter(torch.zeros(a.vocab_size, a.num_experts_per_tok,
                                                    dtype=torch.long, device=device),
                                        requires_grad=False)
        else:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(a.n_routed_experts, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor,
                token_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k])."""
        logits = F.linear(x, self.weight)
        scores = (F.softplus(logits).sqrt() if self.a.scoring_func == "sqrtsoftplus"
                  else logits.sigmoid())
        if self.is_hash:
            if token_ids is None:
                raise ValueError("a hash-routed layer needs the token ids of its rows")
            ids = self.tid2eid[token_ids]
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.a.num_experts_per_tok,
                             dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.a.routed_scaling_factor, ids


class V4Experts(nn.Module):
    """Stacked as the checkpoint stores them: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, a: V4Args, dtype: torch.dtype, device: str | torch.device):
        super().__init__()
        e, h, i = a.n_routed_experts, a.hidden_size, a.moe_intermediate_size
        self.limit = a.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        w = weights.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start:start + n]
            start += n
            tokens = sel // k
            gate, up = F.linear(x[tokens], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), self.down_proj[e])
            out.index_add_(0, tokens, (y * w[sel, None]).to(out.dtype))
        return out


class V4MoE(nn.Module):
    def __init__(self, a: V4Args, layer: int, kernels: Kernels, dtype: torch.dtype,
                 device: str | torch.device):
        super().__init__()
        self.gate = V4Router(a, a.is_hash(layer), dtype, device)
        self.experts = V4Experts(a, dtype, device)
        self.shared_experts = SharedExpert(a, kernels, dtype, device)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        weights, ids = self.gate(x, token_ids)
        return self.experts(x, ids, weights) + self.shared_experts(x)
