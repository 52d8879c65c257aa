"""ForwardBatch.build: the index tensors the model reads, and how decode rows are grouped."""

import pytest
import torch

from stages.forward_batch import ForwardBatch, decode_buckets


def test_decode_buckets_cap_padding_and_leave_singletons():
    # lengths 3, 4 share bucket (2, 4]; 5, 8 share (4, 8]; 100 is alone -> per-row path
    assert decode_buckets({0: 3, 1: 4, 2: 5, 3: 8, 4: 100}) == [[0, 1], [2, 3]]
    assert decode_buckets({0: 9}) == []
    for rows in decode_buckets({i: n for i, n in enumerate([1, 2, 3, 17, 30, 31, 64, 65])}):
        lengths = [[1, 2, 3, 17, 30, 31, 64, 65][r] for r in rows]
        assert max(lengths) < 2 * min(lengths) or max(lengths) <= 2  # padding < 2x


def test_decode_groups_stay_under_the_key_budget():
    """Long-context rows must not be gathered all at once: 64 rows of 128K keys would be a 32 GiB
    temporary at Llama-8B's KV width."""
    long_rows = {i: 131072 for i in range(64)}
    groups = decode_buckets(long_rows, max_keys=1 << 18, max_row_keys=1 << 20)
    assert [len(g) for g in groups] == [2] * 32  # 2 x 131072 keys fit 2**18
    assert decode_buckets({0: 300000, 1: 300000}, max_keys=1 << 18,
                          max_row_keys=1 << 20) == []  # alone: per row
    assert decode_buckets({i: 100 for i in range(10)}, max_keys=512) == [[0, 1, 2, 3],
                                                                          [4, 5, 6, 7], [8, 9]]


def test_long_rows_are_never_grouped():
    """A group copies and pads its rows' K/V; a long row alone reads its blocks in place."""
    assert decode_buckets({0: 4096, 1: 4000, 2: 4097, 3: 5000, 4: 32768, 5: 32768}) == [[0, 1]]
    assert decode_buckets({0: 5000, 1: 5000}, max_row_keys=8192) == [[0, 1]]


def test_build_groups_decode_rows_and_keeps_prefill_rows_alone():
    b = 4
    rows = [(0, 6, [0, 1], True),      # a prefill row (blocks consecutive: a slice)
            (5, 1, [7, 2], True),      # decode at position 5: prefix of 6 keys
            (6, 1, [3, 9], True),      # decode at position 6: 7 keys, same bucket as 6
            (2, 1, [5], True)]         # decode at position 2: 3 keys, a bucket of its own
    fb = ForwardBatch.build(rows, b)
    assert fb.positions.tolist() == [0, 1, 2, 3, 4, 5, 5, 6, 2]
    assert fb.sample_indices.tolist() == [5, 6, 7, 8]
    assert fb.prefix_slots[0] == slice(0, 6)
    assert fb.prefix_slots[1] is None and fb.prefix_slots[2] is None
    assert fb.prefix_slots[3] == slice(20, 23)  # one block: read in place
    (group,) = fb.decode_groups
    assert group.token_index.tolist() == [6, 7]  # rows 1 and 2
    assert group.slots.tolist() == [[28, 29, 30, 31, 8, 9, 0], [12, 13, 14, 15, 36, 37, 38]]
    assert group.mask.tolist() == [[True] * 6 + [False], [True] * 7]
    assert group.mask.dtype == torch.bool


def test_build_without_prefixes_keeps_the_token_indices():
    """A family whose attention plans its own keys (DeepSeek-V4) gets no prefix slots or decode
    groups, and the same positions, slots and sampling rows."""
    from stages.models.families import family_of

    rows = [(0, 6, [0, 1], True), (5, 1, [7, 2], True), (6, 1, [3, 9], False), (1, 3, [5], True)]
    full, bare = ForwardBatch.build(rows, 4), ForwardBatch.build(rows, 4, prefixes=False)
    for name in ("positions", "slot_mapping", "sample_indices"):
        assert torch.equal(getattr(full, name), getattr(bare, name))
    assert bare.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, 9, 38, 21, 22, 23]
    assert bare.sample_indices.tolist() == [5, 6, 10]
    assert (bare.row_offsets, bare.prefix_slots, bare.decode_groups) == ([0, 6, 7, 8], [], [])
    assert not family_of("deepseek_v4").attention_prefixes
    assert family_of("llama").attention_prefixes


def test_decode_flags_decide_the_decode_groups_not_the_token_count():
    """A prefill chunk of one token (the token budget leaves one token of room) is no decode
    row: it keeps its prefix and is attended as a chunk, as it would be inside a longer one;
    a decode row of more than one token is refused."""
    rows = [(5, 1, [0, 1], True), (6, 1, [2, 3], True), (0, 3, [5], False)]
    flagged = ForwardBatch.build(rows, 4, decode=[True, False, False])
    assert flagged.row_decode == [True, False, False]
    assert flagged.prefix_slots[1] is not None and flagged.prefix_slots[2] is not None
    by_length = ForwardBatch.build(rows, 4)
    assert by_length.row_decode == [True, True, False]
    assert by_length.prefix_slots[:2] == [None, None]  # one decode group of both
    with pytest.raises(ValueError, match="a decode row has one token"):
        ForwardBatch.build(rows, 4, decode=[True, False, True])
