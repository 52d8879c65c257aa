import pytest

from stages.partition import layer_ranges


def _check_cover(ranges, num_layers):
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert b == c
    assert all(b > a for a, b in ranges)


@pytest.mark.parametrize("num_layers,num_stages", [
    (layers, stages) for layers in [1, 2, 3, 4, 7, 32, 61, 80] for stages in [1, 2, 3, 4, 8]
    if stages <= layers])  # more stages than layers is the error test's case
def test_even_split_covers_and_balances(num_layers, num_stages):
    ranges = layer_ranges(num_layers, num_stages)
    assert len(ranges) == num_stages
    _check_cover(ranges, num_layers)
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the extra layers go to earlier stages


def test_examples():
    assert layer_ranges(4, 1) == [(0, 4)]
    assert layer_ranges(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert layer_ranges(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


@pytest.mark.parametrize("num_stages", [0, -1, 5])
def test_bad_stage_counts(num_stages):
    with pytest.raises(ValueError, match="stage"):
        layer_ranges(4, num_stages)


def test_weighted_split():
    assert layer_ranges(10, 2, [1.0, 1.0]) == [(0, 5), (5, 10)]
    ranges = layer_ranges(12, 3, [2.0, 1.0, 1.0])
    _check_cover(ranges, 12)
    assert [b - a for a, b in ranges] == [6, 3, 3]
    ranges = layer_ranges(5, 5, [100.0, 1.0, 1.0, 1.0, 1.0])
    assert [b - a for a, b in ranges] == [1] * 5  # every stage keeps a layer


def test_weighted_errors():
    with pytest.raises(ValueError, match="weights"):
        layer_ranges(8, 2, [1.0])
    with pytest.raises(ValueError, match="positive"):
        layer_ranges(8, 2, [1.0, 0.0])
