"""The real SmolLM2-135M-Instruct through the Ray engine: greedy tokens identical to
transformers on the same checkpoint, for PP 1/2/3, chunked prefill and not, every skip mode."""

from __future__ import annotations

import pytest

from app import SamplingParams
from app.bench.target import BenchEngine
from tests.smollm2_ref import EOS, hf_greedy

MAX_NEW = 10
PROMPTS = [
    "The capital of France is",
    "Here is a short list of fruits: apple, banana,",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Translate to French: I would like a cup of coffee, please. ->",
    "In 1969, the first humans landed on the Moon. The mission was called",
]


@pytest.fixture(scope="module")
def cases(smollm2_hf):
    model, tok = smollm2_hf
    ids = [tok.encode(p) for p in PROMPTS]
    return ids, [hf_greedy(model, p, MAX_NEW) for p in ids]


def test_reference_is_sensible(smollm2_hf, cases):
    _, tok = smollm2_hf
    assert tok.decode(cases[1][0]).startswith(" Paris")


# PP=2 (make serve's default) in make test; PP=1 and PP=3 (the same path with one hop less or
# more, each met by the tiny checkpoints' tests) under `slow`: make test stays under 30 minutes
@pytest.mark.parametrize("pp", [pytest.param(1, marks=pytest.mark.slow), 2,
                                pytest.param(3, marks=pytest.mark.slow)])
def test_greedy_matches_transformers(ray_cluster, smollm2_dir, cases, pp):
    prompts, reference = cases
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    # BenchEngine: the engine plus set_policy between runs (and no prefix cache, so every run
    # prefills its whole prompt under the chunking and skip mode it names)
    with BenchEngine(
        model=smollm2_dir,
        pp_size=pp,
        device="cpu",
        chunk_size=8,
        block_size=16,
        max_num_seqs=8,
        max_model_len=256,
        num_kv_blocks=96,
        channel_check=True,
        stage_num_cpus=0.5,
    ) as engine:
        # chunk 8: every prompt spans several chunks; 512: each prompt in one microbatch
        for chunk in (8, 512):
            for skip in ("off", "sglang", "auto"):
                engine.set_policy(skip_mode=skip, chunk_size=chunk)
                (alone,) = engine.generate([prompts[0]], greedy)
                assert alone.token_ids == reference[0], (chunk, skip)
                outs = engine.generate(prompts, greedy)  # concurrent, mixed lengths
                assert [o.token_ids for o in outs] == reference, (chunk, skip)
                for o, ref in zip(outs, reference):
                    assert o.finish_reason == ("stop" if ref[-1] == EOS else "length")
        stats = engine.stats()
        assert stats["kv_cache_usage"] == 0.0
        if pp > 1:
            assert stats["channel_output_sends"] == stats["pp_output_comm"]["sent"]
