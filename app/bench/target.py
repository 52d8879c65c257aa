"""The one way a benchmark reaches the engine: a BenchEngine (a pipeline with its policy knobs,
run by the bench's actors of app/bench/actors.py) and the synthetic models the benches load.
Nothing in the serving path imports app/bench/."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from app.request import Prompt, RequestOutput, SamplingParams
from stages.protocol import OUTPUT_CHANNELS

StageTiming = tuple[int, int, float]  # (stage, mb_id, seconds) of one forward

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 1048576,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

# Qwen3-30B-A3B-Instruct-2507's shapes (262K positions natively): 48 layers, every one routed.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000.0,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


class BenchEngine:
    """One loaded pipeline: run prompts, read its counters, switch policy between runs."""

    def __init__(self, **options: Any) -> None:
        from app.bench.actors import BenchDriver
        from app.config import EngineConfig

        # Benches send the same prompts under every mode and rep: a prefix-cache hit would
        # measure a shorter prefill than the one asked for.
        options.setdefault("enable_prefix_caching", False)
        self.config = EngineConfig(**options)
        self._engine = BenchDriver(self.config)

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[RequestOutput]:
        return self._engine.generate(prompts, params)

    async def ttft(self, prompt: Prompt, params: SamplingParams) -> float:
        """Seconds to the first streamed delta; the request runs to its end."""
        return (await self.timed(prompt, params))[0]

    async def timed(self, prompt: Prompt, params: SamplingParams) -> tuple[float, list[int]]:
        """(seconds to the first streamed delta, every generated token id); runs to the end."""
        t0 = time.perf_counter()
        first: float | None = None
        tokens: list[int] = []
        async for delta in self._engine.stream(prompt, params):
            if first is None:
                first = time.perf_counter() - t0
            tokens.extend(delta.token_ids)
        if first is None:
            raise RuntimeError("the request streamed nothing")
        return first, tokens

    async def token_times(self, prompt: Prompt, params: SamplingParams) -> list[float]:
        """perf_counter() at each streamed token (a delta of n tokens: n times its arrival)."""
        times: list[float] = []
        async for delta in self._engine.stream(prompt, params):
            times += [time.perf_counter()] * len(delta.token_ids)
        return times

    def stats(self) -> dict[str, Any]:
        return self._engine.stats()

    def comm(self) -> dict[str, int]:
        """The output channel's sent / skipped / missed / orphaned counts so far."""
        comm: dict[str, int] = self.stats()["pp_output_comm"]
        return comm

    def wait_idle(self, timeout: float = 120.0) -> dict[str, Any]:
        t0 = time.monotonic()
        while True:
            s = self.stats()
            if not (s["num_running"] or s["num_waiting"] or s["inflight_microbatches"]):
                return s
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the pipeline did not go idle: {s}")
            time.sleep(0.01)

    def set_policy(self, **knobs: Any) -> list[dict[str, str]]:
        """Between requests: skip_mode, output_post, linear_backend, chunk_size, dynamic
        chunking; returns each stage's kernels."""
        return self._engine.set_policy(**knobs)

    def take_timings(self) -> list[StageTiming]:
        """(stage, mb_id, seconds) of every stage's forwards since the last call."""
        return self._engine.take_timings()

    def close(self) -> None:
        self._engine.shutdown()

    def __enter__(self) -> BenchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def add_memory_flags(p: argparse.ArgumentParser) -> None:
    """The weight and KV cache formats of a bench's engine, and how its KV cache is sized."""
    from stages.protocol import (
        KV_CACHE_DTYPES,
        MXFP4_EXPERTS,
        MXFP4_EXPERTS_DEFAULT,
        QUANTIZATIONS,
    )

    p.add_argument("--quantization", choices=QUANTIZATIONS, default="auto")
    p.add_argument(
        "--mxfp4-experts",
        choices=MXFP4_EXPERTS,
        default=MXFP4_EXPERTS_DEFAULT,
        help="a model's MXFP4 routed experts (deepseek-v4-flash's) packed or dequantized at "
        "load (--mxfp4-experts of ppserve serve)",
    )
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument(
        "--fp8-prefill-attention",
        default="auto",
        help="how prefill chunks read an FP8 latent (--fp8-prefill-attention of ppserve serve)",
    )
    p.add_argument(
        "--kv-blocks",
        choices=("fit", "memory"),
        default="fit",
        help="fit: just the blocks the bench's requests need; memory: as many as "
        "--gpu-memory-utilization leaves beside the weights (the engine's own sizing, so the "
        "KV capacity it reports is the deployment's)",
    )


