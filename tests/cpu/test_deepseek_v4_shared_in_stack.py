"""DeepSeek-V4's shared expert in the routed experts' stack (what a CUDA stage builds,
`moe.shared_expert_in_stack`; forced here on the CPU's torch forms): loaded from a transformers
checkpoint's `shared_experts.*` tensors into the stack's last slot, every token of a short batch
routed to it with weight 1 and a long batch's run densely on the slot, the stage's logits those
of the stage that runs it as a SwiGLU beside the experts, in fp32 and with FP8 weights (W8A8),
hash layers included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.bench.fp8 import StageChain
from stages.kernels.fp8_ref import SCALE_SUFFIX
from stages.model_config import load_model_args
from stages.models.deepseek_v4 import moe as v4_moe
from stages.models.moe import Experts
from tests.deepseek_v4_ref import TINY_V4, write_checkpoint, write_fp8_copy

# 128-wide so the FP8 case keeps its linears and experts in e4m3 (the W8A8 blocks)
WIDE_V4 = dict(TINY_V4, hidden_size=128, moe_intermediate_size=128)
PROMPT = torch.randint(2, 128, (19,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("v4shared") / "m"), WIDE_V4)


def _chain(path: str, in_stack: bool, fp8: bool, monkeypatch, num_blocks: int = 8) -> StageChain:
    with monkeypatch.context() as m:
        m.setattr(v4_moe, "shared_expert_in_stack", lambda *args: in_stack)
        return StageChain(load_model_args(path), path, fp8, num_stages=2,
                          num_blocks=num_blocks, block_size=16)  # fmt: skip


def _logits(c: StageChain) -> torch.Tensor:
    """Prefill in chunks of 6, then three decode steps."""
    out = []
    for start in range(0, len(PROMPT), 6):
        piece = PROMPT[start : start + 6]
        out.append(c.logits(piece, [(start, len(piece), c.table, True)]))
    for i, tok in enumerate((7, 11, 3)):
        out.append(c.logits([tok], [(len(PROMPT) + i, 1, c.table, True)]))
    return torch.cat(out)


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8-weights"])
@pytest.mark.parametrize("grouped_up_to", [1024, 0], ids=["grouped", "dense-on-its-slot"])
def test_the_stack_holds_the_shared_expert_and_gives_the_same_logits(
    checkpoint, fp8, grouped_up_to, monkeypatch
):
    """grouped_up_to: SHARED_IN_STACK_TOKENS; at 0 every batch runs the slot as dense GEMMs
    (what a prefill chunk does), at 1024 these batches run it in the grouped kernel."""
    from stages.models import moe

    monkeypatch.setattr(moe, "SHARED_IN_STACK_TOKENS", grouped_up_to)
    beside = _chain(checkpoint, False, fp8, monkeypatch)
    stacked = _chain(checkpoint, True, fp8, monkeypatch)
    layers = 0
    for plain, fused in zip(beside.stages, stacked.stages):
        for name, layer in fused.layers.items():
            ex, shared = layer.mlp.experts, plain.layers[name].mlp.shared_experts
            assert layer.mlp.shared_experts is None and ex.shared_slot == ex.local == 4
            assert ex.gate_up_proj.shape[0] == 5 and ex.fp8 == fp8
            for leaf in ("gate_up_proj", "down_proj"):
                held, want = getattr(ex, leaf), getattr(shared, leaf)
                assert torch.equal(held[4].view(torch.uint8), want.weight.view(torch.uint8))
                if fp8:
                    assert torch.equal(getattr(ex, leaf + SCALE_SUFFIX)[4], want.weight_scale_inv)
                routed = getattr(plain.layers[name].mlp.experts, leaf)
                assert torch.equal(held[:4].view(torch.uint8), routed.view(torch.uint8))
            layers += 1
    assert layers == WIDE_V4["num_hidden_layers"]
    want, got = _logits(beside), _logits(stacked)
    # one fp32 sum of the k + 1 outputs where the shared one was added after: rounding only
    # (W8A8: the same quantized activations on both paths)
    torch.testing.assert_close(got, want, rtol=2e-4 if fp8 else 2e-5, atol=2e-4 if fp8 else 2e-5)


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8-weights"])
def test_staggered_batched_rows_match_rows_alone_and_the_swiglu_beside(
    checkpoint, fp8, monkeypatch
):
    """One microbatch of rows at different positions (window 8, CSA rate 4 with top-3, HCA rate
    8, blocks of 16): decode rows mid-group, completing a CSA group, completing both rates' and
    a block, far past the window and top-k, and a chunk across a group boundary. With the
    stack's grouped-kernel bound at 3 tokens the batch runs the shared expert densely on its
    slot and each row alone runs it in the grouped kernel: the batched rows equal each row
    alone (W8A8: the same token, within a rounding step), and the stage with the SwiGLU
    beside the experts."""
    from stages.models import moe

    monkeypatch.setattr(moe, "SHARED_IN_STACK_TOKENS", 3)
    prompt = torch.randint(2, 128, (48,), generator=torch.Generator().manual_seed(8)).tolist()
    cases = [(13, 1), (11, 1), (15, 1), (31, 1), (40, 1), (18, 5), (3, 1)]
    tables = [[3 * r, 3 * r + 1, 3 * r + 2] for r in range(len(cases))]
    ids = [t for done, n in cases for t in prompt[done : done + n]]
    rows = [(done, n, table, True) for (done, n), table in zip(cases, tables)]
    # W8A8: the batch's shape moves a row's fp32 sums by ~1e-7, which can flip one e4m3 step of
    # an activation (an AVX2 host flips one in layer 1's MoE for the chunk: 4.7e-3 there, 0.13
    # of 3.3 at the logits), as test_deepseek_v4_paged_decode bounds it
    bound = 5e-2 if fp8 else 1e-5
    got = {}
    for in_stack in (True, False):
        chain = _chain(checkpoint, in_stack, fp8, monkeypatch, num_blocks=3 * len(cases))
        for (done, _), table in zip(cases, tables):
            chain.logits(prompt[:done], [(0, done, table, False)])
        got[in_stack] = chain.logits(ids, rows)
        if in_stack:
            for i, ((done, n), table) in enumerate(zip(cases, tables)):
                alone = chain.logits(prompt[done : done + n], [(done, n, table, True)])
                scale = max(1.0, alone[0].abs().max().item()) if fp8 else 1.0
                assert (got[True][i] - alone[0]).abs().max().item() <= bound * scale, (i, done, n)
                assert torch.equal(got[True][i].argmax(-1), alone[0].argmax(-1)), (i, done, n)
    torch.testing.assert_close(got[True], got[False], rtol=2e-5, atol=2e-5)


def test_the_stack_names_the_shared_experts_tensors_for_its_last_slot():
    ex = Experts(4, 128, 128, torch.float32, "cpu", shared=True)
    assert ex.gate_up_proj.shape[0] == 5 and ex.shared_slot == 4
    pieces = ex.checkpoint_sources("model.layers.2.mlp.experts")
    last = pieces["down_proj"][-1]
    assert last.name == "model.layers.2.mlp.shared_experts.down_proj.weight" and last.at == (4,)
    with pytest.raises(ValueError, match="whole and unpacked"):
        Experts(4, 128, 128, torch.float32, "cpu", mxfp4=True, shared=True)


def test_a_cuda_stage_stacks_it_and_a_cpu_one_does_not(checkpoint):
    args = load_model_args(checkpoint).family_args
    assert v4_moe.shared_expert_in_stack(args, "cuda", None, False)
    assert not v4_moe.shared_expert_in_stack(args, "cpu", None, False)
    assert not v4_moe.shared_expert_in_stack(args, "cuda", None, True)  # MXFP4 kept packed
    # the args' choice (a bench comparing the two) over the device's, where the stack can be
    beside = dataclasses.replace(args, shared_expert_in_stack=False)
    stacked = dataclasses.replace(args, shared_expert_in_stack=True)
    assert not v4_moe.shared_expert_in_stack(beside, "cuda", None, False)
    assert v4_moe.shared_expert_in_stack(stacked, "cpu", None, False)
    assert not v4_moe.shared_expert_in_stack(stacked, "cpu", None, True)


def test_an_fp8_checkpoints_shared_expert_loads_its_bytes_and_scales_into_the_slot(
    checkpoint, tmp_path, monkeypatch
):
    """A checkpoint shipping the weights in FP8 with their `weight_scale_inv` (DeepSeek's
    names): the stack's shared slot holds the shared expert's stored bytes and scales."""
    online = _chain(checkpoint, False, True, monkeypatch).stages[0]
    write_fp8_copy(checkpoint, online, str(tmp_path))
    stacked = _chain(str(tmp_path), True, True, monkeypatch).stages[0]
    for name, layer in stacked.layers.items():
        ex, shared = layer.mlp.experts, online.layers[name].mlp.shared_experts
        for leaf in ("gate_up_proj", "down_proj"):
            want = getattr(shared, leaf)
            assert torch.equal(
                getattr(ex, leaf)[4].view(torch.uint8), want.weight.view(torch.uint8)
            )
            assert torch.equal(getattr(ex, leaf + SCALE_SUFFIX)[4], want.weight_scale_inv)
