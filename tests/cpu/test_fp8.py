"""FP8 on CPU: the block-scaled weight and 1x128 activation quantizers against a per-tile loop,
the W8A8 reference against fp32 matmul, a V3.2 stage keeping FP8 weights (W8A8 on the torch
reference) against the dequantized one, and the FP8 latent cache against the bf16 one through
chunked prefill and decode. The tiny V3.2 has the real latent shape (512 + 64: the FP8 layout's)
and 128-aligned widths (the W8A8 blocks)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.bench.fp8 import StageChain
from stages.forward_batch import ForwardBatch
from stages.kernels import fp8_ref, mxfp4
from stages.kernels.registry import select_kernels
from stages.kv_cache import bytes_per_token_layer
from stages.loader import build_stage_model, keep_fp8_weights, stage_memory_plan
from stages.model_config import load_model_args
from stages.models.deepseek_config import INDEXER_KEY
from stages.models.dsa import SparseRows

W8A8_TOL = 0.06  # relative Frobenius error of e4m3 on both operands (3 mantissa bits)
# a 3-layer random model's logits while attention is dense (prompts up to index_topk): its
# indexer turns small differences into other selected keys further on
LOGITS_TOL = 0.06
BLOCK = 4  # KV block size of the in-process pipelines


def tile_loop_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's checkpoint quantizer written tile by tile (the independent reference)."""
    n, k = w.shape
    scale = torch.empty(-(-n // block), -(-k // block))
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block].float()
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scale[i, j]).to(
                q.dtype
            )
    return q, scale


def test_weight_quantization_round_trip():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 260, generator=g) * torch.logspace(-3, 1, 300)[:, None]).bfloat16()
    q, s = fp8_ref.quantize_weight(w)
    want_q, want_s = tile_loop_quantize(w, 128)
    assert s.shape == (3, 3) and torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    back = fp8_ref.dequantize_weight(q, s)
    tile_max = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260] * 448
    # e4m3: half a unit in the last place is at most 1/16 of a value; nothing exceeds its tile
    err = (back - w.float()).abs()
    assert (err <= w.float().abs() / 16 + tile_max * 2**-9).all()
    stacked = torch.stack((w, -w))  # experts: one scale grid per matrix
    qs, ss = fp8_ref.quantize_weight(stacked)
    assert torch.equal(ss[1], s) and torch.equal(fp8_ref.dequantize_weight(qs, ss)[1], -back)


def test_activation_quantization_and_w8a8_against_fp32():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 448, generator=g) * torch.logspace(-2, 2, 37)[:, None]
    q, s = fp8_ref.quantize_act(x)
    assert q.dtype == fp8_ref.FP8 and s.shape == (37, 4)  # 1 x 128 groups, the last ragged
    err = (fp8_ref.dequantize_act(q, s) - x).abs()
    assert (err <= x.abs() / 16 + s.repeat_interleave(128, 1)[:, :448] * 448 * 2**-9).all()
    w = torch.randn(200, 448, generator=g) / 20
    wq, ws = fp8_ref.quantize_weight(w)
    bias = torch.randn(200, generator=g)
    out = fp8_ref.linear(x.bfloat16(), wq, ws, bias.bfloat16())
    want = x @ w.T + bias
    assert out.dtype == torch.bfloat16 and out.shape == (37, 200)
    rel = ((out.float() - want).norm() / want.norm()).item()
    assert 1e-3 < rel < W8A8_TOL  # quantized, within FP8 precision


