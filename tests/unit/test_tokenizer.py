"""Tokenizers, incremental detokenization and stop strings."""

import json

import pytest

from app.tokenizer import (
    BYTE_BOS,
    BYTE_EOS,
    ByteTokenizer,
    IncrementalDetokenizer,
    StopStringMatcher,
    load_tokenizer,
)

TEXT = "héllo, wörld ✓ 日本語 🙂!"


def test_byte_round_trip():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode(TEXT)
    assert ids[0] == BYTE_BOS and tok.bos_token_id == BYTE_BOS
    assert tok.eos_token_ids == (BYTE_EOS,) and tok.vocab_size == 320
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids + [BYTE_EOS], skip_special_tokens=False) == "<bos>" + TEXT + "<eos>"
    assert tok.encode("a", add_special_tokens=False) == [97]


def test_byte_pieces():
    tok = ByteTokenizer()
    assert tok.id_to_piece(ord("a")) == "a"
    assert tok.id_to_piece(0xE2) == "bytes:\\xe2"
    assert tok.id_to_piece(BYTE_EOS) == "<eos>"


@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_incremental_multibyte_split(step):
    tok = ByteTokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    assert "".join(deltas) == TEXT == detok.text
    assert all("\ufffd" not in d for d in deltas)  # never a half character


def test_incremental_holds_then_gives_up_on_invalid_bytes():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.add([0xE2]) == ""  # could still become a character
    assert detok.add([0x9C]) == ""
    # Four bytes that are no character: stop holding them back.
    out = detok.add([0xFF, 0xFF])
    assert "\ufffd" in out
    assert detok.add([ord("x")]) == "x"


def test_incremental_flush_and_specials():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.add([BYTE_BOS]) == ""
    assert detok.add([ord("a"), 0xC3]) == "a"
    assert detok.flush() == "\ufffd"
    assert detok.text == "a\ufffd"


def feed_all(matcher, deltas):
    out, stopped = [], False
    for d in deltas:
        emit, stopped = matcher.feed(d)
        out.append(emit)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return out, stopped


def test_stop_split_across_deltas():
    m = StopStringMatcher(("STOP",))
    out, stopped = feed_all(m, ["abc S", "T", "O", "P tail"])
    assert stopped and "".join(out) == "abc "
    assert not any("S" in o for o in out)  # the stop's start was never streamed
    assert m.matched == "STOP"


def test_stop_include_and_earliest():
    m = StopStringMatcher(("yz", "b"), include_stop_str_in_output=True)
    out, stopped = feed_all(m, ["xayzb"])
    assert stopped and "".join(out) == "xayz"


def test_stop_hit_or_flushed():
    m = StopStringMatcher(("NEVER",))
    out, stopped = feed_all(m, ["hello ", "NEV", "ER? no, NEV"])
    assert stopped and "".join(out) == "hello "
    m2 = StopStringMatcher(("NEVER",))
    out2, stopped2 = feed_all(m2, ["hello ", "NEVE", "r? NEV"])
    assert not stopped2 and "".join(out2) == "hello NEVEr? NEV"
    m3 = StopStringMatcher(("zz",))
    out3, stopped3 = feed_all(m3, ["abz", "cz"])
    assert not stopped3 and "".join(out3) == "abzcz"


def test_no_stops_passes_through():
    m = StopStringMatcher(())
    assert m.feed("abc") == ("abc", False)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<|eot|>", "hello", "world", "user", "assistant", "hi",
             ":", "!", "[", "]"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")
    hf.chat_template = ("{{ bos_token }}{% for m in messages %}[ {{ m['role'] }} ] "
                        "{{ m['content'] }} <|eot|> {% endfor %}"
                        "{% if add_generation_prompt %}[ assistant ] {% endif %}")
    d = tmp_path_factory.mktemp("hf_tok")
    hf.save_pretrained(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    return str(d)


def test_hf_tokenizer_offline_with_template(hf_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = load_tokenizer(hf_dir)
    assert not isinstance(tok, ByteTokenizer)
    assert tok.eos_token_ids == (2, 3) and tok.bos_token_id == 1
    assert tok.has_chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "hello world"}])
    assert ids == [1, 11, 6, 12, 4, 5, 3, 11, 7, 12]  # bos not doubled
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"
    assert tok.id_to_piece(4) == "hello"
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add([i]) for i in [4, 5, 10, 2])
    assert text == detok.text and text.replace(" ", "") == "helloworld!"


def test_byte_tokenizer_spells_ids_past_its_vocabulary():
    """A random model with a larger vocabulary (the 8B-shaped bench model) samples ids this
    tokenizer has no bytes for: each streams as "<unk>" at once, specials still obey the flag."""
    from app.tokenizer import ByteTokenizer, IncrementalDetokenizer

    tok = ByteTokenizer()
    assert tok.decode([65, 1000, 66, 257]) == "A<unk>B"
    assert tok.decode([256, 1000, 257], skip_special_tokens=False) == "<bos><unk><eos>"
    # 258..319 are the vocabulary's own unused specials: skipped, or named, as before
    assert tok.decode([65, 300]) == "A"
    assert tok.decode([300], skip_special_tokens=False) == "<unused300>"
    detok = IncrementalDetokenizer(tok)
    assert detok.add([70000]) == "<unk>"
    assert detok.add([65]) == "A"


def test_built_in_template_leaves_a_prefilled_answer_open():
    """continue_final_message on the built-in template: the last message without its closing
    newline and no new turn; the same messages otherwise get both."""
    from app.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I"}]
    open_ids = tok.apply_chat_template(chat, add_generation_prompt=False,
                                       continue_final_message=True)
    assert tok.decode(open_ids) == "<|user|>\nhi\n<|assistant|>\nHello, I"
    assert tok.decode(tok.apply_chat_template(chat)) == (
        "<|user|>\nhi\n<|assistant|>\nHello, I\n<|assistant|>\n")
