"""The rule's top-k in one program (stages/kernels/triton_rule_topk.py) on CUDA against
indexer_select.top_k_positions, the rule every selection path keeps: a one-row and a 512-row
decode step's short CSA lines, an 8K chunk's compaction candidates (k + 8k a line), the widest
line it takes; ReLU zeros, -0.0, repeats and -inf tails; the candidates read to their live
prefixes; and replayed in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import indexer_select, triton_rule_topk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _lines(n: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = torch.randn(n, width, generator=g, device="cuda").relu()
    s[:, ::3] = torch.randint(
        0, 4, (n, len(range(0, width, 3))), generator=g, device="cuda"
    ).float()
    s[0, : width // 2] = -0.0
    s[-1, width // 3 :] = float("-inf")
    return s


@pytest.mark.parametrize("n,width,k", [(1, 576, 512), (512, 576, 512), (8192, 4608, 512),
                                       (3, 8192, 512), (7, 300, 300)])  # fmt: skip
@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "ranked"])
def test_kernel_keeps_the_rule(n, width, k, sort):
    scores = _lines(n, width, seed=n + width)
    got = triton_rule_topk.rule_top_k(scores, k, sort=sort)
    assert torch.equal(got, indexer_select.top_k_positions(scores.clone(), k))


def _prefixed(n: int, width: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lines with a live prefix each (k to the whole line, both launches'), -inf past it."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.randint(k, width + 1, (n,), generator=g, device="cuda").int()
    lengths[: n // 2] = torch.randint(k, 2 * k, (n // 2,), generator=g, device="cuda").int()
    scores = _lines(n, width, seed)
    past = torch.arange(width, device="cuda")[None, :] >= lengths[:, None].long()
    return scores.masked_fill_(past, float("-inf")), lengths


@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "ranked"])
def test_kernel_over_live_prefixes_keeps_the_rule(sort):
    scores, lengths = _prefixed(8192, 4608, 512, seed=5)
    got = triton_rule_topk.rule_top_k(scores, 512, sort=sort, lengths=lengths)
    assert torch.equal(got, indexer_select.top_k_positions(scores.clone(), 512))


@pytest.mark.parametrize("prefixes", [False, True], ids=["whole-lines", "live-prefixes"])
def test_graph_replay_equals_eager(prefixes):
    scores, lengths = _prefixed(64, 4608, 512, seed=1)
    given = lengths if prefixes else None
    triton_rule_topk.rule_top_k(scores, 512, lengths=given)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        picked = triton_rule_topk.rule_top_k(scores, 512, lengths=given)
    new, new_lengths = _prefixed(64, 4608, 512, seed=2)
    scores.copy_(new)
    lengths.copy_(new_lengths)
    graph.replay()
    assert torch.equal(picked, indexer_select.top_k_positions(scores.clone(), 512))
