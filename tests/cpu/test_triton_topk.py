"""The long-line top-k (stages/kernels/triton_topk.py: a threshold from group maxima, the Triton
compaction under Triton's CPU interpreter, the top-k of the candidates) against the one
selection rule (indexer_select.top_k_positions: highest score, among equal ones the lower
position, in that order): lines with many exact ties (ReLU zeros, signed zeros, equal sums),
-inf past a line's visible keys, lines with fewer finite scores than k, all-equal lines, lines
longer than one block of the kernel, and two group sizes."""

from __future__ import annotations

import pytest
import torch

from stages.kernels.indexer_select import (
    MAXIMA_GROUP,
    group_maxima,
    maxima_buffer,
    top_k_positions,
)


def _scores(lines: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (lines, width), generator=g).float() / 4
    signs = torch.randint(0, 2, scores.shape, generator=g).bool()
    scores = torch.where((scores == 0) & signs, -0.0, scores)
    scores[:, ::5] = torch.randn(lines, len(range(0, width, 5)), generator=g)
    visible = torch.randint(1, width + 1, (lines, 1), generator=g)
    visible[0] = 2  # fewer finite scores than k: the threshold is -inf
    return scores.masked_fill(torch.arange(width)[None, :] >= visible, float("-inf"))


@pytest.mark.parametrize(
    ("lines", "width", "k", "group"),
    [(3, 40, 1, 8), (3, 200, 5, 8), (2, 2500, 100, 8), (2, 5000, 16, 8), (2, 5000, 16, 16)],
)
def test_interpreted_topk_is_the_rule(triton_interpreter, lines, width, k, group):
    from stages.kernels import triton_topk

    scores = _scores(lines, width, seed=width + k)
    assert width >= 2 * (k + group * k)  # the candidates' path, not torch's
    got = triton_topk.top_k_positions(scores.clone(), k, group)
    assert torch.equal(got, top_k_positions(scores.clone(), k))
    if group == MAXIMA_GROUP:  # the maxima the scores op wrote (signed zeros either way)
        maxima = group_maxima(scores, maxima_buffer(lines, width, scores.device))
        assert torch.equal(triton_topk.top_k_positions(scores.clone(), k, maxima=maxima), got)


def test_interpreted_topk_of_equal_and_continuous_lines(triton_interpreter):
    from stages.kernels import triton_topk

    g = torch.Generator().manual_seed(0)
    scores = torch.stack(
        [torch.full((3000,), 0.5), torch.randn(3000, generator=g), torch.zeros(3000)]
    )
    scores[2, 1::2] = -0.0
    for k in (1, 40, 300):
        got = triton_topk.top_k_positions(scores.clone(), k)
        assert torch.equal(got, top_k_positions(scores.clone(), k)), k


@pytest.mark.parametrize("prefix", [True, False], ids=["live-prefix", "whole-lines"])
@pytest.mark.parametrize("lines", [2, 3])
def test_interpreted_topk_takes_the_kernel_or_torch_for_the_candidates(
    triton_interpreter, monkeypatch, lines, prefix
):
    """The candidates' top-k: on the rule's kernel over each line's live prefix (the
    compaction's count) at any line count; without the prefixes (CANDIDATE_PREFIX off), past
    RULE_KERNEL_MAX_LINES lines (a prefill chunk's) torch's, where the one-program kernel over
    whole lines is slower. The picks are the rule's either way."""
    from stages.kernels import triton_rule_topk, triton_topk

    calls: list[tuple[int, bool]] = []
    kernel = triton_rule_topk.rule_top_k
    monkeypatch.setattr(triton_topk, "RULE_KERNEL_MAX_LINES", 2)
    monkeypatch.setattr(triton_topk, "CANDIDATE_PREFIX", prefix)

    def counted(s, k, lengths=None):
        calls.append((s.shape[0], lengths is not None))
        return kernel(s, k, lengths=lengths)

    monkeypatch.setattr(triton_rule_topk, "rule_top_k", counted)
    scores = _scores(lines, 2500, seed=lines)
    got = triton_topk.top_k_positions(scores.clone(), 100)
    assert torch.equal(got, top_k_positions(scores.clone(), 100))
    if prefix:
        assert calls == [(lines, True)]
    else:
        assert calls == ([(lines, False)] if lines <= 2 else [])


