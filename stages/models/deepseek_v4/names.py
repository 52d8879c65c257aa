"""Checkpoint tensor names of DeepSeek-V4: transformers writes (and reads) DeepSeek's own names
(`attn.wq_a`, `ffn.experts.{e}.w1`, `hc_attn_fn`...), converting them to its module names at load
(transformers' conversion_mapping for deepseek_v4). The stage's modules carry transformers'
names; this is the reverse map, per parameter, with the pieces of what the stage fuses or stacks
(the shared expert's gate and up, the routed experts)."""

from __future__ import annotations

import re

from stages.kernels.fp8_ref import SCALE_SUFFIX, scale_index
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
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
)


def checkpoint_tensor(param: str) -> str:
    """A stage parameter's name -> the tensor transformers writes for it."""
    if param == "lm_head.weight":
        return "head.weight"
    name = "model." + param
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def checkpoint_pieces(param: str, experts: int, inter: int) -> list[Piece]:
    """The checkpoint tensor and index into the parameter of each piece of `param`. A kept-FP8
    weight's scales (`<weight>_scale_inv`, one per 128 x 128 tile) come in the weight's pieces,
    their row slices counted in tiles."""
    if param.endswith(SCALE_SUFFIX):
        return [
            Piece(piece.name + SCALE_SUFFIX, scale_index(piece.index))
            for piece in checkpoint_pieces(param.removesuffix(SCALE_SUFFIX), experts, inter)
        ]
    owner = checkpoint_tensor(param).rsplit(".", 1)[0]
    if ".shared_experts.gate_up_proj." in param:  # w1 (gate) rows, then w3 (up)
        prefix, leaf = owner.rsplit(".", 1)[0], param.rsplit(".", 1)[1]
        return [
            Piece(f"{prefix}.w1.{leaf}", (slice(0, inter),)),
            Piece(f"{prefix}.w3.{leaf}", (slice(inter, 2 * inter),)),
        ]
    if param.endswith("experts.gate_up_proj"):
        return [
            piece
            for e in range(experts)
            for piece in (
                Piece(f"{owner}.{e}.w1.weight", (e, slice(0, inter))),
                Piece(f"{owner}.{e}.w3.weight", (e, slice(inter, 2 * inter))),
            )
        ]
    if param.endswith("experts.down_proj"):
        return [Piece(f"{owner}.{e}.w2.weight", (e,)) for e in range(experts)]
    return [Piece(checkpoint_tensor(param))]
