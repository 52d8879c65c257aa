"""Dynamic chunking: chunk sizes from the cost model, and what they buy in a pipeline."""

import pytest

from app.config import EngineConfig
from app.scheduler import ChunkCost, SchedRequest, Scheduler, SchedulerConfig
from app.scheduler.chunking import dynamic_chunk_size, granule
from tests.unit.scheduler_configs import scheduler_config

LLAMA_8B = ChunkCost.from_shape(hidden=4096, intermediate=14336, heads=32, kv_heads=8,
                                head_dim=128)


def test_llama_8b_cost_is_its_flops_per_layer():
    # q, k, v, o projections (4096x4096, 2 x 4096x1024, 4096x4096) + gate, up, down (3 x 4096x14336)
    weights = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert LLAMA_8B.token_cost == 2 * weights
    assert LLAMA_8B.pair_cost == 4 * 32 * 128
    from app.bench.target import LLAMA3_8B
    from stages.model_config import ModelArgs

    assert ChunkCost.for_model(ModelArgs.from_hf_dict(LLAMA3_8B)) == LLAMA_8B
    # a 4-token chunk after 10 cached tokens: queries see 11, 12, 13, 14 keys
    assert LLAMA_8B.of(10, 4) == 4 * LLAMA_8B.token_cost + 50 * LLAMA_8B.pair_cost


@pytest.mark.parametrize("chunk", [4096, 8192])
def test_equal_cost_chunks_cost_what_the_first_one_costs(chunk):
    g = granule(chunk)
    target = LLAMA_8B.of(0, chunk)
    sizes, prefix = [], 0
    while prefix < 131072:
        size = dynamic_chunk_size(chunk, LLAMA_8B, 1.0, prefix)
        assert size % g == 0 and g <= size <= chunk
        assert LLAMA_8B.of(prefix, size) <= target * 1.0001  # never dearer than the first
        if size < chunk:  # and the largest multiple of the granule that is not
            assert LLAMA_8B.of(prefix, size + g) > target
        sizes.append(size)
        prefix += size
    assert sizes[0] == chunk and sizes == sorted(sizes, reverse=True) and sizes[-1] < chunk / 2


def test_smooth_blends_fixed_and_equal_cost():
    prefix = 100_000
    fixed = dynamic_chunk_size(8192, LLAMA_8B, 0.0, prefix)
    half = dynamic_chunk_size(8192, LLAMA_8B, 0.5, prefix)
    equal = dynamic_chunk_size(8192, LLAMA_8B, 1.0, prefix)
    assert fixed == 8192 > half > equal
    assert abs(half - (8192 + equal) / 2) <= granule(8192) * 1.01


def _drain(chunks: list[tuple[int, int]], stages: int) -> float:
    """Flow-shop makespan of a lone prompt's chunks when each costs LLAMA_8B.of on every stage."""
    finish = [0.0] * stages
    for prefix, size in chunks:
        t = LLAMA_8B.of(prefix, size)
        for s in range(stages):
            finish[s] = max(finish[s], finish[s - 1] if s else 0.0) + t
    return finish[-1]


def _plan_chunks(cfg: SchedulerConfig, prompt_len: int) -> list[tuple[int, int]]:
    s = Scheduler(cfg)
    s.add(SchedRequest("r", tuple(range(prompt_len)), 1))
    chunks = []
    while (plan := s.schedule()) is not None:
        (row,) = plan.rows
        chunks.append((row.start, row.num_tokens))
        s.retire(plan.mb_id, [("r", 7)] if row.sample else [])
        if row.sample:
            break
    return chunks


def test_scheduler_cuts_a_lone_prompt_into_shrinking_chunks_with_less_drain():
    base = dict(chunk_size=8192, max_num_batched_tokens=8192, max_num_seqs=1, max_inflight=1,
                block_size=64, num_blocks=2100, max_model_len=140000)
    fixed = _plan_chunks(scheduler_config(**base), 131072)
    dynamic = _plan_chunks(scheduler_config(**base, chunk_cost=LLAMA_8B), 131072)
    for chunks in (fixed, dynamic):  # the whole prompt, in order, once
        assert [p for p, _ in chunks] == [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
        assert sum(n for _, n in chunks) == 131072
    assert {n for _, n in fixed} == {8192}
    sizes = [n for _, n in dynamic]
    assert sizes[0] == 8192 and sizes[:-1] == sorted(sizes[:-1], reverse=True) and sizes[-2] < 8192
    # under the model's own costs the two-stage drain shrinks
    assert _drain(dynamic, 2) < 0.97 * _drain(fixed, 2)


def test_smooth_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="dynamic_chunk_smooth"):
        EngineConfig(enable_dynamic_chunking=True, dynamic_chunk_smooth=1.5)
    with pytest.raises(ValueError, match="positive"):
        ChunkCost(1.0, 0.0)
