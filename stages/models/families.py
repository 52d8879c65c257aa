"""The model families: one table from a checkpoint's `model_type` to what the engine needs to know
about its family. Standard library only, so the control plane reads it without torch.

A family declares:
- `fields`: the ModelArgs fields it reads from config.json beyond the common ones (its own
  arguments go to `family_args`), and the rope types it supports;
- `stage_class`: the module of one pipeline stage ("module:Class", imported when first built);
- its KV layout: `kv_components` (named cache components -> values per token per layer; bytes
  are their sum times the element size), `cache_class` that holds them and `kv_description`
  for the logs; `fp8_kv`, where the cache can be FP8 (`--kv-cache-dtype fp8`): the bytes per
  token of the components it packs (raising, with the reason, for a model it cannot serve);
- `hidden_shape`: the per-token shape of the hidden state one stage sends the next;
- capabilities the runner asks about: paged-decode CUDA graphs and cuDNN warm-up, both built
  for K/V pages of [slots, kv_heads, head_dim].
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from stages.models.deepseek_config import (
    DEEPSEEK_MODEL_TYPES,
    deepseek_fields,
    fp8_latent_components,
    latent_components,
)

if TYPE_CHECKING:
    from stages.model_config import ModelArgs

PLAIN_ROPE_TYPES = ("default", "llama3")


def _token_hidden(args: ModelArgs) -> tuple[int, ...]:
    return (args.hidden_size,)


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
    hidden_shape: Callable[[ModelArgs], tuple[int, ...]] = _token_hidden
    paged_decode_graphs: bool = False
    cudnn_warm_up: bool = False

    def stage(self) -> type:
        return _resolve(self.stage_class)

    def cache(self) -> type:
        return _resolve(self.cache_class)


def _resolve(name: str) -> type:
    module, attr = name.split(":")
    cls: type = getattr(importlib.import_module(module), attr)
    return cls


def _gqa_attention_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Llama-style attention: Qwen2 biases q/k/v (never o_proj) by default; Qwen3 normalises
    q and k per head."""
    qwen2 = d["model_type"] == "qwen2"
    bias = bool(d.get("attention_bias", qwen2))
    return {
        "attention_bias": bias,
        "o_proj_bias": bias and not qwen2,
        "qk_norm": d["model_type"] == "qwen3",
    }


LLAMA = Family(
    "llama",
    ("llama", "mistral", "qwen2", "qwen3"),
    _gqa_attention_fields,
    PLAIN_ROPE_TYPES,
    "stages.models.llama:LlamaStage",
    paged_decode_graphs=True,
    cudnn_warm_up=True,
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
)
FAMILIES = (LLAMA, DEEPSEEK)
BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
SUPPORTED_MODEL_TYPES = tuple(BY_MODEL_TYPE)


def family_of(model_type: str | None) -> Family:
    if model_type not in BY_MODEL_TYPE:
        raise ValueError(
            f"unsupported model_type {model_type!r}; ppserve supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return BY_MODEL_TYPE[model_type]
