"""Stage weights: only this stage's tensors from a HF safetensors checkpoint, or a seeded random
init that gives every PP split the same weights."""

from __future__ import annotations

import json
import logging
import os
import zlib

import torch
from safetensors import safe_open

from stages import protocol
from stages.kernels.registry import Kernels
from stages.model_config import ModelArgs

log = logging.getLogger(__name__)
StageModel = torch.nn.Module  # a family's stage class (stages/models/families.py)
DTYPES = {**{name: getattr(torch, name) for name in protocol.DTYPES},
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[dtype]


def checkpoint_name(param_name: str) -> str:
    """Module parameter name -> checkpoint tensor name (modules drop the `model.` prefix)."""
    return param_name if param_name.startswith("lm_head.") else "model." + param_name


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


def tensor_sources(model: StageModel) -> dict[str, list[tuple[str, tuple]]]:
    """Parameter name -> (checkpoint tensor, index into the parameter) per piece: the tensor
    of the same name, or the pieces a model fuses or stacks (q/k/v, routed experts)."""
    custom = model.checkpoint_sources() if hasattr(model, "checkpoint_sources") else {}
    return {n: custom.get(n) or [(checkpoint_name(n), ())] for n, _ in model.named_parameters()}


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int]) -> torch.Tensor:
    """Block-scaled FP8 [N, K] (one fp32 scale per block[0] x block[1] tile) -> fp32."""
    n, k = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)
    return weight.float() * scale[:, :k]


def load_stage_weights(model: StageModel, path: str, args: ModelArgs, layer_start: int,
                       layer_end: int, is_first: bool, is_last: bool) -> list[str]:
    """Fill `model` from the checkpoint at `path`, reading only this stage's tensors.

    Returns the checkpoint names read, sorted. With tied embeddings the last stage reads
    `model.embed_tokens.weight` for its head (tied checkpoints usually omit `lm_head.weight`).
    FP8 block-scaled weights (with a `weight_scale_inv`) are dequantized to the model's dtype.
    """
    if (model.layer_start, model.layer_end, model.is_first, model.is_last) != (
            layer_start, layer_end, is_first, is_last):
        raise ValueError("model was built for another stage than the one being loaded")
    params = dict(model.named_parameters())
    files = _weight_files(path)
    # a tensor stored under the parameter's own name wins (e.g. experts saved already stacked)
    pieces = [(name, index, params[p]) for p, srcs in tensor_sources(model).items()
              for name, index in ([(checkpoint_name(p), ())] if checkpoint_name(p) in files
                                  else srcs)]
    missing = sorted({n for n, _, _ in pieces if n not in files})
    if missing:
        raise KeyError(f"checkpoint {path!r} lacks {len(missing)} tensors this stage needs, "
                       f"e.g. {missing[:5]}")
    by_file: dict[str, list[tuple[str, tuple, torch.Tensor]]] = {}
    for piece in pieces:
        by_file.setdefault(files[piece[0]], []).append(piece)
    dequantized = 0
    with torch.no_grad():
        for file, group in sorted(by_file.items()):
            with safe_open(file, framework="pt", device="cpu") as f:
                for n, index, p in group:
                    t = f.get_tensor(n)
                    target = p[index]
                    if t.dtype == torch.float8_e4m3fn and n + "_scale_inv" in files:
                        with safe_open(files[n + "_scale_inv"], framework="pt",
                                       device="cpu") as fs:
                            t = dequantize_fp8(t, fs.get_tensor(n + "_scale_inv"),
                                               args.fp8_block or (128, 128))
                        dequantized += 1
                    if tuple(t.shape) != tuple(target.shape):
                        raise ValueError(f"{n}: checkpoint shape {tuple(t.shape)}, model "
                                         f"expects {tuple(target.shape)}")
                    target.copy_(t)
    if dequantized:
        log.info("FP8 block-scaled checkpoint: %d weights dequantized to %s at load (no FP8 "
                 "GEMM path)", dequantized, next(iter(params.values())).dtype)
    return sorted({n for n, _, _ in pieces})


def random_init(model: torch.nn.Module, seed: int) -> None:
    """Deterministic per global tensor name, so any PP split builds identical weights."""
    sources = tensor_sources(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                # Drawn in fp32 on the parameter's device type (same numbers for any split),
                # per checkpoint tensor (a fused or stacked one draws each piece as its own);
                # drawing 8B parameters on the CPU would dominate a GPU bench's start-up.
                for part, index in sources[name]:
                    piece = p[index]
                    g = torch.Generator(device=p.device)
                    g.manual_seed((seed + zlib.crc32(part.encode())) % 2**63)
                    piece.copy_(torch.randn(piece.shape, generator=g, dtype=torch.float32,
                                            device=p.device) * 0.02)


def build_stage_model(args: ModelArgs, model_path: str | None, layer_start: int, layer_end: int,
                      is_first: bool, is_last: bool, kernels: Kernels,
                      dtype: torch.dtype | str, device: str | torch.device,
                      seed: int = 0) -> StageModel:
    """The stage's module with its weights loaded (or seeded random when model_path is None)."""
    model = args.family.stage()(args, layer_start, layer_end, is_first, is_last, kernels,
                                resolve_dtype(dtype), device)
    if model_path is None:
        random_init(model, seed)
    else:
        load_stage_weights(model, model_path, args, layer_start, layer_end, is_first, is_last)
    model.requires_grad_(False)
    return model.eval()
