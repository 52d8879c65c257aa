"""The scheduler's view of the engine options: a frozen dataclass with no defaults and no checks
of its own. EngineConfig (app/config.py) declares, defaults and validates every option once and
derives this from them (EngineConfig.scheduler_config)."""

from __future__ import annotations

from dataclasses import dataclass

from .chunking import ChunkCost, dynamic_chunk_size, lone_prompt_chunks

# The one definition of each tuple of choices; EngineConfig offers these.
SKIP_MODES = ("off", "sglang", "auto")
KV_ADMISSIONS = ("reserve", "on-demand")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Knobs of the chunked-prefill microbatch scheduler (names follow vLLM where they match).

    chunk_size: most prompt tokens of one request in one microbatch.
    max_num_batched_tokens: token budget of one microbatch (decode rows count 1 each).
    max_num_seqs: most running requests; also the number of slots in stage 0's next_tokens.
    max_inflight: most microbatches dispatched and not yet retired (usually the stage count).
    block_size / num_blocks: the paged KV cache the block pool hands out.
    skip_mode: the output-channel skip rule (docs/ARCHITECTURE.md#the-skip-rule) ("off", "sglang",
    "auto").
    max_model_len: a request's prompt + max_tokens may not exceed this.
    run_ahead: plan a request's decode step t+1 once step t is dispatched
    (docs/ARCHITECTURE.md#run-ahead-decoding),
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
      finishes and start a request with a cached prefix after it (docs/ARCHITECTURE.md#kv-cache).
    chunk_cost / dynamic_chunk_smooth: the model's cost per chunk when chunks are sized to equal
      cost (None: every chunk is chunk_size), and the blend between the two.
    """

    chunk_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_inflight: int
    block_size: int
    num_blocks: int
    skip_mode: str
    max_model_len: int
    run_ahead: bool
    num_stages: int
    kv_admission: str
    enable_prefix_caching: bool
    chunk_cost: ChunkCost | None
    dynamic_chunk_smooth: float
    tokens_from_host: bool

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
