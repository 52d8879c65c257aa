"""Which contiguous layers each pipeline stage owns (pure, standard library only)."""

from __future__ import annotations


def layer_ranges(
    num_layers: int, num_stages: int, weights: list[float] | None = None
) -> list[tuple[int, int]]:
    """[start, end) layer ranges, one per stage, contiguous and covering all layers.

    Without weights the split is even and earlier stages take the remainder: the last stage also
    runs the final norm, LM head and sampler, so it is the one to keep light. With weights (relative
    stage speeds or capacities) each stage gets about its share, and at least one layer.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if num_stages > num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} stages: "
            "every stage needs at least one layer"
        )
    if weights is None:
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    else:
        counts = _weighted_counts(num_layers, num_stages, weights)
    ranges, start = [], 0
    for n in counts:
        ranges.append((start, start + n))
        start += n
    return ranges


def _weighted_counts(num_layers: int, num_stages: int, weights: list[float]) -> list[int]:
    if len(weights) != num_stages:
        raise ValueError(f"got {len(weights)} weights for {num_stages} stages")
    if any(not w > 0 for w in weights):
        raise ValueError(f"stage weights must be positive, got {weights}")
    total = float(sum(weights))
    # Each stage keeps one layer; the rest go by largest remainder (ties to earlier stages).
    spare = num_layers - num_stages
    shares = [spare * w / total for w in weights]
    counts = [1 + int(s) for s in shares]
    left = num_layers - sum(counts)
    order = sorted(range(num_stages), key=lambda i: (-(shares[i] - int(shares[i])), i))
    for i in order[:left]:
        counts[i] += 1
    return counts
