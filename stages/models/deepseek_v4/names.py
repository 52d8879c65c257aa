"""Checkpoint tensor names of DeepSeek-V4: transformers writes (and reads) DeepSeek's own names
(`attn.wq_a`, `ffn.experts.{e}.w1`, `hc_attn_fn`...), converting them to its module names at load
(transformers' conversion_mapping for deepseek_v4). The stage's modules carry transformers'
names; this is the reverse map: per parameter, and for the pieces the stage's modules name
(the shared expert's gate and up, the routed experts, a tensor-parallel rank's slices) per
piece."""

from __future__ import annotations

import re

from stages.kernels.fp8_ref import SCALE_SUFFIX
from stages.stage_context import Piece

# module name (with `model.`) -> checkpoint name; applied in order, each to the previous result
_RENAMES = (
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.kv_norm\.", ".norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    # the routed experts' and the shared expert's projections (pieces of fused parameters)
    (r"experts\.(\d+\.)?gate_proj\.", r"experts.\1w1."),
    (r"experts\.(\d+\.)?up_proj\.", r"experts.\1w3."),
    (r"experts\.(\d+\.)?down_proj\.", r"experts.\1w2."),
)


def checkpoint_tensor(param: str) -> str:
    """A stage parameter's name -> the tensor transformers writes for it."""
    if param == "lm_head.weight":
        return "head.weight"
    name = "model." + param
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def piece_tensor(name: str) -> str:
    """A checkpoint piece a module names (`model.` + its module path, or the head's own
    `lm_head.`) -> the tensor transformers writes for it."""
    return checkpoint_tensor(name.removeprefix("model."))


def checkpoint_pieces(param: str) -> list[Piece]:
    """The checkpoint tensor of a parameter no module names pieces for. A kept-FP8 weight's
    scales (`<weight>_scale_inv`, one per 128 x 128 tile) are the weight's name's."""
    if param.endswith(SCALE_SUFFIX):
        return [Piece(checkpoint_tensor(param.removesuffix(SCALE_SUFFIX)) + SCALE_SUFFIX)]
    return [Piece(checkpoint_tensor(param))]
