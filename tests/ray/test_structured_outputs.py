"""Structured outputs through a real 2-stage pipeline (random model, byte tokenizer): every
constrained output follows its grammar in every skip mode, with and without run-ahead, next to
unconstrained requests in the same microbatches."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from app import Engine, EngineConfig, SamplingParams
from app.request import StructuredOutput

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
