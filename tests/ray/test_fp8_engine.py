"""The V3.2 engine path with --kv-cache-dtype fp8 through Ray on CPU: on a tiny checkpoint with
the FP8 layout's latent (512 + 64), over PP 2 with odd chunks and decode, the greedy tokens of its
stages chained in process with the same FP8 cache; dense MLA (V3) refuses an FP8 cache before Ray
starts, saying why. V4's FP8 KV through the engine gives the tokens of its stages chained in
process."""

from __future__ import annotations

import json
import os

import pytest

from app import Engine, EngineConfig, SamplingParams
from app.bench.fp8 import StageChain
from stages.model_config import load_model_args
from tests.cpu.test_deepseek_v4_fp8_kv import PROMPT as V4_PROMPT
from tests.cpu.test_deepseek_v4_fp8_kv import Pipeline as V4Pipeline
from tests.cpu.test_deepseek_v4_fp8_kv import _chunked_then_decode
from tests.cpu.test_deepseek_v4_fp8_kv import checkpoint as v4_checkpoint  # noqa: F401
from tests.cpu.test_fp8 import checkpoints  # noqa: F401 (the module fixture)

PROMPTS = [[(5 * i + j) % 190 + 3 for i in range(n)] for j, n in enumerate((30, 11, 45))]


def _greedy(path: str, prompts=PROMPTS, **options) -> list[list[int]]:
    cfg = EngineConfig(
        model=path,
        pp_size=2,
        device="cpu",
        chunk_size=7,
        max_model_len=128,
        stage_num_cpus=0.5,
        **{"max_num_seqs": 4, "block_size": 4, "num_kv_blocks": 128, **options},
    )
    with Engine(cfg) as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0))
    return [o.token_ids for o in outs]


def test_fp8_kv_cache_through_the_engine(ray_cluster, checkpoints):  # noqa: F811
    # one row at a time, so each row's chunks are the chained stages' (against its own stages,
    # not the unquantized cache: past index_topk this random model's indexer scores sit close
    # together, many tied at 0, so the FP8 keys' rounding or other chunk boundaries pick other
    # keys and the paths part; tests/cpu/test_fp8.py compares the two)
    got = _greedy(checkpoints["plain"], kv_cache_dtype="fp8", max_num_seqs=1)
    chained = StageChain(load_model_args(checkpoints["plain"]), checkpoints["plain"],
                         kv_cache_dtype="fp8", num_blocks=32, block_size=4)
    assert got == [chained.greedy(p, chunk=7, steps=5) for p in PROMPTS]


def test_dense_mla_refuses_an_fp8_cache(tmp_path, checkpoints):  # noqa: F811
    with open(os.path.join(checkpoints["plain"], "config.json")) as f:
        cfg = json.load(f)
    v3 = tmp_path / "v3"
    v3.mkdir()
    cfg = {k: v for k, v in cfg.items() if not k.startswith("index_")}
    (v3 / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v3"}))
    with pytest.raises(ValueError, match="keeps a bfloat16 latent cache"):
        Engine(EngineConfig(model=str(v3), device="cpu", kv_cache_dtype="fp8"))


def test_v4_fp8_kv_through_the_engine(ray_cluster, v4_checkpoint):  # noqa: F811
    """PP 2 over Ray, chunks of 7 beside a second row: the FP8 pages, their capacity and the
    in-place FP8 attention as the stage runner sets them up, token for token."""
    got = _greedy(
        v4_checkpoint,
        [V4_PROMPT, V4_PROMPT[:20]],
        kv_cache_dtype="fp8",
        block_size=16,
        num_kv_blocks=32,
    )
    _logits, want = _chunked_then_decode(V4Pipeline(v4_checkpoint, "fp8"))
    assert got[0] == want