def memory_options(a: argparse.Namespace, fitted_blocks: int) -> dict[str, Any]:
    """EngineConfig options from add_memory_flags' flags."""
    return dict(
        quantization=a.quantization,
        kv_cache_dtype=a.kv_cache_dtype,
        fp8_prefill_attention=a.fp8_prefill_attention,
        mxfp4_experts=a.mxfp4_experts,
        num_kv_blocks=fitted_blocks if a.kv_blocks == "fit" else None,
    )


def kv_info(engine: BenchEngine) -> dict[str, Any]:
    """The engine's KV cache: capacity in tokens and blocks (every stage holds the same)."""
    s = engine.stats()
    return {k: s[k] for k in ("kv_capacity_tokens", "kv_blocks_total")}


def engine_default(option: str) -> Any:
    """An engine option's default (EngineConfig holds every one)."""
    from app.config import EngineConfig

    return getattr(EngineConfig(), option)


def lone_prompt_chunk_sizes(
    prompt_len: int, chunk: int, smooth: float | None, model: dict[str, Any]
) -> list[int]:
    """The chunk sizes the scheduler cuts a lone prompt of the model config dict `model` into:
    fixed chunks (smooth None) or dynamic chunking with that smooth."""
    from app.config import EngineConfig
    from app.scheduler import ChunkCost
    from stages.model_config import ModelArgs

    options = EngineConfig(chunk_size=chunk, enable_dynamic_chunking=smooth is not None)
    if smooth is not None:
        options = dataclasses.replace(options, dynamic_chunk_smooth=smooth)
    cfg = options.scheduler_config(
        num_blocks=1,
        max_model_len=prompt_len,
        chunk_cost=ChunkCost.for_model(ModelArgs.from_hf_dict(model)),
    )
    return [n for _, n in cfg.lone_prompt_chunks(prompt_len)]


# --model-shape of the benches: random-weight configs of these shapes ("tiny": the built-in
# model). deepseek-v32-bench is issue 11's V3.2-shaped model that FlashMLA's SM90 sparse kernels
# take: DeepSeek-V2-Lite's layers and experts with 64 query heads (64 or 128 only), V3's q LoRA
# (the indexer reads it), V3.2's indexer (top-2048, 64 heads of 128) and 1M positions (the
# 256K rows). deepseek-v4-flash is DeepSeek-V4-Flash's config (docs/bench/configs) in bf16 with
# its routed experts MXFP4 (dequantized at load unless --mxfp4-experts keep), cut to the leading
# layers one H200 holds in bf16 beside a 256K-token KV cache (their layer-type and hash/routed
# pattern kept; app.bench.memory.layers_on_one_gpu).
MODEL_SHAPES = (
    "llama8b",
    "qwen3-30b-a3b",
    "deepseek-v2-lite",
    "deepseek-v32-bench",
    "deepseek-v4-flash",
    "tiny",
)
V4_FLASH_CONFIG = os.path.join(
    os.path.dirname(__file__), "..", "..", "docs", "bench", "configs", "deepseek_v4_flash.json"
)
V4_FLASH_CONTEXT = 1 << 18


def add_model_args(p: argparse.ArgumentParser, shapes: Sequence[str] = MODEL_SHAPES) -> None:
    """--model-shape and --layers, what write_model takes."""
    p.add_argument(
        "--model-shape",
        choices=shapes,
        default="llama8b",
        help="that shape with random weights (app/bench/target.py); tiny: the built-in model",
    )
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")


def add_output_channel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output-channel",
        choices=OUTPUT_CHANNELS,
        default="auto",
        help="how sampled ids reach stage 0 (--output-channel of ppserve serve)",
    )


def shape_config(shape: str) -> dict[str, Any]:
    from stages.model_config import BUILTIN_CONFIG
    from stages.models.deepseek_config import DEEPSEEK_V2_LITE

    if shape == "deepseek-v4-flash":
        return v4_flash_bench_config()
    if shape == "deepseek-v32-bench":
        return dict(
            DEEPSEEK_V2_LITE,
            model_type="deepseek_v32",
            num_attention_heads=64,
            num_key_value_heads=64,
            q_lora_rank=1536,
            index_topk=2048,
            index_n_heads=64,
            index_head_dim=128,
            topk_method="noaux_tc",
            norm_topk_prob=True,
            max_position_embeddings=1 << 20,
        )
    return {
        "tiny": BUILTIN_CONFIG,
        "deepseek-v2-lite": DEEPSEEK_V2_LITE,
        "llama8b": LLAMA3_8B,
        "qwen3-30b-a3b": QWEN3_30B_A3B,
    }[shape]


