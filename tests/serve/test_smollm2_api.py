"""The real tokenizer paths over real HTTP with the official openai client, on SmolLM2-135M-
Instruct: BPE merges, the ChatML template, special tokens in text, multi-byte UTF-8 characters
split across tokens, stop strings across a token boundary, logprobs, echo with special tokens,
chat roles a template takes or refuses, /tokenize and /detokenize; transformers is the oracle."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.serve.conftest import start_cluster, stop_cluster
from tests.smollm2_ref import EOS, SERVED_NAME, chat_ids, hf_greedy, hf_logprobs

REPLACEMENT = "\ufffd"
CHINESE = "你好，世界！你好，"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# ChatML that refuses roles it does not know, as the Llama 2 / Mistral / Gemma templates do,
# and opens with a system turn when the request's chat_template_kwargs give a `persona`
STRICT_TEMPLATE = (
    "{% if persona is defined %}{{ '<|im_start|>system\\n' + persona + '<|im_end|>\\n' }}"
    "{% endif %}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def strict_copy(smollm2_dir: str, root: Path) -> str:
    """SmolLM2 with STRICT_TEMPLATE as its chat template (the other files linked)."""
    for f in Path(smollm2_dir).iterdir():
        if f.name != "chat_template.jinja":
            (root / f.name).symlink_to(f)
    (root / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    return str(root)


@pytest.fixture(scope="module")
def served(smollm2_dir, tmp_path_factory):
    args = {"model": smollm2_dir, "served_model_name": SERVED_NAME, "pp": 2, "chunk_size": 8,
            "max_model_len": 512, "block_size": 16, "num_kv_blocks": 96, "max_num_seqs": 8,
            "channel_check": True}
    strict = {**args, "pp": 1,
              "model": strict_copy(smollm2_dir, tmp_path_factory.mktemp("strict_template"))}
    try:
        yield start_cluster({"smollm2": ("/", args), "strict": ("/strict", strict)})
    finally:
        stop_cluster()


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def complete(client, prompt, **kw):
    return client.completions.create(model=SERVED_NAME, prompt=prompt, temperature=0, **kw)


def streamed_texts(client, prompt, **kw) -> list[str]:
    chunks = complete(client, prompt, stream=True, **kw)
    return [c.choices[0].text for c in chunks if c.choices]


def test_completion_bpe_matches_transformers(client, smollm2_hf):
    model, tok = smollm2_hf
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    assert len(ids) < len(prompt.split()) + 1  # merges: whole words are single tokens
    want = hf_greedy(model, ids, 12)
    r = complete(client, prompt, max_tokens=12)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert r.choices[0].text.startswith(" Paris")
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]


def test_chat_template(client, smollm2_hf):
    model, tok = smollm2_hf
    ids = chat_ids(tok, QUESTION)
    assert ids[0] == 1 and ids.count(EOS) == 2  # <|im_start|>, system + user turns closed
    want = hf_greedy(model, ids, 32)
    assert want[-1] == EOS  # the answer ends its turn
    r = client.chat.completions.create(model=SERVED_NAME, messages=QUESTION, max_tokens=32,
                                       temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(want)


WEATHER_ARGS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                "properties": {"city": {"type": "string", "maxLength": 20},
                               "unit": {"enum": ["celsius", "fahrenheit"]}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": WEATHER_ARGS}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_json_schema_on_a_real_tokenizer(client):
    # llguidance's masks over SmolLM2's 49k BPE tokens: multi-character tokens, greedy
    import json

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_ARGS}}
    r = client.chat.completions.create(model=SERVED_NAME, messages=WEATHER_QUESTION,
                                       max_tokens=40, temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER_ARGS)
    assert r.usage.completion_tokens < len(r.choices[0].message.content)  # multi-char tokens


def test_named_tool_call_through_the_tool_prompt(client, smollm2_hf):
    # SmolLM2's template shows no tools: they go into the system prompt (Hermes format).
    import json

    import jsonschema

    from app.tokenizer import with_tool_prompt

    _model, tok = smollm2_hf
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=WEATHER_QUESTION, max_tokens=40, temperature=0,
        tools=[WEATHER_TOOL], tool_choice={"type": "function",
                                           "function": {"name": "get_weather"}})
    assert r.usage.prompt_tokens == len(chat_ids(tok, with_tool_prompt(WEATHER_QUESTION,
                                                                       [WEATHER_TOOL])))
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_ARGS)
    # The call and its result, sent back, render as the next turn's prompt.
    follow = client.chat.completions.create(
        model=SERVED_NAME, max_tokens=8, temperature=0, tools=[WEATHER_TOOL],
        messages=[*WEATHER_QUESTION, {"role": "assistant", "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}])
    assert follow.choices[0].message.content


def test_echo_prompt_logprobs_match_transformers(client, smollm2_hf):
    # Prefill chunks of 8: every prompt position, across chunk boundaries
    model, tok = smollm2_hf
    prompt = ("Pipeline parallelism splits the layers of a large language model across several "
              "GPUs, and each stage passes its hidden states to the next one.")
    ids = tok.encode(prompt)
    assert len(ids) > 16
    ref = hf_logprobs(model, ids[:1], ids[1:])  # the distribution of each prompt token
    r = complete(client, prompt, max_tokens=2, echo=True, logprobs=2,
                 extra_body={"prompt_logprobs": 2})
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None
    for i, t in enumerate(ids[1:]):
        assert lp.token_logprobs[1 + i] == pytest.approx(ref[i, t].item(), abs=1e-4)
        assert sorted(lp.top_logprobs[1 + i].values(), reverse=True) == pytest.approx(
            ref[i].topk(2).values.tolist(), abs=1e-4)
    vllm = choice.model_extra["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    last = vllm[-1][str(ids[-1])]
    assert last["logprob"] == pytest.approx(ref[-1, ids[-1]].item(), abs=1e-4)
    assert last["rank"] == 1 + int((ref[-1] > ref[-1, ids[-1]]).sum())


def test_special_tokens_in_a_text_prompt(client, smollm2_hf):
    """The rendered template as a plain completion prompt: its <|im_start|>/<|im_end|> are read
    as the special tokens (not spelled out in BPE pieces), so the answer equals the chat one."""
    _, tok = smollm2_hf
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    r = complete(client, text, max_tokens=32)
    assert r.usage.prompt_tokens == len(chat_ids(tok, QUESTION))
    chat = client.chat.completions.create(model=SERVED_NAME, messages=QUESTION, max_tokens=32,
                                          temperature=0)
    assert r.choices[0].text == chat.choices[0].message.content
    assert "<|im_end|>" not in r.choices[0].text and r.choices[0].finish_reason == "stop"


def test_multibyte_stream_equals_whole_text(client, smollm2_hf):
    model, tok = smollm2_hf
    want = hf_greedy(model, tok.encode(CHINESE), 16)
    pieces = [tok.decode([t]) for t in want]
    # the test is about characters split across tokens: make sure the output has some
    assert any(REPLACEMENT in p for p in pieces), pieces
    whole = complete(client, CHINESE, max_tokens=16).choices[0].text
    assert whole == tok.decode(want, skip_special_tokens=True)
    deltas = streamed_texts(client, CHINESE, max_tokens=16)
    assert "".join(deltas) == whole
    assert not any(REPLACEMENT in d for d in deltas[:-1])  # no half character mid-stream


def test_stop_string_across_a_token_boundary(client, smollm2_hf):
    model, tok = smollm2_hf
    prompt = "Here is a short list of fruits: apple, banana,"
    want = hf_greedy(model, tok.encode(prompt), 12)
    text = tok.decode(want)
    # the last two characters of one token and the first two of the next
    k = next(i for i in range(1, len(want) - 1)
             if len(tok.decode(want[i]).strip()) >= 2 and len(tok.decode(want[i + 1])) >= 2)
    stop = tok.decode(want[k])[-2:] + tok.decode(want[k + 1])[:2]
    expected = text[:text.index(stop)]
    r = complete(client, prompt, max_tokens=12, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    assert "".join(streamed_texts(client, prompt, max_tokens=12, stop=[stop])) == expected


def test_logprobs_match_transformers(client, smollm2_hf):
    model, tok = smollm2_hf
    prompt = "Here is a short list of fruits: apple, banana,"
    ids = tok.encode(prompt)
    want = hf_greedy(model, ids, 8)
    ref = hf_logprobs(model, ids, want)
    lp = complete(client, prompt, max_tokens=8, logprobs=3).choices[0].logprobs
    assert len(lp.token_logprobs) == len(want)
    for i, t in enumerate(want):
        assert abs(lp.token_logprobs[i] - ref[i, t].item()) < 1e-4
        best = ref[i].topk(3)
        got = sorted(lp.top_logprobs[i].values(), reverse=True)
        assert got == pytest.approx(best.values.tolist(), abs=1e-4)


# -- echo: the prompt as the tokenizer decodes it (special tokens included), then the completion;
# with logprobs, the prompt's tokens first (the first without a logprob), by their real text

ECHO_PROMPTS = {
    "special token ids": lambda tok: [0] * 5,  # <|endoftext|> x 5: vLLM's own test
    "text": lambda tok: "Hello, my name is",
    "template ids": lambda tok: chat_ids(tok, QUESTION),  # <|im_start|> ... mid-prompt
    "template text": lambda tok: tok.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                         tokenize=False),
}


def echo_case(tok, model, name: str, max_tokens: int = 5):
    """(prompt, its ids, the echoed text, the greedy completion's ids)."""
    prompt = ECHO_PROMPTS[name](tok)
    ids = prompt if isinstance(prompt, list) else tok.encode(prompt)
    echoed = prompt if isinstance(prompt, str) else tok.decode(ids, skip_special_tokens=False)
    want = hf_greedy(model, ids, max_tokens)
    assert EOS not in want  # every generated token is in the text
    return prompt, ids, echoed, want


def joined_logprobs(chunks) -> dict[str, list]:
    """The streamed logprobs of one choice, each chunk's checked to spell that chunk's text."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.logprobs is None:
            assert c.text == ""
            continue
        assert "".join(c.logprobs.tokens) == c.text
        for k in out:
            out[k] += getattr(c.logprobs, k)
    return out


@pytest.mark.parametrize("name", list(ECHO_PROMPTS))
def test_echo_with_logprobs_streamed_and_not(client, smollm2_hf, name):
    model, tok = smollm2_hf
    prompt, ids, echoed, want = echo_case(tok, model, name)
    if name == "special token ids":
        assert echoed == "<|endoftext|>" * 5
    elif "template" in name:
        assert echoed.startswith("<|im_start|>system\n") and echoed.count("<|im_end|>") == 2
    pieces = [tok.decode([t]) for t in ids + want]
    ref = hf_logprobs(model, ids[:1], ids[1:] + want)
    text = echoed + tok.decode(want, skip_special_tokens=True)
    r = complete(client, prompt, max_tokens=5, echo=True, logprobs=1)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == text and "".join(pieces) == text
    assert lp.tokens == pieces  # the first one by its text too
    assert lp.text_offset == [len("".join(pieces[:i])) for i in range(len(pieces))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(
        [ref[i, t].item() for i, t in enumerate(ids[1:] + want)], abs=1e-4)
    # streamed: the prompt and the first token in one chunk, whose logprobs cover both
    chunks = [c.choices[0] for c in complete(client, prompt, max_tokens=5, echo=True,
                                             logprobs=1, stream=True) if c.choices]
    assert len(chunks) == len(want)
    assert chunks[0].text == echoed + pieces[len(ids)]
    assert chunks[0].logprobs.tokens == pieces[:len(ids) + 1]
    assert not any("prompt_logprobs" in (c.model_extra or {}) for c in chunks)  # not asked
    assert "".join(c.text for c in chunks) == text
    streamed = joined_logprobs(chunks)
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


@pytest.mark.parametrize("name", ["special token ids", "text"])
def test_echo_without_logprobs_streamed_and_not(client, smollm2_hf, name):
    model, tok = smollm2_hf
    prompt, ids, echoed, want = echo_case(tok, model, name, max_tokens=3)
    text = echoed + tok.decode(want, skip_special_tokens=True)
    r = complete(client, prompt, max_tokens=3, echo=True)
    assert r.choices[0].text == text and r.choices[0].logprobs is None
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3
    deltas = streamed_texts(client, prompt, max_tokens=3, echo=True)
    assert deltas == [echoed + tok.decode(want[:1]), *[tok.decode([t]) for t in want[1:]]]


# -- chat roles: any role reaches the chat template, which alone may refuse it

NARRATED = [{"role": "narrator", "content": "The story is set in France."}, *QUESTION]


def test_any_role_reaches_the_chat_template(client, smollm2_hf):
    model, tok = smollm2_hf
    ids = chat_ids(tok, NARRATED)
    assert "<|im_start|>narrator\nThe story" in tok.decode(ids)
    want = hf_greedy(model, ids, 8)
    kw = {"model": SERVED_NAME, "messages": NARRATED, "max_tokens": 8, "temperature": 0}
    r = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    chunks = client.chat.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        r.choices[0].message.content)


def test_a_role_the_chat_template_refuses_is_a_400(served):
    strict = served.client(prefix="/strict")
    kw = {"model": SERVED_NAME, "max_tokens": 4, "temperature": 0}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            strict.chat.completions.create(messages=NARRATED, stream=stream, **kw)
        err = e.value.body
        assert err["param"] == "messages" and err["type"] == "invalid_request_error"
        assert "chat template" in err["message"] and "Unknown role: narrator" in err["message"]
    assert strict.chat.completions.create(messages=QUESTION, **kw).choices[0].message.content


# -- /tokenize and /detokenize (vLLM's): the ids a completion of the same input runs

def post(served, path, body, prefix=""):
    import httpx

    return httpx.post(f"{served.base_url}{prefix}{path}", json=body, timeout=60)


def test_tokenize_a_prompt_as_a_completion_counts_it(served, client, smollm2_hf):
    _, tok = smollm2_hf
    prompt = f"The capital of France is {CHINESE}<|im_end|>"  # merges, split characters, a special
    ids = tok.encode(prompt)
    r = post(served, "/tokenize", {"model": SERVED_NAME, "prompt": prompt,
                                   "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                        "token_strs": tok.convert_ids_to_tokens(ids)}
    assert complete(client, prompt, max_tokens=1).usage.prompt_tokens == len(ids)
    plain = post(served, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(prompt, add_special_tokens=False)
    assert plain["token_strs"] is None
    back = post(served, "/detokenize", {"model": SERVED_NAME, "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": prompt}


def test_tokenize_a_chat_as_its_completion_counts_it(served, client, smollm2_hf):
    _, tok = smollm2_hf
    for messages, tools in ((QUESTION, None), (WEATHER_QUESTION, [WEATHER_TOOL])):
        body = {"messages": messages, **({"tools": tools} if tools else {})}
        r = post(served, "/tokenize", body)
        assert r.status_code == 200, r.text
        got = r.json()["tokens"]
        used = client.chat.completions.create(model=SERVED_NAME, max_tokens=1, **body)
        assert used.usage.prompt_tokens == len(got)
        if tools is None:  # the template's own rendering (tools go through the tool prompt)
            assert got == chat_ids(tok, messages)
    bare = post(served, "/tokenize", {"messages": QUESTION, "add_generation_prompt": False})
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=False, tokenize=False)
    assert bare.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    assert bare.json()["tokens"] == chat_ids(tok, QUESTION)[:len(bare.json()["tokens"])]


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"prompt": "a", "messages": QUESTION}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": QUESTION, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": 7}, 400, "prompt"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_tokenize_refuses_bad_input_with_openai_errors(served, path, body, status, param):
    r = post(served, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_tokenize_a_role_the_chat_template_refuses_is_a_400(served):
    r = post(served, "/tokenize", {"messages": NARRATED}, prefix="/strict")
    assert r.status_code == 400 and "Unknown role: narrator" in r.json()["error"]["message"]
    assert post(served, "/tokenize", {"messages": QUESTION}, prefix="/strict").status_code == 200


# -- how the template renders: a prefilled answer continued, the template's own variables

PREFILLED = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]


def test_continue_final_message_goes_on_with_a_prefilled_answer(served, client, smollm2_hf):
    model, tok = smollm2_hf
    text = tok.apply_chat_template(PREFILLED, add_generation_prompt=False,
                                   continue_final_message=True, tokenize=False)
    assert text.endswith("The capital of France is")  # the turn left open: no <|im_end|>
    ids = tok.encode(text, add_special_tokens=False)
    want = hf_greedy(model, ids, 8)
    kw = {"model": SERVED_NAME, "messages": PREFILLED, "max_tokens": 8, "temperature": 0}
    r = client.chat.completions.create(
        **kw, extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert r.choices[0].message.content.startswith(" Paris")
    body = {"messages": PREFILLED, "add_generation_prompt": False, "continue_final_message": True}
    assert post(served, "/tokenize", body).json()["tokens"] == ids
    # a new turn instead: the answer is closed and another one opened
    assert client.chat.completions.create(**kw).usage.prompt_tokens == len(chat_ids(tok, PREFILLED))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


def test_chat_template_kwargs_reach_the_template(served, smollm2_hf):
    _, tok = smollm2_hf
    persona = "You answer like a pirate."
    text = tok.apply_chat_template(QUESTION, chat_template=STRICT_TEMPLATE, persona=persona,
                                   add_generation_prompt=True, tokenize=False)
    assert text.startswith(f"<|im_start|>system\n{persona}")
    ids = tok.encode(text, add_special_tokens=False)
    strict = served.client(prefix="/strict")
    kw = {"model": SERVED_NAME, "messages": QUESTION, "max_tokens": 2, "temperature": 0}
    r = strict.chat.completions.create(**kw, extra_body={"chat_template_kwargs":
                                                         {"persona": persona}})
    assert r.usage.prompt_tokens == len(ids)
    assert strict.chat.completions.create(**kw).usage.prompt_tokens < len(ids)
    body = {"messages": QUESTION, "chat_template_kwargs": {"persona": persona}}
    assert post(served, "/tokenize", body, prefix="/strict").json()["tokens"] == ids
    for bad in ({"tokenize": True}, {"messages": []}, {"add_generation_prompt": False}):
        with pytest.raises(openai.BadRequestError) as e:
            strict.chat.completions.create(**kw, extra_body={"chat_template_kwargs": bad})
        assert e.value.body["param"] == "chat_template_kwargs", bad
    with pytest.raises(openai.BadRequestError) as e:  # not an object
        strict.chat.completions.create(**kw, extra_body={"chat_template_kwargs": ["persona"]})
    assert e.value.body["param"] == "chat_template_kwargs"
