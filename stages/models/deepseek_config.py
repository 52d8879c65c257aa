"""DeepSeek-V2/V3/V3.2 architecture arguments (MLA + MoE, V3.2's sparse-attention indexer) from a
Hugging Face config.json (standard library only). Semantics follow transformers'
modeling_deepseek_v2 / _v3 / _v32."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.kernels import fp8_indexer_layout
from stages.kernels.fallbacks import OpShape

if TYPE_CHECKING:
    from stages.model_config import ModelArgs

DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32")
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")

# DeepSeek-V2-Lite's shapes (random weights in the bench: `--load-format dummy`).
DEEPSEEK_V2_LITE: dict[str, Any] = {
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
}


@dataclass(frozen=True)
class IndexerArgs:
    """DeepSeek-V3.2's lightning indexer (DSA): scores every prefix key of each query with
    n_heads small heads and keeps the top `topk` keys for the layer's MLA."""

    topk: int  # index_topk
    n_heads: int  # index_n_heads
    head_dim: int  # index_head_dim: also the width of its per-token cached key

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "IndexerArgs":
        # transformers' DeepseekV32Config defaults
        out = cls(
            topk=int(d.get("index_topk", 2048)),
            n_heads=int(d.get("index_n_heads", 64)),
            head_dim=int(d.get("index_head_dim", 128)),
        )
        if min(out.topk, out.n_heads) < 1 or out.head_dim < int(d["qk_rope_head_dim"]):
            raise ValueError(f"bad indexer shape {out} (index_head_dim must hold the rope dims)")
        return out


