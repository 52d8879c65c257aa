"""Requests as users state them (pure Python, standard library only)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import NoReturn

from stages.protocol import SamplingSpec


class InvalidRequest(ValueError):
    """Bad input: the API answers 400 with this message, and nothing is queued."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


class Overloaded(InvalidRequest):
    """Too many requests wait already: the API answers 429 with Retry-After; nothing queued."""

    def __init__(self, message: str):
        super().__init__(message, status=429)


GUIDED_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text: a JSON schema (as JSON text; '{"type": "object"}'
    for any object), a regular expression, a choice among strings (as a JSON list) or a Lark /
    GBNF grammar. app/structured.py compiles it."""

    kind: str
    spec: str
    source: str = "response_format"  # the request field it came from, named in errors

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise InvalidRequest(
                f"unknown structured output kind {self.kind!r}; one of {', '.join(GUIDED_KINDS)}.",
                param="structured_outputs",
            )


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # vLLM's and torch's range


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's sampling parameters, same names and defaults where they mean the same."""

    max_tokens: int | None = 16  # None: up to max_model_len
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top logprobs per token; None: none
    skip_special_tokens: bool = True
    # token id -> bias added to its logit; OpenAI's JSON keys are strings, parsed here
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: sample only among these
    # vLLM's: words never generated (the token that would complete one is banned)
    bad_words: tuple[str, ...] = ()
    structured: StructuredOutput | None = None  # the output follows this grammar
    # vLLM's: logprobs of the prompt's tokens (each given the ones before), with top k
    prompt_logprobs: int | None = None
    # vLLM's request priority (not a sampling parameter there; it rides with them here to the
    # scheduler): among waiting requests lower is admitted first, ties by arrival
    priority: int = 0

    def __post_init__(self) -> None:
        # Accept lists from JSON / callers but keep the object hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        self.validate()

    def validate(self) -> None:
        def bad(msg: str, param: str) -> NoReturn:
            raise InvalidRequest(msg, param=param)

        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}.", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if self.top_k < -1:
            bad(f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}.", "top_k")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            bad(
                f"seed must be in the signed 64-bit range [{SEED_MIN}, {SEED_MAX}], got "
                f"{self.seed}.",
                "seed",
            )
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}.", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
                "min_tokens",
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.",
                "presence_penalty",
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.",
                "frequency_penalty",
            )
        if self.repetition_penalty <= 0.0:
            bad(
                f"repetition_penalty must be positive, got {self.repetition_penalty}.",
                "repetition_penalty",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be between 0 and 20, got {self.logprobs}.", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad(
                f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}.",
                "prompt_logprobs",
            )
        if any(not s for s in self.stop):
            bad("stop strings must be non-empty.", "stop")
        if any(not w.strip() for w in self.bad_words):
            bad("bad_words must be non-empty words.", "bad_words")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids must not be empty.", "allowed_token_ids")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the sampler indexes with must exist in the model's vocabulary."""
        fields = {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": tuple(t for t, _ in self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids or (),
        }
        for name, ids in fields.items():
            bad = list(dict.fromkeys(t for t in ids if not 0 <= t < vocab_size))
            if bad:  # every one named, not just the first
                listed = ", ".join(map(str, bad))
                what = f"token id {listed} is" if len(bad) == 1 else f"token ids {listed} are"
                raise InvalidRequest(
                    f"{name}: {what} out of range for a vocabulary of {vocab_size}.", param=name
                )

    def to_spec(
        self, eos_token_ids: Iterable[int], bad_words_ids: tuple[tuple[int, ...], ...] = ()
    ) -> SamplingSpec:
        """What the last stage needs to sample: the model's EOS ids are banned, with
        stop_token_ids, until min_tokens are out (unless ignore_eos); `bad_words_ids` are
        bad_words as the coordinator tokenized them."""
        banned = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
        return SamplingSpec(
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            logprobs=self.logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            min_tokens_banned=tuple(sorted(banned)) if self.min_tokens else (),
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids or (),
            prompt_logprobs=self.prompt_logprobs,
            bad_words=bad_words_ids,
        )


def _bias_pairs(
    bias: Mapping[object, object] | Iterable[tuple[object, object]] | None,
) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a mapping (JSON: string keys) or
    pairs. Every key that is no token id and every bias that is no number in [-100, 100] is
    named in one message, so that a client fixes them all at once."""
    items = bias.items() if isinstance(bias, Mapping) else (bias or ())
    pairs: dict[int, float] = {}
    problems: list[str] = []
    for key, value in items:
        if isinstance(key, bool) or not (
            isinstance(key, int) or (isinstance(key, str) and key.strip().lstrip("-").isdecimal())
        ):
            problems.append(f"key {key!r} is not a token id (an integer)")
        elif (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            problems.append(f"the bias of token {key!r} must be a number, got {value!r}")
        elif not -100.0 <= value <= 100.0:
            problems.append(f"the bias of token {key!r} must be in [-100, 100], got {value}")
        else:
            pairs[int(key)] = float(value)
    if problems:
        raise InvalidRequest(f"logit_bias: {'; '.join(problems)}.", param="logit_bias")
    return tuple(sorted(pairs.items()))


Prompt = str | list[int]  # a prompt as text, or as token ids


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 + how many tokens were likelier (prompt logprobs only)


@dataclass
class RequestOutput:
    """One streamed delta (or, from Engine.generate, the whole result)."""

    request_id: str
    token_ids: list[int]  # new tokens in this delta
    text: str  # new text in this delta
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    prompt_token_ids: list[int] | None = None  # on the first delta only
    # On the first delta, when asked: one entry per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None


def merge_outputs(deltas: list[RequestOutput]) -> RequestOutput:
    """Fold consecutive deltas of one request into one (the whole result, given them all):
    the first's prompt fields, the last's counts and finish."""
    first, last = deltas[0], deltas[-1]
    lps = [lp for d in deltas for lp in (d.logprobs or [])]
    return RequestOutput(
        request_id=first.request_id,
        token_ids=[t for d in deltas for t in d.token_ids],
        text="".join(d.text for d in deltas),
        finished=last.finished,
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        logprobs=lps if first.logprobs is not None or lps else None,
        error=last.error,
        prompt_token_ids=first.prompt_token_ids,
        prompt_logprobs=first.prompt_logprobs,
    )


def params_of_choice(params: SamplingParams, index: int) -> SamplingParams:
    """The params of choice `index` of a request with `n` > 1: with a seed, choice i draws
    from seed + i (wrapped into the signed 64-bit range), as vLLM's parallel sampling does, so
    choice i of a seeded request is reproducible on its own."""
    if params.seed is None or index == 0:
        return params
    seed = (params.seed + index - SEED_MIN) % 2**64 + SEED_MIN
    return replace(params, seed=seed)
