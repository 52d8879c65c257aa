"""The model families: one table from a checkpoint's `model_type` to what the engine needs to know
about its family. Standard library only, so the control plane reads it without torch.

A family declares:
- `fields`: the ModelArgs fields it reads from config.json beyond the common ones (its own
  arguments go to `family_args`), and the rope types it supports;
- `stage_class`: the module of one pipeline stage ("module:Class", imported when first built);
- its KV layout: `kv_components` (named cache components -> values per token per layer; bytes
  are their sum times the element size), `cache_class` that holds them and `kv_description`
  for the logs; `fp8_kv`, where the cache can be FP8 (`--kv-cache-dtype fp8`): the bytes per
  entry of the components it packs (raising, with the reason, for a model it cannot serve),
  and `fp8_block_bytes`, what a block of them takes (a layout may pad its blocks);
  A family whose layers differ (DeepSeek-V4) declares `layer_kv_components` instead: per
  layer, component -> (values per entry, tokens per entry); its cache class then takes the
  stage's layer range, and its block size must be a multiple of `block_multiple`;
- `attention_prefixes`: whether its attention reads the ForwardBatch's per-row prefix slots
  and padded decode groups (DeepSeek-V4 plans its own keys, V4Plan): built only if so;
- `hidden_shape`: the per-token shape of the hidden state one stage sends the next;
- `token_id_layers`: the layers that read their rows' token ids (hash-routed MoE): a stage
  holding one gets them from stage 0 over the hidden channel;
- its attention: `attention_backends`, the backend classes of its cache kinds
  (stages/attention/base.py: GQA's paged K/V, MLA's dense or sparse latent, V4's window and
  compressed entries), and `attention_of`, the one a model takes;
- capabilities the runner asks about: `paged_decode_graphs`, whether its decode-only
  microbatches capture as CUDA graphs under the chosen kernels (every op of the decode step
  sync-free and static-shaped on them), block size and cache dtype: its `graph_ops` beside
  attention, and each attention backend's `can_capture`; and `chunk_attention_dims`,
  the heads and widths of its prefill chunks' dense attention, which the startup warm-up builds
  cuDNN's per-shape graphs for (None: no such attention);
- `op_shapes`: the shapes of the kernel ops its layers call (op -> OpShape), which the registry
  holds against each backend's `supports` when a stage is built (stages/kernels/fallbacks.py).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from stages.kernels.fallbacks import OpShape
from stages.models.deepseek_config import (
    DEEPSEEK_MODEL_TYPES,
    deepseek_fields,
    deepseek_op_shapes,
    fp8_latent_components,
    latent_components,
)
from stages.models.deepseek_v4.config import (
    CSA,
    v4_fields,
    v4_fp8_block_bytes,
    v4_fp8_components,
    v4_hidden_shape,
    v4_layer_components,
)
from stages.protocol import KV_CACHE_DTYPES

if TYPE_CHECKING:
    from stages.model_config import ModelArgs

PLAIN_ROPE_TYPES = ("default", "llama3")
GQA_PAGED = "stages.attention.paged_kv:PagedKVBackend"
# FlashMLA's page size (stages/kernels/flash_mla.py): other block sizes decode on the torch
# reference, which syncs with the host
FLASH_MLA_PAGE = 64


@dataclass(frozen=True)
class GraphSetting:
    """What decides whether a stage's decode step can be captured: the kernels chosen (op ->
    backend), the cache's block size and dtype, the model's dtype."""

    kernels: dict[str, str]
    block_size: int
    kv_cache_dtype: str
    dtype: str


def _never(_s: GraphSetting) -> bool:
    return False


def _always(_s: GraphSetting) -> bool:
    return True


def _fast(s: GraphSetting, ops: list[str]) -> bool:
    """None of `ops` on its torch reference: those size tensors from device values or loop on
    the host (fp8_ref's, fp8_latent's), not captured."""
    return all(s.kernels.get(op, "torch") != "torch" for op in ops)


def _deepseek_graphs(s: GraphSetting) -> bool:
    """Beside MLA's backends (FlashMLA, stages/models/mla_backend.py): the Triton MoE; FP8
    weights on the W8A8 GEMMs (cuBLASLt's or the Triton ones, fed by the fused activation
    quantizer) and the grouped Triton FP8 MoE, each a fixed launch with no host sync."""
    ops = ["moe_experts"]
    if "fp8_linear" in s.kernels:  # set only where FP8 weights stay FP8
        ops += ["fp8_linear", "fp8_swiglu_linear", "moe_experts_fp8"]
    return _fast(s, ops)


def _deepseek_v4_graphs(s: GraphSetting) -> bool:
    """Beside V4's attention backend: the Triton MoE (MXFP4 experts: the grouped W4A16 one)
    and hyper-connections; FP8 weights on the W8A8 GEMMs and the grouped FP8 MoE."""
    ops = ["moe_experts", "moe_experts_mxfp4", "hc_mix", "hc_merge"]
    if "fp8_linear" in s.kernels:
        ops += ["fp8_linear", "fp8_swiglu_linear", "moe_experts_fp8"]
    return _fast(s, ops)


def _token_hidden(args: ModelArgs) -> tuple[int, ...]:
    return (args.hidden_size,)


@dataclass(frozen=True)
class ChunkAttentionDims:
    """The widths of a family's dense prefill-chunk attention as its kernels see them: V is
    the last v_dim values of rows v_row wide (MLA splits it off its K/V projection), and
    cuDNN builds a graph per shape and stride."""

    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    v_row: int


def _no_dims(_args: ModelArgs) -> ChunkAttentionDims | None:
    return None


def _gqa_dims(args: ModelArgs) -> ChunkAttentionDims | None:
    a = args
    return ChunkAttentionDims(
        a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.head_dim, a.head_dim
    )


def _mla_dims(args: ModelArgs) -> ChunkAttentionDims | None:
    """Dense MLA's prefill expands the latent to every head of the rank (V3.2's sparse layers
    do not)."""
    d = args.family_args
    if d.indexer is not None:
        return None
    h = args.num_attention_heads
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim
    return ChunkAttentionDims(h, h, qk, d.v_head_dim, d.qk_nope_head_dim + d.v_head_dim)


def _split_kv_heads(args: ModelArgs, tp_size: int) -> ModelArgs:
    """A GQA rank caches its share of the K/V heads (attention checks they divide)."""
    if tp_size == 1:
        return args
    return dataclasses.replace(
        args,
        num_attention_heads=args.num_attention_heads // tp_size,
        num_key_value_heads=args.num_key_value_heads // tp_size,
    )


def _whole_cache(args: ModelArgs, _tp_size: int) -> ModelArgs:
    """Every rank caches the whole entry (MLA's latent, V4's compressed entries)."""
    return args


def _split_query_heads(args: ModelArgs, tp_size: int) -> ModelArgs:
    """An MLA rank's share of the query heads (num_key_value_heads is every query head's
    expanded K/V: the same share), what its kernels' shapes are declared with (op_shapes,
    chunk_attention_dims); its cache stays whole (the latent's widths do not depend on the
    heads: every rank caches every token's whole latent, stages/models/mla.py)."""
    return _split_kv_heads(args, tp_size)


def _key_value(args: ModelArgs) -> dict[str, int]:
    width = args.num_key_value_heads * args.head_dim
    return {"key": width, "value": width}


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    fields: Callable[[dict[str, Any]], dict[str, Any]]
    rope_types: tuple[str, ...]
    stage_class: str
    cache_class: str = "stages.kv_cache:PagedKVCache"
    kv_components: Callable[[ModelArgs], dict[str, int]] = _key_value
    kv_description: str = "K and V"
    fp8_kv: Callable[[ModelArgs], dict[str, int]] | None = None
    # (component, bytes per entry, entries per block) -> bytes a block of it takes
    fp8_block_bytes: Callable[[str, int, int], int] = lambda _name, entry, entries: entry * entries
    hidden_shape: Callable[[ModelArgs], tuple[int, ...]] = _token_hidden
    # whether the decode step's ops beside attention capture (paged_decode_graphs)
    graph_ops: Callable[[GraphSetting], bool] = _never
    chunk_attention_dims: Callable[[ModelArgs], ChunkAttentionDims | None] = _no_dims
    layer_kv_components: Callable[[ModelArgs, int], dict[str, tuple[int, int]]] | None = None
    block_multiple: Callable[[ModelArgs], int] = lambda _args: 1
    token_id_layers: Callable[[ModelArgs], tuple[int, ...]] = lambda _args: ()
    attention_prefixes: bool = True
    op_shapes: Callable[[ModelArgs], dict[str, OpShape]] = lambda _args: {}
    # The model as one rank of a tensor-parallel stage computes and caches it (its share of
    # the heads): what the rank's cache, kernel targets and decode graphs are sized from
    rank_args: Callable[[ModelArgs, int], ModelArgs] = _split_kv_heads
    # The attention backends ("module:Class", stages/attention/base.py) a stage of the family
    # may build, one per cache kind; `attention_of` picks the model's (an index into them)
    attention_backends: tuple[str, ...] = (GQA_PAGED,)
    attention_of: Callable[[ModelArgs], int] = lambda _args: 0
    # The model with a checkpoint's MXFP4 routed experts widened (--mxfp4-experts dequantize)
    # rather than kept packed; a family without such experts returns its args
    widen_mxfp4_experts: Callable[[ModelArgs], ModelArgs] = lambda args: args
    # (k, widest line) of the sparse-attention indexer's top-k over a prompt of n tokens in a
    # stage of these layers, or None where they select nothing (what the startup warm-up
    # compiles the top-k for)
    top_k_lines: Callable[[ModelArgs, int, range], tuple[int, int] | None] = (
        lambda _args, _n, _layers: None
    )

    def paged_decode_graphs(self, setting: GraphSetting) -> bool:
        """Whether a stage's decode-only microbatches capture as CUDA graphs under `setting`:
        its ops beside attention (graph_ops) and every attention backend it may choose (each
        one's can_capture: the setting does not say which the model takes)."""
        return self.graph_ops(setting) and all(
            _resolve_any(name).can_capture(setting) for name in self.attention_backends
        )

    def attention_backend(self, args: ModelArgs) -> Any:
        """The class of the model's attention backend (imported when first asked)."""
        return _resolve_any(self.attention_backends[self.attention_of(args)])

    def components_of_layer(self, args: ModelArgs, layer: int) -> dict[str, tuple[int, int]]:
        """Cache component -> (values per entry, tokens per entry) of one layer."""
        if self.layer_kv_components is not None:
            return self.layer_kv_components(args, layer)
        return {name: (width, 1) for name, width in self.kv_components(args).items()}

    def stage(self) -> type:
        return _resolve(self.stage_class)

    def cache(self) -> type:
        return _resolve(self.cache_class)


def _resolve_any(name: str) -> Any:
    module, attr = name.split(":")
    return getattr(importlib.import_module(module), attr)


def _resolve(name: str) -> type:
    module, attr = name.split(":")
    cls: type = getattr(importlib.import_module(module), attr)
    return cls


def _gqa_attention_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Llama-style attention: Qwen2 biases q/k/v (never o_proj) by default; Qwen3 and
    Qwen3-MoE normalise q and k per head."""
    qwen2 = d["model_type"] == "qwen2"
    bias = bool(d.get("attention_bias", qwen2))
    return {
        "attention_bias": bias,
        "o_proj_bias": bias and not qwen2,
        "qk_norm": d["model_type"] in ("qwen3", "qwen3_moe"),
    }


@dataclass(frozen=True)
class Qwen3MoeArgs:
    """Routed experts of a Qwen3-MoE layer (transformers' Qwen3MoeSparseMoeBlock)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def is_moe_layer(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )


def _qwen3_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes num_local_experts (its attribute map); Hub checkpoints num_experts
    experts = int(d.get("num_experts", d.get("num_local_experts", 128)))
    step = int(d.get("decoder_sparse_step", 1))
    top_k = int(d.get("num_experts_per_tok", 8))
    if step < 1 or not 0 < top_k <= max(experts, 1):
        raise ValueError(
            f"bad Qwen3-MoE routing: decoder_sparse_step={step}, "
            f"num_experts_per_tok={top_k} of {experts} experts"
        )
    moe = Qwen3MoeArgs(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(d.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
    )
    return {**_gqa_attention_fields(d), "family_args": moe}


LLAMA = Family(
    "llama",
    ("llama", "mistral", "qwen2", "qwen3"),
    _gqa_attention_fields,
    PLAIN_ROPE_TYPES,
    "stages.models.llama:LlamaStage",
    graph_ops=_always,
    chunk_attention_dims=_gqa_dims,
)
QWEN3_MOE = Family(
    "qwen3_moe",
    ("qwen3_moe",),
    _qwen3_moe_fields,
    PLAIN_ROPE_TYPES,
    "stages.models.qwen3_moe:Qwen3MoeStage",
    # no graph_ops: the torch reference of the MoE experts syncs with the host
    chunk_attention_dims=_gqa_dims,
)
DEEPSEEK = Family(
    "deepseek",
    DEEPSEEK_MODEL_TYPES,
    deepseek_fields,
    ("default", "yarn"),
    "stages.models.deepseek:DeepseekStage",
    cache_class="stages.models.mla_cache:LatentKVCache",
    kv_components=latent_components,
    kv_description="MLA latent",
    fp8_kv=fp8_latent_components,
    graph_ops=_deepseek_graphs,
    chunk_attention_dims=_mla_dims,
    op_shapes=deepseek_op_shapes,
    rank_args=_split_query_heads,
    attention_backends=(
        "stages.models.mla_backend:MLADenseBackend",
        "stages.models.mla_backend:MLASparseBackend",
    ),
    attention_of=lambda args: int(args.family_args.indexer is not None),
    top_k_lines=lambda args, n, _layers: (  # every layer of a DSA model selects
        None if args.family_args.indexer is None else (args.family_args.indexer.topk, n)
    ),
)


def _v4_op_shapes(args: ModelArgs) -> dict[str, OpShape]:
    a = args.family_args
    attention = OpShape(a.num_heads, a.head_dim, a.head_dim)
    return {
        "sparse_sink_attention": attention,
        "sparse_sink_attention_fp8": attention,
        "indexer_logits_rows": OpShape(a.index_n_heads, a.index_head_dim),
    }


def _v4_rank_args(args: ModelArgs, tp_size: int) -> ModelArgs:
    """A V4 rank caches whole entries (its cache reads no head count: every rank's heads read
    the shared K=V latents and compressed entries) and runs its share of the query heads, whole
    output groups (V4Attention): those are what its kernels are sized for (op_shapes)."""
    if tp_size == 1:
        return args
    a = args.family_args
    groups = a.o_groups // tp_size
    heads = a.num_heads // a.o_groups * groups
    rank = dataclasses.replace(a, num_heads=heads, o_groups=groups)
    return dataclasses.replace(args, family_args=rank, num_attention_heads=heads)


def _v4_top_k_lines(args: ModelArgs, n: int, layers: range) -> tuple[int, int] | None:
    """The stage's CSA layers pick among their compressed entries: n / rate of them at most."""
    a = args.family_args
    if not any(a.layer_types[i] == CSA for i in layers):
        return None
    return a.index_topk, n // a.compress_rates[CSA]


def _v4_widen_mxfp4(args: ModelArgs) -> ModelArgs:
    """V4 with its fp4 experts as the other weights (the loader then dequantizes them)."""
    if args.family_args.expert_dtype != "fp4":
        return args
    wide = dataclasses.replace(args.family_args, expert_dtype=None)
    return dataclasses.replace(args, family_args=wide)


DEEPSEEK_V4 = Family(
    "deepseek_v4",
    ("deepseek_v4",),
    v4_fields,
    ("default", "yarn"),
    "stages.models.deepseek_v4.stage:DeepseekV4Stage",
    cache_class="stages.models.deepseek_v4.cache:V4Cache",
    kv_description="V4 window latents, compressed entries, compressor inputs",
    fp8_kv=v4_fp8_components,
    fp8_block_bytes=v4_fp8_block_bytes,
    hidden_shape=v4_hidden_shape,
    layer_kv_components=v4_layer_components,
    block_multiple=lambda args: args.family_args.max_rate,
    token_id_layers=lambda args: args.family_args.hash_layers,
    attention_prefixes=False,
    graph_ops=_deepseek_v4_graphs,
    op_shapes=_v4_op_shapes,
    rank_args=_v4_rank_args,
    attention_backends=("stages.models.deepseek_v4.backend:V4Backend",),
    widen_mxfp4_experts=_v4_widen_mxfp4,
    top_k_lines=_v4_top_k_lines,
)
FAMILIES = (LLAMA, QWEN3_MOE, DEEPSEEK, DEEPSEEK_V4)
BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
SUPPORTED_MODEL_TYPES = tuple(BY_MODEL_TYPE)


def family_of(model_type: str | None) -> Family:
    if model_type not in BY_MODEL_TYPE:
        raise ValueError(
            f"unsupported model_type {model_type!r}; ppserve supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return BY_MODEL_TYPE[model_type]


def fp8_components(args: ModelArgs, kv_cache_dtype: str) -> dict[str, int]:
    """Components the cache stores packed in FP8 -> their bytes per token per layer; {} for
    an unquantized cache ("auto" / "bfloat16": the model's dtype). Refuses, with the reason, a
    model whose family has no FP8 cache."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype != "fp8":
        return {}
    if args.family.fp8_kv is None:
        raise ValueError(
            f"--kv-cache-dtype fp8 is not supported for the {args.family.name} "
            "family (only DeepSeek-V3.2's FP8 latent and DeepSeek-V4's FP8 KV)"
        )
    return args.family.fp8_kv(args)
