"""Through Ray on the built-in random model (no checkpoint, no transformers oracle): seeded
sampling, priority admission, structured outputs, the output-channel skip rule, and `ppserve
bench prefix`.

One Ray cluster for all of them: their only shared fixture is `ray_cluster`, which a module
of its own each would start and stop again."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import jsonschema
import pytest

from app import Engine, EngineConfig, SamplingParams
from app.bench.prefix import main as bench_prefix_main
from app.request import StructuredOutput

# -- A request with a seed yields the same tokens whatever the PP size, chunk size or batch. (was
# test_seeded_sampling.py)

def test_seeded_tokens_do_not_depend_on_pp_chunk_or_batch(ray_cluster):
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (40, 9, 71, 23)]
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=s,
                             ignore_eos=True) for s in (11, 12, 13, 14)]
    results = {}
    for pp, chunk in [(1, 512), (3, 5), (2, 7)]:
        cfg = EngineConfig(pp_size=pp, device="cpu", chunk_size=chunk, block_size=8,
                           stage_num_cpus=0.5, num_kv_blocks=256, channel_check=True)
        with Engine(cfg) as engine:
            together = [o.token_ids for o in engine.generate(prompts, params)]
            alone = [engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
        assert together == alone, (pp, chunk)
        results[(pp, chunk)] = together
    first = next(iter(results.values()))
    for key, tokens in results.items():
        assert tokens == first, key
    # the seed really drives the sample: the same prompt with another seed differs
    with Engine(EngineConfig(pp_size=1, device="cpu", num_kv_blocks=256)) as engine:
        other = engine.generate([prompts[0]], [SamplingParams(
            max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=999, ignore_eos=True)])
    assert other[0].token_ids != first[0]


# -- vLLM's `priority` through the engine: one sequence slot, held by a running request; the
# requests that queue behind it are admitted by priority (lower first), then by arrival, whatever
# order they came in. (was test_priority.py)

def test_waiting_requests_are_admitted_by_priority_then_arrival(ray_cluster):
    cfg = EngineConfig(pp_size=1, device="cpu", max_num_seqs=1, num_kv_blocks=256,
                       stage_num_cpus=0.5)
    queued = [("b", 0), ("c", 0), ("urgent", -3), ("later", 2), ("d", 0)]

    async def run(engine: Engine) -> tuple[list[str], int]:
        done: list[str] = []

        async def one(name: str, prompt: list[int], params: SamplingParams) -> None:
            async for out in engine.stream(prompt, params):
                if out.finished:
                    done.append(name)

        first = asyncio.Event()

        async def blocker() -> None:  # holds the one slot for 1,500 decode steps (seconds)
            params = SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0)
            async for out in engine.stream([5, 6, 7], params):
                first.set()
                if out.finished:
                    done.append("blocker")

        tasks = [asyncio.ensure_future(blocker())]
        await first.wait()
        for i, (name, priority) in enumerate(queued):
            params = SamplingParams(max_tokens=2, temperature=0, priority=priority)
            tasks.append(asyncio.ensure_future(one(name, [10 + i, 11, 12], params)))
            # one at a time: Ray may start concurrent calls to the coordinator in any order,
            # and the arrival order is part of what is tested
            deadline = time.monotonic() + 60
            while engine.stats()["num_waiting"] <= i and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        waiting, finished_early = engine.stats()["num_waiting"], list(done)
        await asyncio.gather(*tasks)
        assert not finished_early, "the blocker ended before the others had queued"
        return done, waiting

    with Engine(cfg) as engine:
        done, waiting = asyncio.run(run(engine))
    assert waiting == len(queued)
    assert done == ["blocker", "urgent", "b", "c", "d", "later"]


# -- Structured outputs through a real 2-stage pipeline (random model, byte tokenizer): every
# constrained output follows its grammar in every skip mode, with and without run-ahead, next to
# unconstrained requests in the same microbatches. (was test_structured_outputs.py)

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "n", "color", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["pipeline", "parallel", "serving"]


def _params(kind: str, spec: str, seed: int, max_tokens: int = 120) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=seed, structured=StructuredOutput(kind, spec)
    )


@pytest.mark.parametrize("skip,run_ahead", [("off", True), ("sglang", False), ("auto", True)])
def test_outputs_follow_their_grammar(ray_cluster, skip, run_ahead):
    cfg = EngineConfig(
        pp_size=2,
        device="cpu",
        chunk_size=8,
        block_size=4,
        max_num_seqs=8,
        max_model_len=256,
        channel_check=True,
        stage_num_cpus=0.5,
        num_kv_blocks=512,
        pp_output_skip=skip,
        run_ahead=run_ahead,
    )
    prompts = [
        "Answer in JSON, please: " * 2,
        "A code: ",
        "Pick one: ",
        "Free text: ",
        "{",
        "Short JSON: ",
    ]
    params = [
        _params("json", json.dumps(SCHEMA), 1),
        _params("regex", REGEX, 2),
        _params("choice", json.dumps(CHOICES), 3),
        SamplingParams(max_tokens=40, temperature=1.0, seed=4, ignore_eos=True),
        _params("json", '{"type": "object"}', 5, max_tokens=6),
        _params("json", json.dumps(SCHEMA), 6, max_tokens=5),
    ]
    with Engine(cfg) as engine:
        outs = engine.generate(prompts, params)
        stats = engine.stats()
    js, code, choice, free, any_object, short = outs
    assert js.finish_reason == "stop"
    jsonschema.validate(json.loads(js.text), SCHEMA)
    assert code.finish_reason == "stop" and re.fullmatch(REGEX, code.text)
    assert choice.finish_reason == "stop" and choice.text in CHOICES
    assert free.finish_reason == "length" and len(free.token_ids) == 40
    # Cut by max_tokens: what came out is a prefix of valid JSON.
    assert any_object.finish_reason == "length" and any_object.text.startswith("{")
    assert short.finish_reason == "length" and '{"ok": '.startswith(short.text[:7])
    assert stats["kv_cache_usage"] == 0.0 and stats["num_running"] == 0


# -- The skip is real: the channel counts its own sends, and the modes differ as
# docs/ARCHITECTURE.md#the-skip-rule says. (was test_output_skip.py)

SKIP_LONG = 300  # tokens; chunks of 32 -> 10 chunks, 9 of them mid-prompt


def _prompts(n, length, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(length)] for _ in range(n)]


def _run(skip, prompts, max_tokens=4, budget=None):
    cfg = EngineConfig(pp_size=2, device="cpu", chunk_size=32, pp_output_skip=skip,
                       max_num_batched_tokens=budget, channel_check=True, block_size=16,
                       max_num_seqs=8, stage_num_cpus=0.5, num_kv_blocks=512)
    with Engine(cfg) as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                       ignore_eos=True))
        stats = engine.stats()
    return [o.token_ids for o in outs], stats


@pytest.fixture(scope="module")
def lone(ray_cluster):
    prompts = _prompts(1, SKIP_LONG)
    return {mode: _run(mode, prompts) for mode in ("off", "sglang", "auto")}


def test_channel_counts_its_sends(lone):
    for mode, (_tokens, stats) in lone.items():
        assert stats["channel_output_sends"] == stats["pp_output_comm"]["sent"], mode


def test_auto_skips_mid_prompt_chunks_and_misses_nothing(lone):
    comm = lone["auto"][1]["pp_output_comm"]
    assert comm["skipped"] >= SKIP_LONG // 32 - 1  # every mid-prompt chunk
    assert comm["missed"] == 0


def test_off_sends_everything_and_misses(lone):
    comm = lone["off"][1]["pp_output_comm"]
    assert comm["skipped"] == 0
    assert comm["missed"] >= SKIP_LONG // 32 - 1


def test_modes_give_the_same_tokens(lone):
    assert lone["off"][0] == lone["sglang"][0] == lone["auto"][0]


def test_sglang_misses_where_auto_skips_on_concurrent_long_prompts(ray_cluster):
    # Four long prompts batched together: multi-request prefill microbatches, which the PR's
    # rule never skips and `auto` does.
    prompts = _prompts(4, 200, seed=1)
    tokens_s, sglang = _run("sglang", prompts, budget=128)
    tokens_a, auto = _run("auto", prompts, budget=128)
    assert tokens_s == tokens_a
    assert sglang["pp_output_comm"]["missed"] > 0
    assert auto["pp_output_comm"]["missed"] == 0
    assert auto["pp_output_comm"]["skipped"] > sglang["pp_output_comm"]["skipped"]
    for stats in (sglang, auto):
        assert stats["channel_output_sends"] == stats["pp_output_comm"]["sent"]


# -- `ppserve bench prefix` on CPU with the built-in tiny model and tiny lengths: every part runs
# with the cache on and off, and the JSON holds the rows, the hits where the cache can hit and none
# where it cannot (no timing is checked). (was test_bench_prefix.py)

PREFIX_BLOCK = 16


def test_bench_prefix_smoke(ray_cluster, tmp_path, capsys):
    out = tmp_path / "prefix.json"
    argv = ["--device", "cpu", "--model-shape", "tiny", "--docs", "96,160", "--questions", "2",
            "--question-len", "8", "--chat-turns", "3", "--chat-len", "120", "--chat-reply", "4",
            "--distinct", "2", "--distinct-len", "48", "--chunk-size", "32", "--block-size",
            str(PREFIX_BLOCK), "--out", str(out)]
    assert bench_prefix_main(argv) == 0
    printed = capsys.readouterr().out
    assert "next (on) / first (off)" in printed and "distinct: on / off" in printed
    res = json.loads(out.read_text())
    assert res["command"] == "ppserve bench prefix " + " ".join(argv)
    assert "torch" in res["environment"] and res["model_shape"] == "tiny"
    assert res["engines"]["on"]["enable_prefix_caching"] is True
    assert res["engines"]["off"]["enable_prefix_caching"] is False

    rows = {(r["part"], r["cache"], r.get("doc_len")): r for r in res["rows"]}
    assert set(rows) == {(part, cache, doc) for cache in ("on", "off")
                         for part, doc in (("docs", 96), ("docs", 160), ("chat", None),
                                           ("distinct", None))}
    for (part, cache, doc_len), r in rows.items():
        assert all(t > 0 for t in r["ttft_s"]), r
        assert len(r["prefix_hits"]) == len(r["ttft_s"]) == len(r["prompt_lens"])
        if cache == "off" or part == "distinct":
            assert r["prefix_hits"] == [0] * len(r["ttft_s"]), r
            continue
        # cold first request; each later one finds at least the shared full blocks
        assert r["prefix_hits"][0] == 0, r
        shared = doc_len if part == "docs" else None
        for i, hits in enumerate(r["prefix_hits"][1:], start=1):
            if shared is None:  # chat: the previous turn's whole prompt
                shared = r["prompt_lens"][i - 1]
            assert hits >= shared // PREFIX_BLOCK * PREFIX_BLOCK, (part, i, r)
            shared = None if part == "chat" else shared
    docs = rows[("docs", "on", 160)]
    assert docs["prompt_lens"] == [168] * 3
    assert rows[("chat", "on", None)]["prompt_lens"] == [36, 76, 116]

    s = res["summary"]
    assert set(s["docs"]) == {"96", "160"} and "next_on_over_first_off" in s["docs"]["160"]
    assert len(s["chat"]["on"]["turn_ttft_s"]) == 3
    assert s["distinct"]["on"]["n"] == s["distinct"]["off"]["n"] == 2
    assert s["distinct"]["on_over_off"] > 0
