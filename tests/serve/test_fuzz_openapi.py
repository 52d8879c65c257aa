"""schemathesis against the app's own /openapi.json over real HTTP: cases generated from the
request schemas, valid and schema-violating, per endpoint family. No case may get a 5xx, an error
must have OpenAI's error shape, a schema-violating body must be refused with a 4xx, and the
server must still answer a plain request exactly as before.

PPSERVE_FUZZ_EXAMPLES sets the cases per POST endpoint (CI's default is small; `make fuzz` runs
500). The figures are printed at the end (pytest -s shows them)."""

from __future__ import annotations

import collections
import os

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.serve.conftest import ENGINE_ARGS, start_cluster, stop_cluster

EXAMPLES = int(os.environ.get("PPSERVE_FUZZ_EXAMPLES", "40"))
# Short contexts keep the generated valid requests cheap: at most 63 tokens each.
FUZZ_ARGS = {**ENGINE_ARGS, "max_model_len": 64, "max_request_bytes": 64 << 10}
OK = {"prompt": "abc", "max_tokens": 4, "temperature": 0}
FAMILIES = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
            "models": "/v1/models", "health": "/health", "tokenize": "/tokenize",
            "detokenize": "/detokenize"}


@pytest.fixture(scope="module")
def served():
    try:
        yield start_cluster({"ppserve": ("/", FUZZ_ARGS)})
    finally:
        stop_cluster()


@pytest.fixture(scope="module")
def schema(served):
    import schemathesis

    return schemathesis.openapi.from_url(f"{served.base_url}/openapi.json")


@pytest.fixture(scope="module")
def baseline(served):
    r = httpx.post(f"{served.base_url}/v1/completions", json=OK, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def figures():
    table: dict[str, collections.Counter] = {}
    yield table
    for family, counts in table.items():
        print(f"fuzz {family}: {sum(counts.values())} cases, status counts {dict(counts)}")


def test_schema_documents_the_request_bodies(schema):
    raw = schema.raw_schema
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = raw["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"].startswith("#/components/schemas/")
    chat = raw["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"]
    # content may be absent only from an assistant's tool-call message (checked by the model)
    message = raw["components"]["schemas"]["ChatMessage"]
    assert "role" in message["required"] and {"content", "tool_calls"} <= set(message["properties"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fuzz_family(served, schema, baseline, figures, family):
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        negative_data_rejection,
        response_schema_conformance,
    )

    path = FAMILIES[family]
    ops = [r.ok() for r in schema.get_all_operations() if r.ok().path == path]
    assert len(ops) == 1
    op = ops[0]
    has_body = op.method.upper() == "POST"
    strategy = op.as_strategy(GenerationMode.POSITIVE)
    if has_body:
        strategy = st.one_of(strategy, op.as_strategy(GenerationMode.NEGATIVE))
    counts = figures.setdefault(family, collections.Counter())
    checks = [not_a_server_error, response_schema_conformance]
    if has_body:
        checks.append(negative_data_rejection)

    @settings(max_examples=EXAMPLES if has_body else 5, deadline=None, database=None,
              derandomize=True, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        response = case.call(base_url=served.base_url, timeout=120)
        counts[response.status_code] += 1
        assert response.status_code < 500, (case.body, response.text)
        case.validate_response(response, checks=checks)

    run()
    total = sum(counts.values())
    assert total >= (EXAMPLES if has_body else 1), counts
    if has_body:  # both kinds were tried: some refused, some served
        assert counts[200] > 0 and sum(n for s, n in counts.items() if 400 <= s < 500) > 0
    r = httpx.post(f"{served.base_url}/v1/completions", json=OK, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == baseline
    stats = served.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
