"""A request's streamed deltas: --stream-interval's grouping and the merge of deltas a slow
consumer left waiting, against the same request streamed a token at a time."""

import asyncio

import pytest

from app.request import RequestOutput, SamplingParams
from app.request_stream import RequestStream
from app.tokenizer import ByteTokenizer
from stages.protocol import SampledToken

TEXT = "héllo, wörld! "  # multi-byte characters: the detokenizer holds partial ones back
EOS = ByteTokenizer.eos_token_ids[0]


def _stream(interval: int, **params: object) -> RequestStream:
    sp = SamplingParams(max_tokens=64, temperature=0.0, logprobs=0, **params)  # type: ignore[arg-type]
    prompt = list(b"prompt")
    return RequestStream("r", prompt, sp, 64, ByteTokenizer(), (EOS,), 0.0, None, interval)


def _feed(stream: RequestStream, ids: list[int]) -> None:
    for i, t in enumerate(ids):
        reason = stream.append(t, SampledToken("r", t, logprob=-float(i)))
        if reason is not None:
            stream.close(reason)
            return
    stream.close("length")


def _drain(stream: RequestStream) -> list[RequestOutput]:
    out = []
    while not stream.queue.empty():
        out.append(stream.queue.get_nowait())
    return out


def _whole(deltas: list[RequestOutput]) -> tuple[list[int], str, list[float]]:
    return (
        [t for d in deltas for t in d.token_ids],
        "".join(d.text for d in deltas),
        [lp.logprob for d in deltas for lp in d.logprobs or []],
    )


@pytest.mark.parametrize("interval", [2, 3, 5, 100])
def test_interval_groups_tokens_after_the_first_and_loses_nothing(interval):
    ids = list(TEXT.encode()) + [EOS]
    one, grouped = _stream(1), _stream(interval)
    _feed(one, ids)
    _feed(grouped, ids)
    singles, groups = _drain(one), _drain(grouped)
    assert all(len(d.token_ids) == 1 for d in singles[:-1])
    assert _whole(groups) == _whole(singles)
    assert _whole(groups)[1] == TEXT
    # the first token goes out alone and at once (time to first token), with the prompt
    assert len(groups[0].token_ids) == 1 and groups[0].prompt_token_ids == list(b"prompt")
    assert all(d.prompt_token_ids is None for d in groups[1:])
    # then full groups, the tail (and the stop) in the finishing delta
    assert all(len(d.token_ids) == interval for d in groups[1:-1])
    assert groups[-1].finished and groups[-1].finish_reason == "stop"
    assert [d.completion_tokens for d in groups][-1] == len(ids)


def test_stop_string_inside_a_group_ends_the_text_as_alone():
    ids = list(TEXT.encode())
    one, grouped = _stream(1, stop=["wör"]), _stream(4, stop=["wör"])
    _feed(one, ids)
    _feed(grouped, ids)
    singles, groups = _drain(one), _drain(grouped)
    assert _whole(groups)[1] == _whole(singles)[1] == "héllo, "
    assert groups[-1].finish_reason == singles[-1].finish_reason == "stop"


def test_a_consumer_behind_gets_what_waits_as_one_delta():
    ids = list(TEXT.encode()) + [EOS]
    ref, slow = _stream(1), _stream(1)
    _feed(ref, ids)
    _feed(slow, ids)  # every delta queued before the consumer reads: it is behind by all
    singles = _drain(ref)

    async def consume() -> list[RequestOutput]:
        got = [await slow.next_delta()]
        while not got[-1].finished:
            got.append(await slow.next_delta())
        return got

    merged = asyncio.run(consume())
    assert len(merged) == 1 and merged[0].finished
    assert _whole(merged) == _whole(singles)
    assert merged[0].prompt_token_ids == list(b"prompt")
    assert merged[0].completion_tokens == len(ids)


def test_next_delta_stops_at_a_finished_delta():
    s = _stream(1)
    s.queue.put_nowait(RequestOutput("r", [1], "a"))
    s.queue.put_nowait(RequestOutput("r", [2], "b", finished=True, finish_reason="length"))
    s.queue.put_nowait(RequestOutput("r", [3], "c"))  # never merged past the end
    out = asyncio.run(s.next_delta())
    assert out.token_ids == [1, 2] and out.text == "ab" and out.finished
    assert s.queue.qsize() == 1