def tiny_v32_config():
    import transformers as tf

    return tf.DeepseekV32Config(
        vocab_size=200,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        q_lora_rank=128,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        index_topk=8,
        index_n_heads=2,
        index_head_dim=64,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.02,
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny V3.2 in fp32 and its FP8 form (every 2-D projection and expert stack)."""
    import transformers as tf

    root = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    plain = str(root / "plain")
    tf.DeepseekV32ForCausalLM(tiny_v32_config()).float().save_pretrained(plain)
    tensors = load_file(os.path.join(plain, "model.safetensors"))
    for name in list(tensors):
        if (
            name.endswith(
                (
                    "proj.weight",
                    "mqa.weight",
                    "experts.gate_up_proj",
                    "experts.down_proj",
                    "wq_b.weight",
                    "wk.weight",
                )
            )
            and "weights_proj" not in name
        ):
            tensors[name], tensors[name + "_scale_inv"] = fp8_ref.quantize_weight(tensors[name])
    fp8 = root / "fp8"
    fp8.mkdir()
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(plain, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    }
    (fp8 / "config.json").write_text(json.dumps(cfg))
    return {"plain": plain, "fp8": str(fp8)}


def Pipeline(path: str, fp8_weights: bool = False, kv_cache_dtype: str = "auto") -> StageChain:
    return StageChain(
        load_model_args(path), path, fp8_weights, kv_cache_dtype, num_blocks=32, block_size=BLOCK
    )


PROMPT = [(7 * i + 3) % 197 + 3 for i in range(30)]  # past index_topk: the indexer selects


def weight_only(x, weight, scale_inv, bias=None):
    return torch.nn.functional.linear(
        x, fp8_ref.dequantize_weight(weight, scale_inv).to(x.dtype), bias
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fp8_weights_kept_match_dequantized(checkpoints, caplog):
    """A stage keeping the checkpoint's FP8 bytes (W8A8 on the torch reference) against the
    same checkpoint dequantized at load (CPU's path): logits within FP8 tolerance."""
    caplog.set_level("INFO", logger="stages.loader")
    kept = Pipeline(checkpoints["fp8"], fp8_weights=True)
    assert any("FP8 weights kept for W8A8" in r.message for r in caplog.records)
    layer = kept.stages[0].layers["1"]
    assert layer.self_attn.q_a_proj.weight.dtype == fp8_ref.FP8
    assert layer.mlp.experts.fp8 and layer.mlp.experts.gate_up_proj.dtype == fp8_ref.FP8
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.float32  # absorbed: kept in dtype
    stored = load_file(os.path.join(checkpoints["fp8"], "model.safetensors"))
    assert torch.equal(
        layer.self_attn.q_a_proj.weight.view(torch.uint8),
        stored["model.layers.1.self_attn.q_a_proj.weight"].view(torch.uint8),
    )
    dequantized = Pipeline(checkpoints["fp8"])
    table = list(range(32))
    want = dequantized.logits(PROMPT, [(0, len(PROMPT), table, True)])
    # W8A8 with the activations left unquantized is the dequantized model exactly: every
    # kept weight and scale sits where it belongs (experts included)
    for stage in kept.stages:
        for module in stage.modules():
            if hasattr(module, "kernels"):
                unfused = {"fp8_linear": weight_only, "fp8_swiglu_linear": None}
                module.kernels = replace(module.kernels, **unfused)
    assert torch.equal(kept.logits(PROMPT, [(0, len(PROMPT), table, True)]), want)
    # W8A8: within FP8 tolerance
    kept = Pipeline(checkpoints["fp8"], fp8_weights=True)
    short = PROMPT[:4]
    got = kept.logits(short, [(0, 4, table, True)])
    want = dequantized.logits(short, [(0, 4, table, True)])
    assert 0 < rel(got, want) < LOGITS_TOL and got.argmax() == want.argmax()
    # a bf16 checkpoint with --quantization fp8: quantized at load, the same bytes
    online = Pipeline(checkpoints["plain"], fp8_weights=True)
    assert torch.equal(
        online.stages[0].layers["1"].self_attn.q_a_proj.weight.view(torch.uint8),
        layer.self_attn.q_a_proj.weight.view(torch.uint8),
    )


def test_mxfp4_experts_are_dequantized_or_quantized_to_fp8_at_load(checkpoints, tmp_path):
    """MXFP4 experts (V4's format, recognised from the tensors): the dequantized values in the
    model's dtype, or, in a stage keeping FP8 weights, those values quantized blockwise."""
    tensors = load_file(os.path.join(checkpoints["plain"], "model.safetensors"))
    values = {}
    for name in [n for n in tensors if re.search(r"\.experts\.\d+\.\w+_proj\.weight$", n)]:
        packed, scale = mxfp4.quantize(tensors[name])
        values[name] = mxfp4.dequantize(packed, scale)
        tensors[name] = packed.view(torch.int8)
        tensors[name + "_scale_inv"] = scale.view(torch.float8_e8m0fnu)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(checkpoints["plain"], "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    up = values["model.layers.1.mlp.experts.3.up_proj.weight"]  # rows I.. of expert 3's stack
    held = Pipeline(str(tmp_path)).stages[0].layers["1"].mlp.experts.gate_up_proj
    assert held.dtype == torch.float32 and torch.equal(held[3, 128:], up)
    kept = Pipeline(str(tmp_path), fp8_weights=True).stages[0].layers["1"].mlp.experts
    q, scale = fp8_ref.quantize_weight(up)
    assert kept.gate_up_proj.dtype == fp8_ref.FP8
    assert torch.equal(kept.gate_up_proj[3, 128:].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(kept.gate_up_proj_scale_inv[3, 1:], scale)


def test_fp8_kv_cache_matches_bf16_cache(checkpoints):
    """V3.2 with the 656-byte FP8 latent (quantized on write, dequantized by the torch
    reference of the FP8 sparse kernel) and FP8 indexer keys (read by the indexer's torch
    reference) against the unquantized cache: logits within FP8 tolerance while attention is
    dense; past index_topk (chunked prefill, then decode, fed the bf16 run's greedy tokens)
    within a looser bound: this random model's indexer scores are close together, so FP8's error
    changes some selected keys, and its near-flat logits make argmax agreement a coin toss (2 to
    4 of 6 steps, by which tied keys a top-k keeps); test_fp8_keys_select_the_bf16_keys_top_k
    isolates the selection."""
    fp8 = Pipeline(checkpoints["plain"], kv_cache_dtype="fp8")
    plain = Pipeline(checkpoints["plain"])
    assert fp8.caches[0].pages(0).dtype == torch.uint8 and fp8.caches[0].pages(0).shape[-1] == 656
    keys = fp8.caches[0].pages(0, INDEXER_KEY)
    assert keys.dtype == torch.uint8 and keys.shape[-1] == 64 + 4
    tokens = plain.greedy(PROMPT, chunk=7, steps=6)
    _, want = plain.follow(PROMPT, 7, tokens[:-1])
    _, got = fp8.follow(PROMPT, 7, tokens[:-1])
    assert rel(got, want) < 0.5
    dense = PROMPT[:8]  # a fresh row in each: blocks 0-1 are rewritten
    got = fp8.logits(dense, [(0, 8, list(range(32)), True)])
    want = plain.logits(dense, [(0, 8, list(range(32)), True)])
    assert 0 < rel(got, want) < LOGITS_TOL


def test_fp8_keys_select_the_bf16_keys_top_k(checkpoints):
    """A stage's DSA layer selecting over keys written through the FP8 cache (quantized on
    write) and through the bf16 one: the same top-k slots when the keys' scores are well apart
    (every key a positive multiple of one direction, 15 % apart in rank order, so each query's
    score orders keys by their multiple), for a chunk and a decode row. The head weights are
    made positive, so no query's heads cancel, and the direction's values are powers of two,
    so a key's FP8 rounding is its multiple's: neither the keys' nor the FP8 queries'
    rounding can then reorder keys whose scores are 15 % apart."""
    g = torch.Generator().manual_seed(3)
    caches, picked = {}, {}
    for dtype in ("fp8", "auto"):
        chain = Pipeline(checkpoints["plain"], kv_cache_dtype=dtype)
        attn, kv = chain.stages[0].layers["0"].self_attn, chain.caches[0]
        attn.indexer.weights_proj.weight.data.abs_()
        caches[dtype] = kv
        g.manual_seed(3)
        # powers of two: each key rounds through e4m3 as its multiple does, staying one
        u = torch.randn(64, generator=g).sign() * 2.0 ** torch.randint(-2, 2, (64,), generator=g)
        magnitude = 1.15 ** (torch.randperm(128, generator=g).float() - 64)
        kv.write(0, magnitude[:, None] * u, torch.arange(128), INDEXER_KEY)
        # a chunk of 12 tokens from position 40, and a decode row at position 60 (its own
        # blocks); x and q_resid random: queries and head weights from the layer's indexer
        rows = [(40, 12, list(range(0, 32)), True), (60, 1, list(range(16, 32)), True)]
        batch = ForwardBatch.build(rows, BLOCK, "cpu")
        sparse = SparseRows.build(batch, BLOCK, 8, torch.device("cpu"))
        x = torch.randn(13, 128, generator=g).abs()
        q_resid = torch.randn(13, 128, generator=g)
        cos, sin = torch.ones(13, 32), torch.zeros(13, 32)
        chosen = attn.backend.select(attn, x, q_resid, cos, sin, sparse, kv, 0)
        picked[dtype] = chosen.sort(-1).values
    assert caches["fp8"].pages(0, INDEXER_KEY).dtype == torch.uint8
    assert (picked["fp8"] >= 0).all() and torch.equal(picked["fp8"], picked["auto"])


def test_kv_bytes_and_refusals(checkpoints):
    """Bytes per token follow the cache dtype; dense MLA (V3) refuses an FP8 cache, saying it
    stays bfloat16 and why; FP8 weights are dequantized at load on CPU."""
    args = load_model_args(checkpoints["plain"])
    assert bytes_per_token_layer(args, torch.bfloat16) == (576 + 64) * 2
    # the FP8 latent and the FP8 indexer key (64 e4m3 values and a float32 scale)
    assert bytes_per_token_layer(args, torch.bfloat16, "fp8") == 656 + 64 + 4
    v3 = replace(
        args, model_type="deepseek_v3", family_args=replace(args.family_args, indexer=None)
    )
    with pytest.raises(ValueError, match="bfloat16.*FlashMLA's dense FP8 decode"):
        bytes_per_token_layer(v3, torch.bfloat16, "fp8")
    fp8_args = load_model_args(checkpoints["fp8"])
    assert not keep_fp8_weights(fp8_args, "auto", "cpu")
    assert not keep_fp8_weights(fp8_args, "none", "cuda")
    assert keep_fp8_weights(fp8_args, "auto", "cuda") and keep_fp8_weights(args, "fp8", "cuda")
    with pytest.raises(ValueError, match="quantization"):
        keep_fp8_weights(args, "int4", "cuda")


def test_memory_plan_counts_what_the_stage_holds(checkpoints):
    """The per-stage figures come from the stage modules themselves (built on the meta
    device): FP8 weights take a byte per value plus a scale per 128 x 128 tile."""
    args = load_model_args(checkpoints["plain"])
    bf16 = stage_memory_plan(args, 2, fp8_weights=False)
    fp8 = stage_memory_plan(args, 2, fp8_weights=True, kv_cache_dtype="fp8")
    assert [s.layers for s in bf16] == [(0, 2), (2, 3)]
    model = build_stage_model(
        args, checkpoints["plain"], 2, 3, False, True, select_kernels("cpu"), torch.bfloat16, "cpu"
    )
    held = [*model.parameters(), *model.buffers()]
    assert bf16[1].weight_bytes == sum(t.numel() * t.element_size() for t in held)
    assert fp8[1].weight_bytes < 0.7 * bf16[1].weight_bytes
    assert fp8[0].kv_bytes_per_token == 2 * (656 + 68) and bf16[0].kv_bytes_per_token == 2 * 1280
    assert bf16[0].max_tokens(bf16[0].weight_bytes + 2 * 1280 * 10) == 10


def test_memory_table_counts_mxfp4_experts_of_a_v4_checkpoint():
    """A V4 config whose experts are MXFP4: the plan counts them as the loader holds them,
    packed (half a byte a value and a scale byte per 32) by default and widened with
    mxfp4_experts dequantize; the table prints every row (the FP8 KV columns whether the family
    has an FP8 cache or not) and the experts' bytes both ways, the per-GPU table both columns."""
    from app.bench import memory
    from stages.model_config import ModelArgs
    from tests.deepseek_v4_ref import TINY_V4

    config = dict(TINY_V4, model_type="deepseek_v4", expert_dtype="fp4")
    args = ModelArgs.from_hf_dict(config)
    plan = stage_memory_plan(args, 2, fp8_weights=False, mxfp4_experts="keep")
    wide = stage_memory_plan(args, 2, fp8_weights=False, mxfp4_experts="dequantize")
    experts = TINY_V4["n_routed_experts"] * 3 * TINY_V4["moe_intermediate_size"]
    values = TINY_V4["num_hidden_layers"] * experts * TINY_V4["hidden_size"]
    assert sum(s.routed_expert_values for s in plan) == values
    assert sum(s.routed_expert_bytes for s in plan) == values * 17 // 32  # packed + scales
    assert sum(s.routed_expert_bytes for s in wide) == 2 * values  # held in bf16
    assert sum(s.weight_bytes for s in wide) - sum(s.weight_bytes for s in plan) == (
        2 * values - values * 17 // 32
    )
    lines = memory.table(config, pp_sizes=(2,)).splitlines()
    assert [line.split(" | ")[:2] for line in lines[2:4]] == [["| 2", "bf16"], ["| 2", "FP8"]]
    assert lines[-1].startswith("Routed experts:") and "held packed" in lines[-1]
    gpu = memory.per_gpu_table(config, ((2, 1),)).splitlines()[2].split(" | ")
    fp8_plan = stage_memory_plan(args, 2, True, mxfp4_experts="keep")  # no FP8 KV at this size
    assert gpu[3] == f"{max(s.weight_bytes for s in fp8_plan) / 1e9:,.1f}"


def test_prefill_over_dequantized_prefix_keys_matches_the_fp8_reference(checkpoints):
    """A DSA layer over FP8 pages with mla_prefill_fp8's dequantizing backend
    (flash_mla.mla_sparse_fp8_via_bf16: the chunks' prefix keys dequantized, the indices mapped
    onto them; its bf16 kernel is torch_ref's for fp32 queries), for two chunks beside a decode
    row, their tables sharing a block (a cached prefix): the chunks' tokens go to it, the
    decode row's to mla_sparse_fp8, and together they equal fp8_latent.mla_sparse over the
    pages. Only the chunks' prefixes are dequantized."""
    from stages.kernels import flash_mla, fp8_latent

    g = torch.Generator().manual_seed(4)
    blocks, topk = 24, 8
    pages = fp8_latent.quantize(torch.randn(blocks * BLOCK, 576, generator=g) * 3)
    pages = pages.view(blocks, BLOCK, 1, fp8_latent.BYTES)
    rows = [
        (40, 12, [3, 0, 7, 9, 1, 4, 11, 2, 5, 6, 8, 10, 12], True),
        (9, 1, [3, 20, 21], True),
        (0, 6, [3, 13], True),
    ]
    batch = ForwardBatch.build(rows, BLOCK, "cpu")
    sparse = SparseRows.build(batch, BLOCK, topk, torch.device("cpu"))
    assert len(sparse.prefixes) == 2 and sparse.split is not None
    assert sparse.split[1].tolist() == [12]  # the decode row's one token
    picks = []
    for start, n, table, _ in rows:
        prefix = torch.tensor([b * BLOCK + o for b in table for o in range(BLOCK)])
        for i in range(n):
            visible = prefix[: start + i + 1]
            chosen = visible[torch.randperm(visible.numel(), generator=g)[:topk]]
            picks.append(torch.nn.functional.pad(chosen, (0, topk - chosen.numel()), value=-1))
    indices = torch.stack(picks).int()
    q = torch.randn(batch.num_tokens, 4, 576, generator=g)
    attn = Pipeline(checkpoints["plain"], kv_cache_dtype="fp8").stages[0].layers["0"].self_attn
    kernels = attn.kernels
    attn.kernels = replace(kernels, mla_prefill_fp8=flash_mla.mla_sparse_fp8_via_bf16)
    try:
        got = attn.backend.fp8_attention(attn, q, pages, indices, sparse)
    finally:
        attn.kernels = kernels
    slots, position = sparse.state[flash_mla.PREFIX_KEYS]
    # the chunks' 52 and 6 positions; 4 of the second's are the first's (block 3)
    assert slots.numel() == 52 + 6 and (position >= 0).sum() == 52 + 2
    want = fp8_latent.mla_sparse(q, pages, indices, 512, attn.scale, {})
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_fp8_moe_tiles_follow_the_rows_an_expert_gets():
    """Prefill chunks (at least 128 rows an expert on average) take the sweep's 128-row tiles;
    decode batches keep the 64-row ones, which pad less."""
    from stages.kernels import triton_moe_fp8 as moe

    assert moe.tiles_for(8192 * 6, 256) == moe.tiles_for(4096 * 6, 64) == moe.PREFILL_TILES
    assert moe.tiles_for(512 * 6, 256) == moe.tiles_for(512 * 6, 64) == moe.DECODE_TILES
