"""Dynamic chunk sizes for pipelined prefill (the idea of SGLang's --enable-dynamic-chunking).

A chunk of x prompt tokens after a cached prefix of L costs about
    token_cost * x                          (the linear layers)
  + pair_cost * (L * x + x * (x + 1) / 2)   (attention: query i sees L + i + 1 keys).
With fixed chunks every chunk costs more than the one before, and the dearest one, the last,
sets the pipeline's drain: a lone prompt on S stages takes about its per-stage work plus S - 1
times its dearest chunk. Sizing each chunk to cost what the first one (chunk_size tokens, no
prefix) costs evens them out; `smooth` blends that size with the fixed one (1 = equal cost,
0 = fixed chunks), so the late chunks of very long prompts stay big enough for efficient GEMMs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class ModelShape(Protocol):
    """The shapes a chunk's cost depends on (stages.model_config.ModelArgs has them)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


@dataclass(frozen=True)
class ChunkCost:
    """Relative cost coefficients of a prefill chunk (any unit: only their ratio matters)."""

    token_cost: float
    pair_cost: float

    def __post_init__(self) -> None:
        if not (self.token_cost > 0 and self.pair_cost > 0):
            raise ValueError(f"chunk cost coefficients must be positive, got {self}")

    @classmethod
    def from_shape(
        cls, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
    ) -> "ChunkCost":
        """FLOPs of one dense Llama-style layer: 2 per weight per token; 4 * heads * head_dim
        per (query, key) pair (scores and the weighted sum)."""
        weights = (
            hidden * (heads + 2 * kv_heads) * head_dim
            + heads * head_dim * hidden
            + 3 * hidden * intermediate
        )
        return cls(2.0 * weights, 4.0 * heads * head_dim)

    @classmethod
    def for_model(cls, args: ModelShape) -> ChunkCost:
        """From a model config with hidden_size, intermediate_size, num_attention_heads,
        num_key_value_heads and head_dim (stages.model_config.ModelArgs)."""
        return cls.from_shape(
            args.hidden_size,
            args.intermediate_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )

    def of(self, prefix: int, tokens: int) -> float:
        return self.token_cost * tokens + self.pair_cost * (
            prefix * tokens + tokens * (tokens + 1) / 2
        )


def granule(chunk_size: int) -> int:
    """Chunk sizes are multiples of this (few distinct kernel shapes, whole GEMM tiles)."""
    return max(1, min(256, chunk_size // 8))


def dynamic_chunk_size(chunk_size: int, cost: ChunkCost, smooth: float, prefix: int) -> int:
    """Tokens of the next chunk of a prompt whose first `prefix` tokens are cached."""
    if prefix <= 0 or smooth <= 0:
        return chunk_size
    target = cost.of(0, chunk_size)
    # cost.of(prefix, x) == target: (pair/2) x^2 + (token + pair (prefix + 1/2)) x - target = 0
    a = cost.pair_cost / 2
    b = cost.token_cost + cost.pair_cost * (prefix + 0.5)
    equal_cost = (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
    size = (1 - smooth) * chunk_size + smooth * equal_cost
    g = granule(chunk_size)
    return max(g, min(chunk_size, int(size) // g * g))


def lone_prompt_chunks(chunk_limit: Callable[[int], int], prompt_len: int) -> list[tuple[int, int]]:
    """(prefix, tokens) of each chunk of a prompt that runs alone, cut by `chunk_limit`."""
    chunks, prefix = [], 0
    while prefix < prompt_len:
        n = min(chunk_limit(prefix), prompt_len - prefix)
        chunks.append((prefix, n))
        prefix += n
    return chunks
