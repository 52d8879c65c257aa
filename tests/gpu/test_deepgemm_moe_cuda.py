"""The deepgemm moe_experts_fp8 backend (stages/kernels/deepgemm_moe.py) on an SM90 GPU with
DeepGEMM built (`.gpu-deepgemm/deepgemm_build.sh`, then its env.sh on PYTHONPATH): a prefill
chunk's output equals triton-persistent's bit for bit (DeepGEMM's GEMMs inside our quantizers,
layout and combine), and both are the FP8 reference's within the W8A8 tolerance; a token's
output is the same alone and batched across the prefill threshold (Triton below it, DeepGEMM
above, the route below counted); picks of another rank's experts (-1) add nothing."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import deepgemm_moe, fp8_ref, triton_moe_fp8
from stages.kernels.fallbacks import FALLBACKS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
if torch.cuda.is_available() and not deepgemm_moe.is_available("cuda"):
    pytest.skip("no deep_gemm here (build it: .gpu-deepgemm/)", allow_module_level=True)

EXPERTS, K, HIDDEN, INTER = 32, 4, 1024, 512
# tokens at which the pairs fill PREFILL_FROM_ROWS rows an expert on average
THRESHOLD = triton_moe_fp8.PREFILL_FROM_ROWS * EXPERTS // K


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def weights(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up, gu_s = fp8_ref.quantize_weight(
        torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, device="cuda") / 30
    )
    down, d_s = fp8_ref.quantize_weight(
        torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device="cuda") / 20
    )
    return gate_up, gu_s, down, d_s


def batch(t: int, seed: int, skipped: float = 0.0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, HIDDEN, generator=g, device="cuda").bfloat16()
    ids = torch.rand(t, EXPERTS, generator=g, device="cuda").topk(K, dim=-1).indices
    ids[torch.rand(t, K, generator=g, device="cuda") < skipped] = -1
    return x, ids, torch.rand(t, K, generator=g, device="cuda")


@pytest.mark.parametrize("limit", [None, 0.05], ids=["plain", "swiglu-limit"])
@pytest.mark.parametrize("skipped", [0.0, 0.2], ids=["all-picks", "some-picks-elsewhere"])
@pytest.mark.parametrize("t", [THRESHOLD, 3 * THRESHOLD + 17])
def test_prefill_equals_triton_bit_for_bit(t, skipped, limit):
    w = weights(t)
    x, ids, wt = batch(t, t + 1, skipped)
    assert triton_moe_fp8.tiles_for(t * K, EXPERTS) == triton_moe_fp8.PREFILL_TILES
    before = FALLBACKS.counts()
    got = deepgemm_moe.moe_experts(x, *w, ids, wt, limit=limit)
    assert FALLBACKS.counts() == before  # DeepGEMM's path, no route elsewhere
    want = triton_moe_fp8.moe_experts(x, *w, ids, wt, limit=limit)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    ref = fp8_ref.moe_experts(x.float(), *w, ids, wt, limit=limit)
    assert rel_err(got, ref) < 0.03


def test_a_tokens_output_is_the_same_alone_and_across_the_threshold():
    """The first THRESHOLD // 2 tokens alone (Triton's decode tiles: routed there, counted),
    then inside a chunk of 2 * THRESHOLD (DeepGEMM): the same bits."""
    w = weights(7)
    x, ids, wt = batch(2 * THRESHOLD, 8)
    few = THRESHOLD // 2
    key = ("moe_experts_fp8", "deepgemm", "few_rows")
    before = FALLBACKS.counts().get(key, 0)
    alone = deepgemm_moe.moe_experts(x[:few], *w, ids[:few], wt[:few])
    assert FALLBACKS.counts().get(key, 0) == before + 1
    batched = deepgemm_moe.moe_experts(x, *w, ids, wt)
    assert torch.equal(batched[:few].view(torch.int16), alone.view(torch.int16))
