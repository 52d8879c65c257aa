"""Routed MoE experts on grouped persistent Triton GEMMs (docs/ARCHITECTURE.md#kernel-backends).

``moe_experts(x, gate_up, down, topk_ids, topk_weights)`` matches
``stages.kernels.torch_ref.moe_experts``. The layout is DeepGEMM's grouped contiguous one, built
on the device with no host sync (``stages.kernels.moe_routing``): the (token, expert) pairs
sorted by expert, each expert's rows padded to a multiple of BLOCK_M, so every M tile belongs to
one expert and both operands load through Hopper TMA descriptors. The number of real tiles stays
on the device; the persistent kernels read it themselves.

The tokens' rows are copied into that layout while it is built; gate and up are one GEMM whose
epilogue applies silu(gate) * up; the down GEMM scales each row by its routing weight and
stores it at its (token, k) slot, and the k slots of a token are summed. Both GEMMs are
persistent: one program per SM walks the tiles (``moe_experts_sm1``: SMs - 1, leaving an SM to a
waiting NCCL recv). Tile sizes per model shape: ``stages.kernels.moe_tuning``.

Anything that is not a bf16 CUDA tensor (or has widths that TMA cannot address) goes to the
torch reference, counted and logged once (stages/kernels/fallbacks.py); an empty batch does too,
uncounted. Imports cleanly without triton or CUDA.
"""

from __future__ import annotations

import torch

from stages.kernels import pdl, torch_ref
from stages.kernels.fallbacks import record_fallback
from stages.kernels.moe_routing import Routing, route_and_gather
from stages.kernels.moe_tuning import MoeConfig, TileConfig, pick_moe_config
from stages.kernels.triton_gemm import num_sms
from stages.kernels.triton_moe_combine import combine


def is_available(device: str = "cuda") -> bool:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    return triton is not None and torch.cuda.get_device_capability()[0] >= 9


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    return _moe(x, gate_up, down, topk_ids, topk_weights, limit, sm_margin=0)


def moe_experts_sm1(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    return _moe(x, gate_up, down, topk_ids, topk_weights, limit, sm_margin=1)


def _tma_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    hidden, inter = x.shape[1], down.shape[2]
    return hidden % 8 == 0 and inter % 8 == 0 and gate_up.shape[1] == 2 * inter


def _moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float | None,
    sm_margin: int,
) -> torch.Tensor:
    if x.shape[0] == 0:  # no work either way
        return torch_ref.moe_experts(x, gate_up, down, topk_ids, topk_weights, limit)
    if triton is None:
        reason: str | None = "no_triton"
    elif not x.is_cuda:
        reason = "device"
    elif any(t.dtype != torch.bfloat16 for t in (x, gate_up, down)):
        reason = "dtype"
    elif not _tma_ok(x, gate_up, down):
        reason = "shape"
    else:
        reason = None
    if reason is not None:
        backend = "triton-persistent-sm1" if sm_margin else "triton-persistent"
        detail = f"x {tuple(x.shape)} {x.dtype}, experts {gate_up.dtype} -> torch reference"
        record_fallback("moe_experts", backend, reason, detail)
        return torch_ref.moe_experts(x, gate_up, down, topk_ids, topk_weights, limit)
    t, k = topk_ids.shape
    experts, hidden, inter = down.shape
    cfg = pick_moe_config(t, k, experts, hidden, inter)
    return run_moe(
        x,
        gate_up.contiguous(),
        down.contiguous(),
        topk_ids,
        topk_weights,
        num_sms(x.device) - sm_margin,
        cfg,
        limit,
    )


def run_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    grid: int,
    cfg: MoeConfig,
    limit: float | None = None,
) -> torch.Tensor:
    """Routing, the two grouped GEMMs and the sum over k, on contiguous bf16 weights with
    ``grid`` persistent programs (limit: DeepSeek-V4's swiglu clamp, as torch_ref.swiglu)."""
    t, k = topk_ids.shape
    r, a = route_and_gather(x, topk_ids, topk_weights, down.shape[0], cfg.block_m)
    h = gate_up_silu(a, gate_up, r, grid, cfg.gate, limit)
    y = down_scatter(h, down, r, t * k, grid, cfg.down)
    return combine(y, topk_ids, x.dtype)


