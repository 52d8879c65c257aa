"""The pure decision of prefix-aware routing (app/prefix_routing.py): routing keys and the
ranking of replicas."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.prefix_routing import PrefixKey, PrefixRoutingTable, key_levels, prefix_key, prompt_key

BLOCK = 16


def test_key_levels_double_then_end_at_the_last_full_block():
    assert key_levels(0) == []
    assert key_levels(1) == [1]
    assert key_levels(2) == [1, 2]
    assert key_levels(5) == [1, 2, 4, 5]
    assert key_levels(8) == [1, 2, 4, 8]
    assert key_levels(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_each_hash_is_the_hash_of_everything_before_its_level():
    data = bytes(range(256)) * 3
    key = prefix_key(data, BLOCK)
    assert key.blocks == tuple(key_levels(len(data) // BLOCK))
    for n, h in zip(key.blocks, key.hashes, strict=True):
        assert h == hashlib.blake2b(data[: n * BLOCK], digest_size=8).digest()


@given(
    shared=st.binary(min_size=0, max_size=300),
    a=st.binary(min_size=1, max_size=200),
    b=st.binary(min_size=1, max_size=200),
)
def test_keys_agree_exactly_on_the_levels_inside_the_shared_prefix(shared, a, b):
    if a[0] == b[0]:
        b = bytes([(a[0] + 1) % 256]) + b[1:]
    ka, kb = prefix_key(shared + a, BLOCK), prefix_key(shared + b, BLOCK)
    common = len(shared) // BLOCK
    for n, ha in zip(ka.blocks, ka.hashes, strict=True):
        if n in kb.blocks:
            hb = kb.hashes[kb.blocks.index(n)]
            assert (ha == hb) == (n <= common), n


def test_prompt_keys_of_text_token_ids_and_messages():
    text = "a document about pipelines. " * 10
    assert prompt_key(text, None, BLOCK) == prefix_key(text.encode(), BLOCK)
    ids = list(range(100))
    key = prompt_key(ids, None, BLOCK)
    assert key.num_blocks == 100 // BLOCK
    assert prompt_key(ids + [7, 8, 9], None, BLOCK).hashes[:3] == key.hashes[:3]
    assert prompt_key([1] + ids[1:], None, BLOCK).hashes[0] != key.hashes[0]
    assert prompt_key([2**70], None, BLOCK) == PrefixKey()  # not a token id: no key
    history = [{"role": "system", "content": text}, {"role": "user", "content": "first?"}]
    turn1 = prompt_key(None, history, BLOCK)
    turn2 = prompt_key(None, history + [{"role": "assistant", "content": "x"} for _ in "ab"],
                       BLOCK)
    common = len(turn1.blocks) - 1  # every level but the last (partial at turn 2's cut)
    assert turn1.hashes[:common] == turn2.hashes[:common]
    assert prompt_key("short", None, BLOCK) == PrefixKey()  # under one block: nothing to match
    assert prompt_key(None, None, BLOCK) == PrefixKey()


def _key(n_blocks: int, seed: int) -> PrefixKey:
    return prefix_key(bytes([seed]) * (n_blocks * BLOCK), BLOCK)


def test_a_repeated_prefix_goes_to_the_replica_that_holds_it():
    t = PrefixRoutingTable(max_queue=4)
    doc = "a long shared document. " * 40
    first = prompt_key(doc + "question one?", None, BLOCK)
    t.record("B", first)
    again = prompt_key(doc + "another, different question?", None, BLOCK)
    assert t.matched_blocks("B", again) >= len(doc) // BLOCK // 2
    assert t.matched_blocks("A", again) == 0
    assert t.rank(again, {"A": 0, "B": 3})[0] == "B"  # busier, but holds the prefix


def test_the_longest_match_wins_then_the_least_loaded():
    t = PrefixRoutingTable(max_queue=10)
    key = _key(64, 1)
    t.record("short", prefix_key(bytes([1]) * (16 * BLOCK) + b"x" * 800, BLOCK))
    t.record("long", key)
    assert t.rank(key, {"short": 0, "long": 5, "none": 0}) == ["long", "short", "none"]
    t.record("long2", key)
    assert t.rank(key, {"long": 5, "long2": 2, "short": 0})[:2] == ["long2", "long"]


def test_a_saturated_replica_gives_way_to_the_least_loaded():
    t = PrefixRoutingTable(max_queue=4)
    key = _key(8, 1)
    t.record("A", key)
    assert t.rank(key, {"A": 3, "B": 0, "C": 1})[0] == "A"
    assert t.rank(key, {"A": 4, "B": 2, "C": 1}) == ["C", "B", "A"]


def test_unknown_queue_lengths_count_as_idle():
    t = PrefixRoutingTable(max_queue=2)
    key = _key(8, 1)
    t.record("A", key)
    assert t.rank(key, {"A": None, "B": 0})[0] == "A"
    assert t.rank(_key(8, 2), {"A": None, "B": 1}) == ["A", "B"]


def test_new_prefixes_spread_over_replicas_with_equal_load():
    t = PrefixRoutingTable(max_queue=8)
    sent = []
    for seed in range(6):
        key = _key(8, seed)
        choice = t.rank(key, {"A": 0, "B": 0})[0]
        t.record(choice, key)
        sent.append(choice)
    assert sent == ["A", "B"] * 3


def test_a_small_common_prefix_is_no_match():
    t = PrefixRoutingTable(max_queue=8, min_match=0.25)
    system = bytes([9]) * (2 * BLOCK)
    t.record("A", prefix_key(system + bytes([1]) * (30 * BLOCK), BLOCK))
    other = prefix_key(system + bytes([2]) * (30 * BLOCK), BLOCK)
    assert t.matched_blocks("A", other) == 2
    assert t.rank(other, {"A": 0, "B": 0}) == ["B", "A"]  # 2 of 32 blocks: spread instead


def test_the_lru_forgets_the_oldest_prefixes_first():
    t = PrefixRoutingTable(max_queue=8, capacity=8)
    old, new = _key(8, 1), _key(8, 2)  # 4 hashes each
    t.record("A", old)
    t.record("A", new)
    assert t.matched_blocks("A", old) == 8
    t.record("A", _key(8, 3))
    assert t.matched_blocks("A", old) == 0
    assert t.matched_blocks("A", new) == 8


def test_replicas_that_leave_are_forgotten():
    t = PrefixRoutingTable(max_queue=8)
    key = _key(8, 1)
    t.record("A", key)
    t.record("B", key)
    t.retain(["B", "C"])
    assert t.matched_blocks("A", key) == 0 and t.matched_blocks("B", key) == 8
    t.forget("B")
    assert t.rank(key, {"B": 0, "C": 0}) == ["B", "C"]


def test_no_key_means_least_loaded():
    t = PrefixRoutingTable(max_queue=8)
    assert t.rank(None, {"A": 3, "B": 1, "C": 2}) == ["B", "C", "A"]
    assert t.rank(PrefixKey(), {"A": 0}) == ["A"]


@pytest.mark.parametrize("bad", [dict(max_queue=0), dict(max_queue=1, capacity=0),
                                 dict(max_queue=1, min_match=1.5)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        PrefixRoutingTable(**bad)


@given(
    loads=st.dictionaries(st.sampled_from("ABCDE"), st.one_of(st.none(), st.integers(0, 20)),
                          min_size=1),
    sent=st.lists(st.tuples(st.sampled_from("ABCDE"), st.integers(1, 40), st.integers(0, 3))),
    ask=st.tuples(st.integers(1, 40), st.integers(0, 3)),
)
def test_rank_is_a_permutation_led_by_a_holder_unless_saturated(loads, sent, ask):
    t = PrefixRoutingTable(max_queue=10, min_match=0.0)
    for replica, n, seed in sent:
        t.record(replica, _key(n, seed))
    key = _key(*ask)
    order = t.rank(key, loads)
    assert sorted(order) == sorted(loads)
    best = max(t.matched_blocks(r, key) for r in loads if (loads[r] or 0) < 10) \
        if any((loads[r] or 0) < 10 for r in loads) else 0
    first = order[0]
    if best:
        assert t.matched_blocks(first, key) == best
    else:
        assert (loads[first] or 0) == min(q or 0 for q in loads.values())


def _router_config(args: dict):
    from app.server import build_app

    app = build_app({"device": "cpu", "max_num_seqs": 12, **args})
    pipeline = app._bound_deployment.init_args[0]  # the ingress is bound to PipelineServer
    return pipeline._bound_deployment._deployment_config.request_router_config


def test_build_app_routes_by_prefix_wherever_several_pipelines_may_run():
    from ray.serve.config import RequestRouterConfig

    from app.prefix_router import PrefixAffinityRouter

    default = RequestRouterConfig().request_router_class
    assert _router_config({}).request_router_class == default  # one pipeline
    routed = _router_config({"num_replicas": 2})
    assert routed.request_router_class == "app.prefix_router.PrefixAffinityRouter"
    assert routed.get_request_router_class() is PrefixAffinityRouter
    assert routed.request_router_kwargs == {"max_queue": 12}  # --max-num-seqs
    scaled = _router_config({"autoscaling_config": {"min_replicas": 1, "max_replicas": 3},
                             "prefix_routing_max_queue": 5})
    assert scaled.request_router_kwargs == {"max_queue": 5}
    off = _router_config({"num_replicas": 2, "prefix_routing_max_queue": 0})
    assert off.request_router_class == default
    with pytest.raises(ValueError, match="prefix_routing_max_queue"):
        _router_config({"num_replicas": 2, "prefix_routing_max_queue": -1})
