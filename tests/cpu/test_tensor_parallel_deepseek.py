"""DeepSeek-V2/V3/V3.2 on tensor-parallel stages (`--tp 2`) on CPU ranks (gloo): MLA's query
heads split (q_proj / q_b_proj and kv_b_proj by heads, o_proj by its input columns), the latent
and V3.2's indexer whole on every rank, routed experts split whole, shared experts and dense
MLPs by columns. The split stages chained give transformers' logits (prefill expanded, decode
absorbed, V3.2's sparse selection), the ranks agree bit for bit, and the paged decode path
(DecodeGraphs' static buffers, eager) gives the one-rank result."""

from __future__ import annotations

import pytest
import torch

from stages.kernels.registry import kernel_target, select_kernels
from stages.kv_cache import bytes_per_token_layer
from stages.loader import build_stage_model
from stages.model_config import ModelArgs, load_model_args
from stages.models.deepseek_config import DeepseekArgs
from stages.tensor_parallel import TensorParallel
from tests.cpu.conftest import (
    DEEPSEEK_ARCHS,
    deepseek_config,
    hf_model,
    hf_prompt_logits,
    write_tiny_checkpoints,
)
from tests.cpu.test_deepseek_paged_decode import FP8_V32, LENGTHS, STEPS, decode_case
from tests.cpu.test_shards_vs_hf import PROMPT, TOL
from tests.cpu.test_tensor_parallel import SplitPipeline, chunks_then_decode, prompt_logits
from tests.cpu.tp_ranks import RankPool


def paged_decode_steps(tp, arch, kv_cache_dtype="auto"):
    """decode_case's steps on the torch references: (graph key, general path's logits, the
    paged path's) per step. arch "fp8_v32": V3.2 with the FP8 latent's shape."""
    config = FP8_V32 if arch == "fp8_v32" else deepseek_config(arch).to_dict()
    args = ModelArgs.from_hf_dict(config)
    kernels = select_kernels("cpu", linear="torch", attention="torch")
    steps = decode_case(
        args, kernels, torch.float32, "cpu", 4, 64, LENGTHS, STEPS, False, kv_cache_dtype, tp
    )
    return [(key, general, paged) for key, general, paged, _ in steps]


def attention_widths(tp, path):
    """Rows of the first layer's attention weights the rank holds, by parameter."""
    pipe = SplitPipeline(path, 1, tp)
    attn = pipe.stages[0].layers["0"].self_attn
    return {n: p.shape[0] for n, p in attn.named_parameters() if n.endswith("weight")}


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool(2)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("tp_ds"), DEEPSEEK_ARCHS)


@pytest.fixture(scope="module")
def hf_logits():
    return hf_prompt_logits(DEEPSEEK_ARCHS, PROMPT)


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_split_stages_match_hf(ranks, checkpoints, hf_logits, arch, num_stages):
    got = ranks.run(prompt_logits, checkpoints[arch], num_stages)
    assert torch.equal(got[0], got[1])  # the ranks agree bit for bit: they sample alike
    assert (got[0] - hf_logits[arch]).abs().max().item() <= TOL


@pytest.mark.parametrize("arch", ["ds_v3", "ds_v32_sparse"])
def test_chunks_then_decode_match_hf(ranks, checkpoints, arch):
    """Chunks of 5 (expanded MLA; V3.2 selecting past index_topk), then an absorbed decode
    step over the whole latent each rank cached."""
    (last, token, step), other = ranks.run(chunks_then_decode, checkpoints[arch], 2, 5)
    assert torch.equal(step, other[2])
    with torch.no_grad():
        ref = hf_model(arch)(torch.tensor([PROMPT + [token]])).logits[0]
    assert (last - ref[-2]).abs().max().item() <= TOL
    assert (step - ref[-1]).abs().max().item() <= TOL


