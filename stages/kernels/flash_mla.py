"""MLA dense decode on FlashMLA (docs/ARCHITECTURE.md#kernel-backends): the `sgl-flash-mla` wheel
(1.0.0), whose SM90 kernels are its "legacy" half. Persistent (sized to the SM count), so a waiting
NCCL recv costs it a wave (docs/ARCHITECTURE.md#why-the-output-channel-matters), which is what makes
it worth measuring under the skip.

``mla_decode`` matches ``stages.kernels.torch_ref.mla_decode``: one query per row over the bf16
latent pages [blocks, 64, 1, 576]. The scheduler plan FlashMLA builds on its first call is kept
in the batch's ``state`` and reused by every layer of the stage (same shapes and lengths).

A model FlashMLA cannot serve (not bf16, a latent other than 512 + 64, more than 128 heads for
the sparse kernels, pages other than 64) is refused when the stage is built (``supports``); a
call that gets such an input anyway goes to the torch reference, counted and logged once
(stages/kernels/fallbacks.py). Install on the GPU host with ``pip install --no-deps
sgl-flash-mla`` (its metadata asks for a newer torch than it needs).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from stages.kernels import fp8_latent, torch_ref
from stages.kernels.fallbacks import KernelTarget, Refusal, record_fallback
from stages.models.families import FLASH_MLA_PAGE

MODULES = ("flash_mla", "sgl_flash_mla")


def wheel() -> Any:  # the optional, untyped FlashMLA wheel's module, or None
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def is_available(device: str = "cuda") -> bool:
    """A CUDA device of compute capability 9.x (the legacy SM90 kernels) and the wheel."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability()[0] != 9:
        return False
    return wheel() is not None


def mla_decode(
    q: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    seqlens: torch.Tensor,
    dv: int,
    scale: float,
    state: dict[str, Any],
) -> torch.Tensor:
    """q [R, H, 576] bf16, pages [blocks, 64, 1, 576] bf16 -> [R, H, dv]."""
    refusal = _refused(q, pages, torch.bfloat16, dv, heads=False) or _page_refused(pages)
    if refusal is not None:
        _fall_back("mla_decode", BACKEND, refusal)
        return torch_ref.mla_decode(q, pages, block_table, seqlens, dv, scale, state)
    fm = wheel()
    meta = state.get("flash_mla")
    if meta is None:
        meta = state["flash_mla"] = (
            fm.FlashMLASchedMeta() if hasattr(fm, "FlashMLASchedMeta") else fm.get_mla_metadata()[0]
        )
    out, _lse = fm.flash_mla_with_kvcache(
        q.unsqueeze(1).contiguous(),
        pages,
        block_table,
        seqlens,
        dv,
        meta,
        softmax_scale=scale,
        causal=True,
        use_legacy=True,
    )
    decoded: torch.Tensor = out.squeeze(1)
    return decoded


# The SM90 sparse kernels take 64 or 128 query heads; fewer heads are
# zero-padded (their outputs dropped), top-k is padded with -1 (no key) to a multiple of 128
# (the prefill kernel works in pairs of 64-key tiles).
SPARSE_HEADS = (64, 128)
TOPK_STEP = 128
LATENT_DIM = 576
DV = 512  # the latent part, the width of the output
BACKEND = "flash-mla"
SPARSE_OPS = ("mla_sparse", "mla_sparse_fp8", "mla_prefill_fp8")
PAGED_OPS = ("mla_decode", "mla_sparse_fp8", "mla_prefill_fp8")  # read pages of FLASH_MLA_PAGE


