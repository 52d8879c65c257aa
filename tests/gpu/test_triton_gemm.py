"""The Triton persistent GEMM against torch.nn.functional.linear in fp32.

Inputs are random bf16 (never zeros); the reference is F.linear on the same values upcast to fp32.
Tolerance: relative Frobenius error ||out - ref|| / ||ref|| < 1e-2, the bf16 band (the output's
own bf16 rounding alone gives about 3e-3). Outputs are poisoned with NaN first, so an unwritten
element fails the test.
"""

import pytest
import torch
import torch.nn.functional as F

from stages.kernels import triton_gemm as tg

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not tg.is_available("cuda"), reason="needs CUDA and triton"),
]

TOL = 1e-2

LLAMA8B = [  # (M, N, K): qkv, o, gate_up, down at 4096 and 8192 tokens, and the 8192^3 GEMM
    (m, n, k) for m in (4096, 8192)
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
] + [(8192, 8192, 8192)]

ODD = [
    (1000, 6144, 4096),  # M not a multiple of any block
    (4133, 4097, 4096),  # N odd: pointer path
    (300, 1000, 1000),   # partial tiles in M, N and K on the TMA path
    (257, 515, 515),     # K odd: pointer path
    (128, 8, 64),        # one tile, tiny N
    (129, 4096, 4096),   # just over MIN_M
]


def _check(out, x, w, bias=None):
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < TOL, f"relative error {err:.2e} >= {TOL}"


def _inputs(m, n, k, seed, bias=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("fn", [tg.linear, tg.linear_sm1], ids=["sms", "sms-1"])
@pytest.mark.parametrize("m,n,k", LLAMA8B + ODD)
def test_matches_fp32_reference(m, n, k, fn):
    x, w, _ = _inputs(m, n, k, seed=m * 7 + n * 3 + k)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert fn(x, w, out=out) is out
    _check(out, x, w)


@pytest.mark.parametrize("m,n,k", [(1000, 6144, 4096), (257, 515, 515), (4096, 4096, 4096)])
def test_bias(m, n, k):
    x, w, b = _inputs(m, n, k, seed=11, bias=True)
    _check(tg.linear(x, w, b), x, w, b)


def test_batched_and_strided_input():
    x, w, b = _inputs(2 * 700, 4096 + 64, 4096, seed=5, bias=True)
    x3 = x[:, :4096].reshape(2, 700, 4096)  # non-contiguous rows
    w = w[:4096 + 8]
    out = tg.linear(x3, w, b[:4096 + 8])
    assert out.shape == (2, 700, 4096 + 8)
    _check(out.reshape(-1, 4096 + 8), x[:, :4096], w, b[:4096 + 8])


@pytest.mark.parametrize("m", [1, 16, 127])
def test_small_m_falls_back_to_torch(m):
    x, w, b = _inputs(m, 4096, 4096, seed=m, bias=True)
    _check(tg.linear(x, w, b), x, w, b)


def test_every_tuned_config_is_correct():
    configs = {tg.DEFAULT_LARGE, tg.DEFAULT_MEDIUM, *tg._tuning_table(tg._tuning_path()).values()}
    grid = tg.num_sms("cuda")
    for cfg in configs:
        for m, n, k in [(1000, 1048, 4096), (777, 1001, 1000)]:
            x, w, _ = _inputs(m, n, k, seed=3)
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            tg.launch(x, w, None, out, grid, cfg)
            _check(out, x, w)


def test_grid_sizes():
    assert tg.num_sms("cuda") == torch.cuda.get_device_properties(0).multi_processor_count