@pytest.mark.parametrize(
    "arch,kv_cache_dtype",
    [("ds_v2", "auto"), ("ds_v32_sparse", "auto"), ("fp8_v32", "fp8")],
)
def test_paged_decode_matches_one_rank(ranks, arch, kv_cache_dtype):
    """The decode-only microbatches on DecodeGraphs' static buffers (MLADecodeRows; V3.2 also
    the selecting shape past index_topk; over the FP8 latent every row on the sparse FP8
    kernel) on two ranks == the general path and the same steps on one rank. The FP8 latent
    quantizes the ranks' latents, rounded apart from one rank's, so within an e4m3 step's
    effect there, with the same greedy tokens."""
    whole = paged_decode_steps(None, arch, kv_cache_dtype)
    split, other = ranks.run(paged_decode_steps, arch, kv_cache_dtype)
    assert [key for key, *_ in split] == [key for key, *_ in whole]
    if arch != "ds_v2":
        assert split[0][0][1] == 0 and split[-1][0][1] > 0  # both graph shapes
    for (key, general, paged), (_, _, paged_other), (_, _, ref) in zip(split, other, whole):
        assert torch.equal(paged, paged_other), key
        tol = 1e-4 if kv_cache_dtype == "auto" else 5e-3 * ref.abs().max().item()
        assert (paged - general).abs().max().item() <= tol, key
        assert (paged - ref).abs().max().item() <= tol, key
        assert torch.equal(paged.argmax(-1), ref.argmax(-1)), key


def test_heads_are_split_and_the_latent_is_whole(ranks, checkpoints):
    """Each rank holds half the query heads of q_b_proj and kv_b_proj and half of o_proj's
    input columns; the q LoRA, the latent's projection and V3.2's indexer whole."""
    path = checkpoints["ds_v32_sparse"]
    whole = attention_widths(TensorParallel(), path)
    halves = ranks.run(attention_widths, path)
    assert halves[0] == halves[1]
    for name, rows in whole.items():
        if name.startswith(("q_b_proj", "kv_b_proj")):
            assert halves[0][name] * 2 == rows, name
        else:  # o_proj: whole rows, half the columns; the rest replicated
            assert halves[0][name] == rows, name
    assert {"indexer.wq_b.weight", "kv_a_proj_with_mqa.weight", "q_a_proj.weight"} <= set(whole)


def test_a_rank_declares_its_heads_and_caches_the_whole_latent(checkpoints):
    """Family.rank_args (what the runner sizes a rank's cache and kernel targets from): the
    absorbed ops' and the dense chunk attention's shapes name the rank's heads, the indexer's
    its whole heads (it is replicated), and a token costs the rank the whole latent."""
    v3, v32 = (load_model_args(checkpoints[a]) for a in ("ds_v3", "ds_v32_sparse"))
    one, two = (kernel_target(v3.family.rank_args(v3, n), "bfloat16", 64) for n in (1, 2))
    assert (one.shapes["mla_decode"].heads, two.shapes["mla_decode"].heads) == (4, 2)
    assert (one.shapes["attention"].heads, two.shapes["attention"].heads) == (4, 2)
    d: DeepseekArgs = v32.family_args
    sparse = kernel_target(v32.family.rank_args(v32, 2), "bfloat16", 64).shapes
    assert sparse["mla_sparse"].heads == 2
    assert sparse["indexer_logits_rows"].heads == d.indexer.n_heads
    for args in (v3, v32):
        whole = bytes_per_token_layer(args, torch.bfloat16)
        assert bytes_per_token_layer(args.family.rank_args(args, 2), torch.bfloat16) == whole
    assert whole == 2 * (d.kv_lora_rank + d.qk_rope_head_dim + d.indexer.head_dim)


def test_heads_that_do_not_divide_are_refused(checkpoints):
    args = load_model_args(checkpoints["ds_v3"])
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by .* 3"):
        build_stage_model(
            args, None, 0, 4, True, True, select_kernels("cpu"), torch.float32, "cpu",
            tp=TensorParallel(0, 3),
        )  # fmt: skip
