"""Tokenizers, incremental detokenization and stop strings (no torch, no ray).

`load_tokenizer(path)` gives the checkpoint's own tokenizer (tokenizer.json, chat template) when
the directory has one, else the byte-level tokenizer of the built-in random model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any, cast

BYTE_BOS, BYTE_EOS, BYTE_VOCAB = 256, 257, 320
_REPLACEMENT = "\ufffd"
# A UTF-8 character spans at most 4 bytes (so at most 4 byte-fallback tokens): past that a
# trailing replacement character is real, not an incomplete character.
_MAX_HOLD_TOKENS = 4


def _message_text(content: Any) -> str:
    """OpenAI content is a string or a list of parts; only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type", "text") == "text":
            parts.append(part.get("text", ""))
        else:
            raise ValueError("only text content parts are supported")
    return "".join(parts)


def simple_chat_text(
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The built-in template: one `<|role|>` header line per message, then the content and a
    newline (not after the last one with continue_final_message)."""
    text = "".join(
        f"<|{m.get('role', 'user')}|>\n{_message_text(m.get('content'))}\n" for m in messages
    )
    if continue_final_message:
        return text.removesuffix("\n")
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def with_tool_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """For a template without tool support: the tools described in the system message, and
    earlier calls written into the assistant's content, in the Hermes format that
    app/tool_parsers.py reads back."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    prompt = (
        f"You may call these functions:\n<tools>\n{listing}\n</tools>\nTo call one, "
        'answer with\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )
    out = []
    for m in messages:
        calls = m.get("tool_calls") or ()
        text = _message_text(m.get("content")) + "".join(
            "<tool_call>\n"
            + json.dumps(
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                ensure_ascii=False,
            )
            + "\n</tool_call>"
            for c in calls
        )
        out.append({k: v for k, v in {**m, "content": text}.items() if k != "tool_calls"})
    if out and out[0].get("role") == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{prompt}".lstrip()}, *out[1:]]
    return [{"role": "system", "content": prompt}, *out]


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, 256 <bos>, 257 <eos>; ids 258..319 are unused."""

    bos_token_id = BYTE_BOS
    eos_token_ids = (BYTE_EOS,)
    vocab_size = BYTE_VOCAB
    has_chat_template = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BYTE_BOS] + ids if add_special_tokens else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Bytes as UTF-8 (invalid sequences as U+FFFD); ids past the vocabulary (a random model
        with a larger one, e.g. an 8B-shaped benchmark model, samples them) spell "<unk>"
        whatever `skip_special_tokens` says: they are not special, just unknown here, and a
        streamed token must show up as text (U+FFFD would be held back as a partial character)."""
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            if i >= BYTE_VOCAB:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
                out.append("<unk>")
                continue
            if skip_special_tokens:
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(self._special_name(i))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def id_to_piece(self, token_id: int) -> str:
        if 0 <= token_id < 128:
            return chr(token_id)
        if 128 <= token_id < 256:
            return f"bytes:\\x{token_id:02x}"  # OpenAI's spelling for a partial character
        return self._special_name(token_id)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.id_to_piece(i) for i in ids]

    @staticmethod
    def _special_name(token_id: int) -> str:
        return {BYTE_BOS: "<bos>", BYTE_EOS: "<eos>"}.get(token_id, f"<unused{token_id}>")

    chat_template = ""

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The built-in template (simple_chat_text), which reads no template_kwargs."""
        if tools:
            messages = with_tool_prompt(messages, tools)
        return self.encode(
            simple_chat_text(messages, add_generation_prompt, continue_final_message)
        )


class HFTokenizer:
    """A local Hugging Face tokenizer (tokenizer.json), loaded offline."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception:  # no config.json / unknown class: the raw tokenizer.json still works
            self.hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"))
        self.bos_token_id = self.hf.bos_token_id
        self.eos_token_ids = _eos_ids(path, self.hf.eos_token_id)
        self.vocab_size = len(self.hf)
        template = getattr(self.hf, "chat_template", None) or ""
        # Several named templates: the default one renders chats.
        self.chat_template = template.get("default", "") if isinstance(template, dict) else template
        self.has_chat_template = bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return cast(str, self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_piece(self, token_id: int) -> str:
        text = cast(str, self.hf.decode([token_id], skip_special_tokens=False))
        if _REPLACEMENT in text:  # a byte-fallback piece: show the raw token instead
            return str(self.hf.convert_ids_to_tokens(token_id))
        return text

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary's own spelling (byte-level BPE's "Ġ" for a space, ...)."""
        return cast(list[str], self.hf.convert_ids_to_tokens(list(ids)))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """template_kwargs: variables of the template (app/openai/protocol.py keeps the
        renderer's own parameters out of them)."""
        msgs = [{**m, "content": _message_text(m.get("content"))} for m in messages]
        if tools and "tools" not in self.chat_template:  # a template that cannot show them
            msgs, tools = with_tool_prompt(msgs, tools), None
        if not self.has_chat_template:
            # Like a base model served without a template: a plain, documented fallback.
            text = simple_chat_text(msgs, add_generation_prompt, continue_final_message)
            return self.encode(text)
        hf_tools: list[dict[Any, Any] | Callable[..., Any]] | None = list(tools) if tools else None
        text = cast(
            str,
            self.hf.apply_chat_template(
                msgs,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                tools=hf_tools,
                **(template_kwargs or {}),
            ),
        )
        # The rendered template already holds BOS where the model wants it.
        return self.encode(text, add_special_tokens=False)


def _eos_ids(path: str, tokenizer_eos: int | None) -> tuple[int, ...]:
    """EOS ids from the tokenizer, config.json and generation_config.json (Llama 3 has several)."""
    ids: list[int] = [] if tokenizer_eos is None else [tokenizer_eos]
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(path, name)) as f:
                value = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            continue
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(model_path: str | None) -> Tokenizer:
    """The checkpoint's tokenizer when `model_path` holds tokenizer.json, else the byte one."""
    if model_path and os.path.exists(os.path.join(model_path, "tokenizer.json")):
        return HFTokenizer(model_path)
    return ByteTokenizer()


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, holding back incomplete characters.

    The window trick of vLLM's detokenize_incrementally: decode a few tokens of context before the
    new ones, so tokenizers that strip or merge at token boundaries still give the right text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # context start
        self._read_offset = 0  # tokens before this are already in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        return self._advance(force=False)

    def flush(self) -> str:
        """At the end of a request: whatever is still held back, incomplete or not."""
        return self._advance(force=True)

    def _advance(self, force: bool) -> str:
        ids = self.token_ids
        if self._read_offset >= len(ids):
            return ""
        prefix = self._decode(ids[self._prefix_offset : self._read_offset])
        end, full = len(ids), self._decode(ids[self._prefix_offset :])
        if full.endswith(_REPLACEMENT) and not force:
            complete, full = self._last_complete(end)
            if complete is None:
                return ""
            end = complete
        if len(full) <= len(prefix) and not force:
            return ""  # e.g. only special tokens so far: nothing visible yet
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, end
        self.text += delta
        return delta

    def _last_complete(self, end: int) -> tuple[int | None, str]:
        """The latest window end whose text ends on a whole character; (None, "") to wait."""
        for k in range(1, _MAX_HOLD_TOKENS):
            if end - k <= self._read_offset:
                break
            text = self._decode(self.token_ids[self._prefix_offset : end - k])
            if not text.endswith(_REPLACEMENT):
                return end - k, text
        if end - self._read_offset >= _MAX_HOLD_TOKENS:  # too long to be one character: invalid
            return end, self._decode(self.token_ids[self._prefix_offset : end])
        return None, ""


class StopStringMatcher:
    """Cuts streamed text at the first stop string, never streaming part of one."""

    def __init__(self, stops: tuple[str, ...], include_stop_str_in_output: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include = include_stop_str_in_output
        # A stop can begin up to len(longest)-1 chars before the newest delta: keep those back.
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        self._buf += delta
        hit, stop = -1, ""
        for s in self.stops:
            i = self._buf.find(s)
            if i >= 0 and (hit < 0 or i < hit):
                hit, stop = i, s
        if hit >= 0:
            emit = self._buf[: hit + (len(stop) if self.include else 0)]
            self._buf, self.stopped, self.matched = "", True, stop
            return emit, True
        cut = max(len(self._buf) - self._hold, 0)
        emit, self._buf = self._buf[:cut], self._buf[cut:]
        return emit, False

    def flush(self) -> str:
        """At the end of a request that did not stop on a string: the held-back tail."""
        emit, self._buf = self._buf, ""
        return "" if self.stopped else emit
