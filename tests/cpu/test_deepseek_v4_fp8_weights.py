"""DeepSeek-V4 keeping FP8 weights (`--quantization fp8` on CUDA; here W8A8 on the torch
reference): every 128-aligned linear and the routed experts, hash layers included, held in e4m3
with 128 x 128 scales, the experts' swiglu clamp applied on the FP8 path. With the activations
left unquantized the stage is exactly the unquantized one holding the dequantized weights (the
wiring); W8A8 is within FP8 tolerance of it. A checkpoint shipping those weights in FP8 (with
`weight_scale_inv`, DeepSeek's names) loads the same bytes and scales into the stage."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from app.bench.fp8 import StageChain
from stages.kernels import fp8_ref
from stages.kernels.fp8_ref import SCALE_SUFFIX
from stages.model_config import load_model_args
from tests.deepseek_v4_ref import TINY_V4, write_checkpoint, write_fp8_copy

# TINY_V4 with 128-wide hidden and expert widths (the W8A8 blocks); its swiglu_limit of 0.5
# clamps most gate and up values, so a path that dropped the clamp would show
FP8_WEIGHTS_V4 = dict(TINY_V4, hidden_size=128, moe_intermediate_size=128)
PROMPT = torch.randint(2, 128, (21,), generator=torch.Generator().manual_seed(5)).tolist()
BLOCK = 16
# This random 4-layer model amplifies rounding about tenfold: bf16 alone puts its logits 0.047
# off fp32's (measured), and e4m3 activations keep 4 fewer mantissa bits than bf16; W8A8 measured
# 0.39 against the dequantized weights
W8A8_TOL = 0.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("v4w8") / "m"), FP8_WEIGHTS_V4)


def chain(path: str, fp8_weights: bool) -> StageChain:
    return StageChain(
        load_model_args(path), path, fp8_weights, num_stages=1, num_blocks=8, block_size=BLOCK
    )


def logits(c: StageChain) -> torch.Tensor:
    """A prompt in chunks of 7 (inside the compressors' groups), then two decode steps."""
    out = []
    for start in range(0, len(PROMPT), 7):
        piece = PROMPT[start : start + 7]
        out.append(c.logits(piece, [(start, len(piece), c.table, True)]))
    for i, tok in enumerate((5, 9)):
        out.append(c.logits([tok], [(len(PROMPT) + i, 1, c.table, True)]))
    return torch.cat(out)


def weight_only(x, weight, scale_inv, bias=None):
    w = fp8_ref.dequantize_weight(weight, scale_inv).to(x.dtype)
    return torch.nn.functional.linear(x, w, bias)


def test_v4_keeps_fp8_linears_and_experts(checkpoint):
    kept = chain(checkpoint, fp8_weights=True)
    stage = kept.stages[0]
    fp8 = {n for n, p in stage.named_parameters() if p.dtype == fp8_ref.FP8}
    for layer in range(FP8_WEIGHTS_V4["num_hidden_layers"]):  # hash layers 0-1, routed 2-3
        mlp = stage.layers[str(layer)].mlp
        assert mlp.experts.fp8 and f"layers.{layer}.mlp.experts.gate_up_proj" in fp8
        assert f"layers.{layer}.mlp.shared_experts.down_proj.weight" in fp8
        assert f"layers.{layer}.self_attn.q_b_proj.weight" in fp8
    assert all(n + SCALE_SUFFIX in dict(stage.named_parameters()) for n in fp8)

    # the unquantized stage holding the FP8 weights dequantized: the same logits exactly when
    # the FP8 stage's linears leave their activations unquantized
    plain = chain(checkpoint, fp8_weights=False)
    params = dict(stage.named_parameters())
    with torch.no_grad():
        for name, p in plain.stages[0].named_parameters():
            if name in fp8:
                p.copy_(fp8_ref.dequantize_weight(params[name], params[name + SCALE_SUFFIX]))
    want = logits(plain)
    for module in stage.modules():
        if hasattr(module, "kernels"):
            module.kernels = replace(module.kernels, fp8_linear=weight_only, fp8_swiglu_linear=None)
    assert torch.equal(logits(kept), want)

    # W8A8: each linear's input quantized in 1 x 128 groups
    got = logits(chain(checkpoint, fp8_weights=True))
    err = ((got - want).norm() / want.norm()).item()
    assert 0 < err < W8A8_TOL


def test_an_fp8_v4_checkpoint_loads_its_bytes_and_scales(checkpoint, tmp_path):
    """Every tensor the stage keeps in FP8 stored quantized in the checkpoint, with its
    `weight_scale_inv` (the fused shared gate/up and the stacked experts come in pieces)."""
    online = chain(checkpoint, fp8_weights=True).stages[0]
    write_fp8_copy(checkpoint, online, str(tmp_path))
    loaded = dict(chain(str(tmp_path), fp8_weights=True).stages[0].named_parameters())
    for name, p in online.named_parameters():
        want = p.view(torch.uint8) if p.dtype == fp8_ref.FP8 else p
        got = loaded[name].view(torch.uint8) if p.dtype == fp8_ref.FP8 else loaded[name]
        assert torch.equal(got, want), name
