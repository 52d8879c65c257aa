"""Tensor-parallel stages (`--tp 2`) on CPU ranks (gloo): each rank loads its slices only, and
the split stages chained give transformers' logits, in one chunk, in chunks and in a decode
step, for the Llama family (GQA, qwen2's biases, qwen3's q/k norms, a tied head) and Qwen3-MoE
(experts split whole over the ranks)."""

from __future__ import annotations

import pytest
import torch

from stages.forward_batch import ForwardBatch
from stages.kernels.registry import select_kernels
from stages.kv_cache import make_kv_cache
from stages.loader import build_stage_model, stage_memory_plan
from stages.model_config import load_model_args
from stages.partition import layer_ranges
from stages.tensor_parallel import TensorParallel
from tests.cpu.conftest import ARCHS, QWEN3_MOE_ARCHS, hf_model, write_tiny_checkpoints
from tests.cpu.test_shards_vs_hf import PROMPT, TABLE, TOL
from tests.cpu.tp_ranks import RankPool

TP_ARCHS = (*ARCHS, *QWEN3_MOE_ARCHS)


class SplitPipeline:
    """One rank's stages of a checkpoint chained in process (the hidden state between stages
    is whole on every rank), each with its own cache of the rank's K/V heads."""

    def __init__(self, path, num_stages, tp: TensorParallel, block_size=4, num_blocks=16):
        args = load_model_args(path)
        kernels = select_kernels("cpu")
        self.block_size = block_size
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
                make_kv_cache(cache_args, b - a, num_blocks, block_size, torch.float32, "cpu")
            )

    @torch.no_grad()
    def logits(self, token_ids, rows, all_positions=False):
        batch = ForwardBatch.build(rows, self.block_size, "cpu")
        x = torch.tensor(token_ids, dtype=torch.long)
        for stage, cache in zip(self.stages, self.caches):
            x = stage(x, batch, cache)
        return self.stages[-1].compute_logits(x if all_positions else x[batch.sample_indices])


def prompt_logits(tp, path, num_stages):
    pipe = SplitPipeline(path, num_stages, tp)
    n = len(PROMPT)
    return pipe.logits(PROMPT, [(0, n, list(range(8)), True)], all_positions=True)


def chunks_then_decode(tp, path, num_stages, chunk):
    """PROMPT in chunks of `chunk`, then one decode step after its greedy token: the last
    chunk's and the decode step's logits."""
    pipe = SplitPipeline(path, num_stages, tp, num_blocks=12)
    for start in range(0, len(PROMPT), chunk):
        part = PROMPT[start : start + chunk]
        last = pipe.logits(part, [(start, len(part), TABLE, True)])
    token = int(last[0].argmax())
    step = pipe.logits([token], [(len(PROMPT), 1, TABLE, True)])
    return last[0], token, step[0]


def held_bytes(tp, path):
    """The rank's parameter and buffer bytes of a one-stage model."""
    stage = SplitPipeline(path, 1, tp).stages[0]
    return sum(t.numel() * t.element_size() for t in [*stage.parameters(), *stage.buffers()])


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool(2)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("tp"), TP_ARCHS)


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("arch", TP_ARCHS)
def test_split_stages_match_hf(ranks, checkpoints, arch, num_stages):
    with torch.no_grad():
        want = hf_model(arch)(torch.tensor([PROMPT])).logits[0].float()
    got = ranks.run(prompt_logits, checkpoints[arch], num_stages)
    assert torch.equal(got[0], got[1])  # the ranks agree bit for bit: they sample alike
    assert (got[0] - want).abs().max().item() <= TOL


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_chunks_then_decode_match_hf(ranks, checkpoints, arch):
    (last, token, step), other = ranks.run(chunks_then_decode, checkpoints[arch], 2, 5)
    assert torch.equal(step, other[2])
    model = hf_model(arch)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT + [token]])).logits[0]
    assert (last - ref[-2]).abs().max().item() <= TOL
    assert (step - ref[-1]).abs().max().item() <= TOL


def test_each_rank_holds_half(ranks, checkpoints):
    """Heads, MLP columns, experts and the vocabulary are split: each rank holds about half
    the weights (the norms and the routers are whole on both)."""
    whole = held_bytes(TensorParallel(), checkpoints["qwen3_moe"])
    halves = ranks.run(held_bytes, checkpoints["qwen3_moe"])
    assert halves[0] == halves[1]
    assert 0.5 * whole < halves[0] < 0.55 * whole
    # the memory plan (bench memory --pp-tp) counts what a rank holds, and half the K/V heads
    args = load_model_args(checkpoints["qwen3_moe"])
    (one,) = stage_memory_plan(args, 1, False, dtype=torch.float32)
    (rank,) = stage_memory_plan(args, 1, False, dtype=torch.float32, tp_size=2)
    assert (one.weight_bytes, rank.weight_bytes) == (whole, halves[0])
    assert rank.kv_bytes_per_token * 2 == one.kv_bytes_per_token


def test_heads_that_do_not_divide_are_refused(checkpoints):
    """Widths that three ranks cannot share (two K/V heads, 128 MLP columns): a clear error
    when the stage is built."""
    args = load_model_args(checkpoints["llama"])
    with pytest.raises(ValueError, match=r"\(128\) is not divisible by the tensor-parallel size 3"):
        build_stage_model(
            args, None, 0, 4, True, True, select_kernels("cpu"), torch.float32, "cpu",
            tp=TensorParallel(0, 3),
        )


def test_a_rank_reads_its_slices_only(checkpoints, tensor_reads):
    """Rank 1 of 2 reads half of every split tensor (its rows or columns of the linears, its
    experts, its vocabulary rows) and the whole of the rest (norms, the router)."""
    from safetensors import safe_open

    path = checkpoints["qwen3_moe"]
    args = load_model_args(path)
    build_stage_model(args, path, 0, 4, True, True, select_kernels("cpu"), torch.float32, "cpu",
                      tp=TensorParallel(1, 2))
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        whole = {n: f.get_slice(n).get_shape() for n in f.keys()}
    def kept_whole(name: str) -> bool:  # norms, routers, and experts (each on one rank)
        return name.endswith(("norm.weight", ".gate.weight")) or ".experts." in name

    for name, values in tensor_reads.values.items():
        total = torch.Size(whole[name]).numel()
        assert values == (total if kept_whole(name) else total // 2), name
    split = {n for n in whole if not kept_whole(n)}  # attention, dense MLP, embedding, head
    assert split <= set(tensor_reads) and len(split) == 21
    experts = {n for n in whole if ".experts." in n}
    assert len(experts & set(tensor_reads)) * 2 == len(experts)  # half the experts
