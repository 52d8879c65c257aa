"""Scheduler configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from .chunking import ChunkCost, dynamic_chunk_size, lone_prompt_chunks

# The one definition of each tuple of choices; EngineConfig offers these.
SKIP_MODES = ("off", "sglang", "auto")
KV_ADMISSIONS = ("reserve", "on-demand")


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of the chunked-prefill microbatch scheduler (names follow vLLM where they match).

    chunk_size: most prompt tokens of one request in one microbatch.
    max_num_batched_tokens: token budget of one microbatch (decode rows count 1 each).
    max_num_seqs: most running requests; also the number of slots in stage 0's next_tokens.
    max_inflight: most microbatches dispatched and not yet retired (usually the stage count).
    block_size / num_blocks: the paged KV cache the block pool hands out.
    skip_mode: the output-channel skip rule of DESIGN §5 ("off", "sglang", "auto").
    max_model_len: a request's prompt + max_tokens may not exceed this.
    run_ahead: plan a request's decode step t+1 once step t is dispatched (DESIGN §3 step 5),
      not only once its token has retired; the row reads next_tokens[slot] at stage 0.
    num_stages: the pipeline's depth S; with run_ahead, a request's consecutive decode steps
      are at least S microbatch ids apart (see Scheduler._decode_ready).
    kv_admission: "reserve" admits a request once prompt + max_tokens blocks can be reserved
      (never preempts); "on-demand" admits on its prompt's blocks + one, allocates as rows
      grow and preempts (recompute) the youngest running request when blocks run out.
    tokens_from_host: the output channel is the host (--output-channel host): a decode row
      carries its input token in the plan, so a request's next step is planned only once its
      previous token has retired, run-ahead or not.
    enable_prefix_caching: keep full blocks named by a hash of their tokens after their request
      finishes and start a request with a cached prefix after it (DESIGN §6, prefix_cache.py).
    """

    chunk_size: int = 2048
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    max_inflight: int = 2
    block_size: int = 64
    num_blocks: int = 1024
    skip_mode: str = "auto"
    max_model_len: int = 131072
    run_ahead: bool = False
    num_stages: int = 1
    kv_admission: str = "reserve"
    enable_prefix_caching: bool = True
    chunk_cost: ChunkCost | None = None
    dynamic_chunk_smooth: float = 0.75
    tokens_from_host: bool = False

    def __post_init__(self) -> None:
        for name in (
            "chunk_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_inflight",
            "block_size",
            "num_blocks",
            "max_model_len",
            "num_stages",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")
        if self.skip_mode not in SKIP_MODES:
            raise ValueError(
                f"SchedulerConfig.skip_mode must be one of {SKIP_MODES}, got {self.skip_mode!r}"
            )
        if self.kv_admission not in KV_ADMISSIONS:
            raise ValueError(
                f"SchedulerConfig.kv_admission must be one of {KV_ADMISSIONS}, "
                f"got {self.kv_admission!r}"
            )
        if not 0.0 <= self.dynamic_chunk_smooth <= 1.0:
            raise ValueError(
                "SchedulerConfig.dynamic_chunk_smooth must be in [0, 1], "
                f"got {self.dynamic_chunk_smooth!r}"
            )

    def chunk_limit(self, prefix: int) -> int:
        """Most prompt tokens of one request's next chunk, `prefix` of them already cached."""
        if self.chunk_cost is None:
            return self.chunk_size
        return dynamic_chunk_size(
            self.chunk_size, self.chunk_cost, self.dynamic_chunk_smooth, prefix
        )

    def lone_prompt_chunks(self, prompt_len: int) -> list[tuple[int, int]]:
        """(prefix, tokens) of each chunk of a prompt of prompt_len that runs alone."""
        return lone_prompt_chunks(self.chunk_limit, prompt_len)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)
