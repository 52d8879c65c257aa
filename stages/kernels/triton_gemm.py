"""Persistent bf16 GEMM in Triton for linear layers (docs/ARCHITECTURE.md#kernel-backends).

``linear(x, weight, bias)`` computes ``x @ weight.T (+ bias)`` with torch.nn.Linear's layout
(x [..., K], weight [N, K]). The grid is the number of SMs: each program walks the output tiles
with a stride of the grid size (grouped ordering for L2 reuse), so the kernel owns the whole chip,
which is what a waiting NCCL recv (one SM) turns into a second wave. ``linear_sm1`` launches one
program fewer, leaving an SM free for the comm kernel.

Tiles are loaded with Hopper TMA through host-side tensor descriptors when the shapes allow it
(16-byte aligned rows: K and N multiples of 8), else with plain masked loads. Small M (decode) and
anything that is not a bf16 CUDA tensor go to torch, counted and logged once
(stages/kernels/fallbacks.py). Block configurations per shape come from a
measured sweep on an H200 (``docs/bench/triton_gemm_tuning.json``, made by
``python -m app.bench.contention --tune``); ``PPSERVE_TRITON_GEMM_TUNING=path.json`` overrides
them with such a file.

Imports cleanly without triton or CUDA: triton is imported lazily.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from stages.kernels.fallbacks import record_fallback

# Below this many rows the Triton kernel is not worth a launch: fall back to cuBLAS.
MIN_M = 128


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    subtile: bool = False  # store the epilogue in two halves (frees shared memory for stages)
    warp_specialize: bool = False
    tma: bool = True  # TMA descriptors when the shapes allow; False forces pointer loads

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_LARGE = GemmConfig()
DEFAULT_MEDIUM = GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=8)

# (M, N, K) -> config: the fastest of the sweep's candidates on an H200 (torch 2.11, Triton 3.6;
# do_bench medians, docs/bench/triton_gemm_tuning.json). The top few configs of a shape are
# within 1-3 % of each other, about the run-to-run spread. Lookup takes the entry with the same
# (N, K) and the nearest M; shapes not listed use the defaults above.
# Comments: the shape's layer, then this kernel's / cuBLAS's time in the sweep (us).
_TUNED: dict[tuple[int, int, int], GemmConfig] = {
    (8192, 8192, 8192): GemmConfig(128, 256, 64, 8, 3, 8),  # 8192^3 1550/1528
    (4096, 6144, 4096): GemmConfig(128, 256, 64, 8, 3, 8),  # qkv 298/301
    (4096, 4096, 4096): GemmConfig(128, 256, 64, 8, 3, 8, subtile=True),  # o 204/213
    (4096, 28672, 4096): GemmConfig(128, 256, 64, 16, 3, 8),  # gate_up 1449/1486
    (4096, 4096, 14336): GemmConfig(128, 256, 64, 8, 3, 8, subtile=True),  # down 702/708
    (8192, 6144, 4096): GemmConfig(128, 256, 64, 8, 3, 8),  # qkv 628/599
    (8192, 4096, 4096): GemmConfig(128, 256, 64, 8, 3, 8, subtile=True),  # o 414/415
    (8192, 28672, 4096): GemmConfig(128, 256, 64, 16, 3, 8),  # gate_up 2864/2888
    (8192, 4096, 14336): GemmConfig(128, 256, 64, 8, 3, 8, warp_specialize=True),  # down 1411/1416
    (512, 6144, 4096): GemmConfig(128, 256, 64, 8, 3, 8, warp_specialize=True),  # qkv 51/41
    (512, 4096, 4096): GemmConfig(128, 256, 64, 8, 4, 8, subtile=True),  # o 46/29
    (512, 28672, 4096): GemmConfig(64, 256, 64, 8, 4, 4),  # gate_up 194/179
    (512, 4096, 14336): GemmConfig(128, 128, 64, 8, 4, 4),  # down 95/88
}


def is_available(device: str = "cuda") -> bool:
    """True when this backend can run on ``device``: a CUDA device and an importable triton."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` on a persistent grid of one program per SM."""
    return _linear(x, weight, bias, out, sm_margin=0)


