"""logit_bias, allowed_token_ids and grammar masks: their validation and what the sampler
does with them (the real Sampler on CPU tensors)."""

from __future__ import annotations

import pytest
import torch

from app.openai.protocol import ChatCompletionRequest, CompletionRequest
from app.request import InvalidRequest, SamplingParams
from stages.protocol import SamplingSpec
from stages.sampler import RowToSample, Sampler, unpack_mask


def spec(**kw):
    return SamplingParams(**kw).to_spec(eos_token_ids=())


def sample(logits, *rows):
    sampler = Sampler(torch.device("cpu"))
    return [s.token_id for s in sampler.collect(sampler.pick(logits, list(rows)))]


def test_logit_bias_parsed_from_json_keys():
    req = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"7": 5, "3": -1.5}})
    assert req.sampling_params().logit_bias == ((3, -1.5), (7, 5.0))
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"9": 100}}
    )
    assert chat.sampling_params().to_spec(()).logit_bias == ((9, 100.0),)


@pytest.mark.parametrize(
    "bias,names",
    [
        ({"abc": 1}, "'abc'"),
        ({"1.5": 1}, "'1.5'"),
        ({"5": 100.5}, "100.5"),
        ({"5": -101}, "-101"),
        ({"5": "1"}, "'1'"),
    ],
)
def test_bad_logit_bias_named(bias, names):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == "logit_bias" and names in str(e.value)


def test_token_ids_checked_against_the_vocabulary():
    with pytest.raises(InvalidRequest, match="token id 320 .* vocabulary of 320") as e:
        SamplingParams(logit_bias={"320": 1}).check_vocab(320)
    assert e.value.param == "logit_bias"
    with pytest.raises(InvalidRequest, match="vocabulary of 320") as e:
        SamplingParams(allowed_token_ids=[1, 400]).check_vocab(320)
    assert e.value.param == "allowed_token_ids"
    with pytest.raises(InvalidRequest, match="empty"):
        SamplingParams(allowed_token_ids=[])


def test_bias_and_allowed_ids_decide_the_token():
    logits = torch.zeros(3, 50)
    logits[:, 10] = 5.0  # the plain argmax
    rows = [
        RowToSample(spec(temperature=0, logit_bias={"42": 6}), 0, (), []),
        RowToSample(spec(temperature=0, logit_bias={"10": -100}), 0, (), []),
        RowToSample(spec(temperature=1.0, allowed_token_ids=[3, 4]), 0, (), []),
    ]
    a, b, c = sample(logits, *rows)
    assert a == 42 and b != 10 and c in (3, 4)


def _packed(allowed: set[int], vocab: int) -> bytes:
    out = bytearray((vocab + 31) // 32 * 4)
    for t in allowed:
        out[t // 8] |= 1 << (t % 8)
    return bytes(out)


def test_mask_unpacks_bit_by_bit_and_pads_with_false():
    allowed = {0, 7, 8, 31, 33, 60}
    bits = unpack_mask(_packed(allowed, 64), 70, torch.device("cpu"))
    assert bits.shape == (70,) and set(torch.nonzero(bits).flatten().tolist()) == allowed


def test_mask_applied_before_sampling():
    logits = torch.randn(2, 64)
    mask = _packed({5, 50}, 64)
    rows = [
        RowToSample(spec(temperature=0), 0, (), [], mask),
        RowToSample(spec(temperature=1.0, seed=3), 0, (), [], mask),
    ]
    for _ in range(5):
        assert set(sample(logits, *rows)) <= {5, 50}


def test_bad_words_ban_the_completing_token():
    logits = torch.zeros(1, 50)
    logits[0, 7] = 5.0
    seqs = SamplingSpec(temperature=0.0, bad_words=((7,), (3, 9, 7)))
    assert sample(logits, RowToSample(seqs, 0, (), [])) != [7]  # a one-token word: always
    two = SamplingSpec(temperature=0.0, bad_words=((3, 9, 7),))
    assert sample(logits, RowToSample(two, 2, (), [3, 9])) != [7]  # the output ends with 3 9
    assert sample(logits, RowToSample(two, 2, (), [9, 3])) == [7]
    assert two.needs_history  # the last stage keeps the output it matches against
    with pytest.raises(InvalidRequest):
        SamplingParams(bad_words=[" "])


def test_every_bad_logit_bias_entry_named_at_once():
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(logit_bias={"a": 1, "5": 200, "6": None, "7": 1, "b": 2})
    message = str(e.value)
    assert all(named in message for named in ("'a'", "'b'", "200", "None")) and "'7'" not in message
    with pytest.raises(InvalidRequest, match="token ids 320, 400 are out of range"):
        SamplingParams(logit_bias={"320": 1, "1": 1, "400": 2}).check_vocab(320)
