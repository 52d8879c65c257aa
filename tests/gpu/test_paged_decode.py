"""The Triton paged decode kernel against the torch reference, on the paged cache layout:
scattered (non-consecutive) blocks, GQA groups of 1, 3 and 4, padding rows of length 0, split
counts from 1 to more than a row has pages."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _case(rows, hq, hkv, d, block, lengths, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    max_blocks = max(1, max(-(-n // block) for n in lengths))
    num_blocks = rows * max_blocks + 3
    slots = num_blocks * block
    k = torch.randn(slots, hkv, d, generator=g, device="cuda").to(dtype)
    v = torch.randn(slots, hkv, d, generator=g, device="cuda").to(dtype)
    q = torch.randn(rows, hq, d, generator=g, device="cuda").to(dtype)
    perm = torch.randperm(num_blocks, generator=g, device="cuda")[:rows * max_blocks]
    tables = torch.zeros(rows + 2, max_blocks, dtype=torch.int32, device="cuda")
    table_rows = torch.randperm(rows + 2, generator=g, device="cuda")[:rows]
    tables[table_rows] = perm.view(rows, max_blocks).to(torch.int32)
    lens = torch.tensor(lengths, dtype=torch.long, device="cuda")
    return q, k, v, tables, table_rows, lens


CASES = {  # id -> rows, Hq, Hkv, D, block, lengths
    "llama8b-64rows": (64, 32, 8, 128, 64, [1 + (7 * i) % 300 for i in range(64)]),
    "smollm-gqa3": (5, 9, 3, 64, 64, [1, 64, 65, 129, 1000]),
    "mha-block16": (3, 4, 4, 32, 16, [17, 5, 300]),
    "padding-rows": (6, 32, 8, 128, 64, [40, 0, 700, 0, 0, 1]),
    "long-rows": (2, 32, 8, 128, 64, [32768, 20000]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("splits", [None, 1, 7])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_paged_decode_matches_reference(case, splits, dtype):
    from stages.kernels import torch_ref
    from stages.kernels.triton_paged_decode import paged_decode_attention

    rows, hq, hkv, d, block, lengths = CASES[case]
    q, k, v, tables, table_rows, lens = _case(rows, hq, hkv, d, block, lengths, dtype)
    scale = d ** -0.5
    out = paged_decode_attention(q, k, v, tables, table_rows, lens, scale, block, splits)
    ref = torch_ref.paged_decode_attention(q.float(), k.float(), v.float(), tables, table_rows,
                                           lens, scale, block)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    assert out.dtype == dtype
    err = (out.float() - ref).abs().max().item()
    assert err <= tol, err
    assert torch.all(out[lens == 0] == 0)


def test_triton_paged_decode_is_graph_safe():
    """Captured once, replayed with other lengths and tables: same as a fresh call."""
    from stages.kernels.triton_paged_decode import paged_decode_attention

    q, k, v, tables, table_rows, lens = _case(8, 32, 8, 128, 64, [50] * 8, torch.bfloat16)
    paged_decode_attention(q, k, v, tables, table_rows, lens, 0.1, 64, 4)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, k, v, tables, table_rows, lens, 0.1, 64, 4)
    lens.copy_(torch.tensor([1, 0, 5, 64, 65, 128, 129, 3], device="cuda"))
    tables.copy_(tables.flip(0))
    graph.replay()
    fresh = paged_decode_attention(q, k, v, tables, table_rows, lens, 0.1, 64, 4)
    assert torch.equal(out, fresh)
