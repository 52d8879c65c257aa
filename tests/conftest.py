"""Fixtures shared by every test layer: the real SmolLM2 checkpoint and its transformers oracle.

The checkpoint comes from `ppserve download smollm2` into the usual cache ($PPSERVE_CACHE, else
~/.cache/ppserve): a fresh CI machine fetches it once, at the first test that asks, and every
later test file of the run reads it from there.
"""

from __future__ import annotations

import atexit
import os
import sys

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from app.models_cache import ensure_model

    return str(ensure_model("smollm2"))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    """(transformers model in float32, its tokenizer) on the converted checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session", autouse=True)
def _sparse_attention_oracle_tie_rule():
    """Every transformers reference of the run selects DeepSeek's sparse keys by ppserve's tie
    rule (tests/hf_reference.py: stable_indexer_topk); where transformers or those models are
    missing (the GPU host) there is nothing to patch."""
    from tests.hf_reference import stable_indexer_topk

    with stable_indexer_topk():
        yield


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """Exit with pytest's status once its report is written, skipping the interpreter's teardown:
    there torch's and Ray's native destructors (gRPC, the Serve router's event-loop thread, which
    outlives `serve.shutdown`) run in no fixed order, and a CI run whose 1,044 tests had all passed
    died there of a segfault (exit 139). Registered last, this atexit callback runs first, after
    pytest's own cleanup and the joins of non-daemon threads; a crash before it prints every
    thread's stack (`make test` sets PYTHONFAULTHANDLER)."""

    def exit_with_pytest_status() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(session.exitstatus))

    atexit.register(exit_with_pytest_status)
