import pytest

from app.scheduler.skip import ReqInfo, decide_send, needed_req_ids, sglang_send, token_needed
from stages.protocol import Row


def chunk(rid, start, n, sample=False):
    return Row(rid, 0, start, n, tuple(range(n)), sample=sample, output_index=0, is_prefill=True)


def decode(rid, pos, out_idx):
    return Row(rid, 0, pos, 1, None, input_from_mb=0, sample=True, output_index=out_idx,
               is_prefill=False)


INFO = {"a": ReqInfo(prompt_len=100, max_tokens=5), "b": ReqInfo(prompt_len=100, max_tokens=1),
        "lp": ReqInfo(prompt_len=100, max_tokens=5, wants_logprobs=True)}


# (rows, sglang sends?) — the PR's rule: skip iff prefill-only, one request, chunk not its last,
# no logprobs.
SGLANG_TABLE = [
    ([chunk("a", 0, 50)], False),  # lone mid-prompt chunk: skip
    ([chunk("a", 50, 50, sample=True)], True),  # last chunk: send
    ([chunk("lp", 0, 50)], True),  # logprobs asked: send
    ([chunk("a", 0, 50), chunk("b", 0, 50)], True),  # two requests: send
    ([decode("a", 100, 1)], True),  # not prefill-only: send
    ([decode("a", 100, 1), chunk("b", 0, 50)], True),
    ([chunk("b", 0, 50)], False),
]


@pytest.mark.parametrize("rows,sends", SGLANG_TABLE)
def test_sglang_rule_table(rows, sends):
    assert sglang_send(rows, INFO) is sends
    assert decide_send("sglang", rows, INFO) is sends


AUTO_TABLE = [
    ([chunk("a", 0, 50)], False),  # mid-prompt: nothing sampled
    ([chunk("a", 50, 50, sample=True)], True),  # first token, request continues
    ([chunk("b", 50, 50, sample=True)], False),  # max_tokens=1: request ends at this token
    ([chunk("lp", 0, 50)], False),  # logprobs do not force a send
    ([chunk("a", 0, 50), chunk("b", 0, 50)], False),  # several requests, none needed
    ([decode("a", 103, 3)], True),  # 3 + 1 < 5
    ([decode("a", 104, 4)], False),  # the last token: nobody reads it
    ([decode("a", 104, 4), chunk("b", 0, 10)], False),
    ([decode("a", 104, 4), chunk("a", 50, 50, sample=True)], True),
]


@pytest.mark.parametrize("rows,sends", AUTO_TABLE)
def test_auto_rule_table(rows, sends):
    assert decide_send("auto", rows, INFO) is sends


def test_off_always_sends_and_needed():
    for rows, _ in SGLANG_TABLE + AUTO_TABLE:
        assert decide_send("off", rows, INFO) is True
    assert needed_req_ids([decode("a", 103, 3), decode("b", 100, 0)], INFO) == ("a",)
    assert not token_needed(chunk("a", 0, 10), 5)
    with pytest.raises(ValueError):
        decide_send("sometimes", [chunk("a", 0, 1)], INFO)


def test_lone_prompt_sglang_equals_auto():
    info = {"a": ReqInfo(prompt_len=40, max_tokens=3)}
    for k in range(4):
        rows = [chunk("a", 10 * k, 10, sample=(k == 3))]
        assert decide_send("sglang", rows, info) == decide_send("auto", rows, info)
