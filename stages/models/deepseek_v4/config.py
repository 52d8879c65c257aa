"""DeepSeek-V4 architecture arguments from a Hugging Face config.json (standard library only).

Semantics are transformers' DeepseekV4Config (>= 5.24), including its legacy keys
(`compress_ratios`, `compress_rate_csa` / `_hca`, `num_hash_layers`, `qk_rope_head_dim`). Every
field that changes the math is read; a value transformers' model would ignore or that ppserve does
not implement is refused here, at load, with the field's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.kernels import fp8_indexer_layout, fp8_v4_layout

if TYPE_CHECKING:
    from stages.model_config import ModelArgs

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"  # compressed at a small rate, top-k by the lightning indexer
HCA = "heavily_compressed_attention"  # compressed at a large rate, every entry attended
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
DEFAULT_RATES = {CSA: 4, HCA: 128}
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")  # transformers' ACT2FN has no "softmax"
ROPE_TYPES = ("default", "yarn")
EXPERT_DTYPES = (None, "fp8", "fp4", "bf16", "bfloat16")


@dataclass(frozen=True)
class RopeArgs:
    """One of V4's two rotaries: "main" (sliding layers) or "compress" (CSA / HCA layers, their
    compressors and the indexer). yarn is None for plain RoPE."""

    theta: float
    yarn: dict[str, Any] | None

    @classmethod
    def from_dict(cls, label: str, d: dict[str, Any], max_positions: int) -> "RopeArgs":
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported deepseek_v4 rope_parameters[{label!r}] rope_type "
                f"{rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        if rope_type == "default":
            return cls(float(d["rope_theta"]), None)
        yarn = {
            k: v
            for k, v in d.items()
            if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")
        }
        if "original_max_position_embeddings" not in yarn:
            raise ValueError(
                f"yarn rope_parameters[{label!r}] needs original_max_position_embeddings"
            )
        if yarn.get("factor") is None:
            yarn["factor"] = max_positions / yarn["original_max_position_embeddings"]
        # transformers reads `truncate` from the top-level dict, which V4 nests: always True
        yarn["truncate"] = True
        return cls(float(d["rope_theta"]), yarn)


@dataclass(frozen=True)
class V4Args:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_heads: int
    head_dim: int  # the single K=V head's width, also every query head's
    rope_dim: int  # trailing rotary channels of each head (qk_rope_head_dim)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]  # layer type -> tokens per compressed entry
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    mlp_bias: bool  # the shared expert's projections
    rms_norm_eps: float
    main_rope: RopeArgs
    compress_rope: RopeArgs
    max_position_embeddings: int
    tie_word_embeddings: bool
    # the routed experts' storage (expert_dtype): fp4 = MXFP4, kept packed; None = as the
    # other weights (stages.model_config.mxfp4_experts_as widens fp4 for --mxfp4-experts
    # dequantize)
    expert_dtype: str | None = None
    # the shared expert in the routed experts' stack (moe.shared_expert_in_stack): None = on a
    # CUDA stage where it can; False = a SwiGLU beside them (SGLang's
    # --disable-shared-experts-fusion; benches compare the two)
    shared_expert_in_stack: bool | None = None

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of `layer`, 0 for a sliding-only layer."""
        t = self.layer_types[layer]
        return 0 if t == SLIDING else int(self.compress_rates[t])

    def is_hash(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == HASH_MOE

    @property
    def max_rate(self) -> int:
        return max([self.rate(i) for i in range(self.num_hidden_layers)] + [1])

    @property
    def hash_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_hash(i))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "V4Args":
        n = int(d["num_hidden_layers"])
        head_dim = int(d.get("head_dim", 512))
        _refuse(d, "num_key_value_heads", 1, "V4 has one shared K=V head")
        _refuse(d, "n_shared_experts", 1, "transformers builds exactly one shared expert")
        _refuse(d, "norm_topk_prob", True, "transformers always renormalises the top-k weights")
        _refuse(d, "hidden_act", "silu", "only silu experts are implemented")
        _refuse(d, "attention_bias", False, "transformers' V4 attention has no biases")
        rates = dict(d.get("compress_rates") or DEFAULT_RATES)
        for key, t in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if d.get(key) is not None:
                rates[t] = int(d[key])
        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            layer_types = [_RATIO_TO_TYPE[r] for r in d["compress_ratios"]]
        if layer_types is None:
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        layer_types = tuple(layer_types[:n])
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            hashed = d.get("num_hash_layers")
            hashed = 3 if hashed is None else int(hashed)
            mlp_types = [HASH_MOE] * min(n, hashed) + [MOE] * max(0, n - hashed)
        mlp_types = tuple(mlp_types[:n])
        for name, types, allowed in (
            ("layer_types", layer_types, LAYER_TYPES),
            ("mlp_layer_types", mlp_types, (HASH_MOE, MOE)),
        ):
            if len(types) != n or any(t not in allowed for t in types):
                raise ValueError(f"deepseek_v4 {name} must list {n} of {allowed}, got {types}")
        for t in set(layer_types) - {SLIDING}:
            if int(rates.get(t, 0)) < 1:
                raise ValueError(f"deepseek_v4 compress_rates[{t!r}] must be >= 1, got {rates}")
        factor = d.get("partial_rotary_factor")
        if factor is None:
            factor = (
                d["qk_rope_head_dim"] / head_dim
                if d.get("qk_rope_head_dim") is not None
                else 64 / 512
            )
        rope_dim = int(head_dim * float(factor))
        if rope_dim % 2 or not 0 < rope_dim <= min(head_dim, int(d.get("index_head_dim", 128))):
            raise ValueError(
                f"deepseek_v4 rope dims {rope_dim} must be even and fit head_dim and index_head_dim"
            )
        max_pos = int(d.get("max_position_embeddings", 1048576))
        main, compress = _rope_dicts(d, float(factor))
        scoring = d.get("scoring_func", "sqrtsoftplus")
        if scoring not in SCORING_FUNCS:
            raise ValueError(
                f"unsupported deepseek_v4 scoring_func {scoring!r}; supported: "
                f"{', '.join(SCORING_FUNCS)}"
            )
        heads, groups = int(d.get("num_attention_heads", 64)), int(d.get("o_groups", 8))
        if heads % groups:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of o_groups={groups}")
        quant = d.get("quantization_config") or {}
        if quant and quant.get("quant_method") != "fp8":
            raise ValueError(
                f"unsupported deepseek_v4 quantization {quant!r} (only block-scaled fp8)"
            )
        out = cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=n,
            num_heads=heads,
            head_dim=head_dim,
            rope_dim=rope_dim,
            q_lora_rank=int(d.get("q_lora_rank", 1024)),
            o_groups=groups,
            o_lora_rank=int(d.get("o_lora_rank", 1024)),
            sliding_window=int(d.get("sliding_window", 128)),
            layer_types=layer_types,
            compress_rates={t: int(r) for t, r in rates.items()},
            index_n_heads=int(d.get("index_n_heads", 64)),
            index_head_dim=int(d.get("index_head_dim", 128)),
            index_topk=int(d.get("index_topk", 512)),
            hc_mult=int(d.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            mlp_layer_types=mlp_types,
            n_routed_experts=int(d.get("n_routed_experts", 256)),
            num_experts_per_tok=int(d.get("num_experts_per_tok", 6)),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 2048)),
            scoring_func=scoring,
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(d.get("swiglu_limit", 10.0)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            main_rope=RopeArgs.from_dict("main", main, max_pos),
            compress_rope=RopeArgs.from_dict("compress", compress, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            expert_dtype=expert_dtype(d),  # refuses an unknown one
        )
        if (
            min(
                out.sliding_window,
                out.hc_mult,
                out.hc_sinkhorn_iters,
                out.index_topk,
                out.num_experts_per_tok,
            )
            < 1
            or out.num_experts_per_tok > out.n_routed_experts
        ):
            raise ValueError(
                f"bad deepseek_v4 shape: sliding_window={out.sliding_window}, "
                f"hc_mult={out.hc_mult}, hc_sinkhorn_iters={out.hc_sinkhorn_iters}, "
                f"index_topk={out.index_topk}, top-{out.num_experts_per_tok} of "
                f"{out.n_routed_experts} experts"
            )
        return out


def expert_dtype(d: dict[str, Any]) -> str | None:
    """The routed experts' storage: `expert_dtype` in quantization_config (V4.1) or at the top
    level (V4; transformers moves it into quantization_config, where one already there wins).
    fp4 is MXFP4, which the stage keeps packed (or the loader dequantizes at load)."""
    quant = d.get("quantization_config") or {}
    value = quant.get("expert_dtype", d.get("expert_dtype"))
    if value not in EXPERT_DTYPES:
        raise ValueError(
            f"unsupported deepseek_v4 expert_dtype {value!r}; supported: "
            f"{', '.join(str(v) for v in EXPERT_DTYPES if v)} (fp4: MXFP4)"
        )
    return value if value is None else str(value)


def _refuse(d: dict[str, Any], key: str, supported: object, why: str) -> None:
    if key in d and d[key] is not None and d[key] != supported:
        raise ValueError(f"unsupported deepseek_v4 {key}={d[key]!r}: only {supported!r} ({why})")


def _rope_dicts(d: dict[str, Any], factor: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """transformers' nesting of `rope_parameters` into its "main" and "compress" rotaries."""
    rp = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return dict(rp["main"]), dict(rp["compress"])
    yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": float(d.get("rope_theta", 10000.0))}
    compress = {
        **yarn,
        "rope_theta": float(d.get("compress_rope_theta", 160000.0)),
        "partial_rotary_factor": factor,
    }
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


# The cache components of a layer: every token's K=V latent; compressed layers add every token's
# compressor inputs and one entry per group of `rate` tokens (CSA: also the indexer's).
KV, COMP_IN, COMP, INDEX_IN, INDEX_KEYS = "kv", "comp_in", "comp", "index_in", "index_keys"


def layer_components(a: V4Args, layer: int) -> dict[str, tuple[int, int]]:
    """Component name -> (values per entry, tokens per entry) of one layer."""
    out = {KV: (a.head_dim, 1)}
    kind, rate = a.layer_types[layer], a.rate(layer)
    if kind == SLIDING:
        return out
    series = 2 if kind == CSA else 1  # CSA's two overlapping series (Ca, Cb) per token
    out[COMP_IN] = (2 * series * a.head_dim, 1)  # kv and gate projections
    out[COMP] = (a.head_dim, rate)
    if kind == CSA:
        out[INDEX_IN] = (2 * series * a.index_head_dim, 1)
        out[INDEX_KEYS] = (a.index_head_dim, rate)
    return out


def v4_fp8_components(args: ModelArgs) -> dict[str, int]:
    """Bytes per entry of the components an FP8 cache stores: the window latents and the
    compressed entries, what attention reads, in FlashMLA's 584-byte V4 layout
    (stages/kernels/fp8_v4_layout.py); the indexer's keys as e4m3 values and a float32 scale in
    their block layout (stages/kernels/fp8_indexer.py), scored on FP8 tensor cores. The
    compressor inputs stay in the model's dtype."""
    a: V4Args = args.family_args
    nope = a.head_dim - a.rope_dim
    if (nope, a.rope_dim) != (fp8_v4_layout.NOPE, fp8_v4_layout.ROPE):
        raise ValueError(
            f"--kv-cache-dtype fp8: the V4 FP8 layout holds {fp8_v4_layout.NOPE} no-rope + "
            f"{fp8_v4_layout.ROPE} rope values (head_dim 512), not {nope} + {a.rope_dim}"
        )
    return {
        KV: fp8_v4_layout.ENTRY_BYTES,
        COMP: fp8_v4_layout.ENTRY_BYTES,
        INDEX_KEYS: fp8_indexer_layout.key_bytes(a.index_head_dim),
    }


def v4_fp8_block_bytes(name: str, entry_bytes: int, entries: int) -> int:
    """Bytes a block of an FP8 component takes: FlashMLA's V4 layout pads its blocks; the
    indexer keys' block is its entries' bytes."""
    if name == INDEX_KEYS:
        return entry_bytes * entries
    return fp8_v4_layout.packed_bytes(entry_bytes, entries)


def v4_layer_components(args: ModelArgs, layer: int) -> dict[str, tuple[int, int]]:
    return layer_components(args.family_args, layer)


def v4_hidden_shape(args: ModelArgs) -> tuple[int, ...]:
    """Between stages: the hc_mult residual streams of every token."""
    return (args.family_args.hc_mult, args.hidden_size)


def v4_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The ModelArgs fields a DeepSeek-V4 config sets (its own in family_args)."""
    a = V4Args.from_hf_dict(d)
    return {
        "family_args": a,
        "intermediate_size": a.moe_intermediate_size,
        "num_key_value_heads": 1,
        "head_dim": a.head_dim,
        "attention_bias": False,
        "o_proj_bias": False,
        "qk_norm": False,
        "mlp_bias": a.mlp_bias,
        "max_position_embeddings": a.max_position_embeddings,
    }