@dataclass(frozen=True)
class DeepseekArgs:
    version: str  # "v2": softmax gate (greedy / group-limited); "v3": sigmoid + bias-corrected
    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs (x0, x1), (x2, x3)...; else rotate_half halves
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int  # layers below this index keep a dense MLP
    topk_method: str  # v2: greedy | group_limited_greedy; v3: noaux_tc
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool  # v3 only: transformers' V2 router never renormalises
    indexer: IndexerArgs | None = None  # V3.2: every layer attends sparsely (DSA)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values one token keeps per layer in the cache: the compressed KV and its rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "DeepseekArgs":
        version = "v2" if d["model_type"] == "deepseek_v2" else "v3"  # V3.2 routes as V3
        sparse = d["model_type"] == "deepseek_v32"
        experts = int(d.get("n_routed_experts") or 0)
        n_group = int(d.get("n_group") or 1)
        topk_group = int(d.get("topk_group") or 1)
        if version == "v2":
            method = d.get("topk_method") or "greedy"
            if method not in V2_TOPK_METHODS:
                raise ValueError(
                    f"unsupported DeepSeek-V2 topk_method {method!r}; supported: "
                    f"{', '.join(V2_TOPK_METHODS)}"
                )
        else:
            method = "noaux_tc"  # transformers' V3 router, whatever the config names
        if experts and experts % n_group:
            raise ValueError(f"n_routed_experts={experts} is not a multiple of n_group={n_group}")
        if topk_group > n_group:
            raise ValueError(f"topk_group={topk_group} exceeds n_group={n_group}")
        q_lora = d.get("q_lora_rank")
        first_dense = int(d.get("first_k_dense_replace") or 0)
        if sparse:
            if not q_lora:
                raise ValueError("deepseek_v32 needs q_lora_rank: its indexer reads the q LoRA")
            layers = int(d["num_hidden_layers"])
            dense = min(first_dense, layers)
            if d.get("mlp_layer_types") not in (
                None,
                ["dense"] * dense + ["sparse"] * (layers - dense),
            ):
                raise ValueError(
                    "mlp_layer_types other than first_k_dense_replace dense layers "
                    "then MoE are not supported"
                )
        return cls(
            version=version,
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(d["kv_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
            # transformers' V3.2 always interleaves its MLA rope dims
            rope_interleave=(
                True if version == "v2" or sparse else bool(d.get("rope_interleave", True))
            ),
            n_routed_experts=experts,
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
            first_k_dense_replace=first_dense,
            topk_method=method,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=version == "v3" and bool(d.get("norm_topk_prob", True)),
            indexer=IndexerArgs.from_hf_dict(d) if sparse else None,
        )


def deepseek_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The ModelArgs fields a DeepSeek config sets: head_dim is the q/k head width, and every
    query head has its own K/V once the latent is expanded."""
    args = DeepseekArgs.from_hf_dict(d)
    bias = bool(d.get("attention_bias", False))
    return {
        "family_args": args,
        "head_dim": args.qk_head_dim,
        "num_key_value_heads": int(d["num_attention_heads"]),
        "attention_bias": bias,
        "o_proj_bias": bias,
        "qk_norm": False,
    }


def deepseek_op_shapes(args: ModelArgs) -> dict[str, OpShape]:
    """The absorbed MLA ops' calls: every query head (the rank's, with the args
    Family.rank_args gives a tensor-parallel rank) over the latent + rope keys, out the
    latent's width; V3.2's sparse ones and its indexer's heads (whole on every rank) over
    their keys."""
    d: DeepseekArgs = args.family_args
    latent = OpShape(args.num_attention_heads, d.latent_dim, d.kv_lora_rank)
    out = {"mla_decode": latent}
    if d.indexer is not None:
        out |= {op: latent for op in ("mla_sparse", "mla_sparse_fp8", "mla_prefill_fp8")}
        keys = OpShape(d.indexer.n_heads, d.indexer.head_dim)
        out |= {"indexer_logits": keys, "indexer_logits_rows": keys}
    return out


# The latent cache's components: the latent itself and V3.2's indexer key.
LATENT = "latent"
INDEXER_KEY = "indexer_key"


def latent_components(args: ModelArgs) -> dict[str, int]:
    """Component name -> values per token per layer."""
    d: DeepseekArgs = args.family_args
    out = {LATENT: d.latent_dim}
    if d.indexer is not None:
        out[INDEXER_KEY] = d.indexer.head_dim
    return out


# FlashMLA's FP8 latent (stages/kernels/fp8_latent.py): the 512 no-rope values in e4m3, an fp32
# scale per 128 of them, the 64 rope values in bf16.
FP8_LATENT_SHAPE = (512, 64)


def fp8_latent_components(args: ModelArgs) -> dict[str, int]:
    """Bytes per token per layer of the components an FP8 cache stores packed: V3.2's latent
    (656) and its indexer key (index_head_dim + 4: 132). Raises where it does not apply,
    saying why."""
    d: DeepseekArgs = args.family_args
    if d.indexer is None:
        raise ValueError(
            f"--kv-cache-dtype fp8 is for DeepSeek-V3.2's sparse attention; {args.model_type} "
            "(dense MLA) keeps a bfloat16 latent cache: FlashMLA's dense FP8 decode is not "
            "among its SM90 (legacy) kernels, only the sparse one"
        )
    if (d.kv_lora_rank, d.qk_rope_head_dim) != FP8_LATENT_SHAPE:
        raise ValueError(
            f"the FP8 latent layout holds kv_lora_rank 512 + rope 64, not "
            f"{d.kv_lora_rank} + {d.qk_rope_head_dim}"
        )
    nope, rope = FP8_LATENT_SHAPE
    return {
        LATENT: nope + 4 * (nope // 128) + 2 * rope,
        INDEXER_KEY: fp8_indexer_layout.key_bytes(d.indexer.head_dim),
    }


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(args: DeepseekArgs, rope_scaling: dict[str, Any] | None) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers'
    yarn_apply_mscale)."""
    scale: float = args.qk_head_dim**-0.5
    if rope_scaling and rope_scaling.get("mscale_all_dim"):
        m = yarn_get_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])
        scale *= m * m
    return scale
