"""`ppserve serve` on CUDA with a real FP8 checkpoint: a 4-layer V3.2-bench model written in
DeepSeek's own FP8 format (app/bench/fp8_checkpoint.py: e4m3 weights, 128 x 128 fp32 scales,
quantization_config), reached with the official openai client over HTTP.

1. FP8 served (quantization chosen from the checkpoint, `--kv-cache-dtype fp8`): every
   /v1/completions answers 200 with the tokens asked for; the stage logged FP8 kernels, the
   checkpoint's FP8 weights kept, and the FP8 latent's KV bytes.
2. Accuracy against the same checkpoint dequantized to bf16 (what `--quantization none`
   loads), in process on the engine's stage code: logits relative error and argmax agreement
   along the bf16 model's greedy path, bounded on the prompts within index_topk.
3. The same checkpoint served with `--quantization none --kv-cache-dtype bfloat16`: its greedy
   tokens against the FP8 server's.

The results go to $OUT/serve_fp8_checkpoint.json (when OUT is set; the servers' logs beside it)
and are printed. Bounds are loose: a random model past index_topk (the 2600-token prompt) turns
small differences into other selected keys (app.bench.fp8's yardstick: bf16 itself is 0.3 off
fp32 there).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tests.serve.conftest import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
openai = pytest.importorskip("openai")
pytest.importorskip("ray")

MODEL = "v32-fp8"
LAYERS = 4
MAX_NEW = 8
CHUNK = 256  # the in-process chains' prefill chunk
PROMPT_LENS = (40, 300, 2600)  # the last past V3.2-bench's index_topk (2048)
SERVE_FLAGS = (
    "--pp",
    "1",
    "--device",
    "cuda",
    "--dtype",
    "bfloat16",
    "--max-model-len",
    "4096",
    "--num-gpu-blocks-override",
    "128",
)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 100000) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> dict[str, Any]:
    from app.bench.fp8_checkpoint import write_fp8_checkpoint
    from app.bench.target import shape_config

    config = dict(shape_config("deepseek-v32-bench"), num_hidden_layers=LAYERS)
    written = write_fp8_checkpoint(config, str(tmp_path_factory.mktemp("v32fp8") / "ckpt"))
    torch.cuda.empty_cache()  # the draws' cached blocks, before the servers start
    return written


@pytest.fixture(scope="module")
def report(checkpoint) -> dict[str, Any]:
    return {
        "checkpoint": {k: v for k, v in checkpoint.items() if k != "path"},
        "shape": f"deepseek-v32-bench, {LAYERS} layers",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "prompt_lens": list(PROMPT_LENS),
        "max_new": MAX_NEW,
    }


def log_path(tmp_path_factory: Any, name: str) -> str:
    """A server's log: under $OUT when set (it comes back with the results), else tmp."""
    root = os.environ.get("OUT") or str(tmp_path_factory.mktemp("logs"))
    return os.path.join(root, name)


def save(report: dict[str, Any]) -> None:
    text = json.dumps(report, indent=1)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "serve_fp8_checkpoint.json"), "w") as f:
            f.write(text)


def wait_healthy(port: int, proc: subprocess.Popen[bytes], log: str, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ppserve serve exited {proc.returncode}:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"ppserve serve not healthy after {limit_s:.0f} s:\n{tail(log)}")


