"""`ppserve generate` with no --model runs SmolLM2 (from the cache the session fixture filled)
and says something sensible; `--model random` still runs the built-in model."""

from __future__ import annotations

import os
import subprocess
import sys


def generate(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "app.cli", "generate", *args, "--num-cpus", "4",
                           "--stage-num-cpus", "0.5"], capture_output=True, text=True,
                          timeout=600, env=env)


def test_generate_defaults_to_smollm2(smollm2_dir):
    r = generate("The capital of France is", "--max-tokens", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(" Paris"), r.stdout
    assert "[3 tokens, finish_reason=length]" in r.stderr


def test_model_random_keeps_the_builtin_model():
    r = generate("The capital of France is", "--model", "random", "--max-tokens", "3",
                 "--ignore-eos")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[3 tokens, finish_reason=length]" in r.stderr
    assert "Paris" not in r.stdout  # random weights and a byte tokenizer: noise
