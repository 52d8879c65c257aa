"""The output-channel skip decision (docs/ARCHITECTURE.md#the-skip-rule): pure functions of a plan's
rows.

A sampling row's token is *needed at stage 0* iff its request continues after it
(output_index + 1 < max_tokens): only then does a later decode row read it from the slot.

- ``off``: always send.
- ``auto``: send iff some row's token is needed.
- ``sglang``: the source PR's rule (SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM), reproduced exactly:
  skip iff the batch is prefill-only, holds exactly one request, that request's chunk is not
  the last of its prompt, and it asks no logprobs; else send.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from stages.protocol import Row


class ReqInfo(NamedTuple):
    """What the rules need to know about a request besides its row."""

    prompt_len: int
    max_tokens: int
    wants_logprobs: bool = False


def token_needed(row: Row, max_tokens: int) -> bool:
    """Whether stage 0 will read this row's sampled token (a later decode row consumes it)."""
    return row.sample and row.output_index + 1 < max_tokens


def needed_req_ids(rows: Sequence[Row], info: Mapping[str, ReqInfo]) -> tuple[str, ...]:
    return tuple(r.req_id for r in rows if token_needed(r, info[r.req_id].max_tokens))


def auto_send(rows: Sequence[Row], info: Mapping[str, ReqInfo]) -> bool:
    return any(token_needed(r, info[r.req_id].max_tokens) for r in rows)


def sglang_send(rows: Sequence[Row], info: Mapping[str, ReqInfo]) -> bool:
    prefill_only = all(r.is_prefill for r in rows)
    req_ids = {r.req_id for r in rows}
    if not prefill_only or len(req_ids) != 1:
        return True
    (req_id,) = req_ids
    ri = info[req_id]
    chunk_end = max(r.start + r.num_tokens for r in rows)
    not_last_chunk = chunk_end < ri.prompt_len
    return not (not_last_chunk and not ri.wants_logprobs)


def decide_send(mode: str, rows: Sequence[Row], info: Mapping[str, ReqInfo]) -> bool:
    """Whether the last stage sends this microbatch's sampled ids to stage 0."""
    if mode == "off":
        return True
    if mode == "auto":
        return auto_send(rows, info)
    if mode == "sglang":
        return sglang_send(rows, info)
    raise ValueError(f"unknown skip mode {mode!r}")