def supports(op: str, target: KernelTarget) -> Refusal | None:
    """Whether FlashMLA's SM90 kernels serve `op` for the stage's model (None: they do)."""
    shape = target.shapes.get(op)
    if shape is None:  # the model never calls op
        return None
    if target.dtype != "bfloat16":
        return Refusal("dtype", f"the model runs in {target.dtype}; FlashMLA takes bfloat16")
    if shape.head_dim != LATENT_DIM or shape.v_dim != DV:
        return Refusal(
            "head_dim",
            f"a latent of {shape.v_dim} + rope {shape.head_dim - shape.v_dim} values; "
            f"FlashMLA takes {DV} + {LATENT_DIM - DV}",
        )
    if op in SPARSE_OPS and shape.heads > max(SPARSE_HEADS):
        return Refusal(
            "heads", f"{shape.heads} query heads; the sparse kernels take {max(SPARSE_HEADS)}"
        )
    if op in PAGED_OPS and target.block_size != FLASH_MLA_PAGE:
        return Refusal("page_size", f"KV blocks of {target.block_size}; FlashMLA reads pages of 64")
    return None


def _refused(
    q: torch.Tensor, keys: torch.Tensor, keys_dtype: torch.dtype, dv: int, heads: bool
) -> Refusal | None:
    """Why a call is not FlashMLA's, if it is not: bf16 queries 576 wide, keys in keys_dtype
    (bf16, or uint8 FP8 pages), output dv 512 and, for the sparse kernels (heads), at most 128
    query heads."""
    if q.dtype != torch.bfloat16 or keys.dtype != keys_dtype:
        return Refusal("dtype", f"queries in {q.dtype}, keys in {keys.dtype}")
    if q.shape[-1] != LATENT_DIM or dv != DV:
        return Refusal("head_dim", f"queries {q.shape[-1]} wide, output {dv}")
    if heads and q.shape[-2] > max(SPARSE_HEADS):
        return Refusal("heads", f"{q.shape[-2]} query heads")
    return None


def _page_refused(pages: torch.Tensor) -> Refusal | None:
    if pages.shape[1] != FLASH_MLA_PAGE:
        return Refusal("page_size", f"pages of {pages.shape[1]}")
    return None


def _fall_back(op: str, backend: str, refusal: Refusal) -> None:
    record_fallback(op, backend, refusal.reason, f"{refusal.detail} -> torch reference")


def pad_heads(q: torch.Tensor) -> torch.Tensor | None:
    h = q.shape[-2]
    target = next((n for n in SPARSE_HEADS if h <= n), None)
    if target is None:
        return None
    if target == h:
        return q
    pad = q.new_zeros(*q.shape[:-2], target - h, q.shape[-1])
    return torch.cat((q, pad), dim=-2)


def pad_topk(indices: torch.Tensor) -> torch.Tensor:
    extra = -indices.shape[-1] % TOPK_STEP
    if extra == 0:
        return indices.to(torch.int32).contiguous()
    pad = indices.new_full((*indices.shape[:-1], extra), -1)
    return torch.cat((indices, pad), dim=-1).to(torch.int32).contiguous()


def mla_sparse(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, dv: int, scale: float
) -> torch.Tensor:
    """torch_ref.mla_sparse on flash_mla_sparse_fwd (bf16 latent, 576 wide, dv 512)."""
    refusal = _refused(q, kv, torch.bfloat16, dv, heads=True)
    if refusal is not None:
        _fall_back("mla_sparse", BACKEND, refusal)
        return torch_ref.mla_sparse(q, kv, indices, dv, scale)
    return _sparse_bf16(q, kv, indices, dv, scale)


def _sparse_bf16(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, dv: int, scale: float
) -> torch.Tensor:
    qp = pad_heads(q)
    if qp is None:  # the callers refused more heads
        raise ValueError(f"FlashMLA's sparse kernels take at most 128 heads, got {q.shape[1]}")
    out, _max, _lse = wheel().flash_mla_sparse_fwd(
        qp.contiguous(),
        kv,
        pad_topk(indices).unsqueeze(1),
        scale,
        dv,
        use_legacy=True,
        return_log2_lse=False,
    )
    attended: torch.Tensor = out[:, : q.shape[1]]
    return attended


