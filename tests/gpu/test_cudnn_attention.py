"""cuDNN chunk attention (prefix + diagonal, merged by log-sum-exp) against the torch reference.

Random bf16 q/k/v; the reference is torch_ref.attention on the same values upcast to fp32 (SDPA
math with a bottom-right causal mask). Tolerance: max abs error < 2e-2 on outputs of magnitude
~0.1-1: bf16 rounding of the output and of the two partial results (the measured error on
Llama-8B shapes is 1e-4 to 1e-3, docs/bench/attention.json). K/V are also given as a slice view
of a paged cache, as the engine passes them when a request's blocks are consecutive. Both paths
are tested on every shape: `split_attention` (cuDNN), and `attention`, which hands chunks of
fewer than 512 queries (decode steps too) to the reference's SDPA in bf16.
"""

import pytest
import torch

from stages.kernels import cudnn_attention as ca
from stages.kernels import torch_ref
from stages.kernels.registry import select_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ca.is_available("cuda"), reason="needs CUDA and cuDNN >= 9"),
]

HEADS = [(32, 8, 128), (4, 2, 64), (8, 8, 16)]  # (Hq, Hkv, D): Llama-8B, small GQA, MHA
# ragged query counts (padded to Q_ALIGN inside) and aligned ones, squares, prefixes shorter
# than KEY_ALIGN (all with the diagonal), and longer ones cut at a multiple of it
SHAPES = [(1, 1), (1, 777), (5, 5), (5, 9), (64, 4096), (1000, 1000), (1000, 3001), (4096, 8192),
          (512, 512), (600, 601), (512, 4608), (700, 9000), (4096, 12288), (777, 66313)]


@pytest.mark.parametrize("fn", ["split_attention", "attention"])
@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("t,length", SHAPES)
def test_matches_reference(fn, hq, hkv, d, t, length):
    g = torch.Generator(device="cuda").manual_seed(t * 7919 + length)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    # Keys and values inside a larger cache tensor [slots, Hkv, D], read through a slice view.
    cache = torch.randn(2, length + 100, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = cache[0][50:50 + length], cache[1][50:50 + length]
    scale = d ** -0.5
    out = getattr(ca, fn)(q, k, v, scale)
    ref = torch_ref.attention(q.float(), k.float(), v.float(), scale)
    assert out.shape == (t, hq, d) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    assert err < 2e-2, f"max abs error {err}"


def test_more_queries_than_keys_is_an_error():
    q = torch.randn(4, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 8, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        ca.attention(q, k, k, 0.125)


def test_auto_picks_cudnn_on_cuda_and_torch_on_cpu():
    assert select_kernels("cuda").names["attention"] == "cudnn"
    assert select_kernels("cpu").names["attention"] == "torch"


@pytest.mark.parametrize("fn", ["split_attention", "attention"])
@pytest.mark.parametrize("heads,t,length", [(16, 600, 601), (16, 4096, 8269), (16, 777, 33000),
                                            (128, 1000, 5000), (16, 64, 4096)])
def test_mla_head_dims_match_reference(fn, heads, t, length):
    """MLA's expanded heads: q/k 192, v 128 (narrower), run by cuDNN without padding."""
    g = torch.Generator(device="cuda").manual_seed(t + length)
    q = torch.randn(t, heads, 192, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(length, heads, 192, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(length, heads, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = 192 ** -0.5
    out = getattr(ca, fn)(q, k, v, scale)
    ref = torch_ref.attention(q.float(), k.float(), v.float(), scale)
    assert out.shape == (t, heads, 128) and out.dtype == torch.bfloat16
    err = (out.float() - ref).abs().max().item()
    assert err < 2e-2, f"max abs error {err}"
