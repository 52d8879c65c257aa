"""Decode-only microbatches replayed as CUDA graphs (PP=1, one GPU, bf16): greedy tokens
identical to the eager paged path (--enforce-eager) and to transformers on the same checkpoint
(up to a near-tie in HF's own bf16 logits, as in test_engine_cuda.py), and the decode steps
really were graph replays."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_NEW = 16
TOL = 0.05


@pytest.fixture(scope="module")
def ray_gpu():
    import ray

    ray.init(num_gpus=1, num_cpus=8, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.cpu.conftest import hf_model

    path = str(tmp_path_factory.mktemp("ckpt") / "llama-bf16")
    model = hf_model("llama")
    model.config.max_position_embeddings = 1024
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def _hf(path, prompts):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_NEW,
                                 do_sample=False, eos_token_id=2, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
            refs.append((out.sequences[0, len(p):].tolist(), [s[0].float() for s in out.scores]))
    del model
    return refs


def _run(path, prompts, **overrides):
    from app import Engine, EngineConfig, SamplingParams

    cfg = EngineConfig(**{**dict(model=path, pp_size=1, device="cuda", dtype="bfloat16",
                                 block_size=64, max_model_len=1024, max_num_seqs=24,
                                 chunk_size=64, gpu_memory_utilization=0.3), **overrides})
    with Engine(cfg) as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                       ignore_eos=True))
        return outs, engine.stats(), engine.info["stages"]


def test_decode_graphs_match_eager_and_transformers(ray_gpu, checkpoint):
    rng = random.Random(3)
    lengths = (5, 70, 130, 3, 64, 200, 9, 33, 1, 17, 65, 128)  # 12 rows: bucket 16 pads 4
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in lengths]
    graphed, stats, stages = _run(checkpoint, prompts)
    eager, eager_stats, _ = _run(checkpoint, prompts, enforce_eager=True)
    assert stages[0]["decode_graphs"]["graphs"] > 0
    assert stats["decode_graph_steps"][0] >= MAX_NEW - 2  # decode ran as replays
    assert eager_stats["decode_graph_steps"] == [0]
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    compared = 0
    for out, (toks, logits) in zip(graphed, _hf(checkpoint, prompts)):
        for step, (mine, ref) in enumerate(zip(out.token_ids, toks)):
            if mine != ref:  # only a near-tie in HF's bf16 logits may explain a difference
                assert logits[step].max() - logits[step][mine] <= TOL, (step, mine, ref)
                break
            compared += 1
    assert compared >= len(prompts) * MAX_NEW // 2
