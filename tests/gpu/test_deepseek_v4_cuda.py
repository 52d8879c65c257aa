"""DeepSeek-V4 on CUDA: the stage's batched rows (compressor groups, indexer selection, window and
entry gathers from one V4Plan) == the same stage on CPU, which CI holds to transformers (fp32,
torch backends: any difference is the device handling); and the Triton indexer-rows kernel on
V4's plans (compressed entries as keys, a token sees the groups before it, token tiles) ==
the torch reference."""

from __future__ import annotations

import pytest
import torch

from stages.forward_batch import ForwardBatch
from stages.kernels import indexer_select, triton_indexer
from stages.kernels.registry import select_kernels
from stages.kv_cache import make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import ModelArgs
from stages.models.deepseek_v4 import plan as v4_plan
from tests.deepseek_v4_ref import TINY_V4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BLOCK = 16
CONFIG = dict(TINY_V4, model_type="deepseek_v4")


def _run(device: str, weights: dict | None = None) -> tuple[list[torch.Tensor], dict]:
    args = ModelArgs.from_hf_dict(CONFIG)
    kernels = select_kernels(device, linear="torch", moe_experts="torch", indexer_logits="torch")
    model = build_stage_model(args, None, 0, 4, True, True, kernels, torch.float32, device, 3)
    if weights is not None:
        model.load_state_dict(weights)
    kv = make_kv_cache(args, range(4), 24, BLOCK, torch.float32, device)
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(3, 128, (n,), generator=g).tolist() for n in (45, 24, 10))
    ta, tb, tc = [9, 2, 17, 4], [1, 15], [5]
    out = []

    def forward(ids: list[int], rows: list) -> None:
        batch = ForwardBatch.build(rows, BLOCK, device)
        h = model(torch.tensor(ids, device=device), batch, kv)
        out.append(model.compute_logits(h[batch.sample_indices]).cpu())

    for start in range(0, 42, 7):  # chunks of 7: boundaries inside CSA and HCA groups
        forward(a[start : start + 7], [(start, 7, ta, True)])
    forward(b[:21], [(0, 21, tb, True)])
    for step in range(3):  # decode rows past the window, one completing groups, beside a chunk
        forward(
            [a[42 + step], b[21 + step]] + (c if step == 0 else []),
            [(42 + step, 1, ta, True), (21 + step, 1, tb, True)]
            + ([(0, 10, tc, True)] if step == 0 else []),
        )
    return out, model.state_dict()


def test_v4_stage_on_cuda_matches_cpu():
    cpu, weights = _run("cpu")
    cuda, _ = _run("cuda", weights)
    for c, g in zip(cpu, cuda):
        assert (c - g).abs().max().item() <= 1e-3


def test_triton_indexer_rows_on_v4_plans(monkeypatch):
    """Chunk rows and decode rows at rate 4 over 64 index heads of 128; score tiles forced small
    so a chunk is scored in several token tiles."""
    monkeypatch.setattr(v4_plan, "SCORE_TILE_BYTES", 4 * 64 * 512)
    dev, rate, block = torch.device("cuda"), 4, 128
    rows = [(0, 700, list(range(0, 8)), True), (2000, 1, list(range(8, 24)), True)]
    rows += [(37 + 5 * i, 1, [24 + i], True) for i in range(6)]
    batch = ForwardBatch.build(rows, block, dev)
    p = v4_plan.V4Plan.build(batch, 128, {rate: (False, True)}, block, dev).rates[rate]
    assert len(p.select) > 1
    g = torch.Generator(device=dev).manual_seed(0)
    t = batch.num_tokens
    q = torch.randn(t, 64, 128, device=dev, generator=g).bfloat16()
    keys = torch.randn(32 * block // rate, 128, device=dev, generator=g).bfloat16()
    weights = torch.randn(t, 64, device=dev, generator=g)
    for tokens, select in p.select:
        args = (q[tokens], keys, weights[tokens], 128**-0.5, select)
        got = triton_indexer.indexer_logits_rows(*args)
        ref = indexer_select.logits_rows_reference(*args)
        finite = torch.isfinite(ref)
        assert torch.equal(finite, torch.isfinite(got))
        assert torch.allclose(got[finite], ref[finite], rtol=2e-2, atol=2e-2)
        cols = torch.arange(ref.shape[1], device=dev)
        assert torch.equal(finite, cols[None, :] < p.visible[tokens, None])
