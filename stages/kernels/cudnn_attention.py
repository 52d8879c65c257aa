"""Chunk attention on cuDNN: the prefix and the diagonal as two calls, merged by log-sum-exp.

PyTorch's SDPA runs a bottom-right causal chunk (t queries after L - t cached keys) on
FlashAttention-2, while a square causal prompt goes to cuDNN, which is faster on H200. Here
the chunk is cut so both parts fit cuDNN's top-left causal mask: the t x (L - t) prefix needs no
mask, the t x t diagonal is square (top-left == bottom-right), and the two partial softmaxes merge
exactly by their log-sum-exps. cuDNN takes GQA natively (no KV-head repeat). Figures:
docs/PERFORMANCE.md.

cuDNN builds a graph per shape (PyTorch caches it per thread, keyed by every size), tens of
milliseconds for each new (queries, keys) pair. So the calls' shapes
are bucketed (split_attention: key counts in steps of KEY_ALIGN, query counts of Q_ALIGN), and a
stage builds a long prompt's chunk shapes at startup (StageRunner.warm_up), so requests do not
pay for them. TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 (one graph per power of two, ragged offsets) is
not used: it made the kernels slower at long key counts. Decode steps and short
chunks, where cuDNN's higher host cost per call outweighs its kernel, stay on the torch reference
(counted as fallbacks of reason few_rows, logged once at info). A model whose dtype or head
widths cuDNN does not take is refused when the stage is built (``supports``): the op is torch's.
"""

from __future__ import annotations

import torch

from stages.kernels import torch_ref
from stages.kernels.fallbacks import KernelTarget, Refusal, record_fallback

MIN_QUERIES = 512  # chunks with fewer new tokens (decode steps included) go to SDPA
SHORT_CHUNKS = f"chunks under {MIN_QUERIES} queries (decode steps included) -> SDPA"
Q_ALIGN = 256  # queries (and the diagonal's keys) padded to a multiple: fewer cuDNN graphs
KEY_ALIGN = 4096  # the prefix part's key count is a multiple (the rest joins the diagonal)


def is_available(device: str) -> bool:
    return (
        str(device).startswith("cuda")
        and torch.cuda.is_available()
        and torch.backends.cudnn.is_available()
        and (torch.backends.cudnn.version() or 0) >= 90000
        and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
    )


MAX_HEAD_DIM = 256  # cuDNN's fused flash kernels on SM90, q/k and v widths each


DTYPES = ("bfloat16", "float16")


def _widths_refused(qk: int, v: int) -> Refusal | None:
    if all(d % 8 == 0 and d <= MAX_HEAD_DIM for d in (qk, v)):
        return None
    return Refusal("head_dim", f"q/k {qk} and v {v} wide (multiples of 8 up to {MAX_HEAD_DIM})")


def supports(op: str, target: KernelTarget) -> Refusal | None:
    """Whether cuDNN serves the stage's chunk attention (None: it does)."""
    shape = target.shapes.get(op)
    if shape is None:  # the model has no dense chunk attention
        return None
    if target.dtype not in DTYPES:
        return Refusal("dtype", f"the model runs in {target.dtype}; cuDNN takes {DTYPES}")
    return _widths_refused(shape.head_dim, shape.v_dim)


def _refused(q: torch.Tensor, v: torch.Tensor) -> Refusal | None:
    if str(q.dtype).removeprefix("torch.") not in DTYPES:
        return Refusal("dtype", f"queries in {q.dtype}")
    return _widths_refused(q.shape[-1], v.shape[-1])


def _cudnn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k/v [1, H, seq, D] -> (out [1, Hq, t, D], lse [1, Hq, t] fp32)."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    out: torch.Tensor = res[0]
    return out, res[1].reshape(out.shape[:3]).float()


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[n, H, D] -> [1, H, n, D]."""
    return x.transpose(0, 1).unsqueeze(0)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as torch_ref.attention: q [t, Hq, D], k [L, Hkv, D], v [L, Hkv, Dv] ->
    [t, Hq, Dv] (MLA's expanded heads: D 192, Dv 128, run as they are)."""
    t, length = q.shape[0], k.shape[0]
    if t > length:
        raise ValueError(f"{t} queries attend to a prefix of only {length} keys")
    if t < MIN_QUERIES:  # by design, on every decode step: nothing built per call
        record_fallback("attention", "cudnn", "few_rows", SHORT_CHUNKS)
        return torch_ref.attention(q, k, v, scale)
    refusal = _refused(q, v)
    if refusal is not None:
        record_fallback("attention", "cudnn", refusal.reason, f"{refusal.detail} -> SDPA")
        return torch_ref.attention(q, k, v, scale)
    return split_attention(q, k, v, scale)


def merge_partials(
    a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Softmax attention over keys A + B from its parts over A and over B (outputs [..., t, D],
    log-sum-exps [..., t]), in fp32."""
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (a.float() * w_a[..., None] + b.float() * w_b[..., None]) / (w_a + w_b)[..., None]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [n, H, D] with zero rows appended up to `rows`."""
    if x.shape[0] == rows:
        return x
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def diagonal_sizes(max_queries: int) -> range:
    """Every square the diagonal part can have for chunks of up to max_queries queries (it
    takes up to KEY_ALIGN - 1 cached keys besides the chunk's own): building these ahead
    covers chunks at any offset, e.g. a chunk shortened by the decode rows sharing its batch."""
    return range(
        _round_up(MIN_QUERIES, Q_ALIGN),
        _round_up(max_queries + KEY_ALIGN - 1, Q_ALIGN) + 1,
        Q_ALIGN,
    )


def split_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """cuDNN for any t <= L (bf16/fp16, head dims multiples of 8 up to 256; v's may differ).

    Shapes are bucketed so cuDNN meets few of them: the prefix part covers the keys up to the
    last multiple of KEY_ALIGN before the chunk (base); the r cached keys after it go with the
    diagonal, whose queries are padded at the top by r rows, so a square top-left causal mask
    gives each real query exactly its keys; queries (and the diagonal's keys) are padded at
    the end to a multiple of Q_ALIGN. A real query never sees a padded key; padded rows are
    dropped."""
    t, length = q.shape[0], k.shape[0]
    if t == 1:  # one query sees every key
        return _cudnn(_bhsd(q), _bhsd(k), _bhsd(v), False, scale)[0][0].transpose(0, 1)
    cut = length - t
    base = cut // KEY_ALIGN * KEY_ALIGN
    r = cut - base
    rows = _round_up(t + r, Q_ALIGN)
    q_diag = q if rows == t else q.new_zeros((rows, *q.shape[1:]))
    if rows != t:
        q_diag[r : r + t] = q
    diag, diag_lse = _cudnn(
        _bhsd(q_diag),
        _bhsd(_pad_rows(k[base:], rows)),
        _bhsd(_pad_rows(v[base:], rows)),
        True,
        scale,
    )
    diag, diag_lse = diag[:, :, r : r + t], diag_lse[:, :, r : r + t]
    if base == 0:  # no keys before the diagonal's square
        return diag[0].transpose(0, 1)
    pre, pre_lse = _cudnn(
        _bhsd(_pad_rows(q, _round_up(t, Q_ALIGN))), _bhsd(k[:base]), _bhsd(v[:base]), False, scale
    )
    out = merge_partials(pre[:, :, :t], pre_lse[:, :, :t], diag, diag_lse)
    return out.to(q.dtype)[0].transpose(0, 1)
