"""The route_topk op's Triton kernel (stages/kernels/triton_route_topk.py) against its torch form
on CUDA at DeepSeek-V4-Flash's router (256 experts, top 6, sqrtsoftplus, scale 1.5): the same
experts per token with the same weights (the order of the k is the kernel's: by score), a hash
layer's given ids in their order, and captured in a CUDA graph, the same as eager."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import route_topk as torch_form
from stages.kernels import triton_route_topk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("t", [1, 512, 8192])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("hashed", [False, True])
def test_kernel_matches_the_torch_form(t, scoring, hashed):
    g = torch.Generator(device="cuda").manual_seed(t)
    logits = (torch.randn(t, 256, generator=g, device="cuda") * 3).bfloat16()
    bias = torch.randn(256, generator=g, device="cuda") * 0.1
    ids = torch.randint(0, 256, (t, 6), generator=g, device="cuda") if hashed else None
    want = torch_form.route_topk(logits, 6, scoring, 1.5, bias, ids)
    got = triton_route_topk.route_topk(logits, 6, scoring, 1.5, bias, ids)
    if not hashed:
        got, want = _by_expert(*got), _by_expert(*want)
    assert torch.equal(got[1], want[1])
    # libdevice's expf / log1pf are torch's: a bf16 rounding apart at most, rarely
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2**-7, atol=0)
    assert (got[0] != want[0]).float().mean() < 1e-3


def test_graph_replay_equals_eager():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, 256, generator=g, device="cuda") * 3).bfloat16()
    bias = torch.randn(256, generator=g, device="cuda") * 0.1
    triton_route_topk.route_topk(logits, 6, "sqrtsoftplus", 1.5, bias)  # compiled before
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = triton_route_topk.route_topk(logits, 6, "sqrtsoftplus", 1.5, bias)
    logits.copy_((torch.randn(64, 256, generator=g, device="cuda") * 3).bfloat16())
    graph.replay()
    want_w, want_ids = triton_route_topk.route_topk(logits, 6, "sqrtsoftplus", 1.5, bias)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)


@pytest.mark.parametrize("hashed", [False, True])
def test_the_shared_experts_pick_is_appended(hashed):
    """`extra` (V4's shared expert in the routed stack): the k picks as without it, then the
    extra id with weight 1, the given ids of a hash layer left as they were."""
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = (torch.randn(300, 256, generator=g, device="cuda") * 3).bfloat16()
    bias = torch.randn(256, generator=g, device="cuda") * 0.1
    ids = torch.randint(0, 256, (300, 6), generator=g, device="cuda") if hashed else None
    plain_w, plain_ids = triton_route_topk.route_topk(logits, 6, "sqrtsoftplus", 1.5, bias, ids)
    w, got = triton_route_topk.route_topk(logits, 6, "sqrtsoftplus", 1.5, bias, ids, extra=256)
    assert w.shape == got.shape == (300, 7)
    assert torch.equal(got[:, :6], plain_ids) and torch.equal(w[:, :6], plain_w)
    assert bool((got[:, 6] == 256).all()) and bool((w[:, 6] == 1).all())