@pytest.mark.parametrize("compact", [(4, 4), (64, 4), (1024, 16)])
@pytest.mark.parametrize("find_theta", [False, True])
@pytest.mark.parametrize("gather", [None, 16], ids=["by-step", "gather-16"])
def test_interpreted_topk_is_the_rule_at_any_compaction_step(
    triton_interpreter, compact, find_theta, gather
):
    """The compaction's launch (group maxima a step, warps) changes how a line is walked, not
    what it keeps: many steps a line (the equal groups' cut-off taken step by step), or the
    whole line in one; its scores read step by step or over the taken groups' indices, a few
    or many a step."""
    from stages.kernels import triton_topk

    scores = _scores(2, 5000, seed=11)
    got = triton_topk.top_k_positions(
        scores.clone(), 16, compact=compact, find_theta=find_theta, gather=gather
    )
    assert torch.equal(got, top_k_positions(scores.clone(), 16))


@pytest.mark.parametrize(
    ("gather", "resident"),
    [(2, True), (64, True), (64, False)],
    ids=["gather-2", "gather-64", "gather-64-maxima-walked"],
)
def test_interpreted_gathered_compaction_is_the_rule_on_tied_lines(
    triton_interpreter, monkeypatch, gather, resident
):
    """The gathered walk takes every group above theta and only the first k whose maximum
    equals it: lines all of one value, all zeros of both signs, ties at theta inside groups
    above it, fewer finite scores than k, and the lines of the tie tests above; theta from
    maxima held in registers or (fewer resident keys than the line's groups) walked."""
    from stages.kernels import triton_topk

    if not resident:
        monkeypatch.setattr(triton_topk, "RESIDENT_KEYS", 64)

    g = torch.Generator().manual_seed(5)
    width = 3000
    lines = torch.stack(
        [
            torch.full((width,), 0.5),
            torch.zeros(width),
            torch.randint(0, 3, (width,), generator=g).float(),  # many ties at every value
            torch.randn(width, generator=g).relu(),  # ReLU zeros: theta often 0
        ]
    )
    lines[1, 1::2] = -0.0
    lines[3, 2000:] = float("-inf")
    for k in (1, 40, 300):
        got = triton_topk.top_k_positions(lines.clone(), k, gather=gather)
        assert torch.equal(got, top_k_positions(lines.clone(), k)), k
    scores = _scores(3, 2500, seed=3)
    got = triton_topk.top_k_positions(scores.clone(), 100, gather=gather)
    assert torch.equal(got, top_k_positions(scores.clone(), 100))


