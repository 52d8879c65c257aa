"""The rule's top-k of a line in one program (stages/kernels/triton_rule_topk.py) under Triton's
interpreter against indexer_select.top_k_positions, the rule every selection path keeps (the
highest scores first, among equal ones the lower position): the same positions in the same
order, on lines of heavy ties (ReLU zeros, -0.0 beside 0.0, repeated values), -inf tails, widths
and k off the powers of two, k the whole line; the line left as it was."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import indexer_select

pytestmark = pytest.mark.interpreter


def _lines(n: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, width, generator=g).relu()  # ReLU: many exact zeros
    s[:, ::3] = torch.randint(0, 4, (n, len(range(0, width, 3))), generator=g).float()  # repeats
    s[0, : width // 2] = -0.0  # -0.0 ties 0.0
    s[1 % n, width // 3 :] = float("-inf")  # a line with fewer finite scores than k
    return s


@pytest.mark.parametrize(
    "n,width,k",
    [(3, 600, 512), (2, 100, 37), (4, 64, 64), (2, 4608, 512), (1, 1000, 1), (5, 17, 16)],
)
@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "ranked"])
def test_interpreted_kernel_keeps_the_rule(triton_interpreter, n, width, k, sort):
    """Both orderings of step 3: the kept keys sorted (the default) or their ranks counted."""
    from stages.kernels import triton_rule_topk

    scores = _lines(n, width, seed=width + k)
    before = scores.clone()
    got = triton_rule_topk.rule_top_k(scores, k, sort=sort)
    assert torch.equal(scores.view(torch.int32), before.view(torch.int32))  # -0.0 kept too
    want = indexer_select.top_k_positions(scores.clone(), k)
    assert got.shape == want.shape == (n, k) and got.dtype == torch.long
    assert torch.equal(got, want)


@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "ranked"])
def test_interpreted_kernel_over_live_prefixes_keeps_the_rule(
    triton_interpreter, monkeypatch, sort
):
    """Lines given their live prefix (at least k, -inf past it, as triton_topk's candidates):
    prefixes up to PREFIX_BLOCK in one launch, longer ones in the line's; ties, -0.0 and -inf
    inside the prefixes; the rule's positions, as over whole lines."""
    from stages.kernels import triton_rule_topk

    monkeypatch.setattr(triton_rule_topk, "PREFIX_BLOCK", 64)
    n, width, k = 6, 300, 40
    scores = _lines(n, width, seed=7)
    lengths = torch.tensor([40, 64, 65, 300, 41, 200], dtype=torch.int32)  # both launches
    scores.masked_fill_(torch.arange(width)[None, :] >= lengths[:, None].long(), float("-inf"))
    got = triton_rule_topk.rule_top_k(scores, k, sort=sort, lengths=lengths)
    assert torch.equal(got, indexer_select.top_k_positions(scores.clone(), k))


def test_lines_it_does_not_fit_are_refused():
    from stages.kernels import triton_rule_topk

    assert triton_rule_topk.fits(8192, 512) and triton_rule_topk.fits(600, 600)
    assert not triton_rule_topk.fits(8193, 512)  # wider than a program holds
    assert not triton_rule_topk.fits(4096, 2048)  # V3.2's k: torch's path
    assert not triton_rule_topk.fits(100, 101)
    with pytest.raises(ValueError, match="lines of up to"):
        triton_rule_topk.rule_top_k(torch.zeros(1, 9000), 512)
