"""Engine configuration: one frozen dataclass, validated in one place.

CLI flags, Serve `args` and the Python API all become an EngineConfig through `from_dict`.
Names follow vLLM where they mean the same (max_model_len, max_num_seqs, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SKIP_MODES = ("off", "sglang", "auto")
KV_ADMISSIONS = ("reserve", "on-demand")
OUTPUT_POSTS = ("early", "late")
DEVICES = ("cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # local Hugging Face directory; None: built-in random model
    served_model_name: str | None = None
    load_format: str = "auto"  # "dummy": config.json's shapes, seeded random weights (vLLM's name)
    pp_size: int = 2
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    chunk_size: int = 512  # prefill tokens of one request per microbatch
    max_num_batched_tokens: int | None = None  # token budget per microbatch; None: chunk_size
    max_num_seqs: int = 64  # running requests (= stage 0's token slots)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # Requests queued for admission past which new ones get a 429; None: no bound.
    max_waiting_requests: int | None = None
    max_inflight: int | None = None  # microbatches in flight; None: pp_size (2 x with run_ahead)
    block_size: int = 64
    num_kv_blocks: int | None = None  # override the memory-derived count
    kv_cache_memory_bytes: int = 1 << 30  # per stage, CPU only
    gpu_memory_utilization: float = 0.9
    pp_output_skip: str = "auto"
    output_post: str = "early"
    # Plan a request's decode step t+1 once step t is dispatched, not once its token retired.
    run_ahead: bool = False
    # "reserve": admit once prompt + max_tokens blocks can be reserved (no preemption);
    # "on-demand": admit on the prompt's blocks, grow lazily, preempt (recompute) under pressure.
    kv_admission: str = "reserve"
    # Size each prompt chunk to cost about what the first one (chunk_size) costs, so later,
    # attention-heavy chunks shrink and the pipeline drains sooner (SGLang's dynamic chunking).
    enable_dynamic_chunking: bool = False
    dynamic_chunk_smooth: float = 0.75  # 1 = equal-cost chunks, 0 = fixed chunk_size
    # Build the attention kernels (cuDNN graphs) for the chunks of a prompt this long at
    # startup; None: the longest that fits (max_model_len, the KV cache); 0: none.
    warmup_len: int | None = None
    channel_check: bool = False  # every message carries a checked header (tests turn it on)
    linear_backend: str = "auto"
    attention_backend: str = "auto"
    placement_strategy: str = "PACK"
    stage_num_cpus: float = 1.0  # logical CPUs per stage bundle when on CPU
    torch_threads: int = 1  # intra-op threads per CPU stage
    seed: int = 0  # the built-in random model's weights

    def __post_init__(self):
        def bad(msg):
            raise ValueError(msg)

        if self.load_format not in ("auto", "dummy"):
            bad(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.pp_size < 1:
            bad(f"pp_size must be >= 1, got {self.pp_size}")
        if self.device not in DEVICES:
            bad(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            bad(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.chunk_size < 1:
            bad(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            bad("max_num_seqs must be >= 1")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            bad(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.block_size < 1:
            bad("block_size must be >= 1")
        if self.pp_output_skip not in SKIP_MODES:
            bad(f"pp_output_skip must be one of {SKIP_MODES}, got {self.pp_output_skip!r}")
        if self.kv_admission not in KV_ADMISSIONS:
            bad(f"kv_admission must be one of {KV_ADMISSIONS}, got {self.kv_admission!r}")
        if self.output_post not in OUTPUT_POSTS:
            bad(f"output_post must be one of {OUTPUT_POSTS}, got {self.output_post!r}")
        if self.warmup_len is not None and self.warmup_len < 0:
            bad(f"warmup_len must be >= 0, got {self.warmup_len}")
        if not 0.0 <= self.dynamic_chunk_smooth <= 1.0:
            bad(f"dynamic_chunk_smooth must be in [0, 1], got {self.dynamic_chunk_smooth}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad("gpu_memory_utilization must be in (0, 1]")
        if self.max_inflight is not None and self.max_inflight < 1:
            bad("max_inflight must be >= 1")
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            bad(f"unknown placement_strategy {self.placement_strategy!r}")

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def token_budget(self) -> int:
        return self.max_num_batched_tokens or self.chunk_size

    @property
    def inflight(self) -> int:
        # Run-ahead puts a request's consecutive steps >= pp_size microbatches apart: with only
        # pp_size in flight, step t+1 could never leave before step t retires.
        return self.max_inflight or (2 * self.pp_size if self.run_ahead else self.pp_size)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model or "ppserve-random"

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        """From CLI/Serve args: accepts dashes or underscores, rejects unknown keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        aliases = {"pp": "pp_size", "pipeline_parallel_size": "pp_size"}
        kwargs = {}
        for key, value in d.items():
            key = aliases.get(key.replace("-", "_"), key.replace("-", "_"))
            if key not in names:
                raise ValueError(f"unknown engine option {key!r}")
            kwargs[key] = value
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
