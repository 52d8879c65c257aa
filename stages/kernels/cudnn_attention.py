"""Chunk attention on cuDNN: the prefix and the diagonal as two calls, merged by log-sum-exp.

PyTorch's SDPA runs a bottom-right causal chunk (t queries after L - t cached keys) on
FlashAttention-2, while a square causal prompt goes to cuDNN, which on H200 is 1.7x faster. Here
the chunk is cut so both parts fit cuDNN's top-left causal mask: the t x (L - t) prefix needs no
mask, the t x t diagonal is square (top-left == bottom-right), and the two partial softmaxes merge
exactly by their log-sum-exps. cuDNN takes GQA natively (no KV-head repeat).
Measured (docs/bench/attention.json, t=8K, L=128K, Llama-8B heads): 29.1 ms vs 51.9 ms.

cuDNN builds a graph per shape (PyTorch caches it), so a new prefix length costs a rebuild;
TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 (PyTorch >= 2.9, PR 155958) is meant to serve every length of
BSHD inputs, which ours are, from one graph. Not confirmed here: with it set, the first run of a
new prompt was still 0.5-0.9 s slower (docs/PERFORMANCE.md). Decode steps and short chunks, where
cuDNN's higher host cost per call outweighs its kernel, stay on the torch reference.
"""

from __future__ import annotations

import os

import torch

from stages.kernels import torch_ref

# For PyTorch's cuDNN attention calls; this module is imported before the first one.
os.environ.setdefault("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")

MIN_QUERIES = 512  # chunks with fewer new tokens (decode steps included) go to SDPA


def is_available(device: str) -> bool:
    return (str(device).startswith("cuda") and torch.cuda.is_available()
            and torch.backends.cudnn.is_available()
            and (torch.backends.cudnn.version() or 0) >= 90000
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"))


def _supported(q: torch.Tensor) -> bool:
    d = q.shape[-1]
    return q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= 128


def _cudnn(q, k, v, causal: bool, scale: float):
    """q/k/v [1, H, seq, D] -> (out [1, Hq, t, D], lse [1, Hq, t] fp32)."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    out = res[0]
    return out, res[1].reshape(out.shape[:3]).float()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as torch_ref.attention: q [t, Hq, D], k/v [L, Hkv, D] -> [t, Hq, D]."""
    t, length = q.shape[0], k.shape[0]
    if t > length:
        raise ValueError(f"{t} queries attend to a prefix of only {length} keys")
    if t < MIN_QUERIES or not _supported(q):
        return torch_ref.attention(q, k, v, scale)
    return split_attention(q, k, v, scale)


def merge_partials(a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor,
                   lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over keys A + B from its parts over A and over B (outputs [..., t, D],
    log-sum-exps [..., t]), in fp32."""
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (a.float() * w_a[..., None] + b.float() * w_b[..., None]) / (w_a + w_b)[..., None]


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """cuDNN for any t <= L (bf16/fp16, head dim a multiple of 8 up to 128)."""
    t, length = q.shape[0], k.shape[0]
    q_, k_, v_ = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, seq, D]
    if t == 1 or t == length:  # one query sees every key; a square needs only top-left causal
        return _cudnn(q_, k_, v_, t > 1, scale)[0][0].transpose(0, 1)
    cut = length - t
    pre, pre_lse = _cudnn(q_, k_[:, :, :cut], v_[:, :, :cut], False, scale)
    diag, diag_lse = _cudnn(q_, k_[:, :, cut:], v_[:, :, cut:], True, scale)
    return merge_partials(pre, pre_lse, diag, diag_lse).to(q.dtype)[0].transpose(0, 1)