def mla_sparse_fp8_decode(
    q: torch.Tensor,
    pages: torch.Tensor,
    indices: torch.Tensor,
    dv: int,
    scale: float,
    state: dict[Any, Any],
) -> torch.Tensor:
    """One query per row, q [R, H, 576] bf16, over FP8 latent pages [blocks, B, 1, 656]
    (stages.kernels.fp8_latent's layout) at slot ids indices [R, topk] (-1 = none) ->
    [R, H, dv] bf16. The plan built on the first call is kept in `state` for the other layers.
    """
    qp = pad_heads(q)
    if qp is None:
        raise ValueError(
            f"FlashMLA's sparse decode takes at most 128 query heads, got {q.shape[1]}"
        )
    fm = wheel()
    meta = state.get("flash_mla_sparse")
    if meta is None:
        meta = state["flash_mla_sparse"] = fm.get_mla_metadata()[0]
    out, _lse = fm.flash_mla_with_kvcache(
        qp.unsqueeze(1).contiguous(),
        pages,
        None,
        None,
        dv,
        meta,
        softmax_scale=scale,
        causal=False,
        is_fp8_kvcache=True,
        indices=pad_topk(indices).unsqueeze(1),
        use_legacy=True,
    )
    decoded: torch.Tensor = out[:, 0, : q.shape[1]]
    return decoded


def mla_sparse_fp8(
    q: torch.Tensor,
    pages: torch.Tensor,
    indices: torch.Tensor,
    dv: int,
    scale: float,
    state: dict[Any, Any],
) -> torch.Tensor:
    """fp8_latent.mla_sparse on FlashMLA's sparse FP8 decode kernel, every query (decode rows
    and prefill chunks alike) one batch row of it, as SGLang's flashmla_kv prefill does."""
    return _sparse_fp8(q, pages, indices, dv, scale, state, "mla_sparse_fp8", BACKEND)


def _sparse_fp8(
    q: torch.Tensor,
    pages: torch.Tensor,
    indices: torch.Tensor,
    dv: int,
    scale: float,
    state: dict[Any, Any],
    op: str,
    backend: str,
) -> torch.Tensor:
    refusal = _refused(q, pages, torch.uint8, dv, heads=True) or _page_refused(pages)
    if refusal is not None:
        _fall_back(op, backend, refusal)
        return fp8_latent.mla_sparse(q, pages, indices, dv, scale, state)
    key = ("flash_mla_sparse", q.shape[0])  # the plan depends on the number of rows
    plan: dict[str, Any] = state.setdefault(key, {})
    return mla_sparse_fp8_decode(q, pages, indices, dv, scale, plan)


PREFIX_KEYS = "prefix_keys"  # state key: (slots [S], position [cache slots] int32, -1 = none)


def mla_sparse_fp8_via_bf16(
    q: torch.Tensor,
    pages: torch.Tensor,
    indices: torch.Tensor,
    dv: int,
    scale: float,
    state: dict[Any, Any],
) -> torch.Tensor:
    """fp8_latent.mla_sparse for prefill chunks' queries: the keys of the chunks' prefixes
    (state[PREFIX_KEYS], set by the DSA layer) dequantized to bf16, the indices mapped onto
    them, then FlashMLA's bf16 sparse prefill kernel (`mla_sparse`), as SGLang's default V3.2
    prefill over an FP8 cache does. Without that plan: mla_sparse_fp8."""
    op, backend = "mla_prefill_fp8", "flash-mla-bf16"
    plan = state.get(PREFIX_KEYS)
    if plan is None:
        record_fallback(op, backend, "no_plan", "no prefix keys in the batch state -> flash-mla")
        return _sparse_fp8(q, pages, indices, dv, scale, state, op, backend)
    refusal = _refused(q, pages, torch.uint8, dv, heads=True)
    if refusal is not None:
        _fall_back(op, backend, refusal)
        return fp8_latent.mla_sparse(q, pages, indices, dv, scale, state)
    slots, position = plan
    kv = fp8_latent.dequantize(pages.view(-1, fp8_latent.BYTES).index_select(0, slots))
    local = torch.where(indices >= 0, position[indices.clamp(min=0).long()], -1)
    return _sparse_bf16(q, kv.to(q.dtype).view(-1, 1, LATENT_DIM), local, dv, scale)
