"""DeepSeek decode-only microbatches captured as CUDA graphs (FlashMLA's absorbed MLA, the
Triton grouped MoE; V3.2: the Triton indexer, top-k on the device, FlashMLA's sparse MLA), bf16:
each replay's logits equal the same static buffers run eagerly and agree with the general
ForwardBatch path, on V2-style and V3.2-style tiny shapes with rows of different lengths, a
bucket padded with 3 rows and (V3.2) both graph shapes; the same for V3.2 with FP8 weights (W8A8
on cuBLASLt / Triton, the grouped Triton FP8 MoE), the FP8 latent (FlashMLA's sparse FP8 kernel
for every row) and both; and through the engine, graphed greedy tokens equal --enforce-eager's
with the decode steps replayed, in bf16 and with --quantization fp8 --kv-cache-dtype fp8."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

from stages.kernels import flash_mla
from stages.kernels.registry import select_kernels
from stages.model_config import ModelArgs
from stages.models.families import DEEPSEEK, GraphSetting
from tests.cpu.test_deepseek_paged_decode import decode_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flash_mla.is_available(), reason="needs CUDA SM90 and sgl-flash-mla"),
]

# FlashMLA's shapes: a 576-wide latent (512 + 64 rope), 16 query heads; 8 experts, top-2
FLASH_V2 = {
    "model_type": "deepseek_v2", "vocab_size": 500, "hidden_size": 512,
    "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
# V3.2: q LoRA (the indexer reads it), top-128 of 16 index heads x 128
FLASH_V32 = dict(
    FLASH_V2,
    model_type="deepseek_v32",
    q_lora_rank=256,
    topk_method="noaux_tc",
    n_group=4,
    topk_group=2,
    index_topk=128,
    index_n_heads=16,
    index_head_dim=128,
)
LENGTHS = (5, 70, 120, 3, 9)  # 5 rows: bucket 8 pads 3; 1-2 blocks of 64
STEPS = 12  # the longest row grows from 121 to 132 keys: past index_topk at step 7


@pytest.mark.parametrize("cfg", [FLASH_V2, FLASH_V32], ids=["v2", "v32"])
def test_graphed_decode_equals_eager_and_the_general_path(cfg):
    args = ModelArgs.from_hf_dict(cfg)
    kernels = select_kernels("cuda", linear="torch", attention="torch")
    assert kernels.names["mla_decode"] == "flash-mla"
    assert kernels.names["moe_experts"] == "triton-persistent"
    steps = decode_case(args, kernels, torch.bfloat16, "cuda", 64, 512, LENGTHS, STEPS, True)
    for key, ref, eager, graphed in steps:
        assert graphed is not None and key[0] == 8
        assert torch.equal(graphed, eager), (key, (graphed - eager).abs().max().item())
        scale = ref.abs().max().item()
        assert (graphed - ref).abs().max().item() <= 0.03 * scale, key
        assert (graphed.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8
    widths = [key[1] for key, *_ in steps]
    if "index_topk" in cfg:
        assert widths[0] == 0 and widths[-1] == 512  # dense within top-k, then selecting
    else:
        assert set(widths) == {0}


@pytest.mark.parametrize(
    "cfg,fp8_weights,kv_cache_dtype",
    [
        (FLASH_V32, True, "auto"),
        (FLASH_V32, False, "fp8"),
        (FLASH_V32, True, "fp8"),
        (FLASH_V2, True, "auto"),
    ],
    ids=["v32_fp8_weights", "v32_fp8_kv", "v32_fp8_both", "v2_fp8_weights"],
)
def test_fp8_graphed_decode_equals_eager_and_the_general_path(cfg, fp8_weights, kv_cache_dtype):
    """FP8 weights and/or (V3.2) the FP8 latent: the graphs capture (the family admits these
    kernels), each replay equals the eager run of the same buffers exactly, through the dense
    shape (FP8 latent: every prefix slot on the sparse FP8 kernel) and V3.2's selecting one."""
    args = ModelArgs.from_hf_dict(cfg)
    kernels = select_kernels(
        "cuda", linear="torch", attention="torch", fp8_linear="auto" if fp8_weights else None
    )
    assert kernels.names["mla_sparse_fp8"] == "flash-mla"
    if fp8_weights:
        assert kernels.names["fp8_linear"] == "decode-scaled-mm"
        assert kernels.names["moe_experts_fp8"] == "triton-persistent"
    assert DEEPSEEK.paged_decode_graphs(GraphSetting(kernels.names, 64, kv_cache_dtype, "bfloat16"))
    steps = decode_case(
        args, kernels, torch.bfloat16, "cuda", 64, 512, LENGTHS, STEPS, True, kv_cache_dtype
    )
    for key, ref, eager, graphed in steps:
        assert graphed is not None and key[0] == 8
        assert torch.equal(graphed, eager), (key, (graphed - eager).abs().max().item())
        scale = ref.abs().max().item()
        assert (graphed - ref).abs().max().item() <= 0.05 * scale, key
        assert (graphed.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8
    widths = [key[1] for key, *_ in steps]
    if "index_topk" in cfg:
        assert widths[0] == 0 and widths[-1] == 512
    else:
        assert set(widths) == {0}


@pytest.fixture(scope="module")
def ray_gpu():
    import ray

    ray.init(address="local", num_gpus=1, num_cpus=8, include_dashboard=False,
             runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0"}})  # fmt: skip
    yield
    ray.shutdown()


T = TypeVar("T")
# EngineConfig's fields of graphed_and_eager's engines unless the caller gives others
ENGINE_DEFAULTS = dict(
    pp_size=1,
    device="cuda",
    dtype="bfloat16",
    max_model_len=512,
    max_num_seqs=8,
    chunk_size=128,
    gpu_memory_utilization=0.3,
)


def graphed_and_eager(run: Callable[[Any], T], widths: tuple[int, ...], **config) -> dict[bool, T]:
    """run(engine) on an engine with decode graphs and on one with --enforce-eager (keyed by
    eager), one after the other (config: EngineConfig's fields over ENGINE_DEFAULTS), checking
    after each run that the graphed engine captured graphs of each of `widths` (select widths)
    and replayed decode steps, the eager one none."""
    from app import Engine, EngineConfig

    outs = {}
    for eager in (False, True):
        with Engine(EngineConfig(**{**ENGINE_DEFAULTS, **config, "enforce_eager": eager})) as e:
            outs[eager] = run(e)
            stats, stages = e.stats(), e.info["stages"]
        if eager:
            assert stats["decode_graph_steps"] == [0]
        else:
            assert stages[0]["decode_graphs"]["select_widths"] == list(widths)
            assert stats["decode_graph_steps"][0] >= 4
    return outs


def graphed_and_eager_tokens(
    tmp_path, model=FLASH_V32, block_size=64, widths=(0, 512), **formats
) -> dict[bool, list[list[int]]]:
    """Greedy tokens of the engine (V3.2 by default, random weights) graphed and
    --enforce-eager (keyed by eager): graphed_and_eager over six prompts at once."""
    from app import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(model))
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 150, 64, 1, 30, 129)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return graphed_and_eager(
        lambda engine: [o.token_ids for o in engine.generate(prompts, params)],
        widths,
        model=str(tmp_path),
        load_format="dummy",
        block_size=block_size,
        **formats,
    )


def test_engine_graphs_deepseek_decode(ray_gpu, tmp_path):
    outs = graphed_and_eager_tokens(tmp_path)
    assert outs[False] == outs[True]


def test_engine_graphs_fp8_deepseek_decode(ray_gpu, tmp_path):
    outs = graphed_and_eager_tokens(tmp_path, quantization="fp8", kv_cache_dtype="fp8")
    assert outs[False] == outs[True]
