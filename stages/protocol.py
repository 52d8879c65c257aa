"""The contract between the coordinator (app/) and the stage actors (stages/).

Plain frozen dataclasses, standard library only: both sides import this module and nothing
else crosses the boundary. Plans are immutable once dispatched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# The choices of StageSpec's fields; EngineConfig's options offer exactly these.
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")  # dummy: the checkpoint's shapes with seeded random weights
OUTPUT_POSTS = ("early", "late")  # early: output recv posted at dispatch; late: before its use
# How the sampled ids travel from the last stage to stage 0 (docs/ARCHITECTURE.md#channels):
# auto (resolved by the pipeline), nccl (gloo on CPU), copy (CUDA IPC peer copy + interprocess
# event, one node), host (stage 0 reads them from the plans: no output message at all).
OUTPUT_CHANNELS = ("auto", "nccl", "copy", "host")
QUANTIZATIONS = ("auto", "none", "fp8")  # weights (stages/loader.py: keep_fp8_weights)
MXFP4_EXPERTS = ("keep", "dequantize")  # a checkpoint's MXFP4 experts (model_config.py)
# the faster MoE (docs/PERFORMANCE.md, "MXFP4 experts kept in FP4"): every entry point's default
MXFP4_EXPERTS_DEFAULT = "dequantize"
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8")  # stages/models/families.py: fp8_components


@dataclass(frozen=True)
class SamplingSpec:
    """What the last stage needs to sample one request's tokens."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or negative: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus top k
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # Token ids that may not be sampled before min_tokens are out (EOS unless ignore_eos, and
    # stop_token_ids); the coordinator resolves them.
    min_tokens_banned: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    allowed_token_ids: tuple[int, ...] = ()  # non-empty: only these may be sampled
    # Logprobs of the prompt's tokens, with top k: the last stage applies the LM head to
    # every prompt position of this request (only this request's rows).
    prompt_logprobs: int | None = None
    # Token sequences never completed: the last token of one is banned when the output ends
    # with the others (all of it when it is one token).
    bad_words: tuple[tuple[int, ...], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def needs_history(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.bad_words)
        )

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits change before the choice (a plain argmax is not enough)."""
        return bool(self.logit_bias or self.allowed_token_ids)


@dataclass(frozen=True)
class NewRequest:
    """Sent once, in the first plan that names the request."""

    req_id: str
    slot: int  # index into stage 0's next_tokens buffer
    sampling: SamplingSpec
    # Only filled for the last stage, and only when repetition_penalty needs the prompt.
    prompt_token_ids: tuple[int, ...] = ()
    # Last stage only: a re-admission after preemption (recompute) brings back the tokens the
    # request generated so far, the sampler history of presence/frequency/repetition
    # penalties; prompt_token_ids stays the original prompt.
    output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Row:
    """One request's contiguous tokens in a microbatch (a prefill chunk or one decode token)."""

    req_id: str
    slot: int
    start: int  # position of the row's first token
    num_tokens: int
    # Input token ids; stage 0 only. None for a decode row that reads next_tokens[slot].
    token_ids: tuple[int, ...] | None
    # For a decode row reading its slot: the microbatch whose output wrote that slot.
    input_from_mb: int | None = None
    sample: bool = False  # the last stage samples at this row's last token
    output_index: int = 0  # tokens the request generated before this row's sample
    is_prefill: bool = True


@dataclass(frozen=True)
class MicrobatchPlan:
    mb_id: int
    rows: tuple[Row, ...]
    new_requests: tuple[NewRequest, ...] = ()
    # Block ids appended to each request's block table, as (req_id, (block ids...)).
    block_updates: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # Requests whose tables the stages drop before running this plan.
    finished: tuple[str, ...] = ()
    # Whether the last stage sends the sampled ids to stage 0 over the output channel.
    send_output: bool = True
    # Last stage only: structured outputs' allowed tokens for this plan's sampling rows, as
    # (req_id, packed bitmask: bit t % 8 of byte t // 8 allows token t).
    token_masks: tuple[tuple[str, bytes], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    def for_stage(self, stage: int, num_stages: int) -> "MicrobatchPlan":
        """The view one stage receives: only stage 0 gets token ids, only the last prompt ids."""
        rows = self.rows
        if stage != 0:
            rows = tuple(replace(r, token_ids=None) for r in rows)
        news, masks = self.new_requests, self.token_masks
        if stage != num_stages - 1:
            news = tuple(replace(n, prompt_token_ids=(), output_token_ids=()) for n in news)
            masks = ()
        return replace(self, rows=rows, new_requests=news, token_masks=masks)


@dataclass(frozen=True)
class SampledToken:
    req_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of prompt tokens start, start + 1, ... of one request, each given the tokens
    before it (one prefill chunk's worth)."""

    req_id: str
    start: int  # prompt position of the first token scored
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    top: tuple[tuple[tuple[int, float], ...], ...] = ()  # per token, when top k > 0


@dataclass(frozen=True)
class FallbackCount:
    """Calls of `op` that its chosen `backend` routed elsewhere for `reason` (one of
    stages.kernels.fallbacks.REASONS), or 1 for a backend declined when the stage was built."""

    op: str
    backend: str
    reason: str
    count: int


@dataclass(frozen=True)
class StepResult:
    """Returned by every stage for every plan; only the last stage fills `sampled`."""

    mb_id: int
    stage: int
    sampled: tuple[SampledToken, ...] = ()
    forward_s: float = 0.0  # this stage's compute for the microbatch (CUDA events on GPU)
    # The channel's own count of output messages sent so far: tests check it against the
    # scheduler's decisions.
    output_sends: int = 0
    # (mb_id, seconds) of this stage's forwards whose CUDA events completed since the last step.
    timings: tuple[tuple[int, float], ...] = ()
    graphed: bool = False  # this stage ran the microbatch as a CUDA graph replay
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # last stage, for the rows that ask
    # Kernel fallbacks this stage's process counted since its previous result.
    fallbacks: tuple[FallbackCount, ...] = ()


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """What one stage is told at creation; EngineConfig.stage_spec (app/config.py) derives it
    from the engine options, which hold every default and check."""

    stage_index: int
    num_stages: int
    layer_start: int
    layer_end: int  # exclusive
    model_path: str | None  # None: the built-in random model
    load_format: str  # "dummy": the checkpoint's shapes with seeded random weights
    device: str
    dtype: str  # resolved: never "auto"
    block_size: int
    max_running: int  # slots in next_tokens
    kv_cache_bytes: int  # the KV budget on CPU (on GPU it comes from gpu_memory_utilization)
    gpu_memory_utilization: float
    channel_check: bool  # test mode: every message carries a checked header
    output_post: str  # "early": recv posted at dispatch; "late": before its consumer
    output_channel: str  # resolved: "nccl", "copy" or "host" (never "auto")
    linear_backend: str
    attention_backend: str
    seed: int  # the built-in random model's seed
    max_model_len: int  # width of the decode graphs' block tables; 0: no decode graphs
    enforce_eager: bool  # decode-only microbatches run the paged path without graphs
    quantization: str  # FP8 weights: auto (the checkpoint's), none, fp8 (loader.py)
    kv_cache_dtype: str  # auto / bfloat16: the model's dtype; fp8 (kv_cache.py)
    fp8_prefill_attention: str = "auto"  # mla_prefill_fp8's backend (registry.py)
    mxfp4_experts: str = MXFP4_EXPERTS_DEFAULT  # MXFP4 experts packed or dequantized
    # The stage's tensor-parallel ranks: this actor is rank tp_rank of tp_size, all running
    # every plan of the stage (stages/tensor_parallel.py)
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1
