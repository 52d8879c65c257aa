"""The route_topk op (DeepSeek-V4's router after its gate GEMM): its torch form against the
routing written out per token, and the Triton kernel under Triton's CPU interpreter against the
torch form (tests/gpu/test_route_topk_cuda.py holds it to the same on CUDA): the same experts
(in another order: by score, where torch's top-k leaves the order open) with the same weights."""

from __future__ import annotations

import logging

import pytest
import torch

from stages.kernels import route_topk as torch_form
from stages.kernels.fallbacks import FALLBACKS


def _logits(t: int, experts: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, experts, generator=g) * 3).to(dtype)
    bias = torch.randn(experts, generator=g) * 0.1
    return logits, bias, g


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_torch_form_is_the_routing_written_out(scoring):
    logits, bias, _ = _logits(5, 32, torch.float32)
    weights, ids = torch_form.route_topk(logits, 4, scoring, 1.5, bias)
    for t in range(5):
        x = logits[t].double()
        score = torch.sqrt(torch.log1p(torch.exp(x))) if scoring == "sqrtsoftplus" else x.sigmoid()
        want = torch.sort((score + bias.double()).argsort(descending=True)[:4]).values
        assert torch.equal(torch.sort(ids[t]).values, want)
        chosen = score[ids[t]]
        torch.testing.assert_close(weights[t].double(), chosen / chosen.sum() * 1.5)


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("t,experts,k", [(9, 256, 6), (1, 256, 6), (5, 48, 3)])
@pytest.mark.parametrize("hashed", [False, True])
def test_interpreted_kernel_matches_the_torch_form(
    triton_interpreter, scoring, t, experts, k, hashed
):
    from stages.kernels import triton_route_topk

    logits, bias, g = _logits(t, experts, torch.bfloat16, seed=t + k)
    ids = (
        torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
        if hashed
        else None
    )
    want_w, want_ids = torch_form.route_topk(logits, k, scoring, 1.5, bias, ids)
    got_w, got_ids = triton_route_topk.launch(logits, k, scoring, 1.5, bias, ids)
    if hashed:  # the given ids, in their order
        assert got_ids.data_ptr() == ids.data_ptr()
        assert torch.equal(got_w, want_w)
        return
    got_w, got_ids = _by_expert(got_w, got_ids)
    want_w, want_ids = _by_expert(want_w, want_ids)
    assert torch.equal(got_ids, want_ids)
    # the interpreter's log(1 + exp) against torch's log1p: a bf16 unit, rarely
    torch.testing.assert_close(got_w.float(), want_w.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("hashed", [False, True])
def test_an_extra_pick_is_appended_with_weight_one(triton_interpreter, hashed):
    """`extra` (the shared expert in the routed stack): every token's k picks and weights as
    without it, then the extra id with weight exactly 1, on both forms."""
    from stages.kernels import triton_route_topk

    t, experts, k = 7, 64, 6
    logits, bias, g = _logits(t, experts, torch.bfloat16, seed=11)
    ids = (
        torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
        if hashed
        else None
    )
    for form in (torch_form.route_topk, triton_route_topk.launch):
        plain_w, plain_ids = form(logits, k, "sqrtsoftplus", 1.5, bias, ids)
        w, got = form(logits, k, "sqrtsoftplus", 1.5, bias, ids, extra=experts)
        assert w.shape == got.shape == (t, k + 1) and w.dtype == logits.dtype
        assert torch.equal(got[:, :k], plain_ids) and torch.equal(w[:, :k], plain_w)
        assert bool((got[:, k] == experts).all()) and bool((w[:, k] == 1).all())
        if hashed:  # the given ids stay as they were
            assert ids.shape == (t, k) and torch.equal(got[:, :k], ids)


def test_interpreted_kernel_breaks_ties_to_the_lower_expert(triton_interpreter):
    from stages.kernels import triton_route_topk

    logits = torch.zeros(2, 16, dtype=torch.bfloat16)
    logits[1, 9] = 1.0
    weights, ids = triton_route_topk.launch(logits, 3, "sigmoid", 1.0, torch.zeros(16))
    assert ids.tolist() == [[0, 1, 2], [9, 0, 1]]
    assert torch.allclose(weights[0].float(), torch.full((3,), 1 / 3), atol=2**-8)


def test_triton_backend_off_cuda_is_a_counted_fallback(caplog):
    pytest.importorskip("triton")
    from stages.kernels import triton_route_topk

    FALLBACKS.reset()
    logits, bias, _ = _logits(3, 16, torch.bfloat16)
    want = torch_form.route_topk(logits, 2, "sqrtsoftplus", 1.0, bias)
    with caplog.at_level(logging.WARNING, logger="stages.kernels.fallbacks"):
        got = triton_route_topk.route_topk(logits, 2, "sqrtsoftplus", 1.0, bias)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert FALLBACKS.counts() == {("route_topk", "triton", "device"): 1}
    assert "route_topk on triton (device" in caplog.text
    FALLBACKS.reset()
