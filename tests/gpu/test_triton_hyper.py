"""DeepSeek-V4's hyper-connections on Triton (stages/kernels/triton_hyper.py) against the torch
form (stages/kernels/hyper_connection.py) on the same bf16 streams: prefill-sized and ragged
token counts, hc_mult 4 and 2, V4-Flash's hidden size; and a bf16 V4 stage whose kernels pick
Triton equals the same stage on the torch forms."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stages.kernels import hyper_connection, triton_hyper

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _inputs(t: int, n: int, d: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    streams = torch.randn(t, n, d, generator=g, device="cuda").bfloat16()
    m = (2 + n) * n
    fn = torch.randn(m, n * d, generator=g, device="cuda") * (n * d) ** -0.5
    base = torch.randn(m, generator=g, device="cuda") * 0.1
    scale = torch.rand(3, generator=g, device="cuda") + 0.5
    return streams, fn, base, scale


@pytest.mark.parametrize("t", [1, 512, 8192])
def test_mix_with_the_blocks_input_norm(t):
    """out_norm (V4RMSNorm of the collapsed input, folded into _finish): the torch form's
    collapse then norm, within a bf16 unit; against rms_norm_fp32 of the kernel's own collapse,
    the same but for the sum of squares' order."""
    from stages.kernels import rope_tail

    streams, fn, base, scale = _inputs(t, 4, 4096)
    weight = torch.rand(4096, device="cuda") + 0.5
    _, _, plain = triton_hyper.mix(streams, fn, base, scale, 20, 1e-6, 1e-6)
    _, _, normed = triton_hyper.mix(streams, fn, base, scale, 20, 1e-6, 1e-6, (weight, 1e-6))
    own = rope_tail.fp32_rms_norm(plain, weight, 1e-6)
    torch.testing.assert_close(normed.float(), own.float(), rtol=2**-7, atol=0)
    assert (normed != own).float().mean() < 0.01
    _, _, ref = hyper_connection.mix(streams, fn, base, scale, 20, 1e-6, 1e-6, (weight, 1e-6))
    torch.testing.assert_close(normed.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("precision", triton_hyper.PRECISIONS)
@pytest.mark.parametrize("t,n,d", [(4096, 4, 4096), (37, 4, 4096), (512, 4, 1024), (129, 2, 640)])
def test_mix_matches_torch(t, n, d, precision):
    streams, fn, base, scale = _inputs(t, n, d)
    post, comb, collapsed = triton_hyper.mix(
        streams, fn, base, scale, 20, 1e-6, 1e-6, precision=precision
    )
    ref_post, ref_comb, ref_collapsed = hyper_connection.mix(
        streams, fn, base, scale, 20, 1e-6, 1e-6
    )
    torch.testing.assert_close(post, ref_post, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(comb, ref_comb, rtol=1e-4, atol=1e-5)
    # collapsed is rounded to bf16 from fp32 sums whose order differs: one bf16 ulp
    torch.testing.assert_close(collapsed.float(), ref_collapsed.float(), rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("t,n,d", [(4096, 4, 4096), (37, 4, 4096), (129, 2, 640)])
def test_merge_matches_torch(t, n, d):
    streams, fn, base, scale = _inputs(t, n, d, seed=1)
    post, comb, _ = hyper_connection.mix(streams, fn, base, scale, 20, 1e-6, 1e-6)
    g = torch.Generator(device="cuda").manual_seed(2)
    out = torch.randn(t, d, generator=g, device="cuda").bfloat16()
    got = triton_hyper.merge(streams, out, post, comb)
    ref = hyper_connection.merge(streams, out, post, comb)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    # the torch form rounds three times to bf16 (post * out, cuBLAS's 4-wide product, their sum)
    # where the kernel rounds its fp32 sum once: within one ulp of each term and two of the
    # result (the result may round into the next binade). Where the terms cancel, a term's ulp
    # is many of the result's (one element in 67M was two of them off, session 28)
    scaled = (post.to(out.dtype).unsqueeze(-1) * out.unsqueeze(-2)).float()
    product = torch.matmul(comb.to(out.dtype).transpose(-1, -2), streams).float()
    bound = 2 * _bf16_ulp(ref.float()) + _bf16_ulp(scaled) + _bf16_ulp(product)
    off = (got.float() - ref.float()).abs() - bound
    assert bool((off <= 0).all()), f"{int((off > 0).sum())} elements, worst {off.max().item()}"


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """bf16's unit in the last place at each of x's magnitudes (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0**-126))) - 7)


def test_v4_stage_on_triton_hyper_connections_matches_torch_forms():
    from stages.forward_batch import ForwardBatch
    from stages.kernels.registry import select_kernels
    from stages.kv_cache import make_kv_cache
    from stages.loader import build_stage_model
    from stages.model_config import ModelArgs
    from tests.deepseek_v4_ref import TINY_V4

    args = ModelArgs.from_hf_dict(dict(TINY_V4, model_type="deepseek_v4"))
    layers = args.num_hidden_layers
    outs = []
    for backend in ("triton", "torch"):
        kernels = select_kernels("cuda", linear="torch", moe_experts="torch")
        if backend == "torch":
            kernels = dataclasses.replace(
                kernels, hc_mix=hyper_connection.mix, hc_merge=hyper_connection.merge
            )
        else:
            assert kernels.names["hc_mix"] == "triton"
        model = build_stage_model(
            args, None, 0, layers, True, True, kernels, torch.bfloat16, "cuda", 3
        )
        kv = make_kv_cache(args, range(layers), 8, 16, torch.bfloat16, "cuda")
        ids = torch.randint(3, 100, (40,), generator=torch.Generator().manual_seed(0))
        batch = ForwardBatch.build([(0, 40, list(range(4)), True)], 16, "cuda")
        with torch.inference_mode():
            outs.append(model(ids.cuda(), batch, kv).float())
    torch.testing.assert_close(outs[0], outs[1], rtol=5e-2, atol=5e-2)
