"""`bench load`'s decode timing: a delta of n tokens shares its gap among them."""

import pytest

from app.bench.stream_timing import steady_decode, stream_shape, token_gaps_ms


def test_a_delta_of_n_tokens_shares_its_gap():
    # first token at 0 s, three at 1 s (one delta), one at 3 s
    gaps = token_gaps_ms([0.0, 1.0, 1.0, 1.0, 3.0])
    assert [g[2] for g in gaps] == pytest.approx([1000 / 3] * 3 + [2000.0])
    assert [(g[0], g[1]) for g in gaps] == [(0.0, 1.0)] * 3 + [(1.0, 3.0)]


def test_steady_window_counts_grouped_and_single_streams_alike():
    single = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    grouped = [0.0, 0.1, 0.1, 0.3, 0.3, 0.5]  # the same tokens in deltas of two
    s, g = steady_decode([single]), steady_decode([grouped])
    assert s["steady_tokens_per_s"] == pytest.approx(g["steady_tokens_per_s"]) == pytest.approx(10)
    assert s["itl_p50_ms"] == pytest.approx(g["itl_p50_ms"]) == pytest.approx(100)


def test_a_window_shorter_than_a_step_gives_no_rate():
    """One request's first token came after another's tokens but just before its last: the
    window holds one token of a request and no whole gap, so no steady rate (not 1 / epsilon)."""
    early = [0.0, 0.1, 0.2, 0.3]
    late = [0.299, 0.4, 0.5]
    s = steady_decode([early, late])
    assert s["steady_tokens_per_s"] is None and s["itl_p50_ms"] is None
    shape = stream_shape([early, late], t0=0.0)
    assert shape["first_token_s"] == [0.0, pytest.approx(0.1495), 0.299]
    assert shape["last_token_s"] == [0.3, 0.4, 0.5]
    assert shape["deltas_min_p50"] == [3, 3.5]
