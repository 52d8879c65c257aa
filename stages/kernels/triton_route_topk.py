"""The `route_topk` op (stages/kernels/route_topk.py) in one Triton kernel: a program per block
of tokens holds their expert logits, scores them, takes the top k of score + bias by k passes
of a maximum (among equal ones the lower expert), and writes the renormalised, scaled weights
and the ids. torch took nine kernels (softplus, sqrt, the biased sum, top-k, gather, sum, the
epsilon, the division, the scale), each a launch of a decode step's eight layers.

The same roundings as the torch form: every step rounded to the logits' dtype where torch's
is, libdevice's expf / log1pf (torch's softplus: log1p(exp(x)), x itself above 20) and IEEE
divisions. torch's top-k leaves the order of its k and the choice among exact ties to the
implementation; here they come by descending score, ties to the lower expert (a tie between
continuous scores plus an fp32 bias is rare; the MoE's sum does not depend on the order).
Inputs off CUDA take the torch form, counted and logged once (stages/kernels/fallbacks.py).
"""

from __future__ import annotations

import torch

from stages.kernels import pdl
from stages.kernels import route_topk as reference
from stages.kernels.fallbacks import record_fallback

BLOCK_T = 4  # tokens a program (256 experts each)
SCORINGS = ("sqrtsoftplus", "sigmoid")


def is_available(device: str = "cuda") -> bool:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    return triton is not None


