"""FlashMLA dense decode and the grouped persistent Triton MoE GEMM against the torch reference
(fp32), on DeepSeek-V2-Lite / V3 shapes; and a DeepSeek stage on CUDA whose logits agree across
backends.

Tolerance: relative Frobenius error < 1e-2 (the bf16 band). Outputs of the reference run in fp32
on the same bf16 inputs.
"""

from __future__ import annotations

import pytest
import torch

from stages.kernels import flash_mla, torch_ref, triton_moe

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _pages_and_tables(lengths: list[int], num_blocks: int, g: torch.Generator):
    """Random latent pages and per-row block tables of distinct, shuffled blocks."""
    pages = torch.randn(num_blocks, 64, 1, 576, generator=g, device="cuda").bfloat16()
    need = [-(-n // 64) for n in lengths]
    perm = torch.randperm(num_blocks, generator=g, device="cuda")
    width = max(need)
    table = torch.zeros(len(lengths), width, dtype=torch.int32, device="cuda")
    used = 0
    for r, b in enumerate(need):
        table[r, :b] = perm[used:used + b].int()
        used += b
    return pages, table, torch.tensor(lengths, dtype=torch.int32, device="cuda")


@needs_cuda
@pytest.mark.skipif(not flash_mla.is_available("cuda"), reason="needs sgl-flash-mla on SM90")
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("lengths", [[1, 63, 64, 65, 700, 4096], [8192] * 8, [3] * 64])
def test_flash_mla_decode_matches_reference(heads, lengths):
    g = torch.Generator(device="cuda").manual_seed(heads + len(lengths))
    need = sum(-(-n // 64) for n in lengths)
    pages, table, seqlens = _pages_and_tables(lengths, need + 7, g)
    q = torch.randn(len(lengths), heads, 576, generator=g, device="cuda").bfloat16()
    scale = 192 ** -0.5
    out = flash_mla.mla_decode(q, pages, table, seqlens, 512, scale, {})
    ref = torch_ref.mla_decode(q.float(), pages.float(), table, seqlens, 512, scale, {})
    assert out.shape == (len(lengths), heads, 512)
    assert rel_err(out, ref) < TOL


@needs_cuda
@pytest.mark.skipif(not flash_mla.is_available("cuda"), reason="needs sgl-flash-mla on SM90")
@pytest.mark.parametrize("lengths", [[5, 63, 64, 65, 120, 127, 250, 490] * 2, [3] * 40 + [4090]])
def test_flash_mla_decode_rows_against_the_same_rows_alone(lengths):
    """Each decode row in a batch against the same row alone (a fresh plan each: FlashMLA splits
    the keys by the batch) and against the reference, row by row. Records how far a row moves
    with its batch: V3.2's dense decode rows run this kernel, and with W8A8 its batched requests
    part from their lone runs on the H200 (tests/gpu/test_batched_vs_alone_cuda.py)."""
    g = torch.Generator(device="cuda").manual_seed(len(lengths))
    need = sum(-(-n // 64) for n in lengths)
    pages, table, seqlens = _pages_and_tables(lengths, need + 7, g)
    q = torch.randn(len(lengths), 16, 576, generator=g, device="cuda").bfloat16()
    scale = 192**-0.5
    batched = flash_mla.mla_decode(q, pages, table, seqlens, 512, scale, {})
    rows = [slice(i, i + 1) for i in range(len(lengths))]
    alone = torch.cat([
        flash_mla.mla_decode(q[r], pages, table[r], seqlens[r], 512, scale, {}) for r in rows
    ])  # fmt: skip
    ref = torch_ref.mla_decode(q.float(), pages.float(), table, seqlens, 512, scale, {})

    def worst(out: torch.Tensor, ref: torch.Tensor) -> float:
        diff = (out.float() - ref.float()).flatten(1).norm(dim=1)
        return (diff / ref.float().flatten(1).norm(dim=1)).max().item()

    against_alone, against_ref = worst(batched, alone), worst(batched, ref)
    print(f"{len(lengths)} rows: worst against alone {against_alone:.2e}, ref {against_ref:.2e}")
    assert against_alone < TOL and against_ref < TOL


@needs_cuda
@pytest.mark.skipif(not flash_mla.is_available("cuda"), reason="needs sgl-flash-mla on SM90")
def test_flash_mla_plan_is_shared_by_layers():
    """One state dict across layers (as the model passes it): same results as fresh plans."""
    g = torch.Generator(device="cuda").manual_seed(5)
    pages, table, seqlens = _pages_and_tables([100, 2000, 37], 60, g)
    state: dict = {}
    for _layer in range(3):
        q = torch.randn(3, 16, 576, generator=g, device="cuda").bfloat16()
        shared = flash_mla.mla_decode(q, pages, table, seqlens, 512, 0.07, state)
        fresh = flash_mla.mla_decode(q, pages, table, seqlens, 512, 0.07, {})
        torch.testing.assert_close(shared, fresh, atol=0, rtol=0)


def _moe_inputs(tokens, hidden, inter, experts, k, g, skew=False):
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda")
               * hidden ** -0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, generator=g, device="cuda")
            * inter ** -0.5).bfloat16()
    scores = torch.randn(tokens, experts, generator=g, device="cuda")
    if skew:  # most tokens on a few experts, many experts empty
        scores[:, :3] += 10
    weights, ids = scores.softmax(-1).topk(k, dim=-1)
    return x, gate_up, down, ids, weights


@needs_cuda
@pytest.mark.skipif(not triton_moe.is_available("cuda"), reason="needs triton")
@pytest.mark.parametrize("fn", ["moe_experts", "moe_experts_sm1"])
@pytest.mark.parametrize("tokens,hidden,inter,experts,k,skew", [
    (1, 2048, 1408, 64, 6, False),  # one decode row
    (64, 2048, 1408, 64, 6, False),  # a decode batch (V2-Lite)
    (4096, 2048, 1408, 64, 6, False),  # a prefill chunk (V2-Lite)
    (4096, 2048, 1408, 64, 6, True),  # skewed routing, empty experts
    (1000, 7168, 2048, 64, 8, False),  # V3 hidden and expert width, partial tiles
    (77, 520, 200, 10, 3, False),  # odd sizes
])
def test_triton_moe_matches_reference(fn, tokens, hidden, inter, experts, k, skew):
    g = torch.Generator(device="cuda").manual_seed(tokens + experts)
    x, gate_up, down, ids, weights = _moe_inputs(tokens, hidden, inter, experts, k, g, skew)
    out = getattr(triton_moe, fn)(x, gate_up, down, ids, weights)
    ref = torch_ref.moe_experts(x.float(), gate_up.float(), down.float(), ids, weights)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < TOL


@needs_cuda
@pytest.mark.skipif(not triton_moe.is_available("cuda"), reason="needs triton")
def test_triton_moe_applies_the_swiglu_limit():
    """DeepSeek-V4's swiglu_limit, clamped in the gate/up GEMM's epilogue (V4-Flash widths)."""
    g = torch.Generator(device="cuda").manual_seed(4)
    x, gate_up, down, ids, weights = _moe_inputs(2048, 4096, 2048, 32, 6, g)
    x = x * 8  # gate/up values well past the limit
    limit = 0.5
    out = triton_moe.moe_experts(x, gate_up, down, ids, weights, limit)
    ref = torch_ref.moe_experts(x.float(), gate_up.float(), down.float(), ids, weights, limit)
    unclamped = torch_ref.moe_experts(x.float(), gate_up.float(), down.float(), ids, weights)
    assert rel_err(unclamped, ref) > 0.1  # the clamp matters at these values
    assert rel_err(out, ref) < TOL


@needs_cuda
def test_deepseek_stage_backends_agree():
    """A 2-layer V2-Lite-shaped stage in bf16: prefill then decode logits with the fastest
    backends available equal the torch reference backends' within the bf16 band."""
    from stages.forward_batch import ForwardBatch
    from stages.kernels.registry import select_kernels
    from stages.kv_cache import make_kv_cache
    from stages.loader import build_stage_model
    from stages.model_config import ModelArgs
    from stages.models.deepseek_config import DEEPSEEK_V2_LITE

    args = ModelArgs.from_hf_dict(dict(DEEPSEEK_V2_LITE, num_hidden_layers=2))
    fast = select_kernels("cuda", moe_experts="auto" if not triton_moe.is_available("cuda")
                          else "triton-persistent")
    ref = select_kernels("cuda", attention="torch", mla_decode="torch", moe_experts="torch")
    logits = []
    for kernels in (fast, ref):
        model = build_stage_model(args, None, 0, 2, True, True, kernels, "bfloat16", "cuda", 3)
        kv = make_kv_cache(args, 2, 8, 64, torch.bfloat16, "cuda")
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, args.vocab_size, (300,), generator=g).cuda()
        table = [5, 1, 7, 3, 0]
        out = []
        batch = ForwardBatch.build([(0, 300, table, True)], 64, "cuda")
        h = model(prompt, batch, kv)
        out.append(model.compute_logits(h[batch.sample_indices]))
        for step in range(3):  # the same decode inputs for both (not each one's argmax)
            nxt = prompt[step:step + 1]
            batch = ForwardBatch.build([(300 + step, 1, table, True)], 64, "cuda")
            h = model(nxt, batch, kv)
            out.append(model.compute_logits(h[batch.sample_indices]))
        logits.append(torch.cat(out))
    assert fast.names["mla_decode"] == ("flash-mla" if flash_mla.is_available("cuda")
                                        else "torch")
    assert rel_err(logits[0], logits[1]) < 2e-2
