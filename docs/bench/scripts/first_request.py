"""TTFT of the first requests after startup against repeats of them, on a fresh PP=2 engine
(Llama-3-8B shapes, random weights, chunks of 4096, max_model_len 40000: the serve bench's
server), with the startup attention warm-up and without it (--warmup-len 0).

  python docs/bench/scripts/first_request.py OUT.json      (two GPUs)
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import ray

from app.bench.target import BenchEngine, environment, write_model
from app.request import SamplingParams


def measure(model_dir: str, warmup_len: int | None) -> dict:
    rng = random.Random(0)
    prompts = {n: [rng.randrange(1000, 120000) for _ in range(n)] for n in (32768, 20000)}
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    with BenchEngine(model=model_dir, load_format="dummy", pp_size=2, device="cuda",
                     dtype="bfloat16", chunk_size=4096, max_model_len=40000,
                     warmup_len=warmup_len) as engine:
        result = {"warmup_len": warmup_len, "startup_s": time.perf_counter() - t0,
                  "attention_warmup": engine.stats()["attention_warmup"], "ttft_s": []}
        for n in (32768, 32768, 20000, 20000):
            result["ttft_s"].append((n, asyncio.run(engine.ttft(prompts[n], params))))
            print(warmup_len, result["ttft_s"][-1], flush=True)
    return result


def main(out: str) -> None:
    model_dir, _, model = write_model("llama8b", None)
    ray.init(num_gpus=2, num_cpus=8, include_dashboard=False,
             runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0"}})
    res = {"command": "python docs/bench/scripts/first_request.py " + out,
           "environment": environment(), "runs": []}
    for warmup_len in (None, 0):
        res["runs"].append(measure(model_dir, warmup_len))
        json.dump(res, open(out, "w"), indent=1)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
