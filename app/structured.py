"""Structured outputs: grammars compiled with llguidance, one matcher per constrained request.

The coordinator owns the matchers (it sees every sampled token): before a constrained
request's sampling row is dispatched it computes the row's token bitmask here, the plan carries
it to the last stage, which applies it on the device (stages/sampler.py). The bitmask is
llguidance's: 32-bit little-endian words, bit t % 32 of word t // 32 allows token t, i.e. bit
t % 8 of byte t // 8.

JSON is generated compact-but-readable, as `json.dumps` writes it (", " and ": ", no other
whitespace): a model cannot wander off into endless whitespace, and the text stays what
models are trained on.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from app.request import InvalidRequest, StructuredOutput

if TYPE_CHECKING:
    import llguidance

_JSON_OPTIONS: Any = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class _ByteVocab:
    """The built-in byte tokenizer as llguidance sees it: ids 0..255 are bytes, the rest are
    special (never text)."""

    def __init__(self, vocab_size: int, bos: int, eos: int) -> None:
        self.bos_token_id, self.eos_token_id = bos, eos
        self.tokens = [bytes([i]) for i in range(256)] + [
            f"<special{i}>".encode() for i in range(256, vocab_size)
        ]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def llg_tokenizer(
    tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> llguidance.LLTokenizer:
    """llguidance's view of the serving tokenizer, with the model's vocabulary size (the
    logits' width) and its EOS ids. Takes about a second for a large vocabulary: build once."""
    import llguidance

    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        from llguidance.hf import from_tokenizer  # imports transformers: only for HF ones

        return from_tokenizer(hf, n_vocab=vocab_size, eos_token=list(eos_token_ids))
    vocab = _ByteVocab(vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_ids[0])
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(vocab), n_vocab=vocab_size, eos_token=list(eos_token_ids)
    )


def grammar_text(so: StructuredOutput) -> str:
    """llguidance's grammar for `so`; InvalidRequest when its spec is not even well formed."""
    import llguidance

    try:
        if so.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(so.spec, overrides=_JSON_OPTIONS)
        if so.kind == "choice":
            choices = json.loads(so.spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("the choices must be a non-empty list of non-empty strings")
            return llguidance.grammar_from("choice", so.spec)
        if so.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(so.spec)
        return llguidance.grammar_from("grammar", so.spec)
    except ValueError as e:
        raise InvalidRequest(
            f"invalid {so.kind} for structured output: {e}", param=so.source
        ) from None


class Grammars:
    """Compiles the requests' constraints against one tokenizer (built on first use)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._args = (tokenizer, vocab_size, eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._error: str | None = None

    def prepare(self) -> llguidance.LLTokenizer | None:
        """Build llguidance's tokenizer now (about a second for a large vocabulary), not in
        the first constrained request. A tokenizer it cannot read leaves structured outputs
        refused (the reason in each 400), never the server down."""
        if self._tokenizer is None and self._error is None:
            try:
                self._tokenizer = llg_tokenizer(*self._args)
            except Exception as e:  # e.g. a slow (non-Rust) tokenizer
                self._error = f"{type(e).__name__}: {e}"
        return self._tokenizer

    def matcher(self, so: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request; InvalidRequest (400) for a bad grammar."""
        tokenizer = self.prepare()
        if tokenizer is None:
            raise InvalidRequest(
                f"structured outputs are unavailable with this model's tokenizer ({self._error}).",
                param=so.source,
            )
        import llguidance  # imported by prepare's llg_tokenizer already

        grammar = grammar_text(so)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidRequest(
                f"invalid {so.kind} for structured output: {error}", param=so.source
            )
        m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if m.is_error():
            raise InvalidRequest(
                f"invalid {so.kind} for structured output: {m.get_error()}", param=so.source
            )
        if not any(m.compute_bitmask()):
            raise InvalidRequest(
                f"the {so.kind} of this structured output allows no output.",
                param=so.source,
            )
        return GrammarMatcher(m)


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def mask(self) -> bytes:
        """The tokens allowed next, packed (module docstring)."""
        return self._m.compute_bitmask()

    def accept(self, token_id: int) -> str | None:
        """Advance by a sampled token; an error message if the grammar rejects it."""
        if self._m.is_stopped():
            return None  # e.g. EOS after the grammar's end, under ignore_eos
        if not self._m.consume_token(token_id):
            return (
                f"the structured output's grammar rejected token {token_id}: {self._m.get_error()}"
            )
        return None

    @property
    def done(self) -> bool:
        """Nothing but the end may follow: the request stops here."""
        return self._m.is_stopped()
