"""The group_pool op's Triton kernel (stages/kernels/triton_group_pool.py) against its torch form
(stages/kernels/group_pool.py) on CUDA, at DeepSeek-V4-Flash's shapes: an 8K chunk's CSA groups
(the compressor's and the indexer's) and HCA groups, a decode step's group per row with most not
live, and captured in a CUDA graph, the same as eager."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import group_pool as torch_form
from stages.kernels import triton_group_pool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# (groups, rate, overlap, w): an 8K chunk's CSA compressor / indexer / HCA groups, 512 decode rows
CASES = [(2048, 4, True, 512), (2048, 4, True, 128), (64, 128, False, 512), (512, 128, False, 512),
         (512, 4, True, 512), (1, 128, False, 512)]  # fmt: skip


def _problem(groups: int, rate: int, overlap: bool, w: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    series = 2 if overlap else 1
    total = 4 * groups * rate + 64
    inputs = (torch.randn(total, 2 * series * w, generator=g, device="cuda") * 2).bfloat16()
    slots = torch.randperm(total, generator=g, device="cuda")[: groups * 2 * rate]
    first = torch.zeros(groups, dtype=torch.bool, device="cuda")
    first[0] = True
    bias = torch.randn(rate, series * w, generator=g, device="cuda")
    return inputs, slots.view(groups, 2 * rate), first, bias


@pytest.mark.parametrize("groups,rate,overlap,w", CASES)
@pytest.mark.parametrize("live", [False, True])
def test_kernel_matches_the_torch_form(groups, rate, overlap, w, live):
    inputs, slots, first, bias = _problem(groups, rate, overlap, w, seed=groups + rate)
    alive = None
    if live:  # a decode step: the rows whose token completes a group
        alive = torch.arange(groups, device="cuda") % rate == rate - 1
        alive[0] = True
    want = torch_form.pool_groups(inputs, slots, first, bias, rate, overlap, alive)
    got = triton_group_pool.pool_groups(inputs, slots, first, bias, rate, overlap, alive)
    # the softmax's and the pool's sums in another order: a weight one bf16 unit off moves its
    # product (inputs of scale 2) by up to 2**-7, which a cancelling sum does not shrink (1 in
    # 10**6 values on the H200), so the bound is absolute at the products' scale
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-6)
    assert (got != want).float().mean() < 0.01
    if live:
        assert not got[~alive].any()


def test_graph_replay_equals_eager():
    inputs, slots, first, bias = _problem(512, 128, False, 512, seed=3)
    live = torch.zeros(512, dtype=torch.bool, device="cuda")
    live[::128] = True
    eager = triton_group_pool.pool_groups(inputs, slots, first, bias, 128, False, live)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        triton_group_pool.pool_groups(inputs, slots, first, bias, 128, False, live)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_group_pool.pool_groups(inputs, slots, first, bias, 128, False, live)
    live.zero_()
    live[5::128] = True  # the next step's rows, in the same buffer
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(
        out, triton_group_pool.pool_groups(inputs, slots, first, bias, 128, False, live)
    )
    assert not torch.equal(out, eager)
