"""DeepSeek-V4's router: sqrtsoftplus (or sigmoid) scores; the top-k by the bias-corrected score
or, in hash layers, the frozen `tid2eid[token id]` table; weights renormalised and scaled by
routed_scaling_factor. The MoE block around it is the shared one (stages/models/moe.py), with
gate and up clamped at swiglu_limit in the routed experts and the shared one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stages.kernels.registry import Kernels
from stages.models.deepseek_v4.config import V4Args
from stages.models.layers import Device, SwiGLU
from stages.models.moe import Experts, MoE
from stages.tensor_parallel import TensorParallel


class V4Router(nn.Module):
    """Checkpoint name `gate`: its weight, and the bias correction or the hash table."""

    def __init__(
        self, a: V4Args, is_hash: bool, kernels: Kernels, dtype: torch.dtype, device: Device
    ):
        super().__init__()
        if kernels.route_topk is None:
            raise RuntimeError("DeepSeek-V4 layers need kernels.route_topk, unset here")
        self.a, self.routes_by_token, self._route = a, is_hash, kernels.route_topk
        self.weight = nn.Parameter(
            torch.empty(a.n_routed_experts, a.hidden_size, dtype=dtype, device=device)
        )
        if is_hash:
            # a valid table (token t -> k consecutive experts from t * k) until a checkpoint's
            # replaces it: random weights route evenly
            k = a.num_experts_per_tok
            table = torch.arange(a.vocab_size * k, device=device).view(-1, k) % a.n_routed_experts
            self.tid2eid = nn.Parameter(table, requires_grad=False)
        else:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(a.n_routed_experts, dtype=torch.float32, device=device)
            )

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]): the route_topk op after the gate's GEMM."""
        logits = F.linear(x, self.weight)
        k, a = self.a.num_experts_per_tok, self.a
        if self.routes_by_token:
            if token_ids is None:
                raise ValueError("a hash-routed layer needs the token ids of its rows")
            ids = self.tid2eid[token_ids]
            routed: tuple[torch.Tensor, torch.Tensor] = self._route(
                logits, k, a.scoring_func, a.routed_scaling_factor, ids=ids
            )
        else:
            routed = self._route(
                logits, k, a.scoring_func, a.routed_scaling_factor, self.e_score_correction_bias
            )
        return routed


def v4_moe(
    a: V4Args,
    layer: int,
    kernels: Kernels,
    dtype: torch.dtype,
    device: Device,
    tp: TensorParallel | None = None,
) -> MoE:
    """On a tensor-parallel stage the router (and a hash layer's tid2eid table) is whole on
    every rank, each rank holds n_routed_experts / size whole experts and its share of the
    shared expert's columns, and one all-reduce sums them (stages/models/moe.py). A checkpoint's
    MXFP4 routed experts (expert_dtype fp4, unless --mxfp4-experts dequantize) stay packed."""
    h, i = a.hidden_size, a.moe_intermediate_size
    fp8 = kernels.fp8_linear is not None
    return MoE(
        V4Router(a, a.is_hash(layer), kernels, dtype, device),
        Experts(
            a.n_routed_experts,
            h,
            i,
            dtype,
            device,
            fp8=fp8,
            tp=tp,
            mxfp4=a.expert_dtype == "fp4",
        ),
        SwiGLU(h, i, a.mlp_bias, kernels, dtype, device, limit=a.swiglu_limit, tp=tp),
        kernels,
        swiglu_limit=a.swiglu_limit,
        tp=tp,
    )
