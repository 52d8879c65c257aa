"""A random-weight DeepSeek checkpoint in DeepSeek's own FP8 format, as the Hub's DeepSeek-V3 and
V3.2 checkpoints ship it, at a bench shape (app/bench/target.py) and any layer count:

    python -m app.bench.fp8_checkpoint --model-shape deepseek-v32-bench --layers 4 --out DIR

The weights are `--load-format dummy`'s draws (stages/loader.py random_init: same seed, same
device type), stored as in DeepSeek-V3.2's safetensors: the attention projections, the
indexer's wq_b and wk and every MLP and expert (dense, shared, routed, one tensor per expert)
float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 tile (its amax / 448); the router,
the indexer's weights_proj, embeddings and lm_head bfloat16; norms and the router's bias
float32. One shard per layer and model.safetensors.index.json; config.json with DeepSeek-V3's
quantization_config; a word-level tokenizer whose token i is spelled `t<i>` (a random model's
text says nothing, but its ids can be read back from the text of a completion).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from app.bench.target import MODEL_SHAPES, add_model_args, shape_config
from stages.kernels import fp8_ref
from stages.kernels.fp8_ref import SCALE_SUFFIX
from stages.kernels.registry import select_kernels
from stages.loader import random_init, tensor_sources
from stages.model_config import ModelArgs
from stages.stage_context import StageContext, StageModel

QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [fp8_ref.BLOCK, fp8_ref.BLOCK],
}
# The modules whose weights DeepSeek-V3.2's checkpoint holds in FP8 (its tensor listing): MLA's
# projections, the indexer's query and key projections, and every MLP's three.
FP8_MODULES = frozenset(
    {
        "q_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "wq_b",
        "wk",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
)
FP32_SUFFIXES = ("norm.weight", "norm.bias", "e_score_correction_bias")
ARCHITECTURES = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
}
SHAPES = tuple(s for s in MODEL_SHAPES if s.startswith("deepseek-v") and "v4" not in s)


def is_fp8(name: str) -> bool:
    """Whether DeepSeek stores the checkpoint tensor `name` in FP8 (with its scales)."""
    module, _, leaf = name.rpartition(".")
    return (
        leaf == "weight"
        and name.startswith("model.layers.")
        and module.rpartition(".")[2] in FP8_MODULES
    )


def stored_dtype(name: str) -> torch.dtype:
    """The dtype of an unquantized tensor in DeepSeek-V3.2's checkpoint."""
    return torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16


def checkpoint_tensors(stage: StageModel) -> dict[str, torch.Tensor]:
    """The stage's parameters under the checkpoint's names, in DeepSeek's FP8 format (on CPU)."""
    params = dict(stage.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for param, pieces in tensor_sources(stage).items():
        for name, index, *_ in pieces:  # a whole stage: no tensor-parallel slices
            value = params[param][index]
            if is_fp8(name):
                q, scale = fp8_ref.quantize_weight(value)
                out[name], out[name + SCALE_SUFFIX] = q.cpu(), scale.cpu()
            else:
                out[name] = value.to(stored_dtype(name)).cpu().contiguous()
    return out


def write_tokenizer(out: str, vocab_size: int) -> None:
    """A word-level tokenizer over the whole vocabulary: id i is the word `t<i>`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(out, "tokenizer.json"))
    # No special tokens declared: transformers splits text at them, and `t1` would split `t17`
    # (config.json's eos_token_id still ends a request).
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)


def write_fp8_checkpoint(
    config: dict[str, Any], out: str, seed: int = 0, device: str | None = None
) -> dict[str, Any]:
    """Writes the checkpoint of the DeepSeek config dict `config` into `out` (drawn and
    quantized on `device`: CUDA when there is one); returns a summary (tensors, bytes)."""
    args = ModelArgs.from_hf_dict(config)
    if args.family.name != "deepseek" or args.model_type not in ARCHITECTURES:
        raise ValueError(
            f"an FP8 checkpoint is written for DeepSeek-V2/V3/V3.2 configs, not {args.model_type}"
        )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(out, exist_ok=True)
    # No fp8_linear: every weight in the model's dtype and its checkpoint layout.
    kernels = select_kernels("cpu")
    layers = args.num_hidden_layers
    weight_map: dict[str, str] = {}
    total = fp8 = 0
    for layer in range(layers):  # a stage per layer: one layer's fp32 draws at a time
        ctx = StageContext(
            args,
            range(layer, layer + 1),
            layer == 0,
            layer == layers - 1,
            kernels,
            torch.float32,
            torch.device(device),
        )
        stage = args.family.stage()(ctx)
        random_init(stage, seed)
        tensors = checkpoint_tensors(stage)
        del stage
        shard = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        fp8 += sum(t.dtype == fp8_ref.FP8 for t in tensors.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    saved = {
        "architectures": [ARCHITECTURES[args.model_type]],
        "torch_dtype": "bfloat16",
        **config,
        "quantization_config": QUANTIZATION_CONFIG,
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(saved, f, indent=1)
    write_tokenizer(out, args.vocab_size)
    return {"path": out, "tensors": len(weight_map), "fp8_tensors": fp8, "bytes": total}


def write_dequantized(src: str, out: str, dtype: torch.dtype = torch.float32) -> str:
    """The checkpoint at `src` with its FP8 weights dequantized to `dtype` (and everything
    else cast to it), its config without quantization_config: the bf16 copy DeepSeek's
    fp8_cast_bf16 makes, for references that do not read FP8."""
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    os.makedirs(out, exist_ok=True)
    weight_map: dict[str, str] = {}
    for shard in shards:
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            raw = {n: f.get_tensor(n) for n in f.keys()}
        plain = {
            n: (
                fp8_ref.dequantize_weight(t, raw[n + SCALE_SUFFIX]) if t.dtype == fp8_ref.FP8 else t
            ).to(dtype)
            for n, t in raw.items()
            if not n.endswith(SCALE_SUFFIX)
        }
        save_file(plain, os.path.join(out, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(plain, shard))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p, SHAPES)
    p.add_argument("--out", required=True, help="directory to write the checkpoint into")
    p.add_argument("--seed", type=int, default=0, help="random_init's seed (--seed of serve)")
    p.add_argument("--device", default=None, help="where to draw and quantize (default: cuda)")
    p.set_defaults(model_shape="deepseek-v32-bench")
    a = p.parse_args(argv)
    base = shape_config(a.model_shape)
    config = dict(base, num_hidden_layers=a.layers or base["num_hidden_layers"])
    summary = write_fp8_checkpoint(config, a.out, a.seed, a.device)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
