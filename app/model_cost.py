"""The model's own count of its work, from its config.json: the FLOPs of prefill chunks and
decode rows, the bytes a decode step reads (the weights once, every row's KV), and the rates of
the chip they are set against. One definition for `ppserve bench`'s distance to the hardware
(app/bench/roofline.py) and the live server's counters (the coordinator feeds app/metrics.py,
the dashboard divides them by the stages' busy time). Standard library only.

FLOPs come from the scheduler's own chunk cost (app.scheduler.chunking.ChunkCost: 2 per weight
per token, 4 * heads * head_dim per query-key pair), fed the active MLP width of MoE layers, plus
the LM head (2 * hidden * vocab) for each row that samples. For MLA (DeepSeek) shapes this is an
estimate: attention is counted as GQA of the config's heads and head_dim, V3.2's indexer as dense
pairs of its own heads, sparse attention at index_topk keys a query, V4's compressed keys at their
compression rate beside its window. Good enough to say how far a step is from the chip, not to
1 %.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.scheduler.chunking import ChunkCost
from stages.model_config import load_config

if TYPE_CHECKING:
    from app.config import EngineConfig
    from stages.protocol import Row

log = logging.getLogger("ppserve.model_cost")

H200_BF16_TFLOPS = 790.0  # dense bf16 GEMMs alone: 752-793 TF/s (docs/bench/CONTENTION.md)
H200_FP8_TFLOPS = 1580.0  # twice bf16, the FP8 tensor cores' ratio (not measured here)
H200_FP8_PEAK_TFLOPS = 1979.0  # the data sheet's dense FP8 (issue 35's "FP8 peak")
H200_HBM_TBS = 4.8  # the data sheet's
# Memory bandwidth by chip, the data sheets' (H100 SXM5 80 GB: HBM3). The H100 is the H200's
# GH100 die, SMs and tensor rates, so the H200's GEMM rates above stand for both.
HBM_TBS = {"H200": H200_HBM_TBS, "H100": 3.35}
# A microbatch holding any prefill chunk is a prefill step (its decode rows share its GEMMs);
# one of decode rows only is a decode step.
PHASES = ("prefill", "decode")
READS = ("weights", "kv")  # what a decode step reads
_V4_KINDS = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}
_ELEMENT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
# Bytes a value of MXFP4 routed experts held packed (--mxfp4-experts keep): an e2m1 pair a byte,
# one e8m0 scale byte per 32 values (stages/kernels/mxfp4.py)
MXFP4_BYTES = 0.5 + 1 / 32


def _experts(cfg: dict[str, Any]) -> tuple[int, int, int]:
    """(routed experts, top-k, shared experts); (0, 0, 0) for a dense model."""
    routed = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    return routed, cfg.get("num_experts_per_tok") or 0, cfg.get("n_shared_experts") or 0


def _mlp_widths(cfg: dict[str, Any], experts_read: float) -> list[float]:
    """Per layer: the MLP width a token computes (experts_read = routed experts counted)."""
    routed, _, shared = _experts(cfg)
    layers = cfg["num_hidden_layers"]
    if not routed:
        return [float(cfg["intermediate_size"])] * layers
    dense = cfg.get("first_k_dense_replace") or 0
    moe = float(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    return [
        float(cfg.get("intermediate_size", 0)) if i < dense else moe * (experts_read + shared)
        for i in range(layers)
    ]


def _head_dim(cfg: dict[str, Any]) -> int:
    if cfg.get("qk_nope_head_dim"):
        return int(cfg["qk_nope_head_dim"]) + int(cfg.get("qk_rope_head_dim") or 0)
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _layer_cost(cfg: dict[str, Any], width: float) -> ChunkCost:
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return ChunkCost.from_shape(
        cfg["hidden_size"], int(width), cfg["num_attention_heads"], kv_heads, _head_dim(cfg)
    )


def _v4_rate(cfg: dict[str, Any], layer: int) -> tuple[str, float]:
    """(attention kind, tokens per compressed key; 0 for a sliding-only layer) of a V4 layer,
    read as stages/models/deepseek_v4/config.py reads them."""
    if cfg.get("layer_types") is None:  # DeepSeek's own configs give the ratios
        ratio = int(cfg["compress_ratios"][layer])
        return _V4_KINDS[ratio], float(ratio)
    kind = str(cfg["layer_types"][layer])
    rates = cfg.get("compress_rates") or {k: r for r, k in _V4_KINDS.items() if r}
    return kind, float(rates.get(kind) or 0)


def _pairs(cfg: dict[str, Any], layer: int, prefix: int, n: int) -> tuple[float, float]:
    """(query-key pairs attended, pairs the indexer scores) of one chunk in one layer."""
    causal = prefix * n + n * (n + 1) / 2
    topk = int(cfg.get("index_topk") or 0)
    if cfg.get("model_type") == "deepseek_v4":
        # every query: its sliding window, plus compressed keys (CSA: top-k of them, chosen by
        # the indexer over all; HCA: all of them)
        kind, rate = _v4_rate(cfg, layer)
        window = n * (cfg.get("sliding_window") or 0)
        compressed = causal / rate if rate else 0.0
        if kind == "compressed_sparse_attention":
            return window + min(compressed, n * topk), compressed
        return window + compressed, 0.0
    if topk:  # V3.2: top-k keys a query, the indexer over every pair
        return min(causal, n * topk), causal
    return causal, 0.0


def kv_bytes_per_token(cfg: dict[str, Any], kv_bytes: float) -> float:
    """KV bytes one token holds over all layers (kv_bytes per element: 2 bf16, 1 FP8)."""
    if cfg.get("kv_lora_rank"):  # MLA: the latent and its rope part
        per_layer = cfg["kv_lora_rank"] + (cfg.get("qk_rope_head_dim") or 0)
    elif cfg.get("model_type") == "deepseek_v4":  # one head_dim vector (before compression)
        per_layer = cfg["head_dim"]
    else:
        per_layer = 2 * (cfg.get("num_key_value_heads") or 1) * _head_dim(cfg)
    return float(per_layer) * float(cfg["num_hidden_layers"]) * kv_bytes


def _experts_touched(cfg: dict[str, Any], rows: int) -> float:
    """Routed experts any of `rows` tokens picks, expected under uniform routing."""
    routed, top_k, _ = _experts(cfg)
    return routed * (1 - (1 - top_k / routed) ** rows) if routed else 0.0


def weight_params(cfg: dict[str, Any], rows: int) -> float:
    """Weights one decode step of `rows` tokens reads: the linear layers' (norms are noise), of
    the routed experts any row picked, the embedding and the LM head."""
    # ChunkCost counts 2 FLOPs per weight
    widths = _mlp_widths(cfg, _experts_touched(cfg, rows))
    params = sum(_layer_cost(cfg, w).token_cost / 2 for w in widths)
    return float(params + 2.0 * cfg["hidden_size"] * cfg["vocab_size"])


def routed_expert_params(cfg: dict[str, Any], rows: int) -> float:
    """Of weight_params, the routed experts' (gate, up and down of each expert touched, in
    every MoE layer)."""
    if not _experts(cfg)[0]:
        return 0.0
    moe_layers = cfg["num_hidden_layers"] - (cfg.get("first_k_dense_replace") or 0)
    width = float(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    return float(3.0 * cfg["hidden_size"] * width * _experts_touched(cfg, rows) * moe_layers)


def weight_read_bytes(
    cfg: dict[str, Any], rows: int, weight_bytes: float, expert_bytes: float | None = None
) -> float:
    """Bytes of the weights one decode step of `rows` tokens reads; the routed experts at
    `expert_bytes` a value where they are held otherwise (MXFP4_BYTES packed), else at
    `weight_bytes`."""
    total = weight_params(cfg, rows) * weight_bytes
    if expert_bytes is not None:
        total += routed_expert_params(cfg, rows) * (expert_bytes - weight_bytes)
    return total


def expert_bytes_held(cfg: dict[str, Any], mxfp4_experts: str) -> float | None:
    """MXFP4_BYTES where the model's routed experts are MXFP4 and stay packed (--mxfp4-experts
    keep), else None: they are held as the other weights."""
    return MXFP4_BYTES if cfg.get("expert_dtype") == "fp4" and mxfp4_experts == "keep" else None


def decode_bytes(
    cfg: dict[str, Any],
    rows: int,
    context: int,
    weight_bytes: float,
    kv_bytes: float,
    expert_bytes: float | None = None,
) -> dict[str, float]:
    """Bytes one decode step of `rows` rows at `context` tokens each reads: the weights it
    touches and the KV."""
    kv = kv_bytes_per_token(cfg, kv_bytes) * rows * context
    return {"weights": weight_read_bytes(cfg, rows, weight_bytes, expert_bytes), "kv": kv}


@dataclass(frozen=True)
class PeakRates:
    """One GPU's peak rates, which the dashboard sets the achieved ones against: matmul FLOP/s
    by dtype ("bf16", "fp8") and memory bytes/s."""

    flops: dict[str, float]
    memory_bytes_per_s: float

    @classmethod
    def of(cls, bf16_tflops: float, fp8_tflops: float, memory_tbs: float) -> PeakRates:
        return cls({"bf16": bf16_tflops * 1e12, "fp8": fp8_tflops * 1e12}, memory_tbs * 1e12)


@dataclass(frozen=True)
class StepWork:
    """The model work of one microbatch: its phase (PHASES), the FLOPs of its rows and, for a
    decode step, the bytes it reads (0 for a prefill step)."""

    phase: str
    flops: float
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0


class ModelCost:
    """FLOPs and bytes of a model's rows. The layers' costs are summed once, per kind of
    attention, so a microbatch costs a few multiplications a row."""

    def __init__(
        self,
        cfg: dict[str, Any],
        weight_bytes: float = 2.0,
        kv_bytes: float = 2.0,
        expert_bytes: float | None = None,
    ):
        self.cfg, self.weight_bytes, self.expert_bytes = cfg, weight_bytes, expert_bytes
        _, top_k, _ = _experts(cfg)
        index_pair = 2.0 * (cfg.get("index_n_heads") or 0) * (cfg.get("index_head_dim") or 0)
        groups: dict[str, list[float]] = {}  # kind -> [a layer of it, token, pair, index cost]
        for layer, width in enumerate(_mlp_widths(cfg, float(top_k))):
            cost = _layer_cost(cfg, width)
            kind = _v4_rate(cfg, layer)[0] if cfg.get("model_type") == "deepseek_v4" else ""
            g = groups.setdefault(kind, [float(layer), 0.0, 0.0, 0.0])
            g[1] += cost.token_cost
            g[2] += cost.pair_cost
            g[3] += index_pair
        self._groups = [(int(g[0]), g[1], g[2], g[3]) for g in groups.values()]
        self.head_flops = float(2.0 * cfg["hidden_size"] * cfg["vocab_size"])  # one sampled token
        self.kv_per_token = kv_bytes_per_token(cfg, kv_bytes)
        self._weights: dict[int, float] = {}  # decode step's weight bytes by its tokens

    @classmethod
    def for_engine(cls, config: EngineConfig, fp8_checkpoint: bool) -> ModelCost | None:
        """The served model's, at the element sizes its stages hold: FP8 weights on CUDA when
        --quantization or the checkpoint says so (stages/loader.py: keep_fp8_weights), an FP8
        KV cache with --kv-cache-dtype fp8 (1 byte an element), else --dtype's; MXFP4 routed
        experts kept packed at MXFP4_BYTES a value. None, with a
        warning, for a config.json the estimate cannot read: the server runs without the
        work counters rather than not at all."""
        size = _ELEMENT_BYTES.get(config.resolved_dtype, 2.0)
        fp8_w = config.quantization == "fp8" or (config.quantization == "auto" and fp8_checkpoint)
        weights = 1.0 if fp8_w and config.device == "cuda" else size
        kv = 1.0 if config.kv_cache_dtype == "fp8" else size
        try:
            cfg = load_config(config.model)
            return cls(cfg, weights, kv, expert_bytes_held(cfg, config.mxfp4_experts))
        except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:
            log.warning("no FLOP / byte counts for this model (config.json: %r)", e)
            return None

    def chunk_flops(self, prefix: int, tokens: int) -> float:
        """FLOPs of `tokens` tokens after `prefix` cached ones, through every layer (no head)."""
        total = 0.0
        for layer, token_cost, pair_cost, index_cost in self._groups:
            attended, indexed = _pairs(self.cfg, layer, prefix, tokens)
            total += token_cost * tokens + pair_cost * attended + index_cost * indexed
        return total

    def step_weight_bytes(self, tokens: int) -> float:
        """The weights a decode step of `tokens` rows reads, in bytes."""
        if tokens not in self._weights:
            self._weights[tokens] = weight_read_bytes(
                self.cfg, tokens, self.weight_bytes, self.expert_bytes
            )
        return self._weights[tokens]

    def step(self, rows: Sequence[Row]) -> StepWork:
        """The work of one microbatch of `rows` (a decode row reads its start + 1 keys)."""
        flops = sum(
            self.chunk_flops(r.start, r.num_tokens) + self.head_flops * r.sample for r in rows
        )
        if any(r.is_prefill for r in rows):
            return StepWork("prefill", flops)
        tokens = sum(r.num_tokens for r in rows)
        keys = sum(r.start + r.num_tokens for r in rows)
        return StepWork("decode", flops, self.step_weight_bytes(tokens), self.kv_per_token * keys)


def prefill_flops(cfg: dict[str, Any], chunks: list[int]) -> float:
    """FLOPs of a lone prompt cut into `chunks` (the last token's logits included)."""
    cost, prefix, total = ModelCost(cfg), 0, 0.0
    for n in chunks:
        total += cost.chunk_flops(prefix, n)
        prefix += n
    return total + cost.head_flops
