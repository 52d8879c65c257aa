"""app/structured.py on the byte tokenizer: masks allow exactly the grammar's next bytes,
matchers follow sampled tokens, bad grammars are refused with a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from app.request import InvalidRequest, StructuredOutput
from app.structured import Grammars
from app.tokenizer import BYTE_EOS, BYTE_VOCAB, ByteTokenizer


@pytest.fixture(scope="module")
def grammars():
    return Grammars(ByteTokenizer(), BYTE_VOCAB, (BYTE_EOS,))


def allowed(mask: bytes) -> set[int]:
    return {t for t in range(BYTE_VOCAB) if mask[t // 8] >> (t % 8) & 1}


def test_mask_follows_the_grammar(grammars):
    m = grammars.matcher(StructuredOutput("choice", json.dumps(["ab", "ac", "b"])))
    assert allowed(m.mask()) == {ord("a"), ord("b")}
    assert m.accept(ord("a")) is None and not m.done
    assert allowed(m.mask()) == {ord("b"), ord("c")}
    assert m.accept(ord("c")) is None and m.done


def test_json_is_compact_and_the_end_allows_eos(grammars):
    m = grammars.matcher(StructuredOutput("json", '{"type": "integer"}'))
    assert ord(" ") not in allowed(m.mask())  # no free whitespace
    m.accept(ord("7"))
    assert {ord("0"), BYTE_EOS} <= allowed(m.mask())  # 7, 70, ... or the end
    assert allowed(m.mask()) <= set(range(ord("0"), ord("9") + 1)) | {BYTE_EOS}


def test_rejected_token_is_an_error_message(grammars):
    m = grammars.matcher(StructuredOutput("regex", "[0-9]+"))
    assert "rejected token 65" in m.accept(65)


@pytest.mark.parametrize(
    "kind,spec",
    [
        ("regex", "(a"),
        ("json", "{not json"),
        ("json", '{"type": "nope"}'),
        ("choice", "[]"),
        ("grammar", "start: missing_rule"),
        ("regex", "$^x"),
    ],
)
def test_bad_grammars_refused(grammars, kind, spec):
    with pytest.raises(InvalidRequest) as e:
        grammars.matcher(StructuredOutput(kind, spec))
    assert e.value.param == "response_format" and e.value.status == 400


def test_a_tokenizer_llguidance_cannot_read_refuses_constraints_only():
    broken = Grammars(object(), BYTE_VOCAB, (BYTE_EOS,))
    assert broken.prepare() is None  # the server starts anyway
    with pytest.raises(InvalidRequest, match="unavailable with this model's tokenizer") as e:
        broken.matcher(StructuredOutput("regex", "a", "guided_regex"))
    assert e.value.param == "guided_regex"
