"""DeepSeek-V2/V3 (MLA + MoE) stage shards chained == the whole Hugging Face model, on tiny
checkpoints transformers wrote: prefill (expanded MLA), decode (absorbed MLA over the latent
cache), mixed batches, sharded and FP8 block-scaled checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from stages.kv_cache import bytes_per_block, bytes_per_token_layer
from stages.loader import load_stage_weights
from stages.model_config import ModelArgs, load_model_args
from stages.models.deepseek import DeepseekRouter, DeepseekStage
from stages.models.deepseek_config import DEEPSEEK_V2_LITE, softmax_scale
from tests.cpu.conftest import (
    DEEPSEEK_ARCHS,
    cpu_context,
    hf_model,
    hf_prompt_logits,
    write_tiny_checkpoint,
    write_tiny_checkpoints,
)
from tests.cpu.test_shards_vs_hf import (
    PROMPT,
    TABLE,
    TOL,
    Pipeline,
    check_chained_stages,
    prefill_in_chunks,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("ds"), DEEPSEEK_ARCHS)


@pytest.fixture(scope="module")
def hf_logits():
    return hf_prompt_logits(DEEPSEEK_ARCHS, PROMPT)


def hf_next_logits(arch: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(arch)(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_chained_stages_match_hf(checkpoints, hf_logits, arch, num_stages):
    check_chained_stages(checkpoints[arch], num_stages, hf_logits[arch])


@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_chunks_then_absorbed_decode(checkpoints, hf_logits, arch):
    """Odd chunks over non-contiguous blocks, then decode steps that attend in latent space."""
    pipe = Pipeline(checkpoints[arch], num_stages=2, block_size=4, num_blocks=12)
    logits = prefill_in_chunks(pipe)
    assert (logits[0] - hf_logits[arch][-1]).abs().max().item() <= TOL
    ids = list(PROMPT)
    for _ in range(3):
        ids.append(int(logits[0].argmax()))
        logits = pipe.logits([ids[-1]], [(len(ids) - 1, 1, TABLE, True)])
        assert (logits[0] - hf_next_logits(arch, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("arch", ["ds_v3", "ds_v32_sparse"])
def test_decode_rows_and_a_chunk_in_one_batch(checkpoints, arch):
    """Two decode rows (absorbed, one kernel call) beside a prefill chunk (expanded; V3.2: every
    row sparse, the decode rows' prefixes read through their block tables)."""
    pipe = Pipeline(checkpoints[arch], num_stages=3, block_size=4, num_blocks=24)
    a, b, c = PROMPT[:9], PROMPT[3:17], PROMPT[:20]
    ta, tb, tc = [0, 5, 10], [1, 6, 11, 16], [2, 7, 12, 17, 22]
    pipe.logits(a[:8] + b[:13] + c[:12], [(0, 8, ta, False), (0, 13, tb, False),
                                          (0, 12, tc, False)])
    logits = pipe.logits([a[8], b[13]] + c[12:], [(8, 1, ta, True), (13, 1, tb, True),
                                                  (12, 8, tc, True)])
    for row, ids in zip(logits, (a, b, c)):
        assert (row - hf_next_logits(arch, ids)).abs().max().item() <= TOL


def test_stage_reads_only_its_tensors(tmp_path, tensor_reads):
    """A sharded checkpoint: the middle stage reads its layers' tensors, the per-expert ones
    included, once each, and nothing of other layers."""
    path = write_tiny_checkpoint(tmp_path, "ds_v3", max_shard_size="100KB")
    assert len(list(tmp_path.glob("ds_v3-sharded/*.safetensors"))) >= 3
    read = tensor_reads
    args = load_model_args(path)
    model = DeepseekStage(cpu_context(args, range(1, 3), False, False))
    names = load_stage_weights(model, path)
    assert sorted(read) == names and len(read) == len(set(read))
    assert all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in read)
    # per layer: 7 attention tensors (q LoRA), router weight + bias, 8 x 3 experts, 3 shared,
    # 2 norms
    assert len(read) == 2 * (7 + 2 + 24 + 3 + 2)


def _fp8_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled e4m3 as DeepSeek's checkpoints store it (weight, weight_scale_inv)."""
    n, k = w.shape
    rows, cols = -(-n // block), -(-k // block)
    scale = torch.empty(rows, cols)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).to(q.dtype)
    return q, scale


