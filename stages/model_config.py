"""Model architecture arguments read from a Hugging Face config.json (standard library only).

Both transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) layouts are read.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from stages.models.families import Family, family_of
from stages.protocol import MXFP4_EXPERTS

log = logging.getLogger(__name__)

# The built-in random model; byte-level vocabulary: 0..255 bytes, 256 <bos>, 257 <eos>, rest unused.
BUILTIN_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 1048576,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
}


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; else {"rope_type": "llama3", "factor": ...}
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool  # Llama/Qwen3 put attention_bias on o_proj too; Qwen2 never does
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    fp8_block: tuple[int, int] | None = None  # weight_scale_inv block of an FP8 checkpoint
    # The family's own arguments (stages/models/families.py), read only by its model code.
    family_args: Any = None

    @property
    def family(self) -> Family:
        return family_of(self.model_type)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelArgs":
        model_type = d.get("model_type")
        family = family_of(model_type)
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
        if d.get("sliding_window") and d.get("use_sliding_window", model_type == "mistral"):
            # Mistral v0.1 declares a 4K window; ppserve attends to the full prefix (as later
            # Mistral releases do), so outputs differ from windowed attention past the window.
            log.warning(
                "ignoring sliding_window=%s: ppserve uses full attention", d["sliding_window"]
            )
        heads = int(d["num_attention_heads"])
        theta, scaling = _rope(d, family.rope_types)
        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else eos if isinstance(eos, list) else [eos]
        fields = dict(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d.get("intermediate_size") or 0),  # MoE-only: the family's
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_list),
            fp8_block=_fp8_block(d),
        )
        return cls(**{**fields, **family.fields(d)})


def _fp8_block(d: dict[str, Any]) -> tuple[int, int] | None:
    quant = d.get("quantization_config") or {}
    if not quant:
        return None
    if quant.get("quant_method") != "fp8":
        raise ValueError(
            f"unsupported quantization {quant.get('quant_method')!r} (only block-scaled fp8)"
        )
    block = quant.get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


def _rope(d: dict[str, Any], supported: tuple[str, ...]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either config layout."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in supported:
        raise ValueError(
            f"unsupported rope type {rope_type!r} for {d.get('model_type')}; "
            f"supported: {', '.join(supported)}"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn":
        params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
        if params.get("factor") is None:  # transformers: the ratio of the two lengths
            params["factor"] = (
                d["max_position_embeddings"] / params["original_max_position_embeddings"]
            )
        return theta, {"rope_type": rope_type, **params}
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key not in params:
            raise ValueError(f"llama3 rope scaling needs {key!r}")
    params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return theta, {"rope_type": rope_type, **params}


def load_config(path: str | None) -> dict[str, Any]:
    """The config.json of the checkpoint directory `path`, or the built-in random model's when
    None."""
    if path is None:
        return dict(BUILTIN_CONFIG)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist (or is not a directory)")
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise FileNotFoundError(f"no config.json in model directory {path!r}")
    with open(cfg, encoding="utf-8") as f:
        d: dict[str, Any] = json.load(f)
    return d


def mxfp4_experts_as(args: ModelArgs, mode: str) -> ModelArgs:
    """The model with a checkpoint's MXFP4 routed experts (DeepSeek-V4's expert_dtype fp4)
    kept packed (keep: W4A16 experts) or as the other weights (dequantize: widened at load)."""
    if mode not in MXFP4_EXPERTS:
        raise ValueError(f"mxfp4_experts must be one of {MXFP4_EXPERTS}, got {mode!r}")
    return args if mode == "keep" else args.family.widen_mxfp4_experts(args)


def load_model_args(path: str | None) -> ModelArgs:
    """ModelArgs of the checkpoint directory `path`, or of the built-in random model when None."""
    return ModelArgs.from_hf_dict(load_config(path))
