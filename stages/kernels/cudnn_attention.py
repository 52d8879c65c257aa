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
chunks, where cuDNN's higher host cost per call outweighs its kernel, stay on the torch reference.
"""

from __future__ import annotations

import torch

from stages.kernels import torch_ref

MIN_QUERIES = 512  # chunks with fewer new tokens (decode steps included) go to SDPA
Q_ALIGN = 256  # queries (and the diagonal's keys) padded to a multiple: fewer cuDNN graphs
KEY_ALIGN = 4096  # the prefix part's key count is a multiple (the rest joins the diagonal)


def is_available(device: str) -> bool:
    return (str(device).startswith("cuda") and torch.cuda.is_available()
            and torch.backends.cudnn.is_available()
            and (torch.backends.cudnn.version() or 0) >= 90000
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"))


MAX_HEAD_DIM = 256  # cuDNN's fused flash kernels on SM90, q/k and v widths each


def _supported(q: torch.Tensor, v: torch.Tensor) -> bool:
    return q.dtype in (torch.bfloat16, torch.float16) and all(
        d % 8 == 0 and d <= MAX_HEAD_DIM for d in (q.shape[-1], v.shape[-1]))


def _cudnn(q, k, v, causal: bool, scale: float):
    """q/k/v [1, H, seq, D] -> (out [1, Hq, t, D], lse [1, Hq, t] fp32)."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    out = res[0]
    return out, res[1].reshape(out.shape[:3]).float()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as torch_ref.attention: q [t, Hq, D], k [L, Hkv, D], v [L, Hkv, Dv] ->
    [t, Hq, Dv] (MLA's expanded heads: D 192, Dv 128, run as they are)."""
    t, length = q.shape[0], k.shape[0]
    if t > length:
        raise ValueError(f"{t} queries attend to a prefix of only {length} keys")
    if t < MIN_QUERIES or not _supported(q, v):
        return torch_ref.attention(q, k, v, scale)
    return split_attention(q, k, v, scale)


def merge_partials(a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor,
                   lse_b: torch.Tensor) -> torch.Tensor:
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
    out[:x.shape[0]] = x
    return out


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def diagonal_sizes(max_queries: int) -> range:
    """Every square the diagonal part can have for chunks of up to max_queries queries (it
    takes up to KEY_ALIGN - 1 cached keys besides the chunk's own): building these ahead
    covers chunks at any offset, e.g. a chunk shortened by the decode rows sharing its batch."""
    return range(_round_up(MIN_QUERIES, Q_ALIGN),
                 _round_up(max_queries + KEY_ALIGN - 1, Q_ALIGN) + 1, Q_ALIGN)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """cuDNN for any t <= L (bf16/fp16, head dims multiples of 8 up to 256; v's may differ).

    Shapes are bucketed so cuDNN meets few of them: the prefix part covers the keys up to the
    last multiple of KEY_ALIGN before the chunk (base); the r cached keys after it go with the
    diagonal, whose queries are padded at the top by r rows, so a square top-left causal mask
    gives each real query exactly its keys; queries (and the diagonal's keys) are padded at
    the end to a multiple of Q_ALIGN. A real query never sees a padded key; padded rows are
    dropped."""
    t, length = q.shape[0], k.shape[0]
    bhsd = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731  [n, H, D] -> [1, H, n, D]
    if t == 1:  # one query sees every key
        return _cudnn(bhsd(q), bhsd(k), bhsd(v), False, scale)[0][0].transpose(0, 1)
    cut = length - t
    base = cut // KEY_ALIGN * KEY_ALIGN
    r = cut - base
    rows = _round_up(t + r, Q_ALIGN)
    q_diag = q if rows == t else q.new_zeros((rows, *q.shape[1:]))
    if rows != t:
        q_diag[r:r + t] = q
    diag, diag_lse = _cudnn(bhsd(q_diag), bhsd(_pad_rows(k[base:], rows)),
                            bhsd(_pad_rows(v[base:], rows)), True, scale)
    diag, diag_lse = diag[:, :, r:r + t], diag_lse[:, :, r:r + t]
    if base == 0:  # no keys before the diagonal's square
        return diag[0].transpose(0, 1)
    pre, pre_lse = _cudnn(bhsd(_pad_rows(q, _round_up(t, Q_ALIGN))), bhsd(k[:base]),
                          bhsd(v[:base]), False, scale)
    out = merge_partials(pre[:, :, :t], pre_lse[:, :, :t], diag, diag_lse)
    return out.to(q.dtype)[0].transpose(0, 1)