def v4_flash_bench_config() -> dict[str, Any]:
    from app.bench.memory import layers_on_one_gpu, leading_layers

    with open(V4_FLASH_CONFIG, encoding="utf-8") as f:
        full = json.load(f)
    full.pop("quantization_config", None)  # bf16 weights
    # the layers that fit with bf16 experts (the shape's count before the experts stayed FP4);
    # the routed experts MXFP4 as the checkpoint ships them (random init quantizes them)
    cut = leading_layers(full, layers_on_one_gpu(full, V4_FLASH_CONTEXT))
    return dict(cut, expert_dtype="fp4")


def stage_args(config: dict[str, Any], mxfp4_experts: str | None = None) -> Any:
    """ModelArgs of a bench shape as the engine holds it: MXFP4 experts (deepseek-v4-flash's)
    packed or widened as --mxfp4-experts says, by default the engine's default. Benches that
    build a stage without an engine start here."""
    from stages.model_config import ModelArgs, mxfp4_experts_as
    from stages.protocol import MXFP4_EXPERTS_DEFAULT

    args = ModelArgs.from_hf_dict(config)
    return mxfp4_experts_as(args, mxfp4_experts or MXFP4_EXPERTS_DEFAULT)


def kv_block_size(model: dict[str, Any]) -> int:
    """The KV block size the engine picks for the config dict `model` (64, or a multiple of
    DeepSeek-V4's largest compression rate)."""
    from app.config import EngineConfig
    from stages.model_config import ModelArgs

    return EngineConfig().for_model(ModelArgs.from_hf_dict(model)).kv_block_size


def write_model(shape: str, layers: int | None) -> tuple[str | None, str, dict[str, Any]]:
    """(model dir or None, load_format, config dict): a MODEL_SHAPES shape with random weights
    (a config.json in a temp dir, load_format dummy); "tiny" = the built-in model."""
    from stages.model_config import BUILTIN_CONFIG

    if shape == "tiny" and layers is None:
        return None, "auto", dict(BUILTIN_CONFIG)
    base = shape_config(shape)
    cfg = dict(base, num_hidden_layers=layers or base["num_hidden_layers"])
    d = tempfile.mkdtemp(prefix=f"ppserve-{shape}-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d, "dummy", cfg


def start_local_ray(pp: int, device: str) -> bool:
    """A private local Ray cluster for a bench's stages, unless this process is already in
    one (the CLI's); whether it started one (then the bench shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(
        address="local",
        num_gpus=pp if device == "cuda" else 0,
        num_cpus=max(8, pp + 2),
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "1"}},
    )
    return True


def commit() -> str:
    """The tree's commit: PPSERVE_COMMIT where set (a GPU host given the tree without .git),
    else git's."""
    if os.environ.get("PPSERVE_COMMIT"):
        return os.environ["PPSERVE_COMMIT"]
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# kernel libraries the registry's auto picks where they import: module -> its distributions
KERNEL_LIBRARIES = {
    "flash_mla": ("sgl-flash-mla", "flash-mla", "flash_mla"),
    "deep_gemm": ("deep-gemm", "deep_gemm"),
}


def kernel_libraries() -> dict[str, str | None]:
    """Each kernel library's version where it is importable ("present" without package
    metadata, as a source build on the path), else None: which kernels a figure ran on. Found
    without importing them (deep_gemm's import loads its extension)."""
    import importlib.metadata
    import importlib.util

    found: dict[str, str | None] = {}
    for module, dists in KERNEL_LIBRARIES.items():
        if importlib.util.find_spec(module) is None:
            found[module] = None
            continue
        found[module] = "present"
        for dist in dists:
            try:
                found[module] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def environment() -> dict[str, Any]:
    """Versions, devices, the commit and the kernel libraries, written into every result
    file."""
    import ray
    import torch

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "ray": ray.__version__,
        "commit": commit(),
        "kernel_libraries": kernel_libraries(),
    }
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env