def gate_up_silu(
    a: torch.Tensor,
    gate_up: torch.Tensor,
    r: Routing,
    grid: int,
    g: TileConfig,
    limit: float | None = None,
) -> torch.Tensor:
    """h [rows, I] = silu(a @ gate[e].T) * (a @ up[e].T), e the expert of each row's tile."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, hidden = a.shape
    experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    h = torch.empty(rows, inter, dtype=a.dtype, device=a.device)
    a_desc = TensorDescriptor(a, [rows, hidden], [hidden, 1], [r.block_m, g.block_k])
    # gate_up [E, 2I, H] as [2E, I, H]: gate of expert e is slice 2e, up is 2e + 1, so a tile
    # past I reads zeros instead of the other half
    w_desc = TensorDescriptor(
        gate_up,
        [2 * experts, inter, hidden],
        [inter * hidden, hidden, 1],
        [1, g.block_n, g.block_k],
    )
    h_desc = TensorDescriptor(h, [rows, inter], [inter, 1], [r.block_m, g.block_n])
    progs = max(1, min(grid, r.max_tiles * triton.cdiv(inter, g.block_n)))
    _gate_up_silu[(progs,)](
        a_desc,
        w_desc,
        h_desc,
        r.tile_expert,
        r.num_tiles,
        inter,
        hidden,
        progs,
        0.0 if limit is None else float(limit),
        HAS_LIMIT=limit is not None,
        BLOCK_M=r.block_m,
        BLOCK_N=g.block_n,
        BLOCK_K=g.block_k,
        GROUP_M=g.group_m,
        FLATTEN=g.flatten,
        WARP_SPECIALIZE=g.warp_specialize,
        num_warps=g.num_warps,
        num_stages=g.num_stages,
        **pdl.options(h),
    )
    return h


def down_scatter(
    h: torch.Tensor, down: torch.Tensor, r: Routing, pairs: int, grid: int, d: TileConfig
) -> torch.Tensor:
    """y [pairs, H]: each row's (h @ down[e].T) times its routing weight, at its pair's slot."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, inter = h.shape
    experts, hidden = down.shape[0], down.shape[1]
    # a skipped pick's slot (id -1, expert parallelism) stays unwritten: combine skips it
    y = torch.empty(pairs, hidden, dtype=h.dtype, device=h.device)
    h_desc = TensorDescriptor(h, [rows, inter], [inter, 1], [r.block_m, d.block_k])
    d_desc = TensorDescriptor(
        down, [experts, hidden, inter], [hidden * inter, inter, 1], [1, d.block_n, d.block_k]
    )
    progs = max(1, min(grid, r.max_tiles * triton.cdiv(hidden, d.block_n)))
    _down_scatter[(progs,)](
        h_desc,
        d_desc,
        y,
        r.pair_of_row,
        r.row_weight,
        r.tile_expert,
        r.num_tiles,
        hidden,
        inter,
        progs,
        BLOCK_M=r.block_m,
        BLOCK_N=d.block_n,
        BLOCK_K=d.block_k,
        GROUP_M=d.group_m,
        FLATTEN=d.flatten,
        WARP_SPECIALIZE=d.warp_specialize,
        num_warps=d.num_warps,
        num_stages=d.num_stages,
        **pdl.options(y),
    )
    return y


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.pdl import enter
    from stages.kernels.triton_gemm import _tile_coords

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def _gate_up_silu(a_desc, w_desc, h_desc, tile_expert_ptr, num_tiles_ptr, INTER, H,  # type: ignore[no-untyped-def]
                      num_progs, LIMIT, HAS_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                      PDL: tl.constexpr = False):
        """h[rows of tile m, n tile] = silu(a @ gate[e].T) * (a @ up[e].T), e = tile's expert."""
        enter(PDL)
        num_pid_m = tl.load(num_tiles_ptr)
        num_pid_n = (INTER + BLOCK_N - 1) // BLOCK_N
        k_tiles = (H + BLOCK_K - 1) // BLOCK_K
        # the epilogue's own tile counter keeps it independent of the prologue for the
        # pipeliner (as in stages.kernels.triton_gemm)
        tile_c = tl.program_id(0) - num_progs
        for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_progs,
                                flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            expert = tl.load(tile_expert_ptr + pid_m)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                off_k = ki * BLOCK_K
                a = a_desc.load([off_m, off_k])
                wg = tl.reshape(w_desc.load([2 * expert, off_n, off_k]), (BLOCK_N, BLOCK_K))
                wu = tl.reshape(w_desc.load([2 * expert + 1, off_n, off_k]), (BLOCK_N, BLOCK_K))
                acc_g = tl.dot(a, wg.T, acc_g)
                acc_u = tl.dot(a, wu.T, acc_u)
            if HAS_LIMIT:  # DeepSeek-V4's swiglu_limit: gate from above, up both ways
                acc_g = tl.minimum(acc_g, LIMIT)
                acc_u = tl.minimum(tl.maximum(acc_u, -LIMIT), LIMIT)
            act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            tile_c += num_progs
            pid_m, pid_n = _tile_coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
            h_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], act.to(h_desc.dtype))
    # fmt: on

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def _down_scatter(h_desc, d_desc, y_ptr, pair_ptr, weight_ptr, tile_expert_ptr,  # type: ignore[no-untyped-def]
                      num_tiles_ptr, H, INTER, num_progs, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                      PDL: tl.constexpr = False):
        """y[pair of row] = weight of row * (h[row] @ down[e].T) for the rows of each tile."""
        enter(PDL)
        num_pid_m = tl.load(num_tiles_ptr)
        num_pid_n = (H + BLOCK_N - 1) // BLOCK_N
        k_tiles = (INTER + BLOCK_K - 1) // BLOCK_K
        # the epilogue's own tile counter keeps it independent of the prologue for the
        # pipeliner (as in stages.kernels.triton_gemm)
        tile_c = tl.program_id(0) - num_progs
        for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_progs,
                                flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            expert = tl.load(tile_expert_ptr + pid_m)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                off_k = ki * BLOCK_K
                a = h_desc.load([off_m, off_k])
                w = tl.reshape(d_desc.load([expert, off_n, off_k]), (BLOCK_N, BLOCK_K))
                acc = tl.dot(a, w.T, acc)
            tile_c += num_progs
            pid_m, pid_n = _tile_coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            rows = off_m + tl.arange(0, BLOCK_M)
            pair = tl.load(pair_ptr + rows)
            acc = acc * tl.load(weight_ptr + rows)[:, None]
            cols = off_n + tl.arange(0, BLOCK_N)
            ptrs = y_ptr + pair.to(tl.int64)[:, None] * H + cols[None, :]
            keep = (pair[:, None] >= 0) & (cols[None, :] < H)
            tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=keep)
    # fmt: on
