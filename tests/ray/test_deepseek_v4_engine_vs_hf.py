"""DeepSeek-V4 through Ray end to end: greedy tokens identical to transformers' generate, alone
and batched, over PP 1/2/3, odd chunk sizes (chunk boundaries inside compression groups) and
every skip mode, then prompts that hit the prefix cache. The default cases cover every skip
mode, PP size and checkpoint, run-ahead (decode inputs from the output channel, so a later
stage's hash layer reads ids that only stage 0 had) and preemption; the full matrix is slow."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from app import Engine, EngineConfig, SamplingParams
from tests.deepseek_v4_ref import SECOND_V4, TINY_V4, write_checkpoint
from tests.hf_reference import check_output_counts, greedy_continuations

MAX_NEW = 6
CONFIGS = {"tiny": TINY_V4, "second": SECOND_V4}
# (checkpoint, pp, chunk, skip, run_ahead, kv_admission, kv blocks of 16 tokens)
FAST = [
    ("tiny", 3, 7, "off", False, "reserve", 64),
    ("second", 2, 5, "auto", True, "reserve", 64),
    ("tiny", 1, 13, "sglang", False, "on-demand", 4),
]
FULL = [
    (c, pp, chunk, skip, False, "reserve", 64)
    for c, pp, chunk, skip in itertools.product(
        CONFIGS, (1, 2, 3), (5, 7, 13), ("off", "sglang", "auto")
    )
]
CASES = FAST + [
    pytest.param(*case, marks=pytest.mark.slow)
    for case in FULL
    if case[:4] not in {f[:4] for f in FAST}
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4-ckpt")
    return {name: write_checkpoint(str(root / name), cfg) for name, cfg in CONFIGS.items()}


@pytest.fixture(scope="module")
def prompts():
    """Longer than the windows and several groups; the last two share the first's first two
    blocks (prefix-cache hits once it has run)."""
    rng = random.Random(7)
    base = [[rng.randrange(2, 96) for _ in range(n)] for n in (45, 9, 23, 1, 37)]
    return base + [base[0][:32] + [5, 6, 7], base[0][:40]]


@pytest.fixture(scope="module")
def references(checkpoints, prompts):
    """checkpoint -> transformers' greedy continuation of each prompt, one at a time."""
    from transformers import DeepseekV4ForCausalLM

    out = {}
    with torch.no_grad():
        for name, path in checkpoints.items():
            model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            out[name] = greedy_continuations(model, prompts, MAX_NEW, eos_token_id=1)
    return out


@pytest.mark.parametrize("name,pp,chunk,skip,run_ahead,admission,blocks", CASES)
def test_greedy_matches_transformers(
    ray_cluster,
    checkpoints,
    prompts,
    references,
    name,
    pp,
    chunk,
    skip,
    run_ahead,
    admission,
    blocks,
):
    reference = references[name]
    cfg = EngineConfig(
        model=checkpoints[name],
        pp_size=pp,
        device="cpu",
        chunk_size=chunk,
        pp_output_skip=skip,
        block_size=16,
        max_num_seqs=8,
        max_model_len=128,
        channel_check=True,
        stage_num_cpus=0.5,
        num_kv_blocks=blocks,
        run_ahead=run_ahead,
        kv_admission=admission,
    )
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    first, shared = len(prompts) - 2, slice(len(prompts) - 2, None)
    with Engine(cfg) as engine:
        for p, ref in list(zip(prompts, reference))[:2]:  # alone
            (out,) = engine.generate([p], greedy)
            assert out.token_ids == ref
        outs = engine.generate(prompts[:first], greedy)  # batched: decode rows beside chunks
        assert [o.token_ids for o in outs] == reference[:first]
        hits = engine.stats()["prefix_cache_hits"]
        outs = engine.generate(prompts[shared], greedy)  # resume after cached blocks
        assert [o.token_ids for o in outs] == reference[shared]
        stats = engine.stats()
    assert stats["prefix_cache_hits"] > hits
    if admission == "on-demand":
        assert stats["num_preemptions"] > 0
    check_output_counts(stats, skip, pp)


@pytest.mark.slow
def test_flash_like_checkpoint_on_pp_1_2_3(ray_cluster, tmp_path):
    """A third checkpoint, V4-Flash's rates / window / rotaries at tiny widths: 300-token prompts
    span more than two HCA groups of 128, the 128-token window and 75 CSA groups (top-16)."""
    from transformers import DeepseekV4ForCausalLM

    from tests.deepseek_v4_ref import FLASH_LIKE_V4

    path = write_checkpoint(str(tmp_path / "flash-like"), FLASH_LIKE_V4, seed=3)
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 160) for _ in range(n)] for n in (300, 129, 260)]
    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = greedy_continuations(model, prompts, MAX_NEW, eos_token_id=1)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    for pp, chunk in ((1, 77), (2, 100), (3, 129)):
        cfg = EngineConfig(
            model=path,
            pp_size=pp,
            device="cpu",
            chunk_size=chunk,  # block size left out: the family's (128) is taken
            max_num_seqs=4,
            max_model_len=512,
            channel_check=True,
            stage_num_cpus=0.5,
            num_kv_blocks=16,
        )
        with Engine(cfg) as engine:
            (alone,) = engine.generate(prompts[:1], greedy)
            batched = engine.generate(prompts, greedy)
        assert alone.token_ids == reference[0]
        assert [o.token_ids for o in batched] == reference