def route_topk(
    logits: torch.Tensor,
    k: int,
    scoring: str,
    scale: float,
    bias: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    extra: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    reason = _refusal(logits, k, scoring, bias, ids)
    if reason is not None:
        if logits.shape[0]:
            detail = f"logits {tuple(logits.shape)} {logits.dtype} on {logits.device} -> torch"
            record_fallback("route_topk", "triton", reason, detail)
        return reference.route_topk(logits, k, scoring, scale, bias, ids, extra)
    return launch(logits, k, scoring, scale, bias, ids, extra)


def _refusal(
    logits: torch.Tensor,
    k: int,
    scoring: str,
    bias: torch.Tensor | None,
    ids: torch.Tensor | None,
) -> str | None:
    if triton is None:
        return "no_triton"
    if not logits.is_cuda:
        return "device"
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return "dtype"
    if bias is not None and bias.dtype != torch.float32:
        return "dtype"
    if logits.dim() != 2 or logits.stride(-1) != 1 or scoring not in SCORINGS or k < 1:
        return "shape"
    if ids is None and (bias is None or bias.shape != (logits.shape[1],)):
        return "shape"
    if ids is not None and (ids.shape != (logits.shape[0], k) or ids.stride(-1) != 1):
        return "shape"
    return None


def launch(
    logits: torch.Tensor,
    k: int,
    scoring: str,
    scale: float,
    bias: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    extra: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch on any device Triton runs on (its interpreter's tests call it)."""
    t, experts = logits.shape
    width = k + (extra is not None)
    weights = torch.empty(t, width, dtype=logits.dtype, device=logits.device)
    copied = ids is not None and extra is not None  # a hash layer's ids, widened by one
    picked = ids if ids is not None and not copied else None
    if picked is None:
        picked = torch.empty(t, width, dtype=torch.long, device=logits.device)
    given = picked if ids is None else ids
    if t:
        options = {"enable_fp_fusion": False} if logits.is_cuda else {}
        _route_topk[(triton.cdiv(t, BLOCK_T),)](
            logits, logits if bias is None else bias, given, picked, weights, t, experts,
            logits.stride(0), given.stride(0), picked.stride(0), weights.stride(0), scale,
            0 if extra is None else extra,
            K=k, SQRTSOFTPLUS=scoring == "sqrtsoftplus", PICK=ids is None, COPY=copied,
            EXTRA=extra is not None, CUDA_MATH=logits.is_cuda, BLOCK_T=BLOCK_T,
            BLOCK_E=triton.next_power_of_2(experts), K_POW2=triton.next_power_of_2(k),
            num_warps=4, **options, **pdl.options(weights),
        )  # fmt: skip
    return weights, picked


try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.pdl import enter
    # fmt: off

    @triton.jit  # type: ignore[untyped-decorator]
    def _route_topk(  # type: ignore[no-untyped-def]
        logit_ptr, bias_ptr, given_ptr, ids_ptr, w_ptr, T, E, stride_l, stride_g, stride_i,
        stride_w, scale, extra, K: tl.constexpr, SQRTSOFTPLUS: tl.constexpr,
        PICK: tl.constexpr, COPY: tl.constexpr, EXTRA: tl.constexpr, CUDA_MATH: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, K_POW2: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """PICK: the top K by score + bias, stored at ids; else the K given ids (a hash
        layer's), copied to ids with COPY. EXTRA: column K of ids and weights is `extra`, 1."""
        enter(PDL)
        rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        cols = tl.arange(0, BLOCK_E)
        in_t = rows < T
        in_e = (cols < E)[None, :]
        x = tl.load(logit_ptr + rows[:, None] * stride_l + cols[None, :],
                    mask=in_t[:, None] & in_e, other=0.0)
        dtype = x.dtype
        v = x.to(tl.float32)
        if SQRTSOFTPLUS:  # softplus rounded, then its sqrt rounded (two torch ops)
            if CUDA_MATH:
                soft = tl.where(v > 20.0, v, libdevice.log1p(libdevice.exp(v)))
            else:
                soft = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(v)))
            score = tl.sqrt_rn(soft.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        else:
            if CUDA_MATH:
                score = tl.div_rn(1.0, 1.0 + libdevice.exp(-v)).to(dtype).to(tl.float32)
            else:
                score = tl.div_rn(1.0, 1.0 + tl.exp(-v)).to(dtype).to(tl.float32)
        if PICK:  # by score + bias, in fp32
            bias = tl.load(bias_ptr + cols, mask=cols < E, other=0.0)[None, :]
            left = tl.where(in_e, score + bias, float("-inf"))
        slots = tl.arange(0, K_POW2)[None, :]
        picks = tl.zeros([BLOCK_T, K_POW2], dtype=tl.int32)
        total = tl.zeros([BLOCK_T], dtype=tl.float32)
        for j in tl.static_range(K):
            if PICK:
                top = tl.max(left, axis=1)
                pick = tl.min(tl.where(left == top[:, None], cols[None, :], BLOCK_E), axis=1)
                left = tl.where(cols[None, :] == pick[:, None], float("-inf"), left)
                tl.store(ids_ptr + rows * stride_i + j, pick.to(tl.int64), mask=in_t)
            else:
                pick = tl.load(given_ptr + rows * stride_g + j, mask=in_t, other=0).to(tl.int32)
                if COPY:
                    tl.store(ids_ptr + rows * stride_i + j, pick.to(tl.int64), mask=in_t)
            picks = tl.where(slots == j, pick[:, None], picks)
            total += tl.sum(tl.where(cols[None, :] == pick[:, None], score, 0.0), axis=1)
        # the sum rounded, plus 1e-20 rounded (bf16 keeps the sum), as torch's two ops
        denom = (total.to(dtype).to(tl.float32) + 1e-20).to(dtype).to(tl.float32)
        for j in tl.static_range(K):
            pick = tl.sum(tl.where(slots == j, picks, 0), axis=1)
            w = tl.sum(tl.where(cols[None, :] == pick[:, None], score, 0.0), axis=1)
            w = tl.div_rn(w, denom).to(dtype).to(tl.float32)
            tl.store(w_ptr + rows * stride_w + j, (w * scale).to(dtype), mask=in_t)
        if EXTRA:
            tl.store(ids_ptr + rows * stride_i + K, tl.zeros([BLOCK_T], tl.int64) + extra,
                     mask=in_t)
            tl.store(w_ptr + rows * stride_w + K, (tl.zeros([BLOCK_T], tl.float32) + 1.0).to(dtype),
                     mask=in_t)
    # fmt: on
