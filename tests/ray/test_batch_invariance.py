"""Batch invariance for every model family: prompts whose lengths straddle the family's thresholds
(chunk size, block size, index_topk, sliding window, compression rates), two of them sharing a
prefix, served together with staggered arrivals (so prefill chunks and decode rows of different
requests share microbatches, and the token budget cuts chunks where a lone request's would not
be cut), over PP 1/2/3, every skip mode, run-ahead on and off: each request's greedy tokens
equal transformers' (whose sparse indexers keep ppserve's tie rule: tests/conftest.py) and the
same request's served alone. The FP8 cases (V4 over its FP8 cache, V3.2 with W8A8 over its FP8
latent) hold batched == alone only: quantization moves their tokens off transformers'.

A family is covered by one entry of CASES: its tiny checkpoint, how transformers loads it, and
its thresholds. The fast subset (one configuration per checkpoint, rotating PP, skip mode and
run-ahead so each value meets several families) runs in `make test`; the full matrix is slow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from app import Engine, EngineConfig, SamplingParams
from stages.models.families import FAMILIES, family_of
from tests.cpu.conftest import DSA_SPARSE_TOPK, write_tiny_checkpoint
from tests.cpu.test_deepseek_v4_fp8_kv import FP8_V4
from tests.deepseek_v4_ref import TINY_V4, write_checkpoint
from tests.hf_reference import check_output_counts, greedy_continuations, tiny_reference

MAX_NEW = 6
CHUNK = 7
LONG = 45
SKIPS = ("off", "sglang", "auto")


@dataclass(frozen=True)
class Case:
    model_type: str
    write: Callable[[Path], str]  # writes the tiny checkpoint under a directory, returns it
    # (path, prompts) -> transformers' greedy tokens; None: batched == alone only
    reference: Callable[[str, list[list[int]]], list[list[int]]] | None
    block_size: int
    thresholds: tuple[int, ...]  # prompt lengths where the family's attention changes
    options: tuple[tuple[str, str], ...] = ()  # EngineConfig options beyond the model's


def _conftest_case(arch: str, model_type: str, *thresholds: int) -> Case:
    return Case(
        model_type,
        lambda root: write_tiny_checkpoint(root, arch),
        lambda _path, prompts: tiny_reference(arch, prompts, MAX_NEW),
        block_size=4,
        thresholds=thresholds,
    )


def _v4_reference(path: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return greedy_continuations(model, prompts, MAX_NEW, eos_token_id=TINY_V4["eos_token_id"])


V4_WINDOW, (V4_CSA, V4_HCA) = TINY_V4["sliding_window"], TINY_V4["compress_rates"].values()
CASES = {
    "llama": _conftest_case("llama", "llama"),
    "qwen2": _conftest_case("qwen2", "qwen2"),
    "qwen3": _conftest_case("qwen3", "qwen3"),
    "qwen3_moe": _conftest_case("qwen3_moe", "qwen3_moe"),
    "ds_v2": _conftest_case("ds_v2", "deepseek_v2"),
    "ds_v3": _conftest_case("ds_v3", "deepseek_v3"),
    # past index_topk keys the indexer selects (two index heads: many exact ties)
    "ds_v32": _conftest_case("ds_v32_sparse", "deepseek_v32", DSA_SPARSE_TOPK),
    # the window, a CSA and an HCA group, and the first query with more CSA entries than top-k
    "ds_v4": Case(
        "deepseek_v4",
        lambda root: write_checkpoint(str(root / "v4"), TINY_V4),
        _v4_reference,
        block_size=16,
        thresholds=(V4_WINDOW, V4_CSA, V4_HCA, V4_CSA * (TINY_V4["index_topk"] + 1) - 1),
    ),
}
# V4 over its FP8 cache (window latents and compressed entries quantized as written; V4's head
# dim and rope width, which the layout holds): forwards holding decode rows read the pages at
# traced addresses, chunk-only ones gather the keys. Quantization moves the tokens off
# transformers' (tests/cpu/test_deepseek_v4_fp8_kv.py bounds it): batched == alone only.
CASES["ds_v4_fp8_kv"] = dataclasses.replace(
    CASES["ds_v4"],
    write=lambda root: write_checkpoint(str(root / "v4_fp8_kv"), FP8_V4),
    reference=None,
    options=(("kv_cache_dtype", "fp8"),),
)


def _write_v32_fp8_widths(root: Path) -> str:
    import transformers as tf

    from tests.cpu.test_fp8 import tiny_v32_config

    path = str(root / "v32_fp8")
    torch.manual_seed(0)
    tf.DeepseekV32ForCausalLM(tiny_v32_config()).float().save_pretrained(path)
    return path


# V3.2 with W8A8 (its projections and experts quantized at load) over its FP8 latent: decode rows
# on mla_sparse_fp8, prefill chunks on mla_prefill_fp8, split where a forward holds both
CASES["ds_v32_fp8"] = Case(
    "deepseek_v32",
    _write_v32_fp8_widths,
    None,
    block_size=4,
    thresholds=(8,),  # index_topk
    options=(("quantization", "fp8"), ("kv_cache_dtype", "fp8")),
)

# (case, pp, skip, run_ahead): the fast subset rotates the values over the checkpoints
FAST = [
    (name, 1 + i % 3, SKIPS[(i + i // 3) % 3], i % 2 == 1) for i, name in enumerate(CASES)
]
FULL = list(itertools.product(CASES, (1, 2, 3), SKIPS, (False, True)))
MATRIX = FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in FULL if c not in FAST]


def prompt_lengths(case: Case) -> list[int]:
    """Around every threshold, the chunk size and the block size (and twice each), and a prompt
    of several chunks and blocks (45 tokens) whose later queries see many keys."""
    edges = {CHUNK, 2 * CHUNK, case.block_size, 2 * case.block_size, *case.thresholds}
    return sorted({n + d for n in edges for d in (-1, 0, 1) if n + d > 0} | {LONG})


def make_prompts(case: Case) -> list[list[int]]:
    """The lengths above, then two prompts sharing the longest one's whole blocks but one. Tokens
    from 3 up: above every tiny checkpoint's special ids (EOS is 1 or 2)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 96) for _ in range(n)] for n in prompt_lengths(case)]
    shared = prompts[-1][: (LONG // case.block_size - 1) * case.block_size]
    return prompts + [shared + [7, 8, 9], shared + [11]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {name: case.write(root) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, tuple[list[list[int]], list[list[int]] | None]]:
    """case -> (prompts, transformers' greedy continuation of each, one at a time, or None)."""
    out = {}
    for name, case in CASES.items():
        prompts = make_prompts(case)
        ref = case.reference(checkpoints[name], prompts) if case.reference else None
        out[name] = prompts, ref
    return out


def test_every_family_has_a_case():
    """Adding a family to stages/models/families.py adds its checkpoint to CASES."""
    covered = {family_of(case.model_type).name for case in CASES.values()}
    assert covered == {f.name for f in FAMILIES}
    for name in CASES:  # thresholds reach the prompts
        assert max(prompt_lengths(CASES[name])) >= max(CASES[name].thresholds or (0,))


async def _staggered(engine: Engine, prompts: list[list[int]], params: SamplingParams):
    """Each prompt's tokens, the prompts arriving a few milliseconds apart in an interleaved
    order (long and short neighbours), so arrivals land between microbatches of others."""

    async def one(i: int, delay: float) -> tuple[int, list[int]]:
        await asyncio.sleep(delay)
        tokens: list[int] = []
        async for delta in engine.stream(prompts[i], params):
            tokens += delta.token_ids
        return i, tokens

    order = [i for pair in itertools.zip_longest(range(0, len(prompts), 2),
                                                 range(1, len(prompts), 2)) for i in pair
             if i is not None]
    done = await asyncio.gather(*(one(i, 0.02 * k) for k, i in enumerate(order)))
    return [tokens for _, tokens in sorted(done)]


@pytest.mark.parametrize("name,pp,skip,run_ahead", MATRIX)
def test_batched_equals_alone_equals_transformers(ray_cluster, checkpoints, references, name,
                                                  pp, skip, run_ahead):
    case, (prompts, reference) = CASES[name], references[name]
    cfg = EngineConfig(model=checkpoints[name], pp_size=pp, device="cpu", chunk_size=CHUNK,
                       pp_output_skip=skip, run_ahead=run_ahead, block_size=case.block_size,
                       max_num_seqs=16, max_model_len=128, channel_check=True,
                       stage_num_cpus=0.5, num_kv_blocks=256, **dict(case.options))
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    with Engine(cfg) as engine:
        together = asyncio.run(_staggered(engine, prompts, greedy))
        at_once = [o.token_ids for o in engine.generate(prompts, greedy)]
        alone = [engine.generate([p], greedy)[0].token_ids for p in prompts]
        stats = engine.stats()
    for i, p in enumerate(prompts):
        ref = alone[i] if reference is None else reference[i]
        assert alone[i] == ref, f"{name}: prompt {i} ({len(p)} tokens) alone"
        assert together[i] == ref, f"{name}: prompt {i} ({len(p)} tokens) staggered"
        assert at_once[i] == ref, f"{name}: prompt {i} ({len(p)} tokens) batched at once"
    assert stats["prefix_cache_hits"] > 0
    check_output_counts(stats, skip, pp)

