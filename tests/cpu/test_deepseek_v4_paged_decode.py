"""DeepSeek-V4's decode-only microbatches on the static buffers its CUDA graphs replay
(V4Plan.paged: the window padded to its width, every rate's entries to the shape's longest row,
one compression group per row and rate) == the general path (V4Plan.build), on the torch
references: rows on both sides of the window, of each compression rate's group boundary and of
the indexer's top-k, over non-consecutive blocks, a bucket padded with rows of length 0; also
with FP8 weights and with the FP8 KV pages, and on a later stage whose hash-routed layer reads
its rows' token ids from the graphs' own buffer. tests/gpu/test_deepseek_v4_decode_graphs.py
captures the same cases on FlashMLA and the Triton kernels."""

from __future__ import annotations

import pytest
import torch

from stages.decode_graphs import DecodeGraphs
from stages.forward_batch import ForwardBatch, PagedDecodeBatch
from stages.kernels.registry import select_kernels
from stages.kv_cache import make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import ModelArgs, load_model_args
from stages.models.deepseek_v4.plan import V4Plan
from stages.protocol import Row
from tests.cpu.test_deepseek_paged_decode import decode_case
from tests.deepseek_v4_ref import TINY_V4, write_checkpoint

# window 8, rates 4 and 8, index_topk 3: over 10 steps rows cross the window, complete groups
# of both rates and pass three rate-4 entries (the indexer selects)
LENGTHS = (1, 7, 15, 3, 22)
STEPS = 10
FP8_KV_V4 = dict(TINY_V4, head_dim=512, partial_rotary_factor=0.125, index_head_dim=64)
FP8_WEIGHTS_V4 = dict(TINY_V4, hidden_size=128, moe_intermediate_size=128)
# two HCA layers of one rate: the second attends the FP8 slots the first traced (V4Plan.fp8_shared)
HCA = "heavily_compressed_attention"
FP8_KV_TWO_HCA = dict(FP8_KV_V4, layer_types=[HCA, "compressed_sparse_attention", HCA, HCA])


def _args(tmp_path, config: dict) -> ModelArgs:
    return load_model_args(write_checkpoint(str(tmp_path / "v4"), config))


@pytest.mark.parametrize(
    "config,fp8_weights,kv_cache_dtype",
    [
        (TINY_V4, False, "auto"),
        (FP8_WEIGHTS_V4, True, "auto"),
        (FP8_KV_V4, False, "fp8"),
        (FP8_KV_TWO_HCA, False, "fp8"),
    ],
    ids=["bf16_layout", "fp8_weights", "fp8_kv", "fp8_kv_shared_hca_slots"],
)
def test_v4_paged_decode_matches_the_general_path(tmp_path, config, fp8_weights, kv_cache_dtype):
    args = _args(tmp_path, config)
    kernels = select_kernels(
        "cpu", linear="torch", attention="torch", fp8_linear="torch" if fp8_weights else None
    )
    steps = decode_case(
        args, kernels, torch.float32, "cpu", 8, 64, LENGTHS, STEPS, False, kv_cache_dtype
    )
    # The paged shape's wider -1 padding changes the attention's summation order (bits); W8A8
    # activation rounding or the FP8 KV's can turn that into one e4m3 step of a value (on an
    # AVX2 host, one key of fp8_kv_shared_hca_slots at one step: 1.3e-4): looser bounds there.
    bound = 5e-2 if fp8_weights else 2e-3 if kv_cache_dtype == "fp8" else 1e-4
    for key, ref, paged, _ in steps:
        assert key == (8, 64)
        assert (paged - ref).abs().max().item() <= bound * max(1.0, ref.abs().max().item()), key
        assert torch.equal(paged.argmax(-1), ref.argmax(-1)), key