def linear_sm1(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same as ``linear`` with a grid of SMs - 1: one SM stays free for a waiting comm kernel."""
    return _linear(x, weight, bias, out, sm_margin=1)


def num_sms(device: torch.device | int | str = "cuda") -> int:
    """Multiprocessor count of a CUDA device: the grid of ``linear``."""
    dev = torch.device(device)
    return _num_sms(dev.index if dev.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pick_config(m: int, n: int, k: int) -> GemmConfig:
    table = _tuning_table(_tuning_path())
    same = [key for key in table if key[1] == n and key[2] == k]
    if same:
        best = min(same, key=lambda key: abs(key[0] - m) / max(key[0], m))
        return table[best]
    return DEFAULT_LARGE if m >= 1024 else DEFAULT_MEDIUM


def _tuning_path() -> str:
    return os.environ.get("PPSERVE_TRITON_GEMM_TUNING", "")


@functools.lru_cache(maxsize=8)
def _tuning_table(path: str) -> dict[tuple[int, int, int], GemmConfig]:
    if not path:
        return _TUNED
    with open(path) as f:
        data = json.load(f)
    table = {}
    for entry in data["best"]:
        table[(entry["M"], entry["N"], entry["K"])] = GemmConfig(**entry["config"])
    return table


FALLBACK_DETAIL = {  # reason -> the log's words; such calls run on torch (cuBLAS)
    "no_triton": "triton is not installed -> cuBLAS",
    "device": "an input off CUDA -> torch",
    "dtype": "inputs or weights not bf16 -> cuBLAS",
    "shape": "a weight not [N, K] or a bias not [N] -> cuBLAS",
    "few_rows": f"fewer than {MIN_M} rows (decode batches) -> cuBLAS",
}


def _unusable(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, m: int
) -> str | None:
    """Why the kernel does not take this call (a fallbacks.REASONS category), or None."""
    if triton is None:
        return "no_triton"
    if not x.is_cuda:
        return "device"
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return "dtype"
    n = weight.shape[0]
    if (
        weight.dim() != 2
        or weight.shape[1] != x.shape[-1]
        or (bias is not None and bias.shape != (n,))
    ):
        return "shape"
    if m < MIN_M:
        return "few_rows"
    return None


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    sm_margin: int,
) -> torch.Tensor:
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    reason = _unusable(x, weight, bias, m)
    if reason is not None:
        backend = "triton-persistent-sm1" if sm_margin else "triton-persistent"
        record_fallback("linear", backend, reason, FALLBACK_DETAIL[reason])
        result = torch.nn.functional.linear(x, weight, bias)
        if out is not None:
            out.view(-1, n).copy_(result.view(-1, n))
            return out
        return result
    if out is None:
        out2 = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
    else:
        out2 = out.view(m, n)
    cfg = pick_config(m, n, k)
    grid = num_sms(x.device) - sm_margin
    launch(
        x2.contiguous(),
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        out2,
        grid,
        cfg,
    )
    return out2.view(*x.shape[:-1], n) if out is None else out


def launch(
    a: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    c: torch.Tensor,
    grid: int,
    cfg: GemmConfig,
) -> None:
    """Run the kernel on contiguous a [M, K], w [N, K] into c [M, N] with ``grid`` programs."""
    m, k = a.shape
    n = w.shape[0]
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    progs = max(1, min(grid, tiles))
    bias_arg = bias if bias is not None else c
    common = dict(
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.tma and _tma_ok(a, w, c):
        from triton.tools.tensor_descriptor import TensorDescriptor

        store_n = cfg.block_n // 2 if cfg.subtile else cfg.block_n
        a_desc = TensorDescriptor(a, [m, k], [k, 1], [cfg.block_m, cfg.block_k])
        w_desc = TensorDescriptor(w, [n, k], [k, 1], [cfg.block_n, cfg.block_k])
        c_desc = TensorDescriptor(c, [m, n], [n, 1], [cfg.block_m, store_n])
        _gemm_tma[(progs,)](
            a_desc,
            w_desc,
            c_desc,
            bias_arg,
            m,
            n,
            k,
            progs,
            SUBTILE=cfg.subtile,
            WARP_SPECIALIZE=cfg.warp_specialize,
            **common,
        )
    else:
        launch_ptr(a, w, bias, c, grid, cfg)


def launch_ptr(
    a: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    c: torch.Tensor,
    grid: int,
    cfg: GemmConfig,
    a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
) -> None:
    """The pointer-load kernel on a [M, K], w [N, K] (rows of unit stride) into c [M, N]. With
    ``a_scale`` [M, K / block_k] and ``w_scale`` [N / block_n, K / block_k] the operands are
    block-scaled FP8 (W8A8, stages.kernels.fp8_gemm): block_k is the activation group and the
    weight block, block_n the weight block."""
    m, k = a.shape
    n = w.shape[0]
    progs = max(1, min(grid, triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)))
    scaled = a_scale is not None and w_scale is not None
    as_arg = a_scale if a_scale is not None else c
    ws_arg = w_scale if w_scale is not None else c
    _gemm_ptr[(progs,)](
        a,
        w,
        c,
        bias if bias is not None else c,
        as_arg,
        ws_arg,
        m,
        n,
        k,
        progs,
        a.stride(0),
        w.stride(0),
        c.stride(0),
        as_arg.stride(0) if scaled else 0,
        ws_arg.stride(0) if scaled else 0,
        HAS_BIAS=bias is not None,
        BLOCK_SCALED=scaled,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _tma_ok(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> bool:
    if a.is_cuda and torch.cuda.get_device_capability(a.device)[0] < 9:
        return False
    aligned = all(t.data_ptr() % 16 == 0 for t in (a, w, c))
    return aligned and a.shape[1] % 8 == 0 and c.shape[1] % 8 == 0


# Kernels: defined only where triton imports (guarded, so CPU-only installs import this module).
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):  # type: ignore[no-untyped-def]
        in_group = GROUP_M * num_pid_n
        first_m = (tile_id // in_group) * GROUP_M
        group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile_id % group_size)
        pid_n = (tile_id % in_group) // group_size
        return pid_m, pid_n
    # fmt: on

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def _gemm_tma(a_desc, w_desc, c_desc, bias_ptr, M, N, K, num_progs,  # type: ignore[no-untyped-def]
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SUBTILE: tl.constexpr,
                  WARP_SPECIALIZE: tl.constexpr):
        start = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        num_tiles = num_pid_m * num_pid_n
        # A second counter for the epilogue keeps the prologue and the epilogue independent
        # for the pipeliner (as in Triton's persistent-matmul tutorial).
        tile_c = start - num_progs
        for tile_id in tl.range(start, num_tiles, num_progs, flatten=True,
                                warp_specialize=WARP_SPECIALIZE):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                off_k = ki * BLOCK_K
                a = a_desc.load([off_m, off_k])
                w = w_desc.load([off_n, off_k])
                acc = tl.dot(a, w.T, acc)
            tile_c += num_progs
            pid_m, pid_n = _tile_coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
            off_cm = pid_m * BLOCK_M
            off_cn = pid_n * BLOCK_N
            if HAS_BIAS:
                cols = off_cn + tl.arange(0, BLOCK_N)
                b = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
                acc = acc + b.to(tl.float32)[None, :]
            if SUBTILE:
                halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
                acc0, acc1 = tl.split(halves)
                c_desc.store([off_cm, off_cn], acc0.to(tl.bfloat16))
                c_desc.store([off_cm, off_cn + BLOCK_N // 2], acc1.to(tl.bfloat16))
            else:
                c_desc.store([off_cm, off_cn], acc.to(tl.bfloat16))
    # fmt: on

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def dot_rows(a_ptr, w_ptr, as_ptr, ws_ptr, rows, cols, K, stride_am, stride_wn, stride_as,  # type: ignore[no-untyped-def]
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_SCALED: tl.constexpr):
        """a[rows] @ w[cols].T over all of K with pointer loads (rows, cols: int64, in range).
        BLOCK_SCALED: FP8 operands whose K tiles each take a_s[row, ki] * w_s[ki] (as_ptr: the
        activations' group scales, ws_ptr: the output tile's row of weight block scales)."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BLOCK_SCALED:
            k_tiles = tl.cdiv(K, BLOCK_K)
            a_s_next, w_s_next = tl.load(as_ptr + rows * stride_as), tl.load(ws_ptr)
            for ki in range(k_tiles):
                # the next K tile's scales loaded a step ahead: the pipeliner takes only the
                # loads that feed the dot, so these were each step's wait on memory
                a_s, w_s = a_s_next, w_s_next
                ahead = tl.minimum(ki + 1, k_tiles - 1)
                a_s_next = tl.load(as_ptr + rows * stride_as + ahead)
                w_s_next = tl.load(ws_ptr + ahead)
                ks = ki * BLOCK_K + tl.arange(0, BLOCK_K)
                kmask = ks[None, :] < K
                a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=kmask, other=0.0)
                w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=kmask, other=0.0)
                acc += tl.dot(a, w.T) * (a_s[:, None] * w_s)
        else:
            for ki in range(tl.cdiv(K, BLOCK_K)):
                ks = ki * BLOCK_K + tl.arange(0, BLOCK_K)
                kmask = ks[None, :] < K
                a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=kmask, other=0.0)
                w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=kmask, other=0.0)
                acc = tl.dot(a, w.T, acc)
        return acc
    # fmt: on

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def _gemm_ptr(a_ptr, w_ptr, c_ptr, bias_ptr, as_ptr, ws_ptr, M, N, K, num_progs,  # type: ignore[no-untyped-def]
                  stride_am, stride_wn, stride_cm, stride_as, stride_ws,
                  HAS_BIAS: tl.constexpr, BLOCK_SCALED: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        start = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_tiles = num_pid_m * num_pid_n
        for tile_id in tl.range(start, num_tiles, num_progs):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rows_safe = tl.where(rows < M, rows, 0).to(tl.int64)
            cols_safe = tl.where(cols < N, cols, 0).to(tl.int64)
            acc = dot_rows(a_ptr, w_ptr, as_ptr, ws_ptr + pid_n * stride_ws, rows_safe,
                           cols_safe, K, stride_am, stride_wn, stride_as, BLOCK_M, BLOCK_N,
                           BLOCK_K, BLOCK_SCALED)
            if HAS_BIAS:
                b = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
                acc = acc + b.to(tl.float32)[None, :]
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    # fmt: on
