"""Qwen3-MoE stage shards chained == the whole Hugging Face model, on tiny checkpoints
transformers wrote (experts per expert, as save_pretrained writes them, or stacked)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from stages.model_config import ModelArgs, load_model_args
from stages.models.moe import MoE
from stages.models.qwen3_moe import Qwen3MoeStage
from tests.cpu.conftest import (
    QWEN3_MOE_ARCHS,
    cpu_context,
    hf_model,
    hf_prompt_logits,
    write_tiny_checkpoints,
)
from tests.cpu.test_shards_vs_hf import (
    PROMPT,
    TABLE,
    TOL,
    Pipeline,
    check_chained_stages,
    prefill_in_chunks,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("qwen3-moe"), QWEN3_MOE_ARCHS)


@pytest.fixture(scope="module")
def hf_logits():
    return hf_prompt_logits(QWEN3_MOE_ARCHS, PROMPT)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("arch", QWEN3_MOE_ARCHS)
def test_chained_stages_match_hf(checkpoints, hf_logits, arch, num_stages):
    check_chained_stages(checkpoints[arch], num_stages, hf_logits[arch])


def test_chunks_then_decode(checkpoints, hf_logits):
    pipe = Pipeline(checkpoints["qwen3_moe"], num_stages=2, block_size=4, num_blocks=12)
    logits = prefill_in_chunks(pipe)
    assert (logits[0] - hf_logits["qwen3_moe"][-1]).abs().max().item() <= TOL
    ids = PROMPT + [int(logits[0].argmax())]
    logits = pipe.logits(ids[-1:], [(len(PROMPT), 1, TABLE, True)])
    with torch.no_grad():
        ref = hf_model("qwen3_moe")(torch.tensor([ids])).logits[0, -1]
    assert (logits[0] - ref).abs().max().item() <= TOL


def test_layer_kinds_follow_the_config(checkpoints):
    """Routed layers are where transformers puts its sparse block (sparse step, dense list)."""
    for arch in QWEN3_MOE_ARCHS:
        args = load_model_args(checkpoints[arch])
        stage = Qwen3MoeStage(cpu_context(args, range(4), True, True))
        hf = hf_model(arch).model.layers
        ours = [isinstance(stage.layers[str(i)].mlp, MoE) for i in range(4)]
        assert ours == [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf]
    assert ours == [False, True, False, True]  # qwen3_moe_step2: every second layer


def test_stacked_experts_checkpoint(tmp_path, checkpoints, hf_logits):
    """Experts stored stacked (gate_up_proj [E, 2I, H], down_proj [E, H, I]) load the same, and
    a config naming `num_experts` (the Hub's) reads as transformers 5's `num_local_experts`."""
    src = checkpoints["qwen3_moe"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for layer in (0, 2, 3):
        pre = f"model.layers.{layer}.mlp.experts"
        tensors[f"{pre}.gate_up_proj"] = torch.stack(
            [
                torch.cat(
                    [
                        tensors.pop(f"{pre}.{e}.gate_proj.weight"),
                        tensors.pop(f"{pre}.{e}.up_proj.weight"),
                    ]
                )
                for e in range(8)
            ]
        )
        tensors[f"{pre}.down_proj"] = torch.stack(
            [tensors.pop(f"{pre}.{e}.down_proj.weight") for e in range(8)]
        )
    dst = tmp_path / "stacked"
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_experts"] = cfg.pop("num_local_experts")
    (dst / "config.json").write_text(json.dumps(cfg))
    pipe = Pipeline(str(dst), num_stages=2)
    logits = pipe.logits(PROMPT, [(0, len(PROMPT), list(range(8)), True)], all_positions=True)
    assert (logits - hf_logits["qwen3_moe"]).abs().max().item() <= TOL


def test_bad_routing_is_refused(checkpoints):
    with open(os.path.join(checkpoints["qwen3_moe"], "config.json")) as f:
        cfg = json.load(f)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelArgs.from_hf_dict({**cfg, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        ModelArgs.from_hf_dict({**cfg, "decoder_sparse_step": 0})
