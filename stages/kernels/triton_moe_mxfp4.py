"""Routed experts with MXFP4 weights kept packed (DeepSeek-V4's routed experts), W4A16 on one
grouped persistent Triton GEMM per projection: the contract of mxfp4.moe_experts.

The weights stay as the checkpoint stores them, e2m1 nibbles two per byte (uint8 [E, N, K/2],
element 2i in the low nibble) with one e8m0 scale byte per 32 values along K ([E, N, K/32]):
half a byte and 1/32 of a byte per value, against 1 byte (+ scales) in FP8 and 2 in bf16. SM90
has no FP4 tensor cores, so each K tile of weights is upcast in registers to bf16 and fed to a
bf16 MMA with the activations (W4A16, as vLLM's and SGLang's MoE paths do on Hopper): by
default through `tl.dot_scaled` (Triton's own e2m1 upcast with the e8m0 scales, byte-permute
lookups; what triton_kernels' MoE uses on Hopper), or (`Mxfp4Tiles.dot_scaled` False) through
this module's integer dequantizer (bf16 bits built from the nibbles, the scale added to the
exponent) and `tl.dot`. Both are exact: a dequantized weight is representable in bf16.

The token -> expert layout is the bf16 experts' (stages.kernels.moe_routing: DeepGEMM's grouped
contiguous one, built on the device with no host sync, picks of id -1 skipped); gate and up are
one GEMM whose epilogue applies silu(gate) * up (with V4's clamp where given), and the down GEMM
scales each row by its routing weight and stores it at its (token, k) slot, as triton_moe's do;
the k slots of a token are summed. The grid is the SMs (or SMs - 1, leaving one to a waiting
NCCL recv); the tile count stays on the device, so a call is sync-free (CUDA graphs capture it).

Anything not on CUDA, or not bf16/fp16 activations, goes to mxfp4.moe_experts, counted and
logged once (stages/kernels/fallbacks.py); an empty batch does too, uncounted. Imports cleanly
without triton or CUDA.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from stages.kernels import mxfp4
from stages.kernels.fallbacks import record_fallback
from stages.kernels.moe_routing import Routing, route_and_gather
from stages.kernels.triton_gemm import num_sms
from stages.kernels.triton_moe_combine import combine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mxfp4Tiles:
    block_m: int  # the routing's M tile, shared by both GEMMs
    block_n: int
    block_k: int = 128  # four scale groups per K tile
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    # tl.dot_scaled (Triton's own e2m1 -> bf16 upcast, byte-permute lookups, as triton_kernels'
    # MoE uses on Hopper), else our integer dequantizer and tl.dot
    dot_scaled: bool = True


# Rows per expert on average -> tiles. Decode batches (a few rows an expert): 16-row M tiles,
# narrow N so enough tiles keep the SMs busy while the packed weights stream; prefill chunks:
# 128 x 128 tiles. Untuned: `python -m app.bench.mxfp4` sweeps them on the H200. The 64-row
# tiles run on 8 warps: on 4, their gate and up accumulators spilled registers (ptxas: 340
# bytes; tests/cpu/test_triton_compile_sm90.py holds every configuration to none).
DECODE_TILES = Mxfp4Tiles(16, 64, 128, 4, 4)
MID_TILES = Mxfp4Tiles(64, 128, 128, 8, 3)
PREFILL_TILES = Mxfp4Tiles(128, 128, 64, 8, 3)


def tiles_for(pairs: int, experts: int) -> Mxfp4Tiles:
    """The tiles for `pairs` (token, expert) rows over `experts` (a shape, known on the host)."""
    if pairs < 16 * experts:
        return DECODE_TILES
    return MID_TILES if pairs < 128 * experts else PREFILL_TILES


def is_available(device: str = "cuda") -> bool:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    return triton is not None and torch.cuda.get_device_capability()[0] >= 9


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    args = (x, gate_up, gate_up_scale, down, down_scale, topk_ids, topk_weights)
    return _moe(*args, limit=limit, sm_margin=0)


def moe_experts_sm1(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    args = (x, gate_up, gate_up_scale, down, down_scale, topk_ids, topk_weights)
    return _moe(*args, limit=limit, sm_margin=1)


def _moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float | None,
    sm_margin: int,
) -> torch.Tensor:
    args = (x, gate_up, gate_up_scale, down, down_scale, topk_ids, topk_weights)
    if x.shape[0] == 0:  # no work either way
        return mxfp4.moe_experts(*args, limit=limit)
    if triton is None:
        reason: str | None = "no_triton"
    elif not x.is_cuda:
        reason = "device"
    elif x.dtype not in (torch.bfloat16, torch.float16):
        reason = "dtype"
    else:
        reason = None
    if reason is not None:
        backend = "triton-persistent-sm1" if sm_margin else "triton-persistent"
        detail = f"x {tuple(x.shape)} {x.dtype} on {x.device} -> mxfp4.moe_experts"
        record_fallback("moe_experts_mxfp4", backend, reason, detail)
        return mxfp4.moe_experts(*args, limit=limit)
    t, k = topk_ids.shape
    tiles = tiles_for(t * k, gate_up.shape[0])
    return run_moe(*args, grid=num_sms(x.device) - sm_margin, tiles=tiles, limit=limit)


def run_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    grid: int,
    tiles: Mxfp4Tiles,
    limit: float | None = None,
) -> torch.Tensor:
    """Routing, the two grouped W4A16 GEMMs and the sum over k with ``grid`` persistent
    programs (limit: DeepSeek-V4's swiglu clamp, as torch_ref.swiglu)."""
    t, k = topk_ids.shape
    inter = gate_up.shape[1] // 2
    r, a = route_and_gather(x, topk_ids, topk_weights, gate_up.shape[0], tiles.block_m)
    h = grouped_w4a16(a, gate_up, gate_up_scale, r, grid, tiles, inter, limit=limit)
    y = grouped_w4a16(h, down, down_scale, r, grid, tiles, down.shape[1], pairs=t * k)
    return combine(y, topk_ids, x.dtype)


def grouped_w4a16(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    r: Routing,
    grid: int,
    tiles: Mxfp4Tiles,
    n: int,
    pairs: int | None = None,
    limit: float | None = None,
) -> torch.Tensor:
    """a [rows, K] (the layout's rows) times each tile's expert of w [E, N', K/2] (scales
    [E, N', K/32]). Without ``pairs``: gate/up, N' = 2n, returns h [rows, n] =
    silu(gate) * up; with it: down, N' = n, returns y [pairs, n], each row times its routing
    weight at its pair's slot (unwritten where no row lands: a skipped pick)."""
    rows, k = a.shape
    if k % mxfp4.GROUP or w.shape[2] * 2 != k or w_scale.shape[2] * mxfp4.GROUP != k:
        raise ValueError(f"MXFP4 weights {tuple(w.shape)} do not match K = {k}")
    w, ws = w.contiguous().view(torch.uint8), w_scale.contiguous().view(torch.uint8)
    swiglu = pairs is None
    # a skipped pick's slot (id -1) stays unwritten: combine skips it
    c = torch.empty(rows if pairs is None else pairs, n, dtype=a.dtype, device=a.device)
    progs = max(1, min(grid, r.max_tiles * triton.cdiv(n, tiles.block_n)))
    scaled = tiles.dot_scaled and _DOT_SCALED_BUILDS[0]
    try:
        _launch(a, w, ws, c, r, tiles, (n, k, progs), limit, swiglu, scaled)
    except Exception as err:  # tl.dot_scaled not built by this Triton for this GPU
        if not scaled:
            raise
        _DOT_SCALED_BUILDS[0] = False
        log.warning(
            "tl.dot_scaled does not build here (%s): MXFP4 experts use the kernel's own "
            "dequantizer",
            f"{type(err).__name__}: {err}"[:200],
        )
        _launch(a, w, ws, c, r, tiles, (n, k, progs), limit, swiglu, False)
    return c


_DOT_SCALED_BUILDS = [True]  # cleared the first time it fails to build


def _launch(
    a: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    c: torch.Tensor,
    r: Routing,
    tiles: Mxfp4Tiles,
    sizes: tuple[int, int, int],
    limit: float | None,
    swiglu: bool,
    scaled: bool,
) -> None:
    n, k, progs = sizes
    _grouped_w4a16[(progs,)](
        a,
        w,
        ws,
        c,
        r.tile_expert,
        r.num_tiles,
        r.pair_of_row,
        r.row_weight,
        n,
        k,
        progs,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        ws.stride(0),
        ws.stride(1),
        c.stride(0),
        0.0 if limit is None else float(limit),
        SWIGLU=swiglu,
        HAS_LIMIT=limit is not None,
        BF16=a.dtype == torch.bfloat16,
        DOT_SCALED=scaled,
        A_FORMAT="bf16" if a.dtype == torch.bfloat16 else "fp16",
        BLOCK_M=r.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.triton_gemm import _tile_coords

    # fmt: off
    @triton.jit
    def _e2m1_bits(c, sb):  # type: ignore[no-untyped-def]
        """bf16 bits (in int32) of nibbles c times 2^(scale - 127), sb = (scale - 1) << 7:
        magnitude codes 2..7 are (1 + m/2) * 2^(e-1), i.e. bits (code << 6) with the exponent
        raised by scale - 1; code 1 is 0.5 (exponent scale - 1); code 0 is 0; bit 3 the sign.
        Exact while the scale byte is in 2..252 (any real checkpoint's)."""
        mag = c & 7
        bits = tl.where(mag > 1, (mag << 6) + sb, tl.where(mag == 1, sb, 0))
        return bits | ((c & 8) << 12)

    @triton.jit  # type: ignore[untyped-decorator]
    def _dequant(w_ptr, s_ptr, cols, k0, stride_wn, stride_sn, K,  # type: ignore[no-untyped-def]
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr):
        """[BLOCK_N, BLOCK_K] weights of the rows `cols` from K offset k0 (a multiple of 32),
        built in integer ops from the packed bytes, each 32-value group's scale added to the
        exponent: bf16 (BF16), else fp32 (exact either way)."""
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        p = tl.load(w_ptr + cols[:, None] * stride_wn + kb[None, :],
                    mask=kb[None, :] < K // 2, other=0).to(tl.int32)
        p = tl.reshape(p, (BLOCK_N, BLOCK_K // 32, 16))
        kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_ptr + cols[:, None] * stride_sn + kg[None, :],
                    mask=kg[None, :] < K // 32, other=127).to(tl.int32)
        sb = ((s - 1) << 7)[:, :, None]
        bits = tl.join(_e2m1_bits(p & 15, sb), _e2m1_bits(p >> 4, sb))  # element 2i, 2i + 1
        bits = tl.reshape(bits, (BLOCK_N, BLOCK_K))
        if BF16:
            w = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            w = (bits << 16).to(tl.float32, bitcast=True)
        return w

    @triton.jit  # type: ignore[untyped-decorator]
    def _packed(w_ptr, s_ptr, cols, k0, stride_wn, stride_sn, K,  # type: ignore[no-untyped-def]
                BLOCK_K: tl.constexpr):
        """The packed bytes [rows, BLOCK_K / 2] and scale bytes [rows, BLOCK_K / 32] of the rows
        `cols` from K offset k0 (zeros, scale 1, past K)."""
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        p = tl.load(w_ptr + cols[:, None] * stride_wn + kb[None, :], mask=kb[None, :] < K // 2,
                    other=0)
        kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_ptr + cols[:, None] * stride_sn + kg[None, :], mask=kg[None, :] < K // 32,
                    other=127)
        return p, s

    @triton.jit  # type: ignore[untyped-decorator]
    def _grouped_w4a16(  # type: ignore[no-untyped-def]
        a_ptr, w_ptr, ws_ptr, c_ptr, tile_expert_ptr, num_tiles_ptr, pair_ptr, weight_ptr,
        N, K, num_progs, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm, LIMIT,
        SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, BF16: tl.constexpr,
        DOT_SCALED: tl.constexpr, A_FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        num_pid_m = tl.load(num_tiles_ptr)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_progs):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            cols_safe = tl.where(cols < N, cols, 0).to(tl.int64)
            w_e = w_ptr + expert * stride_we
            s_e = ws_ptr + expert * stride_se
            a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(a_rows + ks[None, :], mask=ks[None, :] < K, other=0.0)
                if DOT_SCALED:  # the compiler's e2m1 upcast feeding the MMA
                    wq, wsc = _packed(w_e, s_e, cols_safe, k0, stride_wn, stride_sn, K, BLOCK_K)
                    acc = tl.dot_scaled(a, None, A_FORMAT, tl.trans(wq), wsc, "e2m1", acc)
                    if SWIGLU:  # up: rows N.. of the expert's gate_up
                        uq, usc = _packed(w_e, s_e, cols_safe + N, k0, stride_wn, stride_sn, K,
                                          BLOCK_K)
                        acc_u = tl.dot_scaled(a, None, A_FORMAT, tl.trans(uq), usc, "e2m1",
                                              acc_u)
                else:  # our integer dequantizer, then a plain MMA
                    w = _dequant(w_e, s_e, cols_safe, k0, stride_wn, stride_sn, K, BLOCK_N,
                                 BLOCK_K, BF16)
                    acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
                    if SWIGLU:
                        wu = _dequant(w_e, s_e, cols_safe + N, k0, stride_wn, stride_sn, K,
                                      BLOCK_N, BLOCK_K, BF16)
                        acc_u = tl.dot(a, tl.trans(wu.to(a.dtype)), acc_u)
            if SWIGLU:
                if HAS_LIMIT:  # DeepSeek-V4's swiglu_limit: gate from above, up both ways
                    acc = tl.minimum(acc, LIMIT)
                    acc_u = tl.minimum(tl.maximum(acc_u, -LIMIT), LIMIT)
                acc = acc / (1.0 + tl.exp(-acc)) * acc_u
                dest = rows.to(tl.int64)
                keep = cols[None, :] < N
            else:
                pair = tl.load(pair_ptr + rows)
                acc = acc * tl.load(weight_ptr + rows)[:, None]
                dest = pair.to(tl.int64)
                keep = (pair[:, None] >= 0) & (cols[None, :] < N)
            c_ptrs = c_ptr + dest[:, None] * stride_cm + cols[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=keep)
    # fmt: on
