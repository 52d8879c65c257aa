"""Stage weights: only this stage's tensors from a HF safetensors checkpoint, or a seeded random
init that gives every PP split the same weights."""

from __future__ import annotations

import json
import os
import zlib

import torch
from safetensors import safe_open

from stages import protocol
from stages.kernels.registry import Kernels
from stages.model_config import ModelArgs
from stages.models.llama import LlamaStage

DTYPES = {**{name: getattr(torch, name) for name in protocol.DTYPES},
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[dtype]


# Modules that hold several checkpoint tensors concatenated along the output dimension (one
# GEMM instead of three or two).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_name(param_name: str) -> str:
    """Module parameter name -> checkpoint tensor name (modules drop the `model.` prefix)."""
    return param_name if param_name.startswith("lm_head.") else "model." + param_name


def checkpoint_parts(param_name: str) -> list[str]:
    """The checkpoint tensors a parameter is made of, in concatenation order."""
    name = checkpoint_name(param_name)
    prefix, _, rest = name.rpartition(".")  # rest: weight or bias
    owner, _, module = prefix.rpartition(".")
    if module in FUSED:
        return [f"{owner}.{part}.{rest}" for part in FUSED[module]]
    return [name]


def _weight_files(path: str) -> dict[str, str]:
    """Checkpoint tensor name -> file, from the shard index or the single file's header."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path!r}")
    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def load_stage_weights(model: LlamaStage, path: str, args: ModelArgs, layer_start: int,
                       layer_end: int, is_first: bool, is_last: bool) -> list[str]:
    """Fill `model` from the checkpoint at `path`, reading only this stage's tensors.

    Returns the checkpoint names read, sorted. With tied embeddings the last stage reads
    `model.embed_tokens.weight` for its head (tied checkpoints usually omit `lm_head.weight`).
    """
    if (model.layer_start, model.layer_end, model.is_first, model.is_last) != (
            layer_start, layer_end, is_first, is_last):
        raise ValueError("model was built for another stage than the one being loaded")
    params = dict(model.named_parameters())
    parts = {n: checkpoint_parts(n) for n in params}
    needed = [c for names in parts.values() for c in names]
    files = _weight_files(path)
    missing = sorted(n for n in needed if n not in files)
    if missing:
        raise KeyError(f"checkpoint {path!r} lacks {len(missing)} tensors this stage needs, "
                       f"e.g. {missing[:5]}")
    by_file: dict[str, list[str]] = {}
    for n in needed:
        by_file.setdefault(files[n], []).append(n)
    tensors = {}
    for file, names in sorted(by_file.items()):
        with safe_open(file, framework="pt", device="cpu") as f:
            for n in names:
                tensors[n] = f.get_tensor(n)
    with torch.no_grad():
        for name, p in params.items():
            t = torch.cat([tensors.pop(c) for c in parts[name]])
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{' + '.join(parts[name])}: checkpoint shape "
                                 f"{tuple(t.shape)}, model expects {tuple(p.shape)}")
            p.copy_(t)
    return sorted(needed)


def random_init(model: torch.nn.Module, seed: int) -> None:
    """Deterministic per global tensor name, so any PP split builds identical weights."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                # Drawn in fp32 on the parameter's device type (same numbers for any split),
                # per checkpoint tensor (a fused one draws each part as its own tensor);
                # drawing 8B parameters on the CPU would dominate a GPU bench's start-up.
                owner = model.get_submodule(name.rpartition(".")[0])
                sizes = getattr(owner, "part_sizes", None) or (p.shape[0],)
                for part, rows in zip(checkpoint_parts(name), p.split(list(sizes))):
                    g = torch.Generator(device=p.device)
                    g.manual_seed((seed + zlib.crc32(part.encode())) % 2**63)
                    rows.copy_(torch.randn(rows.shape, generator=g, dtype=torch.float32,
                                           device=p.device) * 0.02)


def build_stage_model(args: ModelArgs, model_path: str | None, layer_start: int, layer_end: int,
                      is_first: bool, is_last: bool, kernels: Kernels,
                      dtype: torch.dtype | str, device: str | torch.device,
                      seed: int = 0) -> LlamaStage:
    """The stage's module with its weights loaded (or seeded random when model_path is None)."""
    model = LlamaStage(args, layer_start, layer_end, is_first, is_last, kernels,
                       resolve_dtype(dtype), device)
    if model_path is None:
        random_init(model, seed)
    else:
        load_stage_weights(model, model_path, args, layer_start, layer_end, is_first, is_last)
    model.requires_grad_(False)
    return model.eval()
