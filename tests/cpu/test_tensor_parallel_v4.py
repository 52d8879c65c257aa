"""DeepSeek-V4 on tensor-parallel stages (`--tp 2`) on CPU ranks (gloo): each rank holds whole
output groups of query heads (their sinks and o_a / o_b slices), half the routed experts, half
the shared expert's columns and half the vocabulary; the compressors, indexers, routers (a hash
layer's table), hyper-connections and the cache are whole on both. The split stages chained give
transformers' logits in one chunk (PP 1 and 2, hash-routed layers on the first and on a later
stage), in chunks with boundaries inside compression groups and in greedy decode, and the
decode-only microbatches on the graphs' static buffers (V4Plan.paged) give TP=1's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from stages.decode_graphs import DecodeGraphs
from stages.forward_batch import ForwardBatch
from stages.kernels import fp8_ref
from stages.kernels.registry import kernel_target, select_kernels
from stages.kv_cache import bytes_per_block, make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import load_model_args
from stages.partition import layer_ranges
from stages.protocol import Row
from stages.tensor_parallel import TensorParallel
from tests.cpu.test_deepseek_v4_vs_hf import BLOCK, PROMPT, TOL
from tests.cpu.tp_ranks import RankPool
from tests.deepseek_v4_ref import SECOND_V4, TINY_V4, write_checkpoint

# SECOND_V4's three output groups do not split over two ranks: two groups of three heads (it
# keeps its biased shared expert, tied head and a hash layer on the second PP stage)
SECOND_TP_V4 = dict(SECOND_V4, o_groups=2)
CONFIGS = {"tiny": TINY_V4, "second": SECOND_TP_V4}
# Widths whose halves stay 128-aligned (two heads of 64 per rank): every linear one rank keeps
# in FP8 two ranks keep too, on the same 128 x 128 tiles and 1 x 128 activation groups
FP8_TP_V4 = dict(
    TINY_V4, hidden_size=256, moe_intermediate_size=256, head_dim=64, q_lora_rank=128,
    o_lora_rank=128,
)  # fmt: skip
CHUNKS = (7, 1, 13, 3, 5, 16)  # boundaries inside CSA and HCA groups
DECODE_STEPS = 3
# paged decode: rows on both sides of the window, of both rates' group boundaries and of the
# indexer's top-k (tiny: window 8, rates 4 and 8, index_topk 3)
PAGED_LENGTHS = (1, 7, 15, 22)
PAGED_STEPS = 6


class SplitPipeline:
    """One rank's stages of a checkpoint chained in process (the streams between stages are
    whole on every rank), each with its own cache (whole entries: Family.rank_args)."""

    def __init__(self, path, num_stages, tp: TensorParallel, num_blocks=12):
        args = load_model_args(path)
        kernels = select_kernels("cpu")
        cache_args = args.family.rank_args(args, tp.size)
        self.stages, self.caches = [], []
        for s, (a, b) in enumerate(layer_ranges(args.num_hidden_layers, num_stages)):
            first, last = s == 0, s == num_stages - 1
            self.stages.append(
                build_stage_model(
                    args, path, a, b, first, last, kernels, torch.float32, "cpu", tp=tp
                )
            )
            self.caches.append(
                make_kv_cache(cache_args, range(a, b), num_blocks, BLOCK, torch.float32, "cpu")
            )

    @torch.no_grad()
    def logits(self, token_ids, rows, all_positions=False):
        batch = ForwardBatch.build(rows, BLOCK)
        ids = torch.tensor(token_ids, dtype=torch.long)
        x = ids
        for stage, cache in zip(self.stages, self.caches):
            # later stages with hash layers get the ids as the runner forwards them
            x = stage(x, batch, cache, None if stage.is_first else ids)
        return self.stages[-1].compute_logits(x if all_positions else x[batch.sample_indices])


def prompt_logits(tp, path, num_stages):
    pipe = SplitPipeline(path, num_stages, tp)
    n = len(PROMPT)
    return pipe.logits(PROMPT, [(0, n, list(range(4)), True)], all_positions=True)


def chunks_then_decode(tp, path):
    """PROMPT in CHUNKS over scattered blocks on PP=2 (every position's logits), then
    DECODE_STEPS greedy steps: (the chunks' logits, the tokens fed, the steps' logits)."""
    pipe = SplitPipeline(path, 2, tp)
    table = [9, 2, 7, 0, 11]
    start, outs = 0, []
    for n in CHUNKS:
        part = PROMPT[start : start + n]
        outs.append(pipe.logits(part, [(start, n, table, False)], all_positions=True))
        start += n
    tokens, steps = [int(outs[-1][-1].argmax())], []
    for i in range(DECODE_STEPS):
        steps.append(pipe.logits([tokens[-1]], [(len(PROMPT) + i, 1, table, True)])[0])
        tokens.append(int(steps[-1].argmax()))
    return torch.cat(outs), tokens[:-1], torch.stack(steps)


def paged_decode(tp, path, block_size):
    """PAGED_LENGTHS prefilled as one batch (non-consecutive blocks), then PAGED_STEPS greedy
    steps, each on DecodeGraphs' eager paged path (V4Plan.paged) and then on the general path
    (the same values rewritten): their logits [steps, rows, vocab] each."""
    args = load_model_args(path)
    kernels = select_kernels("cpu", linear="torch", attention="torch")
    layers = args.num_hidden_layers
    model = build_stage_model(
        args, path, 0, layers, True, True, kernels, torch.float32, "cpu", tp=tp
    )
    need = [-(-(n + PAGED_STEPS) // block_size) for n in PAGED_LENGTHS]
    num_blocks = sum(need) + 1  # the last one: the padding rows' scratch block
    cache_args = args.family.rank_args(args, tp.size)
    kv = make_kv_cache(cache_args, range(layers), num_blocks, block_size, torch.float32, "cpu")
    ids = list(range(num_blocks - 1))
    order = ids[1::2] + ids[::2]
    tables, first = [], 0
    for n in need:
        tables.append(order[first : first + n])
        first += n
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, args.vocab_size, (n,), generator=g).tolist() for n in PAGED_LENGTHS]

    def general(tokens, rows):
        batch = ForwardBatch.build(rows, block_size, "cpu", args.family.attention_prefixes)
        h = model(torch.tensor(tokens), batch, kv)
        return model.compute_logits(h[batch.sample_indices])

    paged, plain = [], []
    with torch.inference_mode():
        logits = general(
            [t for p in prompts for t in p],
            [(0, n, table, True) for n, table in zip(PAGED_LENGTHS, tables)],
        )
        graphs = DecodeGraphs(
            model, kv, num_slots=len(PAGED_LENGTHS), max_model_len=64,
            scratch_slot=(num_blocks - 1) * block_size,
            hidden_shape=args.family.hidden_shape(args), dtype=torch.float32,
            device=torch.device("cpu"), is_first=True, max_rows=8, eager=True,
        )  # fmt: skip
        graphs.update_tables([(i, 0, tuple(t)) for i, t in enumerate(tables)])
        by_req = {str(i): t for i, t in enumerate(tables)}
        for step in range(PAGED_STEPS):
            nxt = logits.argmax(dim=-1).tolist()
            starts = [n + step for n in PAGED_LENGTHS]
            rows = tuple(
                Row(str(i), i, s, 1, None, sample=True, is_prefill=False)
                for i, s in enumerate(starts)
            )
            key = graphs.bucket_for(rows)
            out = graphs.run(key, rows, torch.tensor(nxt), by_req)
            paged.append(model.compute_logits(out).clone())
            logits = general(nxt, [(s, 1, t, True) for s, t in zip(starts, tables)])
            plain.append(logits)
    return torch.stack(paged), torch.stack(plain)


def weight_only(x, weight, scale_inv, bias=None):
    """An FP8 linear that leaves its activations unquantized (W8A8 rounds them to e4m3, where
    the last bit of a sum's order can flip a value's rounding)."""
    w = fp8_ref.dequantize_weight(weight, scale_inv).to(x.dtype)
    return torch.nn.functional.linear(x, w, bias)


def fp8_prompt_logits(tp, path):
    """PROMPT's logits with FP8 weights kept (their activations unquantized: weight_only), and
    the names of the parameters held in FP8."""
    args = load_model_args(path)
    kernels = select_kernels("cpu", fp8_linear="torch")
    layers = args.num_hidden_layers
    model = build_stage_model(
        args, path, 0, layers, True, True, kernels, torch.float32, "cpu", tp=tp
    )
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = replace(module.kernels, fp8_linear=weight_only, fp8_swiglu_linear=None)
    cache_args = args.family.rank_args(args, tp.size)
    kv = make_kv_cache(cache_args, range(layers), 4, BLOCK, torch.float32, "cpu")
    batch = ForwardBatch.build([(0, len(PROMPT), list(range(3)), True)], BLOCK)
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(PROMPT), batch, kv))
    return logits, sorted(n for n, p in model.named_parameters() if p.dtype == fp8_ref.FP8)


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool(2)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_v4")
    return {name: write_checkpoint(str(root / name), cfg) for name, cfg in CONFIGS.items()}


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    from transformers import DeepseekV4ForCausalLM

    return {
        name: DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, path in checkpoints.items()
    }


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_split_v4_stages_match_hf(ranks, checkpoints, hf_models, name, num_stages):
    with torch.no_grad():
        want = hf_models[name](torch.tensor([PROMPT])).logits[0]
    got = ranks.run(prompt_logits, checkpoints[name], num_stages)
    assert torch.equal(got[0], got[1])  # the ranks agree bit for bit: they sample alike
    assert (got[0] - want).abs().max().item() <= TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_split_v4_chunks_then_decode_match_hf(ranks, checkpoints, hf_models, name):
    (chunks, tokens, steps), other = ranks.run(chunks_then_decode, checkpoints[name])
    assert torch.equal(chunks, other[0]) and torch.equal(steps, other[2])
    with torch.no_grad():
        ref = hf_models[name](torch.tensor([PROMPT + tokens])).logits[0]
    n = len(PROMPT)
    assert (chunks - ref[:n]).abs().max().item() <= TOL
    assert (steps - ref[n:]).abs().max().item() <= TOL


def test_split_v4_paged_decode_matches_one_rank(ranks, checkpoints):
    """TINY_V4 (hash layers 0-1, CSA, HCA): TP=2's paged decode == its general path and ==
    TP=1's paged decode."""
    path = checkpoints["tiny"]
    (paged, plain), other = ranks.run(paged_decode, path, 8)
    assert torch.equal(paged, other[0]) and torch.equal(plain, other[1])
    one, _ = paged_decode(TensorParallel(), path, 8)
    for got in (plain, one):
        assert (paged - got).abs().max().item() <= 1e-4 * max(1.0, got.abs().max().item())
        assert torch.equal(paged.argmax(-1), got.argmax(-1))


def test_split_v4_keeps_fp8_weights(ranks, tmp_path):
    """The rank's query heads, output groups, experts and shared-expert columns kept in FP8
    (128-aligned slices of the same tiles, quantized at load): TP=2 == TP=1 up to fp32
    rounding."""
    path = write_checkpoint(str(tmp_path / "fp8"), FP8_TP_V4)
    (got, held), other = ranks.run(fp8_prompt_logits, path)
    want, one_held = fp8_prompt_logits(TensorParallel(), path)
    assert torch.equal(got, other[0]) and held == one_held
    for name in ("q_b_proj.weight", "o_b_proj.weight", "shared_experts.down_proj.weight"):
        assert f"layers.3.self_attn.{name}" in held or f"layers.3.mlp.{name}" in held
    assert "layers.3.mlp.experts.gate_up_proj" in held
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


def test_rank_holds_its_groups_and_caches_whole_entries(checkpoints):
    """A rank's attention holds whole output groups and their heads, its kernels are sized for
    them (kernel_target), its cache is the whole model's; groups that two ranks cannot share
    are refused when the stage is built."""
    args = load_model_args(checkpoints["second"])
    kernels = select_kernels("cpu")
    rank = TensorParallel(1, 2)  # building needs no group: only a forward does
    stage = build_stage_model(args, None, 0, 2, True, False, kernels, torch.float32, "cpu", tp=rank)
    attn = stage.layers["0"].self_attn
    assert (attn.groups, attn.heads, attn.sinks.shape[0]) == (1, 3, 3)
    assert attn.q_b_proj.weight.shape[0] == 3 * args.family_args.head_dim
    assert stage.layers["0"].mlp.experts.first == 3
    shapes = kernel_target(args.family.rank_args(args, 2), "bfloat16", BLOCK).shapes
    assert shapes["sparse_sink_attention"].heads == 3
    assert shapes["indexer_logits_rows"].heads == args.family_args.index_n_heads  # whole
    cache_args = args.family.rank_args(args, 2)
    layers = range(args.num_hidden_layers)
    assert bytes_per_block(cache_args, layers, BLOCK, torch.bfloat16) == bytes_per_block(
        args, layers, BLOCK, torch.bfloat16
    )
    odd = load_model_args(write_checkpoint(str(checkpoints["second"]) + "_odd", SECOND_V4))
    with pytest.raises(ValueError, match=r"o_groups \(3\) is not divisible by the tensor"):
        build_stage_model(odd, None, 0, 2, True, False, kernels, torch.float32, "cpu", tp=rank)
