"""The mixture-of-experts block families share: a router picks each token's experts, the routed
experts run stacked through the grouped-expert kernel (`kernels.moe_experts`), and optional
shared experts run on every token.

A router is any module mapping x [T, hidden] to (weights [T, k] fp32, expert ids [T, k] long);
each family brings its own (checkpoint name `gate`). A router with `routes_by_token` set also
takes the rows' token ids (DeepSeek-V4's hash layers); `swiglu_limit` clamps the experts'
gate and up projections (DeepSeek-V4).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Callable, cast

import torch
from torch import nn

from stages.kernels.fp8_ref import BLOCK as FP8_BLOCK
from stages.kernels.fp8_ref import FP8
from stages.kernels.mxfp4 import GROUP as MXFP4_GROUP
from stages.kernels.registry import Kernels
from stages.models.layers import Device, SwiGLU, project, project_swiglu
from stages.stage_context import Piece, Sources
from stages.tensor_parallel import TensorParallel, one_rank_unless


class Experts(nn.Module):
    """Routed experts stacked: gate_up_proj [E, 2I, H] (gate rows, then up) and down_proj
    [E, H, I]. A checkpoint stores them stacked under these names or per expert
    (`experts.{e}.gate_proj.weight`, ...); `checkpoint_sources` names the per-expert pieces.
    On a tensor-parallel stage each rank holds num_experts / size whole experts, from
    `first` on (expert parallelism). With `mxfp4` (a checkpoint's MXFP4 experts kept packed)
    the weights are uint8 e2m1 pairs [E, N, K/2] with their e8m0 scale bytes [E, N, K/32]
    under `<name>_scale_inv`, run W4A16 (kernels.moe_experts_mxfp4).

    With `shared` the stack holds one more expert after the routed ones, the block's shared
    expert (its gate, up and down loaded from `shared_experts.*`, of the routed experts' width),
    which every token of a decode-sized batch picks with weight 1 (the router appends the pick:
    MoE.forward asks it with `shared_slot`): the grouped kernel runs it with the routed ones,
    where a separate SwiGLU took two GEMMs, two quantizers and the sum (SGLang's shared-experts
    fusion). Longer batches run it as dense GEMMs on its slot (SHARED_IN_STACK_TOKENS). A checkpoint
    storing the routed experts stacked under the parameters' own names does not fit such a
    stack (the loader says the shapes differ)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        device: Device,
        fp8: bool = False,
        tp: TensorParallel | None = None,
        mxfp4: bool = False,
        shared: bool = False,
    ):
        super().__init__()
        tp = one_rank_unless(tp)
        self.num_experts = num_experts  # the model's; the rank holds [first, first + local)
        self.local = local = tp.part(num_experts, "routed experts")
        self.first = tp.rank * local
        self.mxfp4 = mxfp4 and hidden % MXFP4_GROUP == 0 and inter % MXFP4_GROUP == 0
        if shared and (tp.enabled or self.mxfp4):
            raise ValueError("a shared expert joins the routed stack only whole and unpacked")
        self.shared_slot = local if shared else None  # the shared expert's index in the stack
        num_experts = local + int(shared)
        if self.mxfp4:  # packed: two values a byte, one scale byte per 32 along K
            self._packed(num_experts, hidden, inter, device)
            self.fp8 = False
            return
        # FP8 weights kept (W8A8 experts): each with its 128 x 128 scales, `<name>_scale_inv`
        self.fp8 = fp8 and hidden % FP8_BLOCK == 0 and inter % FP8_BLOCK == 0
        wdtype = FP8 if self.fp8 else dtype
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden, dtype=wdtype, device=device)
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden, inter, dtype=wdtype, device=device)
        )
        if self.fp8:
            b = FP8_BLOCK
            self.gate_up_proj_scale_inv = nn.Parameter(
                torch.empty(num_experts, 2 * inter // b, hidden // b, device=device)
            )
            self.down_proj_scale_inv = nn.Parameter(
                torch.empty(num_experts, hidden // b, inter // b, device=device)
            )

    def _packed(self, experts: int, hidden: int, inter: int, device: Device) -> None:
        def byte_param(*shape: int) -> nn.Parameter:
            t = torch.empty(*shape, dtype=torch.uint8, device=device)
            return nn.Parameter(t, requires_grad=False)

        g = MXFP4_GROUP
        self.gate_up_proj = byte_param(experts, 2 * inter, hidden // 2)
        self.down_proj = byte_param(experts, hidden, inter // 2)
        self.gate_up_proj_scale_inv = byte_param(experts, 2 * inter, hidden // g)
        self.down_proj_scale_inv = byte_param(experts, hidden, inter // g)

    def checkpoint_sources(self, name: str) -> Sources:
        i, first = self.gate_up_proj.shape[1] // 2, self.first
        local = range(self.gate_up_proj.shape[0])
        # each slot's checkpoint module: a routed expert's, or the block's shared expert
        owner = {e: f"{name}.{first + e}" for e in range(self.local)}
        if self.shared_slot is not None:
            owner[self.shared_slot] = name.rpartition(".")[0] + ".shared_experts"
        gate_up, down = [], []
        for e in local:
            g = owner[e]
            gate_up.append(Piece(f"{g}.gate_proj.weight", (e, slice(0, i))))
            gate_up.append(Piece(f"{g}.up_proj.weight", (e, slice(i, 2 * i))))
            down.append(Piece(f"{g}.down_proj.weight", (e,)))
        out: Sources = {"gate_up_proj": gate_up, "down_proj": down}
        if self.mxfp4:  # a scale row per weight row: the weights' pieces, renamed
            for param, pieces in list(out.items()):
                out[param + "_scale_inv"] = [p._replace(name=p.name + "_scale_inv") for p in pieces]
        if self.fp8:
            b = i // FP8_BLOCK
            out["gate_up_proj_scale_inv"] = [
                Piece(f"{owner[e]}.{part}.weight_scale_inv", (e, slice(j * b, (j + 1) * b)))
                for e in local
                for j, part in enumerate(("gate_proj", "up_proj"))
            ]
            out["down_proj_scale_inv"] = [
                Piece(f"{owner[e]}.down_proj.weight_scale_inv", (e,)) for e in local
            ]
        return out

    def local_routes(
        self, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's picks as this rank's experts see them: ids made local, a pick another
        rank holds -1 (the experts kernels skip it; its weight zeroed too)."""
        if self.local == self.num_experts:
            return weights, ids
        local = ids - self.first
        mine = (local >= 0) & (local < self.local)
        return weights * mine, torch.where(mine, local, torch.full_like(local, -1))


# Batches of up to this many tokens run a stacked shared expert in the grouped kernel (decode
# steps: two small GEMMs, their quantizers and the sum fewer a layer); longer ones (prefill
# chunks) run it as dense GEMMs on its slot, where cuBLASLt's FP8 GEMM outruns the grouped
# kernel's prefill tiles (~680 TFLOP/s at V4-Flash's 8K chunk, docs/PERFORMANCE.md).
SHARED_IN_STACK_TOKENS = 1024


class MoE(nn.Module):
    def __init__(
        self,
        gate: nn.Module,
        experts: Experts,
        shared_experts: SwiGLU | None,
        kernels: Kernels,
        swiglu_limit: float | None = None,
        tp: TensorParallel | None = None,
    ):
        """On a tensor-parallel stage (`tp`) the router runs whole on every rank, each rank's
        experts add their picks and the shared experts their columns' part, and one all-reduce
        sums them (then the shared experts' output bias, if any); `experts` and
        `shared_experts` must be built with the same group. Experts holding the shared expert
        in their stack (`shared_slot`) take no separate `shared_experts`."""
        super().__init__()
        if experts.shared_slot is not None and shared_experts is not None:
            raise ValueError("the shared expert is in the routed stack: no SwiGLU besides it")
        self.tp = one_rank_unless(tp)
        if kernels.moe_experts is None:
            raise ValueError("no moe_experts kernel was selected")
        if experts.fp8 and kernels.moe_experts_fp8 is None:
            raise ValueError("FP8 experts need the moe_experts_fp8 kernel")
        if experts.mxfp4 and kernels.moe_experts_mxfp4 is None:
            raise ValueError("MXFP4 experts need the moe_experts_mxfp4 kernel")
        self.kernels = kernels
        self.gate, self.experts, self.shared_experts = gate, experts, shared_experts
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        ex = self.experts
        slot = ex.shared_slot
        in_stack = slot is not None and x.shape[0] <= SHARED_IN_STACK_TOKENS
        # the shared expert run with the routed ones: the router appends every token's pick
        picks = {"shared_slot": slot} if in_stack else {}
        if getattr(self.gate, "routes_by_token", False):
            weights, ids = self.gate(x, token_ids, **picks)
        else:
            weights, ids = self.gate(x, **picks)
        out = self.routed(x, *ex.local_routes(weights, ids))
        if slot is not None and not in_stack:
            out = out + self._stacked_shared(x)
        shared = self.shared_experts
        if shared is not None:
            out = out + shared(x, reduce=False)
        out = self.tp.all_reduce(out)
        if shared is not None and shared.unreduced_bias is not None:  # once, after the sum
            out = out + shared.unreduced_bias
        return out

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [T, H] for this rank's picks (ids -1: another
        rank's), on the kernel of the experts' form."""
        ex = self.experts
        options: dict[str, Any] = {}
        if self.swiglu_limit is not None:
            options["limit"] = self.swiglu_limit
        if ex.mxfp4 or ex.fp8:  # packed weights and their scales (see __init__ for the kernels)
            run = self.kernels.moe_experts_mxfp4 if ex.mxfp4 else self.kernels.moe_experts_fp8
            mats: tuple[torch.Tensor, ...] = (
                ex.gate_up_proj,
                ex.gate_up_proj_scale_inv,
                ex.down_proj,
                ex.down_proj_scale_inv,
            )
            if ex.fp8:
                options["fp8_linear"] = self.kernels.fp8_linear
        else:
            run, mats = self.kernels.moe_experts, (ex.gate_up_proj, ex.down_proj)
        return cast(Callable[..., torch.Tensor], run)(x, *mats, ids, weights, **options)

    def _stacked_shared(self, x: torch.Tensor) -> torch.Tensor:
        """The stack's shared expert as dense GEMMs on its slot (what SwiGLU computes)."""
        ex, slot = self.experts, self.experts.shared_slot
        fp8 = ex.fp8
        gate_up = project(
            self.kernels, x, ex.gate_up_proj[slot], ex.gate_up_proj_scale_inv[slot] if fp8 else None
        )
        down_scale = ex.down_proj_scale_inv[slot] if fp8 else None
        return project_swiglu(
            self.kernels, gate_up, self.swiglu_limit, ex.down_proj[slot], down_scale
        )


@torch.inference_mode()
def warm_up_experts(
    modules: Iterable[nn.Module], lengths: list[int], dtype: torch.dtype, device: torch.device
) -> dict[str, float]:
    """One call of the routed experts' kernel at each of these chunk lengths, over zero inputs
    routed by the first of `modules` that is a MoE routing by scores (a hash layer's table
    needs token ids; every layer's experts have the same shapes): the compiles and JIT a
    prefill chunk of that length would otherwise pay in its TTFT (the coordinator warms up CUDA
    stages only)."""
    moes = (m for m in modules if isinstance(m, MoE))
    moe = next((m for m in moes if not getattr(m.gate, "routes_by_token", False)), None)
    if moe is None or not lengths:
        return {}
    t0 = time.perf_counter()
    hidden = moe.experts.down_proj.shape[1]  # [E, H, I] (MXFP4: [E, H, I / 2])
    for n in lengths:
        x = torch.zeros(n, hidden, dtype=dtype, device=device)
        moe.routed(x, *moe.experts.local_routes(*moe.gate(x)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"expert_lengths": float(len(lengths)), "expert_seconds": time.perf_counter() - t0}