def test_fp8_block_scaled_checkpoint(tmp_path, checkpoints, caplog):
    """Projection weights stored as FP8 with weight_scale_inv are dequantized at load: logits
    equal transformers' on the dequantized weights, and the log says so once."""
    src = checkpoints["ds_v2"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    block = 16
    for name in list(tensors):
        if name.endswith("proj.weight") and tensors[name].dim() == 2:
            q, s = _fp8_quantize(tensors[name], block)
            tensors[name], tensors[name + "_scale_inv"] = q, s
    out = tmp_path / "fp8"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "weight_block_size": [block, block]}
    (out / "config.json").write_text(json.dumps(cfg))
    caplog.set_level("INFO", logger="stages.loader")
    pipe = Pipeline(str(out), num_stages=2)
    assert sum("FP8 block-scaled" in r.message for r in caplog.records) == 2  # once per stage
    # transformers reads the same weights, dequantized by hand, in its own layout
    plain = tmp_path / "dequantized"
    plain.mkdir()
    deq = {n: t for n, t in tensors.items() if not n.endswith("_scale_inv")}
    for n, t in deq.items():
        if n + "_scale_inv" in tensors:
            s = tensors[n + "_scale_inv"]
            deq[n] = t.float() * s.repeat_interleave(block, 0)[:t.shape[0]].repeat_interleave(
                block, 1)[:, :t.shape[1]]
    save_file(deq, str(plain / "model.safetensors"), metadata={"format": "pt"})
    (plain / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    import transformers as tf
    with torch.no_grad():
        want = tf.DeepseekV2ForCausalLM.from_pretrained(str(plain), dtype=torch.float32)(
            torch.tensor([PROMPT])).logits[0].float()
    got = pipe.logits(PROMPT, [(0, len(PROMPT), list(range(8)), True)], all_positions=True)
    assert (got - want).abs().max().item() <= TOL
    assert (want - hf_model("ds_v2")(torch.tensor([PROMPT])).logits[0]).abs().max() > TOL


def test_latent_cache_bytes_and_yarn_scale():
    lite = ModelArgs.from_hf_dict(DEEPSEEK_V2_LITE)
    assert lite.family_args.latent_dim == 576 and lite.head_dim == 192
    assert bytes_per_token_layer(lite, torch.bfloat16) == 576 * 2  # not 2 x 16 heads x 192
    assert bytes_per_block(lite, 13, 64, torch.bfloat16) == 13 * 64 * 576 * 2
    # YaRN: softmax scale x mscale(40, 0.707)^2, as transformers' yarn_apply_mscale
    m = 0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert softmax_scale(lite.family_args, lite.rope_scaling) == pytest.approx(192 ** -0.5 * m * m)


def test_grouped_routing_is_exercised(checkpoints):
    """The test configs' group limits change which experts win (else the HF match would not
    test them), and a bad topk_method is refused by name."""
    for arch in ("ds_v2_grouped", "ds_v3"):
        args = load_model_args(checkpoints[arch])
        router = DeepseekRouter(args, "cpu")
        torch.manual_seed(0)
        router.weight.data.normal_(0, 0.1)
        if args.family_args.version == "v3":
            router.e_score_correction_bias.data.zero_()
        x = torch.randn(64, args.hidden_size)
        grouped = router(x)[1].sort(dim=-1).values
        router.d = dataclasses.replace(args.family_args, topk_group=args.family_args.n_group)
        free = router(x)[1].sort(dim=-1).values
        assert not torch.equal(grouped, free)
    with open(os.path.join(checkpoints["ds_v2"], "config.json")) as f:
        cfg = json.load(f)
    with pytest.raises(ValueError, match="topk_method"):
        ModelArgs.from_hf_dict({**cfg, "topk_method": "noaux"})
    with pytest.raises(ValueError, match="rope type"):
        ModelArgs.from_hf_dict({**cfg, "rope_parameters": {"rope_type": "longrope"}})


@pytest.mark.parametrize("arch,indexer_width", [("ds_v3", 0), ("ds_v32_sparse", 16)])
def test_stage_runner_sizes_the_latent_cache(checkpoints, caplog, arch, indexer_width):
    """The stage's block count comes from the latent's bytes (kv_lora_rank + rope per token and
    layer, plus V3.2's indexer key), and the stage logs that figure at start."""
    from app.config import EngineConfig
    from stages.models.deepseek_config import INDEXER_KEY
    from stages.runner import StageRunner

    caplog.set_level("INFO", logger="ppserve.stage")
    config = EngineConfig(model=checkpoints[arch], pp_size=2, block_size=4,
                          kv_cache_memory_bytes=1 << 20)
    spec = config.stage_spec(0, (0, 2), max_model_len=0, output_channel="nccl")
    runner = StageRunner(spec)
    per_token_layer = (32 + 8 + indexer_width) * 4  # fp32 latent (+ key) of the tiny config
    assert f"{per_token_layer} bytes per token per layer" in caplog.text
    assert runner.kv_capacity() == (1 << 20) // (2 * 4 * per_token_layer)
    runner.allocate_kv(3)
    assert runner.kv.pages(1).shape == (3, 4, 1, 40)
    if indexer_width:
        assert runner.kv.pages(1, INDEXER_KEY).shape == (3, 4, 1, indexer_width)
    else:
        assert INDEXER_KEY not in runner.kv.components


def test_experts_saved_stacked(tmp_path, checkpoints, hf_logits):
    """A checkpoint holding the routed experts already stacked (transformers' in-memory layout)
    loads as well as the per-expert one."""
    src = checkpoints["ds_v3_flat"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for layer in range(4):
        pre = f"model.layers.{layer}.mlp.experts"
        n = 8
        gate_up = [torch.cat([tensors.pop(f"{pre}.{e}.gate_proj.weight"),
                              tensors.pop(f"{pre}.{e}.up_proj.weight")]) for e in range(n)]
        down = [tensors.pop(f"{pre}.{e}.down_proj.weight") for e in range(n)]
        tensors[f"{pre}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{pre}.down_proj"] = torch.stack(down)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    pipe = Pipeline(str(tmp_path), num_stages=2)
    logits = pipe.logits(PROMPT, [(0, len(PROMPT), list(range(8)), True)], all_positions=True)
    assert (logits - hf_logits["ds_v3_flat"]).abs().max().item() <= TOL