def tail(log: str, lines: int = 40) -> str:
    with open(log, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


@contextmanager
def serving(path: str, log: str, *flags: str) -> Iterator[Any]:
    """`ppserve serve` on the checkpoint (its own local Ray cluster), as an openai client."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "serve",
        "--model",
        path,
        "--served-model-name",
        MODEL,
        *SERVE_FLAGS,
        *flags,
        "--port",
        str(port),
        "--metrics-port",
        str(free_port()),
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(port, proc, log, 150)
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )
    finally:
        proc.send_signal(signal.SIGINT)  # the CLI shuts Serve and its Ray cluster down
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def complete(client: Any, prompt: list[int], as_text: bool) -> list[int]:
    """Greedy tokens of one /v1/completions (the tokenizer spells token i `t<i>`)."""
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=" ".join(f"t{i}" for i in prompt) if as_text else prompt,
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert raw.status_code == 200
    out = raw.parse()
    assert out.usage.prompt_tokens == len(prompt)  # text went through the checkpoint's tokenizer
    assert out.usage.completion_tokens == MAX_NEW
    assert out.choices[0].finish_reason == "length"
    words = out.choices[0].text.split()
    assert len(words) == MAX_NEW and all(re.fullmatch(r"t\d+", w) for w in words), words
    return [int(w[1:]) for w in words]


def served(path: str, log: str, *flags: str) -> dict[str, Any]:
    """Greedy tokens of every prompt (the first by token ids, the others as text), and what the
    stage logged."""
    with serving(path, log, *flags) as client:
        tokens = [complete(client, p, as_text=i > 0) for i, p in enumerate(prompts())]
    with open(log, errors="replace") as f:
        text = f.read()
    kv = re.search(r"KV cache: (\d+) bytes per token per layer \(MLA latent, (\w+)\)", text)
    weights = re.search(r"stage memory: weights ([\d.]+) GiB", text)
    kernels = dict(re.findall(r"'(fp8_linear|moe_experts_fp8|mla_sparse_fp8)': '([\w-]+)'", text))
    assert kv and weights, tail(log)
    return {
        "tokens": tokens,
        "kv_bytes_per_token_layer": int(kv.group(1)),
        "kv_cache_dtype": kv.group(2),
        "weights_gib": float(weights.group(1)),
        "kernels": kernels,
        "log": text,
    }


@pytest.fixture(scope="module")
def fp8_served(checkpoint, tmp_path_factory) -> dict[str, Any]:
    log = log_path(tmp_path_factory, "serve_fp8_checkpoint.log")
    return served(checkpoint["path"], log, "--kv-cache-dtype", "fp8")


def test_fp8_checkpoint_serves_over_openai(checkpoint, fp8_served, report):
    from stages.kv_cache import bytes_per_token_layer
    from stages.model_config import load_model_args

    s = fp8_served
    assert s["kernels"].get("fp8_linear", "torch") != "torch", s["kernels"]
    assert s["kernels"].get("mla_sparse_fp8") == "flash-mla", s["kernels"]
    kept = re.search(
        r"FP8 weights kept for W8A8: (\d+) from the checkpoint, (\d+) quantized", s["log"]
    )
    assert kept and int(kept.group(1)) > 0 and int(kept.group(2)) == 0, "not kept FP8"
    # the FP8 latent (656 bytes) and the indexer's key, as the engine's own sizing counts them
    args = load_model_args(checkpoint["path"])
    assert s["kv_cache_dtype"] == "fp8"
    assert s["kv_bytes_per_token_layer"] == bytes_per_token_layer(args, torch.bfloat16, "fp8")
    assert s["kv_bytes_per_token_layer"] < bytes_per_token_layer(args, torch.bfloat16, "bfloat16")
    report["fp8_served"] = {k: v for k, v in s.items() if k != "log"}
    report["fp8_served"]["weights_kept_fp8"] = int(kept.group(1))
    save(report)


def test_fp8_logits_against_bf16_dequantized(checkpoint, report):
    """Teacher-forced along the bf16 model's greedy path: both chains read the checkpoint, one
    keeping FP8 weights (W8A8) with the FP8 latent cache, one dequantized to bf16 at load."""
    from app.bench.fp8 import StageChain
    from stages.model_config import load_model_args

    path = checkpoint["path"]
    args = load_model_args(path)
    blocks = -(-(max(PROMPT_LENS) + MAX_NEW) // 64) + 1

    def chain(fp8: bool) -> StageChain:
        return StageChain(
            args,
            path,
            fp8,
            "fp8" if fp8 else "bfloat16",
            num_stages=1,
            num_blocks=blocks,
            block_size=64,
            dtype=torch.bfloat16,
            device="cuda",
        )

    base, test = chain(False), chain(True)
    rows = []
    for prompt in prompts():
        tokens, want = base.follow(prompt, CHUNK, [], MAX_NEW)
        got = test.follow(prompt, CHUNK, tokens)[1]
        want, got = want.float(), got.float()
        assert torch.isfinite(got).all()
        rows.append(
            {
                "prompt_len": len(prompt),
                "bf16_greedy": tokens,
                "logits_rel_err": round(((got - want).norm() / want.norm()).item(), 4),
                "argmax_agreement": round(
                    (got.argmax(-1) == want.argmax(-1)).float().mean().item(), 4
                ),
            }
        )
    del base, test
    torch.cuda.empty_cache()
    topk = args.family_args.indexer.topk
    dense = [r for r in rows if r["prompt_len"] + MAX_NEW <= topk]  # every key attended
    mean = {
        f"{k}_{part}": round(sum(r[k] for r in group) / len(group), 4)
        for part, group in (("dense", dense), ("all", rows))
        for k in ("logits_rel_err", "argmax_agreement")
    }
    report["accuracy"] = {"against": "the checkpoint dequantized to bf16", **mean, "rows": rows}
    save(report)
    # Unrelated logits would be sqrt(2) apart. Past index_topk the random indexer's near-tied
    # scores pick other keys for small differences: recorded, not bounded.
    assert mean["logits_rel_err_dense"] < 0.5
    assert mean["argmax_agreement_dense"] >= 0.5


def test_bf16_dequantized_serves_and_greedy_agreement(
    checkpoint, fp8_served, report, tmp_path_factory
):
    log = log_path(tmp_path_factory, "serve_bf16_dequantized.log")
    s = served(checkpoint["path"], log, "--quantization", "none", "--kv-cache-dtype", "bfloat16")
    assert "fp8_linear" not in s["kernels"], s["kernels"]
    assert re.search(r"FP8 block-scaled checkpoint: \d+ weights dequantized", s["log"])
    assert s["kv_cache_dtype"] == "bfloat16"
    assert s["kv_bytes_per_token_layer"] > fp8_served["kv_bytes_per_token_layer"]
    assert s["weights_gib"] > fp8_served["weights_gib"]
    pairs = list(zip(fp8_served["tokens"], s["tokens"]))
    same = [sum(a == b for a, b in zip(f, b)) / MAX_NEW for f, b in pairs]
    prefix = [next((i for i, (a, b) in enumerate(zip(f, b)) if a != b), MAX_NEW) for f, b in pairs]
    report["bf16_served"] = {k: v for k, v in s.items() if k != "log"}
    report["served_greedy_agreement"] = {
        "positionwise": round(sum(same) / len(same), 4),
        "common_prefix": prefix,
        "first_token": sum(f[0] == b[0] for f, b in pairs) / len(pairs),
    }
    save(report)
