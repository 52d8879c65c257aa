"""DeepSeek-V2/V3/V3.2 through Ray end to end: greedy tokens identical to transformers' generate.

Each tiny checkpoint runs once per PP size; chunk sizes (odd) and skip modes rotate so that
every checkpoint meets every skip mode and every PP size meets every skip mode and chunk size
(the whole matrix under `make test-slow`; `make test` one PP size of each checkpoint, each PP
size with two skip modes).
"""

from __future__ import annotations

import random

import pytest

from app import Engine, EngineConfig, SamplingParams
from tests.cpu.conftest import DEEPSEEK_ARCHS, write_tiny_checkpoints
from tests.hf_reference import check_output_counts, tiny_reference

MAX_NEW = 6
SKIPS = ("off", "sglang", "auto")
CHUNKS = (5, 7, 13)
# make test runs checkpoint i at PP (1, 2, 3, 2, 3, 1)[i]: each PP size twice, with two skip
# modes, chunks 5 and 7; the other two PP sizes of each run under `make test-slow`.
CASES = [pytest.param(arch, pp, CHUNKS[(2 * i + j) % 3], SKIPS[(i + j) % 3],
                      marks=[] if j == (i + i // 3) % 3 else [pytest.mark.slow])
         for i, arch in enumerate(DEEPSEEK_ARCHS) for j, pp in enumerate((1, 2, 3))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("ds-ckpt"), DEEPSEEK_ARCHS)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    return [[rng.randrange(3, 200) for _ in range(n)] for n in [9, 23, 1, 40, 14, 31, 6, 19]]


@pytest.fixture(scope="module")
def references(prompts):
    return {arch: tiny_reference(arch, prompts, MAX_NEW) for arch in DEEPSEEK_ARCHS}


@pytest.mark.parametrize("arch,pp,chunk,skip", CASES)
def test_greedy_matches_transformers(ray_cluster, checkpoints, prompts, references, arch, pp,
                                     chunk, skip):
    reference = references[arch]
    cfg = EngineConfig(model=checkpoints[arch], pp_size=pp, device="cpu", chunk_size=chunk,
                       pp_output_skip=skip, block_size=4, max_num_seqs=8, max_model_len=256,
                       channel_check=True, stage_num_cpus=0.5, num_kv_blocks=512)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    with Engine(cfg) as engine:
        for p, ref in list(zip(prompts, reference))[:2]:  # alone
            (out,) = engine.generate([p], greedy)
            assert out.token_ids == ref
        outs = engine.generate(prompts, greedy)  # batched: decode rows beside chunks
        assert [o.token_ids for o in outs] == reference
        check_output_counts(engine.stats(), skip, pp)
