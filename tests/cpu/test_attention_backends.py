"""Each attention backend (stages/attention/base.py) on a batch mixing decode rows and prefill
chunks of staggered lengths (around the block size, DSA's top-k, V4's window and compression
groups) == the torch reference: GQA's paged K/V and MLA's dense latent against naive attention
over each row's whole prefix; MLA's sparse latent against naive attention over the slots its
indexer selects; the sparse and V4 backends' stage forward against each row alone. The decode
graphs' static batches (static_batch, prepare inside the graph) equal the general path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stages.attention.paged_kv import PagedKVBackend
from stages.forward_batch import ForwardBatch
from stages.kernels.registry import select_kernels
from stages.kv_cache import PagedKVCache, make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import ModelArgs, load_model_args
from stages.models.families import DEEPSEEK, DEEPSEEK_V4, LLAMA, QWEN3_MOE, GraphSetting
from stages.protocol import Row
from tests.cpu.conftest import DSA_SPARSE_TOPK, cpu_context, deepseek_config, hf_config
from tests.cpu.test_attention_ref import naive_attention
from tests.cpu.test_fp8 import tiny_v32_config
from tests.deepseek_v4_ref import TINY_V4, write_checkpoint

BS = 4
# (prefix already cached, new tokens): decode rows at and around the block boundary, chunks
# starting mid-block and at 0, a chunk crossing DSA_SPARSE_TOPK (8) keys
ROWS = [(3, 1), (4, 1), (0, 6), (5, 1), (7, 3), (8, 1), (2, 9)]


def _tables(rows, per_row=6):
    ids = list(range(len(rows) * per_row))
    order = ids[1::2] + ids[::2]  # each row's blocks non-consecutive
    return [order[i * per_row : (i + 1) * per_row] for i in range(len(rows))]


def _slots(table, length, bs=BS):
    return torch.tensor([table[p // bs] * bs + p % bs for p in range(length)], dtype=torch.long)


def _mixed(rows, tables, bs=BS, prefixes=True):
    spec = [(start, n, t, True) for (start, n), t in zip(rows, tables)]
    return ForwardBatch.build(spec, bs, "cpu", prefixes, decode=[n == 1 for _s, n in rows])


def _static(backend, rows, tables, bs=BS, scratch=0):
    """The decode graphs' batch of one bucket over `rows` (all decode rows), as DecodeGraphs
    fills it before a replay."""
    bucket = len(rows)
    meta = torch.tensor(
        backend.replay_meta(
            tuple(Row(str(i), i, s, 1, None, sample=True, is_prefill=False) for i, (s, _) in
                  enumerate(rows)),
            bucket, {str(i): t for i, t in enumerate(tables)}, bs, scratch,
        )
    )  # fmt: skip
    device_tables = torch.tensor(tables, dtype=torch.int32)
    return backend.static_batch(bucket, 0, meta, device_tables, bs, scratch)


def test_paged_kv_backend_equals_naive_attention_on_mixed_rows():
    args = ModelArgs.from_hf_dict(hf_config("llama").to_dict())
    ctx = cpu_context(args, range(0, 1), True, True)
    backend = args.family.attention_backend(args)(ctx)
    assert isinstance(backend, PagedKVBackend)
    hq, hkv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    layer = SimpleNamespace(kernels=ctx.kernels, scale=d**-0.5)
    tables = _tables(ROWS)
    kv = PagedKVCache(args, 1, len(ROWS) * 6 + 1, BS, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    full = []  # each row's K and V over its whole prefix, cached ones written first
    for (start, n), table in zip(ROWS, tables):
        k, v = torch.randn(2, start + n, hkv, d, generator=g)
        kv.write(0, k[:start], v[:start], _slots(table, start))
        full.append((k, v))
    batch = _mixed(ROWS, tables)
    assert batch.decode_groups  # the decode rows attend in padded groups
    t = batch.num_tokens
    q = torch.randn(t, hq, d, generator=g)
    new_k = torch.cat([k[s:] for (s, _n), (k, _v) in zip(ROWS, full)])
    new_v = torch.cat([v[s:] for (s, _n), (_k, v) in zip(ROWS, full)])
    out = backend.forward(layer, q, new_k, new_v, backend.prepare(batch, kv), kv, 0)
    for off, (k, v) in zip(batch.row_offsets, full):
        n = k.shape[0] - ROWS[batch.row_offsets.index(off)][0]
        want = naive_attention(q[off : off + n], k, v, layer.scale)
        torch.testing.assert_close(out[off : off + n], want, atol=1e-5, rtol=1e-5)
    # a lone row (no output copy) and the decode graphs' static batch of the decode rows
    lone = _mixed(ROWS[2:3], tables[2:3])
    off = batch.row_offsets[2]
    got = backend.forward(layer, q[off : off + 6], new_k[off : off + 6], new_v[off : off + 6],
                          backend.prepare(lone, kv), kv, 0)  # fmt: skip
    torch.testing.assert_close(got, out[off : off + 6], atol=1e-6, rtol=1e-6)
    decode = [i for i, (_s, n) in enumerate(ROWS) if n == 1]
    static = _static(backend, [ROWS[i] for i in decode], [tables[i] for i in decode])
    assert static.num_splits == 1  # one SM on the CPU
    idx = torch.tensor([batch.row_offsets[i] for i in decode])
    got = backend.forward(layer, q[idx], new_k[idx], new_v[idx], backend.prepare(static, kv),
                          kv, 0)  # fmt: skip
    torch.testing.assert_close(got, out[idx], atol=1e-5, rtol=1e-5)


def _deepseek_stage(arch, kv_cache_dtype="auto", bs=BS, blocks=64):
    config = tiny_v32_config() if arch == "v32_fp8_widths" else deepseek_config(arch)
    args = ModelArgs.from_hf_dict(config.to_dict())
    kernels = select_kernels("cpu", linear="torch", attention="torch")
    model = build_stage_model(args, None, 0, 1, True, True, kernels, torch.float32, "cpu", 3)
    kv = make_kv_cache(args, 1, blocks, bs, torch.float32, "cpu", kv_cache_dtype)
    return args, model, kv


def _fill_latent(kv, tables, rows, g, bs=BS):
    for (start, n), table in zip(rows, tables):
        kv.write(0, torch.randn(start + n, kv.pages(0).shape[-1], generator=g),
                 _slots(table, start + n, bs))  # fmt: skip


def test_mla_dense_backend_equals_the_expanded_reference():
    """Decode rows in the absorbed form (mla_decode), chunks expanded: both == every row's
    queries over its whole prefix expanded to per-head K/V (the naive form)."""
    args, model, kv = _deepseek_stage("ds_v3")
    backend, attn = model.attention, model.layers["0"].self_attn
    assert type(backend).__name__ == "MLADenseBackend"
    d, tables = args.family_args, _tables(ROWS)
    g = torch.Generator().manual_seed(1)
    _fill_latent(kv, tables, ROWS, g)
    batch = _mixed(ROWS, tables)
    t, h = batch.num_tokens, attn.heads
    q_nope = torch.randn(t, h, d.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(t, h, d.qk_rope_head_dim, generator=g)
    meta = backend.prepare(batch, kv)
    out = backend.forward(attn, q_nope, q_pe, meta, batch, kv, 0, torch.float32)
    q = torch.cat((q_nope, q_pe), dim=-1)
    for (start, n), off, table in zip(ROWS, batch.row_offsets, tables):
        want = attn.expanded(q[off : off + n], kv.gather(0, _slots(table, start + n)))
        torch.testing.assert_close(out[off : off + n], want, atol=1e-5, rtol=1e-5)
    decode = [i for i, (_s, n) in enumerate(ROWS) if n == 1]
    static = _static(backend, [ROWS[i] for i in decode], [tables[i] for i in decode])
    idx = torch.tensor([batch.row_offsets[i] for i in decode])
    got = backend.forward(attn, q_nope[idx], q_pe[idx], backend.prepare(static, kv), static, kv,
                          0, torch.float32)  # fmt: skip
    torch.testing.assert_close(got, out[idx], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_mla_sparse_backend_equals_naive_attention_over_the_selected_slots(kv_cache_dtype):
    """Rows within DSA_SPARSE_TOPK keys attend to their whole prefix, longer ones to their
    indexer's top-k: each token == naive absorbed attention over its selected slots; over the
    FP8 latent (prefill kernel for the chunks, decode kernel for the decode rows, split) too."""
    bs = BS if kv_cache_dtype == "auto" else 64
    blocks = 64 if kv_cache_dtype == "auto" else len(ROWS)
    arch = "ds_v32_sparse" if kv_cache_dtype == "auto" else "v32_fp8_widths"  # 512 + 64
    args, model, kv = _deepseek_stage(arch, kv_cache_dtype, bs, blocks)
    backend, attn = model.attention, model.layers["0"].self_attn
    assert type(backend).__name__ == "MLASparseBackend" and backend.topk == DSA_SPARSE_TOPK
    d, g = args.family_args, torch.Generator().manual_seed(2)
    tables = [[i] for i in range(len(ROWS))] if bs == 64 else _tables(ROWS)
    latent = kv.pages(0).shape[-1] if kv_cache_dtype == "auto" else d.latent_dim
    values = {}
    for (start, n), table in zip(ROWS, tables):
        slots = _slots(table, start + n, bs)
        values.update(zip(slots.tolist(), torch.randn(start + n, latent, generator=g) * 0.3))
        kv.write(0, torch.stack([values[s] for s in slots.tolist()]), slots)
    batch = _mixed(ROWS, tables, bs)
    t, h = batch.num_tokens, attn.heads
    x = torch.randn(t, args.hidden_size, generator=g)
    q_resid = torch.randn(t, d.q_lora_rank, generator=g)
    q_nope = torch.randn(t, h, d.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(t, h, d.qk_rope_head_dim, generator=g)
    cos, sin = torch.ones(t, d.qk_rope_head_dim // 2), torch.zeros(t, d.qk_rope_head_dim // 2)
    rows = backend.prepare(batch, kv)
    # some rows select; chunks beside decode rows (over FP8: split between the two kernels)
    assert rows.plan is not None and rows.chunked and rows.split is not None
    out = backend.forward(attn, x, q_nope, q_pe, q_resid, cos, sin, rows, batch, kv, 0)
    indices = backend.select(attn, x, q_resid, cos, sin, rows, kv, 0)
    stored = kv.gather(0, torch.tensor(sorted(values))).float()  # what the cache holds
    by_slot = dict(zip(sorted(values), stored))
    q = attn.absorbed_query(q_nope, q_pe).double()
    for i in range(t):
        chosen = [s for s in indices[i].tolist() if s >= 0]
        j = max(r for r, off in enumerate(batch.row_offsets) if off <= i)
        length = ROWS[j][0] + i - batch.row_offsets[j] + 1
        if length <= DSA_SPARSE_TOPK:  # the dense rule: the whole prefix
            assert sorted(chosen) == sorted(_slots(tables[j], length, bs).tolist())
        keys = torch.stack([by_slot[s] for s in chosen]).double()
        p = (q[i] @ keys.T * attn.scale).softmax(-1)
        want = attn.unabsorb((p @ keys[:, : d.kv_lora_rank]).float()[None], torch.float32)
        torch.testing.assert_close(out[i], want[0], atol=2e-4, rtol=2e-4)


V4_ROWS = [(7, 1), (8, 1), (3, 6), (15, 1), (6, 5), (21, 1), (0, 9)]  # window 8, rates 4, 8


def test_v4_backend_mixed_batch_equals_each_row_alone(tmp_path):
    """A V4 stage's forward over decode rows and chunks around the window and both rates'
    group boundaries in one batch == each row in a batch of its own."""
    args = load_model_args(write_checkpoint(str(tmp_path / "v4"), TINY_V4))
    kernels = select_kernels("cpu", linear="torch", attention="torch")
    layers = args.num_hidden_layers
    model = build_stage_model(args, None, 0, layers, True, True, kernels, torch.float32, "cpu", 3)
    assert type(model.attention).__name__ == "V4Backend"
    bs = 8
    kv = make_kv_cache(args, layers, 4 * len(V4_ROWS) + 1, bs, torch.float32, "cpu")
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(V4_ROWS))]
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        prefill = [(0, s, t, True) for (s, _n), t in zip(V4_ROWS, tables) if s]
        toks = torch.randint(3, args.vocab_size, (sum(r[1] for r in prefill),), generator=g)
        model(toks, ForwardBatch.build(prefill, bs, "cpu", False), kv)
        new = torch.randint(3, args.vocab_size, (sum(n for _s, n in V4_ROWS),), generator=g)
        batch = _mixed(V4_ROWS, tables, bs, prefixes=False)
        mixed = model(new, batch, kv)
        for j, ((start, n), table) in enumerate(zip(V4_ROWS, tables)):
            off = batch.row_offsets[j]
            alone = ForwardBatch.build([(start, n, table, True)], bs, "cpu", False)
            got = model(new[off : off + n], alone, kv)
            torch.testing.assert_close(got, mixed[off : off + n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", [LLAMA, QWEN3_MOE, DEEPSEEK, DEEPSEEK_V4])
def test_the_family_asks_its_backends_whether_its_decode_step_captures(family):
    """paged_decode_graphs = the family's other ops and every backend it may choose."""
    fast = {op: "fast" for op in select_kernels("cpu").names}
    for block, kv_dtype, dtype, names in [
        (64, "auto", "bfloat16", fast),
        (64, "fp8", "bfloat16", fast),
        (24, "auto", "bfloat16", fast),
        (64, "auto", "float32", fast),
        (64, "auto", "bfloat16", {**fast, "paged_decode": "torch"}),
        (64, "auto", "bfloat16", {**fast, "indexer_logits_rows": "torch"}),
    ]:
        s = GraphSetting(names, block, kv_dtype, dtype)
        backends = [family.attention_backend(args) for args in _family_args(family)]
        want = family.graph_ops(s) and all(b.can_capture(s) for b in backends)
        assert family.paged_decode_graphs(s) == want, (family.name, s)


def _family_args(family):
    if family is DEEPSEEK:
        return [
            ModelArgs.from_hf_dict(deepseek_config(a).to_dict()) for a in ("ds_v3", "ds_v32_sparse")
        ]
    if family is DEEPSEEK_V4:
        return [ModelArgs.from_hf_dict(dict(TINY_V4, model_type="deepseek_v4"))]
    return [
        ModelArgs.from_hf_dict(hf_config("qwen3_moe" if family is QWEN3_MOE else "llama").to_dict())
    ]
