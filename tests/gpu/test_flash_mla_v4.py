"""DeepSeek-V4's kernels against the torch references on the host: FlashMLA's bf16 sparse prefill
with sinks (head dim 512) for prefill and decode rows, its sparse FP8 decode over the 584-byte
pages with the sliding window as the extra cache (against the reference over the dequantized
pages, so quantization error is not counted), and the fused Triton quantize-on-write against the
torch pack. Tolerance: relative Frobenius error < 1e-2 (bf16 outputs)."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import flash_mla, flash_mla_v4, fp8_v4, torch_ref, triton_fp8_latent

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
needs_flash_mla = pytest.mark.skipif(
    not flash_mla.is_available("cuda"), reason="needs sgl-flash-mla on SM90"
)
TOL = 1e-2
SCALE = 512**-0.5


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def sparse_ids(t: int, width: int, n: int, g: torch.Generator, holes: float) -> torch.Tensor:
    """[t, width] distinct ids of 0..n-1 per row, a fraction `holes` of them -1 anywhere."""
    ids = torch.rand(t, n, generator=g, device="cuda").argsort(dim=1)[:, :width].int()
    drop = torch.rand(t, width, generator=g, device="cuda") < holes
    return ids.masked_fill(drop, -1)


@needs_flash_mla
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("t,n,k", [(1024, 4096, 640), (64, 9000, 640), (5, 300, 130)])
def test_sparse_prefill_with_sinks_matches_reference(heads, t, n, k):
    """Prefill chunks and decode rows alike (one query-wise sparse call); 16 heads are padded."""
    g = torch.Generator(device="cuda").manual_seed(heads + t)
    kv = (torch.randn(n, 512, generator=g, device="cuda") / 4).bfloat16()
    q = torch.randn(t, heads, 512, generator=g, device="cuda").bfloat16()
    sinks = torch.randn(heads, generator=g, device="cuda")
    indices = sparse_ids(t, k, n, g, holes=0.2)
    indices[0, 1:] = -1  # a single key
    out = flash_mla_v4.sparse_sink_attention(q, kv, indices, sinks, SCALE)
    ref = torch_ref.sparse_sink_attention(q.float(), kv.float(), indices, sinks, SCALE)
    assert out.shape == (t, heads, 512)
    assert rel_err(out, ref) < TOL


def fp8_pages(blocks: int, entries: int, g: torch.Generator) -> torch.Tensor:
    values = (torch.randn(blocks * entries, 512, generator=g, device="cuda") / 4).bfloat16()
    pages = fp8_v4.allocate(blocks, entries, "cuda")
    triton_fp8_latent.write_v4(pages, values, torch.arange(blocks * entries, device="cuda"))
    return pages


@needs_flash_mla
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize(
    "rows,rate,topk", [(64, 4, 512), (512, 4, 512), (128, 128, 64), (7, 4, 200), (33, 0, 0)]
)
def test_sparse_fp8_decode_with_window_extra_matches_reference(heads, rows, rate, topk):
    """Compressed entries (CSA rate 4: 32 per 128-token block; HCA rate 128: one per block,
    a padded block) as the main cache with ids scattered among -1s, the sliding window of 128
    as the extra cache; rate 0: a sliding-only layer, the window alone."""
    g = torch.Generator(device="cuda").manual_seed(heads * 3 + rows + rate)
    blocks, block = 100, 128
    window_pages = fp8_pages(blocks, block, g)
    window = sparse_ids(rows, 128, blocks * block, g, holes=0.1)
    comp_pages = comp = None
    if rate:
        entries = block // rate
        comp_pages = fp8_pages(blocks, entries, g)
        comp = sparse_ids(rows, topk, blocks * entries, g, holes=0.3)
        comp[0] = -1  # a row that sees no compressed entry yet
    q = torch.randn(rows, heads, 512, generator=g, device="cuda").bfloat16()
    sinks = torch.randn(heads, generator=g, device="cuda")
    args = (window_pages, window, comp_pages, comp, sinks, SCALE)
    out = flash_mla_v4.sparse_sink_attention_fp8(q, *args)
    ref = fp8_v4.sparse_sink_attention(q.float(), *args)
    assert out.shape == (rows, heads, 512)
    assert rel_err(out, ref) < TOL


@needs_flash_mla
@pytest.mark.parametrize("rows,rate,topk", [(1, 128, 64), (512, 128, 64), (64, 0, 0)])
def test_layers_sharing_their_ids_share_packed_ids_and_schedule(rows, rate, topk):
    """The layers of one kind in a forward (V4's HCA layers of a rate, its sliding ones) pass
    one `state`: the second layer, over its own pages and queries, reuses the first's packed
    ids and schedule and gets what a fresh call gets."""
    g = torch.Generator(device="cuda").manual_seed(rows + rate)
    blocks, block = 64, 128
    window = sparse_ids(rows, 128, blocks * block, g, holes=0.1)
    comp = sparse_ids(rows, topk, blocks * (block // rate), g, holes=0.3) if rate else None
    state: dict = {}
    for layer in range(3):
        window_pages = fp8_pages(blocks, block, g)
        comp_pages = fp8_pages(blocks, block // rate, g) if rate else None
        q = torch.randn(rows, 64, 512, generator=g, device="cuda").bfloat16()
        sinks = torch.randn(64, generator=g, device="cuda")
        args = (window_pages, window, comp_pages, comp, sinks, SCALE)
        shared = flash_mla_v4.sparse_sink_attention_fp8(q, *args, state=state)
        assert torch.equal(shared, flash_mla_v4.sparse_sink_attention_fp8(q, *args)), layer
    assert flash_mla_v4.PACKED in state and flash_mla_v4.SCHEDULE in state


def row_errs(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each row's relative Frobenius error [T] (a whole-tensor norm hides one wrong row)."""
    diff = (out.float() - ref.float()).flatten(1).norm(dim=1)
    return diff / ref.float().flatten(1).norm(dim=1).clamp_min(1e-6)


@needs_flash_mla
@pytest.mark.parametrize("rows,rate,topk", [(48, 4, 64), (300, 4, 512), (40, 128, 64)])
def test_sparse_fp8_decode_rows_do_not_depend_on_their_batch(rows, rate, topk):
    """Each row batched with others (FlashMLA plans its splits by the batch) against the same
    row alone and against the reference, row by row: the FP8 decode kernel serves decode rows
    alone and batched, and a row reading wrong keys in some batch would move that request's
    tokens. Rows of 1 to `topk` compressed entries and 1 to 128 window keys."""
    g = torch.Generator(device="cuda").manual_seed(rows + rate)
    heads, blocks, block = 64, 100, 128
    window_pages = fp8_pages(blocks, block, g)
    comp_pages = fp8_pages(blocks, block // rate, g)
    window = sparse_ids(rows, 128, blocks * block, g, holes=0.0)
    comp = sparse_ids(rows, topk, blocks * (block // rate), g, holes=0.0)
    cols = torch.arange(128, device="cuda")
    window = window.masked_fill(
        cols >= torch.randint(1, 129, (rows, 1), generator=g, device="cuda"), -1
    )
    cols = torch.arange(topk, device="cuda")
    comp = comp.masked_fill(
        cols >= torch.randint(0, topk + 1, (rows, 1), generator=g, device="cuda"), -1
    )
    q = torch.randn(rows, heads, 512, generator=g, device="cuda").bfloat16()
    sinks = torch.randn(heads, generator=g, device="cuda")
    batched = flash_mla_v4.sparse_sink_attention_fp8(
        q, window_pages, window, comp_pages, comp, sinks, SCALE
    )
    alone = torch.cat([
        flash_mla_v4.sparse_sink_attention_fp8(
            q[i : i + 1], window_pages, window[i : i + 1], comp_pages, comp[i : i + 1], sinks, SCALE
        )
        for i in range(rows)
    ])  # fmt: skip
    ref = fp8_v4.sparse_sink_attention(
        q.float(), window_pages, window, comp_pages, comp, sinks, SCALE
    )
    worst_alone, worst_ref = (
        row_errs(batched, alone).max().item(),
        row_errs(batched, ref).max().item(),
    )
    print(f"rows {rows}: worst row against alone {worst_alone:.2e}, reference {worst_ref:.2e}")
    assert worst_ref < TOL and worst_alone < TOL, (worst_alone, worst_ref)


@pytest.mark.skipif(triton_fp8_latent.triton is None, reason="needs triton")
@pytest.mark.parametrize("entries", [128, 32, 1])
def test_fused_v4_quantize_on_write_matches_torch_pack(entries):
    """The fused kernel writes the same bytes at the same slots as the torch pack, over a wide
    range of magnitudes, and leaves every other entry alone."""
    g = torch.Generator(device="cuda").manual_seed(entries)
    blocks = max(8, 600 // entries)
    n = min(300, blocks * entries)
    values = torch.randn(n, 512, generator=g, device="cuda")
    values = (values * torch.logspace(-4, 2, n, device="cuda")[:, None]).bfloat16()
    slots = torch.randperm(blocks * entries, generator=g, device="cuda")[:n]
    fused = fp8_v4.allocate(blocks, entries, "cuda")
    ref = fp8_v4.allocate(blocks, entries, "cuda")
    raw = torch.randint(0, 255, ref.view(torch.uint8).shape, generator=g, device="cuda")
    for pages in (fused, ref):  # the same garbage everywhere first
        pages.view(torch.uint8).copy_(raw.to(torch.uint8))
        fp8_v4._parts(pages)[1][..., 7] = 0  # the unused scale byte, which neither writes
    triton_fp8_latent.write_v4(fused, values, slots)
    fp8_v4.write_reference(ref, values, slots)
    assert torch.equal(fused.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(fp8_v4.read(fused, slots).float(), fp8_v4.read(ref, slots).float())


@pytest.mark.parametrize("copies", [1, 2])
def test_fused_v4_write_with_rows_matches_torch(copies):
    """The latent's write with a CSA layer's compressor and indexer inputs copied beside it at
    the same slots (V4-Flash's widths, strided columns of one projection): the same bytes as
    the torch pack and index_copy_, the other slots untouched."""
    g = torch.Generator(device="cuda").manual_seed(copies)
    blocks, entries, n = 16, 64, 300
    values = torch.randn(n, 512, generator=g, device="cuda").bfloat16()
    slots = torch.randperm(blocks * entries, generator=g, device="cuda")[:n]
    parts = torch.randn(n, 2048 + 512, generator=g, device="cuda").bfloat16().split([2048, 512], 1)
    fused, ref = fp8_v4.allocate(blocks, entries, "cuda"), fp8_v4.allocate(blocks, entries, "cuda")
    dsts = [torch.randn(blocks * entries, w, generator=g, device="cuda").bfloat16()
            for w in (2048, 512)][:copies]  # fmt: skip
    rows = tuple(zip(dsts, parts))
    want = [d.clone().index_copy_(0, slots, s) for d, s in rows]
    triton_fp8_latent.write_v4(fused, values, slots, rows)
    fp8_v4.write_reference(ref, values, slots)
    assert torch.equal(fused.view(torch.uint8), ref.view(torch.uint8))
    for (got, _), expected in zip(rows, want):
        assert torch.equal(got, expected)