@pytest.mark.parametrize("k", [1, 7, 64])
@pytest.mark.parametrize("resident", [True, False])
def test_interpreted_threshold_is_the_kth_largest_maximum(triton_interpreter, k, resident):
    """The compaction kernel's theta (the k-th largest group maximum, a bit at a time) against
    torch's top-k of them: negative and positive values, signed zeros, repeats, -inf; a line's
    maxima held in registers, or walked in steps."""
    from stages.kernels import triton_topk

    g = torch.Generator().manual_seed(k)
    lines, width, group = 6, 4000, 8
    scores = torch.randn(lines, width, generator=g) * torch.logspace(-20, 20, lines)[:, None]
    scores[1] = torch.randint(-2, 3, (width,), generator=g).float() * 0.0  # zeros of both signs
    scores[1, ::3] = -0.0
    scores[2, : width // 2] = float("-inf")
    scores[3] = 1.5
    scores[4] = -scores[4].abs()
    groups = width // group
    maxima = scores.view(lines, groups, group).amax(-1)
    theta = torch.empty(lines)
    values = torch.full((lines, k + group * k), float("-inf"))
    positions = torch.zeros(lines, k + group * k, dtype=torch.long)
    live = torch.empty(lines, dtype=torch.int32)
    triton_topk.compact_kernel[(lines,)](
        scores, maxima, theta, values, positions, torch.empty(lines, 1, dtype=torch.int32), live,
        width, groups, k, scores.stride(0), maxima.stride(0), values.stride(0), GROUP=group,
        BLOCK_G=128,
        FIND_THETA=True,
        **(triton_topk._select_launch(groups) if resident else {"SELECT": 64, "RESIDENT": False}),
        GATHER=False, GATHER_G=1,
    )  # fmt: skip
    assert torch.equal(theta, maxima.topk(k, dim=-1).values.amin(-1))  # -0.0 == 0.0
    # the candidates' live prefix: k slots, then one for each score above theta
    assert torch.equal(live.long(), k + (scores > theta[:, None]).sum(1))
    assert (values[:, : k + group * k] == float("-inf")).logical_or(
        torch.arange(k + group * k)[None, :] < live[:, None].long()
    ).all()


@pytest.mark.parametrize(("k", "widest"), [(512, 262144), (2048, 1040384), (512, 10000), (16, 300)])
def test_warm_up_widths_meet_every_compiled_launch(k, widest):
    """The startup warm-up's widths cover each launch a prompt's lines can meet: long lines'
    maxima in registers or not (where lines get that long), width and group count divisible by
    16 or not; short lines' (picking k, or all of a line narrower than k) each launch shape of
    the rule's kernel, where k is one it takes; none wider than the longest line."""
    from stages.kernels import triton_rule_topk, triton_topk

    widths = triton_topk.warm_widths(k, widest)
    first = 2 * (k + triton_topk.GROUP * k)
    long = [w for w in widths if w >= first]
    assert widths and max(widths) <= widest and bool(long) == (widest >= first)

    def launch(width: int) -> tuple[bool, bool, bool]:
        groups = -(-width // triton_topk.GROUP)
        return width % 16 == 0, groups % 16 == 0, groups <= triton_topk.RESIDENT_KEYS

    longest = triton_topk.GROUP * triton_topk.RESIDENT_KEYS
    every = {
        launch(w)
        for w in range(first, widest + 1)
        if widest <= longest or w > longest - 256  # every pattern shows within 256
    } | {launch(w) for w in range(first, min(widest, first + 256) + 1)}
    assert {launch(w) for w in long} == (every if long else set())

    def shape(width: int) -> tuple[int, int] | None:
        kept = min(k, width)
        fits = triton_rule_topk.fits(width, kept) and k <= triton_rule_topk.MAX_K
        return triton_rule_topk.launch_shape(width, kept) if fits else None

    short = {shape(w) for w in range(1, min(first, widest + 1))} - {None}
    assert {shape(w) for w in widths if w < first} - {None} == short
    assert bool(short) == (k <= triton_rule_topk.MAX_K)


def test_warm_up_runs_the_kernels_on_each_width(triton_interpreter):
    """The warm-up's lines of zeros (every score tied) go through the kernels, under Triton's
    interpreter, and still pick the rule's k: the first positions."""
    from stages.kernels import triton_topk

    k, widest = 4, 600
    assert triton_topk.warm_up(k, widest, "cpu") == len(triton_topk.warm_widths(k, widest)) > 0
    picked = triton_topk.top_k_positions(torch.zeros(1, widest), k)
    assert picked.tolist() == [list(range(k))]


def test_models_name_their_top_k_lines(tiny_checkpoints, tmp_path):
    """What the warm-up compiles the top-k for: V3.2's lines are its prompts' tokens, V4's its
    CSA entries (a token in four); a model, or a stage of V4's, that selects nothing has none."""
    from app.bench.target import v4_flash_bench_config
    from stages.model_config import ModelArgs, load_model_args
    from tests.cpu.conftest import write_tiny_checkpoint

    llama = load_model_args(tiny_checkpoints["llama"])
    assert llama.family.top_k_lines(llama, 4096, range(2)) is None
    v32 = load_model_args(write_tiny_checkpoint(tmp_path, "ds_v32_sparse"))
    assert v32.family.top_k_lines(v32, 4096, range(1)) == (v32.family_args.indexer.topk, 4096)
    v4 = ModelArgs.from_hf_dict(v4_flash_bench_config())
    types = v4.family_args.layer_types
    assert v4.family.top_k_lines(v4, 4096, range(len(types))) == (512, 1024)
    no_csa = [i for i, kind in enumerate(types) if kind != "compressed_sparse_attention"]
    assert no_csa[:2] == [0, 1]  # V4-Flash's first two layers: HCA
    assert v4.family.top_k_lines(v4, 4096, range(0, 2)) is None
