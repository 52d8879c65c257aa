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
        self,
        x: torch.Tensor,
        token_ids: torch.Tensor | None = None,
        shared_slot: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]): the route_topk op after the gate's GEMM; with
        `shared_slot` (the shared expert's index in the experts' stack) [T, k + 1], every token
        picking it last with weight 1, written by the same op."""
        logits = F.linear(x, self.weight)
        k, a = self.a.num_experts_per_tok, self.a
        if self.routes_by_token:
            if token_ids is None:
                raise ValueError("a hash-routed layer needs the token ids of its rows")
            ids = self.tid2eid[token_ids]
            routed: tuple[torch.Tensor, torch.Tensor] = self._route(
                logits, k, a.scoring_func, a.routed_scaling_factor, ids=ids, extra=shared_slot
            )
        else:
            routed = self._route(
                logits, k, a.scoring_func, a.routed_scaling_factor, self.e_score_correction_bias,
                extra=shared_slot,
            )  # fmt: skip
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
    MXFP4 routed experts (expert_dtype fp4, unless --mxfp4-experts dequantize) stay packed.

    On CUDA the shared expert (one, of the routed experts' width) joins the routed stack
    (`shared_expert_in_stack`): the grouped kernel runs it with them."""
    h, i = a.hidden_size, a.moe_intermediate_size
    fp8 = kernels.fp8_linear is not None
    mxfp4 = a.expert_dtype == "fp4"
    in_stack = shared_expert_in_stack(a, device, tp, mxfp4)
    experts = Experts(
        a.n_routed_experts, h, i, dtype, device, fp8=fp8, tp=tp, mxfp4=mxfp4, shared=in_stack
    )
    return MoE(
        V4Router(a, a.is_hash(layer), kernels, dtype, device),
        experts,
        None
        if in_stack
        else SwiGLU(h, i, a.mlp_bias, kernels, dtype, device, limit=a.swiglu_limit, tp=tp),
        kernels,
        swiglu_limit=a.swiglu_limit,
        tp=tp,
    )


def shared_expert_in_stack(
    a: V4Args, device: Device, tp: TensorParallel | None, mxfp4: bool
) -> bool:
    """Whether the shared expert runs in the routed experts' grouped kernel: on CUDA, where it
    saves a decode step two small GEMMs, their quantizers and the sum per layer, for a whole
    (not tensor-parallel) stack in the shared expert's format (not MXFP4-packed; V4's shared
    expert is the routed ones' width, without bias). Elsewhere it stays a SwiGLU beside them,
    the torch form the transformers comparisons read (the fused sum rounds once, in fp32, where
    the two outputs were rounded and added in the model's dtype). The args'
    `shared_expert_in_stack` overrides the device's choice where it is set."""
    whole = tp is None or not tp.enabled
    able = whole and not mxfp4 and not a.mlp_bias
    if a.shared_expert_in_stack is not None:  # asked for (a bench's comparison)
        return a.shared_expert_in_stack and able
    return torch.device(device).type == "cuda" and able
