"""StageContext: one check of a stage's layer range for every family, and what it derives."""

from __future__ import annotations

import pytest
import torch

from stages.kernels.registry import select_kernels
from stages.model_config import BUILTIN_CONFIG, ModelArgs
from stages.models.llama import LlamaStage
from stages.stage_context import StageContext

ARGS = ModelArgs.from_hf_dict(BUILTIN_CONFIG)  # 4 layers


def context(layers: range, is_first: bool = False, is_last: bool = False) -> StageContext:
    return StageContext(
        ARGS, layers, is_first, is_last, select_kernels("cpu"), torch.float32, torch.device("cpu")
    )


@pytest.mark.parametrize(
    ("layers", "shown"),
    [
        (range(2, 2), r"\[2, 2\)"),  # empty
        (range(3, 1), r"\[3, 1\)"),  # backwards
        (range(-1, 2), r"\[-1, 2\)"),  # before the first layer
        (range(2, 5), r"\[2, 5\)"),  # past the last
        (range(0, 4, 2), r"\[0, 4\) step 2"),  # not contiguous
    ],
)
def test_a_bad_layer_range_is_refused_with_the_model_s_layer_count(layers, shown):
    with pytest.raises(ValueError, match=rf"bad layer range {shown} for a model with 4 layers"):
        context(layers)


def test_what_a_context_derives():
    ctx = context(range(1, 3), is_last=True)
    assert (ctx.layer_start, ctx.layer_end, ctx.num_local_layers) == (1, 3, 2)
    assert not ctx.holds_embedding  # the built-in model's head is not tied
    assert context(range(0, 1), is_first=True).holds_embedding
    with pytest.raises(AttributeError):
        ctx.layers = range(0, 4)  # frozen: a stage's place does not change under it


def test_a_stage_reads_its_place_from_its_context():
    ctx = context(range(1, 3), is_last=True)
    stage = LlamaStage(ctx)
    assert stage.ctx is ctx and stage.args is ARGS
    assert (stage.layer_start, stage.layer_end, stage.num_local_layers) == (1, 3, 2)
    assert (stage.is_first, stage.is_last, stage.dtype) == (False, True, torch.float32)
    assert list(stage.layers) == ["1", "2"]
    assert hasattr(stage, "lm_head") and not hasattr(stage, "embed_tokens")