def test_paged_plan_groups_and_padding():
    """Per row and rate one group: its entry slot where the row's token completes it, else the
    scratch block's first entry; a padding row (length 0) sees no key."""
    args = ModelArgs.from_hf_dict(dict(TINY_V4, model_type="deepseek_v4"))
    window, bs = args.family_args.sliding_window, 8
    tables = torch.tensor([[3, 1, 0], [2, 0, 0]], dtype=torch.int32)
    lengths = torch.tensor([8, 0, 12])  # positions 7 (completes both rates), pad, 11 (rate 4)
    batch = PagedDecodeBatch(
        positions=(lengths - 1).clamp(min=0),
        slot_mapping=torch.zeros(3, dtype=torch.long),
        lengths=lengths,
        table_rows=torch.tensor([0, 1, 1]),
        block_tables=tables,
        block_size=bs,
        num_splits=1,
        select_width=24,
        scratch_slot=5 * bs,
    )
    rates = {4: (False, True), 8: (True, False)}
    plan = V4Plan.paged(batch, window, rates, select_kernels("cpu"))
    assert plan.window_indices[1].tolist() == [-1] * window
    assert plan.window_indices[0].tolist() == list(range(window))
    r4, r8 = plan.rates[4], plan.rates[8]
    # 2 entries per block at rate 4: row 2 completes entry 2, its table row's second block (0)
    assert r4.groups.entry_slots.tolist() == [3 * 2 + 1, 5 * 2, 0]
    assert r8.groups.entry_slots.tolist() == [3 * 1 + 0, 5, 5]
    assert r4.visible.tolist() == [2, 0, 3] and r4.max_entries == 6
    assert r8.dense_indices is not None and r8.dense_indices.shape == (3, window + 3)
    assert r8.dense_indices[1].tolist() == [-1] * (window + 3)


def test_later_stage_reads_token_ids_through_the_graph_buffers(tmp_path):
    """A stage after the first holding a hash-routed layer (TINY_V4's layer 1) decodes on the
    static buffers with its rows' token ids in their own buffer: == the general path given the
    same streams and ids; without the ids the graphs refuse."""
    args = _args(tmp_path, TINY_V4)
    kernels = select_kernels("cpu", linear="torch", attention="torch")
    model = build_stage_model(args, None, 1, 4, False, True, kernels, torch.float32, "cpu", 3)
    bs, rows = 8, 3
    kv = make_kv_cache(args, range(1, 4), 3 * rows + 1, bs, torch.float32, "cpu")
    tables = [[3 * r, 3 * r + 1, 3 * r + 2] for r in range(rows)]
    graphs = DecodeGraphs(
        model, kv, num_slots=rows, max_model_len=24, scratch_slot=3 * rows * bs,
        hidden_shape=args.family.hidden_shape(args), dtype=torch.float32,
        device=torch.device("cpu"), is_first=False, max_rows=4, eager=True, token_ids=True,
    )  # fmt: skip
    graphs.update_tables([(r, 0, tuple(t)) for r, t in enumerate(tables)])
    g = torch.Generator().manual_seed(2)
    starts = [5, 11, 16]
    with torch.inference_mode():
        for r, start in enumerate(starts):  # each row's prefix, as a stage-0 output would be
            streams = torch.randn(start, *args.family.hidden_shape(args), generator=g)
            ids = torch.randint(3, args.vocab_size, (start,), generator=g)
            batch = ForwardBatch.build([(0, start, tables[r], True)], bs, "cpu", False)
            model(streams, batch, kv, ids)
        streams = torch.randn(rows, *args.family.hidden_shape(args), generator=g)
        ids = torch.randint(3, args.vocab_size, (rows,), generator=g)
        decode = tuple(
            Row(str(r), r, s, 1, None, sample=True, is_prefill=False) for r, s in enumerate(starts)
        )
        key = graphs.bucket_for(decode)
        assert key == (4, 24)
        by_req = {str(r): t for r, t in enumerate(tables)}
        with pytest.raises(ValueError, match="token ids"):
            graphs.run(key, decode, streams, by_req)
        paged = graphs.run(key, decode, streams, by_req, ids).clone()
        batch = ForwardBatch.build(
            [(s, 1, t, True) for s, t in zip(starts, tables)], bs, "cpu", False
        )
        general = model(streams, batch, kv, ids)
    assert (paged - general).abs().max().item() <= 1e-5
