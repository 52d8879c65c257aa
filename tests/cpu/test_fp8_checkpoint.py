"""app/bench/fp8_checkpoint.py: a random DeepSeek-V3.2 checkpoint in DeepSeek's FP8 format.
Its tensors have the Hub checkpoint's names, dtypes and scale grids; its weights are the dummy
model's quantized; the loader reads it with FP8 chosen from its quantization_config; and on CPU
(dequantized at load) two chained stages give transformers' logits on the same checkpoint.

transformers (5.24) dequantizes an FP8 checkpoint on CPU with the block size it derives from the
scale grid (rows // scale rows), which is wrong for a ragged last block (a 192-row weight has 2
tiles of 128, not of 96) and refuses DeepSeek-V3's own 576-row kv_a_proj. So the aligned model
(every width a multiple of 128 or one tile) is checked against transformers reading the FP8
checkpoint itself, the ragged one against transformers on the writer's dequantized copy."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from app.bench.fp8_checkpoint import write_dequantized, write_fp8_checkpoint
from app.tokenizer import load_tokenizer
from stages.kernels import fp8_ref
from stages.loader import keep_fp8_weights, random_init
from stages.model_config import load_model_args
from tests.cpu.conftest import cpu_context
from tests.cpu.test_shards_vs_hf import PROMPT, TOL, Pipeline

_V32 = dict(
    model_type="deepseek_v32",
    vocab_size=200,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    topk_method="noaux_tc",
    index_topk=8,  # below PROMPT's length: the indexer selects keys
    index_n_heads=4,
    index_head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    # widths multiples of 128 or below one tile: q_b 256 x 128, kv_b 256 x 64, experts 128 wide
    "aligned": dict(
        _V32, q_lora_rank=128, qk_nope_head_dim=48, v_head_dim=16, moe_intermediate_size=128
    ),
    # ragged last tiles: q_b 192 x 96, experts 192 wide (the loader's ceil grid)
    "ragged": dict(
        _V32, q_lora_rank=96, qk_nope_head_dim=32, v_head_dim=32, moe_intermediate_size=192
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8ckpt")
    return {k: write_fp8_checkpoint(c, str(root / k), device="cpu") for k, c in CONFIGS.items()}


def stored(path: str) -> dict[str, tuple[str, list[int]]]:
    """Checkpoint tensor -> (safetensors dtype, shape), from the shards' headers."""
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(os.path.join(path, shard), framework="pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                out[name] = (s.get_dtype(), s.get_shape())
                assert weight_map[name] == shard
    return out


def test_tensors_as_deepseek_v32_ships_them(checkpoints):
    """DeepSeek-V3.2's checkpoint listing: FP8 projections and per-expert MLPs with ceil-grid
    fp32 scales; router, indexer weights_proj, embeddings, head bf16; norms and bias fp32."""
    info = checkpoints["ragged"]
    tensors = stored(info["path"])
    assert len(tensors) == info["tensors"]
    layer1 = "model.layers.1."
    want = {
        "model.embed_tokens.weight": ("BF16", [200, 256]),
        "lm_head.weight": ("BF16", [200, 256]),
        "model.norm.weight": ("F32", [256]),
        "model.layers.0.mlp.gate_proj.weight": ("F8_E4M3", [384, 256]),
        "model.layers.0.mlp.gate_proj.weight_scale_inv": ("F32", [3, 2]),
        layer1 + "self_attn.q_b_proj.weight": ("F8_E4M3", [192, 96]),
        layer1 + "self_attn.q_b_proj.weight_scale_inv": ("F32", [2, 1]),
        layer1 + "self_attn.kv_a_proj_with_mqa.weight_scale_inv": ("F32", [1, 2]),
        layer1 + "self_attn.kv_b_proj.weight": ("F8_E4M3", [256, 64]),
        layer1 + "self_attn.indexer.wq_b.weight": ("F8_E4M3", [128, 96]),
        layer1 + "self_attn.indexer.wk.weight_scale_inv": ("F32", [1, 2]),
        layer1 + "self_attn.indexer.weights_proj.weight": ("BF16", [4, 256]),
        layer1 + "self_attn.indexer.k_norm.bias": ("F32", [32]),
        layer1 + "self_attn.kv_a_layernorm.weight": ("F32", [64]),
        layer1 + "mlp.gate.weight": ("BF16", [8, 256]),
        layer1 + "mlp.gate.e_score_correction_bias": ("F32", [8]),
        layer1 + "mlp.shared_experts.down_proj.weight": ("F8_E4M3", [256, 192]),
        layer1 + "mlp.experts.7.up_proj.weight": ("F8_E4M3", [192, 256]),
        layer1 + "mlp.experts.7.up_proj.weight_scale_inv": ("F32", [2, 2]),
        layer1 + "mlp.experts.0.down_proj.weight_scale_inv": ("F32", [2, 2]),
    }
    assert {n: tensors[n] for n in want} == want
    fp8 = [n for n, (dtype, _) in tensors.items() if dtype == "F8_E4M3"]
    assert len(fp8) == info["fp8_tensors"]
    assert all(n + "_scale_inv" in tensors for n in fp8)  # and only FP8 weights have scales
    assert len([n for n in tensors if n.endswith("_scale_inv")]) == len(fp8)
    with open(os.path.join(info["path"], "config.json")) as f:
        config = json.load(f)
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    assert config["architectures"] == ["DeepseekV32ForCausalLM"]
    tok = load_tokenizer(info["path"])  # the word-level tokenizer: ids read back from text
    assert tok.encode("t5 t17 t199", add_special_tokens=False) == [5, 17, 199]
    assert tok.decode([5, 17, 199]) == "t5 t17 t199"
    assert tok.eos_token_ids == (2,)  # config.json's


def test_weights_are_the_dummy_models_quantized(checkpoints):
    """The checkpoint dequantized is random_init's model (the same seed) within e4m3's error,
    each 128 x 128 tile's largest value at 448 x its scale."""
    path = checkpoints["ragged"]["path"]
    args = load_model_args(path)
    dummy = args.family.stage()(cpu_context(args, range(1, 2), False, False))
    random_init(dummy, 0)
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"
    with safe_open(os.path.join(path, "model-00002-of-00003.safetensors"), framework="pt") as f:
        q, scale = f.get_tensor(name), f.get_tensor(name + "_scale_inv")
    want = dummy.layers["1"].mlp.experts.gate_up_proj[3, :192]
    got = fp8_ref.dequantize_weight(q, scale)
    assert ((got - want).norm() / want.norm()).item() < 0.06
    assert scale[1, 0] == want[128:, :128].abs().max() / 448.0  # the ragged tile's own amax


def test_loader_picks_fp8_from_the_config(checkpoints):
    args = load_model_args(checkpoints["aligned"]["path"])
    assert args.fp8_block == (128, 128)
    assert keep_fp8_weights(args, "auto", "cuda")  # kept FP8 on CUDA, chosen by the config
    assert not keep_fp8_weights(args, "none", "cuda")  # --quantization none: dequantized
    assert not keep_fp8_weights(args, "auto", "cpu")  # CPU dequantizes at load


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_stages_match_transformers(checkpoints, tmp_path, caplog, kind):
    """Two chained stages reading their shards (FP8 dequantized at load) == transformers."""
    import transformers as tf

    path = checkpoints[kind]["path"]
    reference = path if kind == "aligned" else write_dequantized(path, str(tmp_path / "plain"))
    model, info = tf.DeepseekV32ForCausalLM.from_pretrained(
        reference, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # every tensor read under its own name, none left out
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0].float()
    caplog.set_level("INFO", logger="stages.loader")
    pipe = Pipeline(path, num_stages=2)
    assert sum("FP8 block-scaled checkpoint" in r.message for r in caplog.records) == 2
    got = pipe.logits(PROMPT, [(0, len(PROMPT), list(range(8)), True)], all_positions=True)
    assert (got - want).abs().max().item() <= TOL
    assert want.std().item() > 0.1  # not degenerate logits
