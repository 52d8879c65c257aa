"""DeepSeek-V4 with an FP8 KV cache (FlashMLA's 584-byte layout) on CPU: the pack / unpack round
trip and byte layout, the cache's quantize-on-write, the bytes a block costs, the refusal of a
shape the layout cannot hold, and the FP8 stages' logits against the same stages on an
unquantized cache (the torch reference of the FP8 attention, which reads the pages at the
addresses the kernel would, then dequantizes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from stages.forward_batch import ForwardBatch
from stages.kernels import fp8_indexer, fp8_v4, indexer_select, triton_fp8_latent
from stages.kernels.fp8_v4_layout import BLOCK_ALIGN, ENTRY_BYTES, VALUE_BYTES, block_bytes
from stages.kernels.registry import select_kernels
from stages.kv_cache import bytes_per_block, make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import load_model_args
from stages.models.deepseek_v4.cache import V4Cache
from stages.models.deepseek_v4.config import COMP, INDEX_KEYS, KV
from stages.partition import layer_ranges
from tests.deepseek_v4_ref import TINY_V4, write_checkpoint

BLOCK = 16
# TINY_V4 at V4's head dim and rope width, which the FP8 layout holds (448 + 64)
FP8_V4 = dict(TINY_V4, head_dim=512, partial_rotary_factor=0.125, index_head_dim=64)
PROMPT = torch.randint(2, 96, (45,), generator=torch.Generator().manual_seed(7)).tolist()
# K = V in e4m3 under power-of-two scales per 64 values: each value within 1/16 of itself. This
# random tiny checkpoint amplifies that through its 4 layers to about 12 % on the logits
# (measured), so 0.2 bounds quantization; the wiring itself is checked exactly against the
# unquantized cache holding the same rounded values (the same operations in the same order).
LOGITS_TOL = 0.2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("v4fp8") / "m"), FP8_V4)


def test_pack_round_trip_and_byte_layout():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(24, 512, generator=g) * torch.rand(24, 1, generator=g) * 4
    values[3] = 0  # an all-zero entry: the floor scale, zeros back
    rows, scales = fp8_v4.quantize(values)
    back = fp8_v4.dequantize(rows, scales).float()
    assert torch.equal(back[:, 448:], values[:, 448:].bfloat16().float())  # rope kept in bf16
    scale = (scales[:, :7].int() << 23).view(torch.float32)  # e8m0: the exponent field
    err = (back[:, :448] - values[:, :448]).abs().view(24, 7, 64)
    bound = values[:, :448].abs().view(24, 7, 64) / 16 + scale[..., None] / 1024
    assert (err <= bound).all() and torch.equal(back[3], torch.zeros(512))
    assert (scales[:, 7] == 0).all()
    # pages of 3 blocks x 5 entries: values at 576 i in the block, scales at 576 * 5 + 8 i
    pages = fp8_v4.allocate(3, 5, "cpu")
    assert pages.shape == (3, 5, 1, ENTRY_BYTES)
    assert pages.stride(0) == block_bytes(5) == 6 * BLOCK_ALIGN
    slots = torch.tensor([7, 0, 14])
    fp8_v4.write_reference(pages, values[:3], slots)
    raw = pages.view(torch.uint8).as_strided((3 * block_bytes(5),), (1,))
    for j, slot in enumerate(slots.tolist()):
        block, i = divmod(slot, 5)
        base = block * block_bytes(5)
        assert torch.equal(raw[base + VALUE_BYTES * i : base + VALUE_BYTES * (i + 1)], rows[j])
        at = base + VALUE_BYTES * 5 + 8 * i
        assert torch.equal(raw[at : at + 8], scales[j])
    assert torch.equal(fp8_v4.read(pages, slots), fp8_v4.dequantize(rows[:3], scales[:3]))
    # the write entry point (the fused kernel's torch path on CPU) stores the same bytes
    other = fp8_v4.allocate(3, 5, "cpu")
    triton_fp8_latent.write_v4(other, values[:3], slots)
    assert torch.equal(other.view(torch.uint8), pages.view(torch.uint8))


def test_bytes_per_block_and_refusals(checkpoint):
    args = load_model_args(checkpoint)
    a, b = args.family_args, BLOCK
    d, di = a.head_dim, a.index_head_dim
    # layers: sliding, CSA (rate 4), HCA (rate 8), CSA; kv and comp packed, blocks padded; the
    # indexer's keys in FP8 (di e4m3 bytes and a float32 scale each)
    kv, comp4, comp8 = block_bytes(b), block_bytes(b // 4), block_bytes(b // 8)
    csa = kv + comp4 + 2 * (b * 4 * d + b * 4 * di) + (b // 4) * (di + 4)
    hca = kv + comp8 + 2 * b * 2 * d
    assert bytes_per_block(args, range(0, 4), b, torch.bfloat16, "fp8") == kv + csa + hca + csa
    tiny = load_model_args(write_checkpoint(str(checkpoint) + "-tiny", TINY_V4))
    with pytest.raises(ValueError, match="448 no-rope"):
        make_kv_cache(tiny, range(0, 4), 4, BLOCK, torch.float32, "cpu", "fp8")


class Pipeline:
    """Stages of one checkpoint chained in process (PP=2), each with its own paged cache."""

    def __init__(self, path: str, kv_cache_dtype: str, prefill_in_place: bool = False):
        args = load_model_args(path)
        kernels = select_kernels("cpu")
        if prefill_in_place:  # chunks on the FP8 attention too (--fp8-prefill-attention flash-mla)
            kernels = replace(kernels, names={**kernels.names, "mla_prefill_fp8": "flash-mla"})
        self.stages, self.caches = [], []
        for s, (a, b) in enumerate(layer_ranges(args.num_hidden_layers, 2)):
            self.stages.append(
                build_stage_model(args, path, a, b, s == 0, s == 1, kernels, torch.float32, "cpu")
            )
            self.caches.append(
                make_kv_cache(args, range(a, b), 12, BLOCK, torch.float32, "cpu", kv_cache_dtype)
            )

    @torch.no_grad()
    def logits(self, token_ids: list[int], rows) -> torch.Tensor:
        batch = ForwardBatch.build(rows, BLOCK)
        ids = torch.tensor(token_ids, dtype=torch.long)
        x = ids
        for stage, cache in zip(self.stages, self.caches):
            x = stage(x, batch, cache, None if stage.is_first else ids)
        return self.stages[-1].compute_logits(x)


def _chunked_then_decode(pipe: Pipeline) -> tuple[torch.Tensor, list[int]]:
    """Odd chunks (group boundaries inside them) on scattered blocks, then 4 greedy steps."""
    table = [9, 2, 7, 0, 11]
    start, outs = 0, []
    for n in (7, 13, 9, 16):
        outs.append(pipe.logits(PROMPT[start : start + n], [(start, n, table, False)]))
        start += n
    tokens = [int(outs[-1][-1].argmax())]
    for _ in range(4):
        out = pipe.logits([tokens[-1]], [(len(PROMPT) + len(tokens) - 1, 1, table, True)])
        tokens.append(int(out[0].argmax()))
    return torch.cat(outs), tokens


@pytest.mark.parametrize("in_place", [False, True], ids=["chunks-dequantized", "chunks-in-place"])
def test_fp8_kv_logits_close_to_the_unquantized_cache(checkpoint, monkeypatch, in_place):
    """Chunked prefill and decode on FP8 pages against the unquantized cache: logits within
    quantization tolerance; and against the unquantized cache fed the values the FP8 pages
    hold (each kv / comp value, and the indexer's keys and queries, rounded through FP8),
    where only the reading differs: equal to the bit. Chunks read their keys dequantized (the
    bf16 prefill kernel's path) or, in_place, the pages at the keys' traced addresses as
    decode rows do, whose torch reference attends over the gathered pool's columns in its
    order: a bound on fp32 noise would not hold on every CPU (an AVX2 EPYC measured 2.9e-4,
    and a score near the indexer's ReLU edge turns noise into another selection)."""
    fp8 = Pipeline(checkpoint, "fp8", in_place)
    assert fp8.caches[0].fp8 and fp8.caches[0].pages(0, "kv").shape[-1] == ENTRY_BYTES
    got, _tokens = _chunked_then_decode(fp8)
    want, _tokens = _chunked_then_decode(Pipeline(checkpoint, "auto"))
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < LOGITS_TOL

    write = V4Cache.write

    def write_rounded(self, local, name, values, slots):
        if name in (KV, COMP):
            values = fp8_v4.dequantize(*fp8_v4.quantize(values)).to(values.dtype)
        if name == INDEX_KEYS:
            values = fp8_indexer.dequantize(*fp8_indexer.quantize(values)).to(values.dtype)
        write(self, local, name, values, slots)

    score = indexer_select.logits_rows_reference

    def score_rounded(q, keys, weights, scale, plan, maxima=None):  # the queries FP8 too
        q8, q_scale = fp8_indexer.quantize_queries(q)
        return score(q8.float() * q_scale[..., None], keys, weights, scale, plan, maxima)

    monkeypatch.setattr(V4Cache, "write", write_rounded)
    monkeypatch.setattr(indexer_select, "logits_rows_reference", score_rounded)
    rounded, _tokens = _chunked_then_decode(Pipeline(checkpoint, "auto"))
    assert torch.equal(got, rounded)


def test_chunk_beside_decode_rows_equals_the_chunk_alone(checkpoint):
    """Over FP8 pages a forward holding a prefill chunk and decode rows splits them
    (V4Backend.split_fp8): the chunk's logits equal those of the same chunk in a forward of its
    own (its keys gathered dequantized either way), and the decode rows' those of a
    decode-only forward. Two requests on their own blocks: A (a 30-token prefix, then a
    chunk of 15 whose CSA groups straddle the cut) and B, C decoding, C past A's HCA entries
    (the chunk's HCA columns are cut to its own rows' width)."""
    a_table, b_table, c_table = [9, 2, 7, 0], [5, 11], [3, 4, 1, 6]
    b_prompt, c_prompt = PROMPT[:20], (PROMPT + PROMPT)[:50]

    def prefill(pipe: Pipeline) -> None:
        pipe.logits(PROMPT[:30], [(0, 30, a_table, False)])
        pipe.logits(b_prompt, [(0, len(b_prompt), b_table, False)])
        pipe.logits(c_prompt, [(0, len(c_prompt), c_table, False)])

    alone, mixed = Pipeline(checkpoint, "fp8"), Pipeline(checkpoint, "fp8")
    prefill(alone)
    prefill(mixed)
    chunk, decode = PROMPT[30:45], [PROMPT[20], PROMPT[23]]
    want_chunk = alone.logits(chunk, [(30, 15, a_table, True)])
    want_decode = alone.logits(decode, [(20, 1, b_table, True), (50, 1, c_table, True)])
    got = mixed.logits(
        [decode[0], *chunk, decode[1]],
        [(20, 1, b_table, True), (30, 15, a_table, True), (50, 1, c_table, True)],
    )
    want = torch.cat((want_decode[:1], want_chunk, want_decode[1:]))
    # fp32 GEMMs of 17 rows and of 15 round apart on the CPU (2e-6 measured on one CPU, as with
    # a bf16 cache; 8e-4 on an AVX-512 one, where such a difference moved a key across an e4m3
    # rounding boundary); a chunk query given another row's keys moves its logits by tenths
    assert (got - want).abs().max().item() < 1e-2


def test_flash_backends_fall_back_to_the_reference_saying_why_once(caplog):
    """A call FlashMLA cannot take (here fp32 queries) runs the torch reference; the reason is
    logged once, not per layer, and counted per call (tests/cpu/test_kernel_fallbacks.py)."""
    from stages.kernels import flash_mla_v4, torch_ref
    from stages.kernels.fallbacks import FALLBACKS

    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(3, 4, 512, generator=g), torch.randn(10, 512, generator=g)
    indices, sinks = torch.tensor([[0, 3, -1], [1, -1, -1], [9, 8, 7]]), torch.zeros(4)
    caplog.set_level("WARNING", logger="stages.kernels.fallbacks")
    FALLBACKS.reset()
    for _ in range(2):
        out = flash_mla_v4.sparse_sink_attention(q, kv, indices, sinks, 0.1)
    assert torch.equal(out, torch_ref.sparse_sink_attention(q, kv, indices, sinks, 0.1))
    assert len([r for r in caplog.records if "queries in torch.float32" in r.message]) == 1
    assert FALLBACKS.counts() == {("sparse_sink_attention", "flash-mla", "dtype"): 2}
    FALLBACKS.reset()


def test_csa_picks_keep_the_contract_flash_mla_takes_them_by(checkpoint):
    """What the FP8 attention's FlashMLA backend takes for granted of a CSA layer's picks
    (stages/kernels/flash_mla_v4.py: no sort, one schedule for the forward's CSA layers): in
    a decode-only forward of rows of several lengths (one with fewer compressed entries than
    index_topk), each row's -1 are at its end, and every call sharing a schedule_state has the
    same window and the same count of picks in each row. Recorded on the op's torch form, on
    one stage holding both CSA layers."""
    args = load_model_args(checkpoint)
    calls: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
    reference = fp8_v4.sparse_sink_attention

    def recorded(q, window_pages, window, comp_pages, comp, sinks, scale, **kw):
        calls.append((window.clone(), None if comp is None else comp.clone(), kw))
        return reference(q, window_pages, window, comp_pages, comp, sinks, scale, **kw)

    kernels = replace(select_kernels("cpu"), sparse_sink_attention_fp8=recorded)
    layers = args.num_hidden_layers
    stage = build_stage_model(
        args, checkpoint, 0, layers, True, True, kernels, torch.float32, "cpu"
    )
    cache = make_kv_cache(args, range(layers), 12, BLOCK, torch.float32, "cpu", "fp8")
    tables = {9: [0], 20: [1, 2], 50: [3, 4, 5, 6], 30: [7, 8]}

    def run(tokens, rows):
        with torch.no_grad():
            batch = ForwardBatch.build(rows, BLOCK)
            stage(torch.tensor(tokens, dtype=torch.long), batch, cache, None)

    for n, table in tables.items():
        run((PROMPT * 2)[:n], [(0, n, table, False)])
    calls.clear()
    run([5, 6, 7, 8], [(n, 1, table, True) for n, table in tables.items()])
    picked = [(w, c, kw) for w, c, kw in calls if kw.get("comp_counts") is not None]
    assert len(picked) == sum(
        kind == "compressed_sparse_attention" for kind in TINY_V4["layer_types"]
    )
    k = TINY_V4["index_topk"]
    counts = [(c >= 0).sum(dim=1) for _, c, _ in picked]
    assert counts[0].tolist() == [min(k, (n + 1) // 4) for n in tables]  # a row short of k
    for window, comp, kw in picked:
        valid = comp >= 0
        assert torch.equal(valid, valid.cummin(dim=1).values)  # no pick after a -1
        assert torch.equal(kw["comp_counts"], valid.sum(dim=1, dtype=torch.int32))
        first_window, _, first_kw = picked[0]
        assert kw["schedule_state"] is first_kw["schedule_state"]
        assert torch.equal(window, first_window)
    assert all(torch.equal(c, counts[0]) for c in counts)
