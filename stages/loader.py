"""Stage weights: only this stage's tensors from a HF safetensors checkpoint, or a seeded random
init that gives every PP split the same weights."""

from __future__ import annotations

import json
import logging
import os
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from safetensors import safe_open

from stages import protocol
from stages.kernels import fp8_ref, mxfp4
from stages.kernels.fp8_ref import SCALE_SUFFIX
from stages.kernels.registry import Kernels
from stages.model_config import ModelArgs, mxfp4_experts_as
from stages.protocol import MXFP4_EXPERTS_DEFAULT, QUANTIZATIONS
from stages.stage_context import Piece, StageContext, StageModel
from stages.tensor_parallel import TensorParallel, one_rank_unless

log = logging.getLogger(__name__)
DTYPES: dict[str, torch.dtype] = {
    **{name: getattr(torch, name) for name in protocol.DTYPES},
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


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


def tensor_sources(model: StageModel) -> dict[str, list[Piece]]:
    """Parameter name -> the checkpoint pieces it is loaded from: the tensor of the same name,
    or the pieces a model fuses, stacks or splits (q/k/v, routed experts, a tensor-parallel
    rank's slices)."""
    custom = model.checkpoint_sources()
    return {n: custom.get(n) or [Piece(checkpoint_name(n))] for n, _ in model.named_parameters()}


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """Block-scaled FP8 [N, K] (one fp32 scale per block[0] x block[1] tile) -> fp32."""
    return fp8_ref.dequantize_weight(weight, scale_inv, block)


def _read(files: dict[str, str], name: str) -> torch.Tensor:
    with safe_open(files[name], framework="pt", device="cpu") as f:
        t: torch.Tensor = f.get_tensor(name)
    return t


# safetensors header dtypes of packed FP4 weights (two values per byte)
PACKED_HEADER_DTYPES = ("I8", "U8", "F4")


def _packed(files: dict[str, str], names: set[str]) -> set[str]:
    """Those of `names` the checkpoint stores in a packed FP4 dtype (read from the headers)."""
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = set()
    for file, group in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            out |= {n for n in group if f.get_slice(n).get_dtype() in PACKED_HEADER_DTYPES}
    return out


def _dequantize_mxfp4(name: str, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check_mxfp4(name, packed, scale)
    return mxfp4.dequantize(packed, scale)


def _check_mxfp4(name: str, packed: torch.Tensor, scale: torch.Tensor) -> None:
    if not mxfp4.is_mxfp4(packed, scale):
        raise ValueError(
            f"{name}: {packed.dtype} {tuple(packed.shape)} with {SCALE_SUFFIX} "
            f"{tuple(scale.shape)} is not MXFP4 (two values per byte, one scale per "
            f"{mxfp4.GROUP} values along K)"
        )


def _kept_mxfp4(name: str, t: torch.Tensor, files: dict[str, str]) -> torch.Tensor:
    """A packed MXFP4 weight (checked against its scales) or an e8m0 scale, as its bytes."""
    if name.endswith(SCALE_SUFFIX):
        if t.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
            raise ValueError(f"{name}: {t.dtype} where MXFP4's e8m0 scale bytes are expected")
        return t.contiguous().view(torch.uint8)
    scale = _read(files, name + SCALE_SUFFIX) if name + SCALE_SUFFIX in files else None
    if t.dtype not in mxfp4.PACKED_DTYPES or scale is None:
        raise ValueError(
            f"{name}: {t.dtype} without packed MXFP4 storage and its {SCALE_SUFFIX}, where "
            f"the stage keeps MXFP4 experts (expert_dtype fp4)"
        )
    _check_mxfp4(name, t, scale)
    return t.contiguous().view(torch.uint8)


def load_stage_weights(model: StageModel, path: str) -> list[str]:
    """Fill `model` from the checkpoint at `path`, reading only the tensors of the stage it was
    built for (its StageContext).

    Returns the checkpoint names read, sorted. With tied embeddings the last stage reads
    `model.embed_tokens.weight` for its head (tied checkpoints usually omit `lm_head.weight`).
    FP8 block-scaled weights (with a `weight_scale_inv`) are dequantized to the model's dtype,
    and so are MXFP4 ones (V4's routed experts: a packed int8 / float4_e2m1fn_x2 weight with
    one ue8m0 scale per 32 values along K) unless the stage holds them packed (uint8 weight and
    scale parameters: their bytes are copied as stored); a kept-FP8 parameter gets them
    quantized blockwise.
    """
    params = dict(model.named_parameters())
    files = _weight_files(path)
    # a tensor stored under the parameter's own name wins (e.g. experts saved already stacked)
    pieces = [
        (piece, p)
        for p, srcs in tensor_sources(model).items()
        for piece in (
            [Piece(checkpoint_name(p))]
            if checkpoint_name(p) in files and not srcs[0].source
            else srcs
        )
    ]
    # Kept-FP8 scales the checkpoint lacks (or has for MXFP4 weights) come from quantizing
    # its weights at load.
    scales = {
        piece.name
        for piece, p in pieces
        if p.endswith(SCALE_SUFFIX) and params[p].dtype != torch.uint8  # not MXFP4's, kept
    }
    weights = {n.removesuffix(SCALE_SUFFIX) for n in scales}
    packed = _packed(files, {n for n in weights if n in files})
    derived = {n for n in scales if n not in files or n.removesuffix(SCALE_SUFFIX) in packed}
    pieces = [(piece, p) for piece, p in pieces if piece.name not in derived]
    missing = sorted({piece.name for piece, _ in pieces if piece.name not in files})
    if missing:
        raise KeyError(
            f"checkpoint {path!r} lacks {len(missing)} tensors this stage needs, e.g. {missing[:5]}"
        )
    by_file: dict[str, list[tuple[Piece, str]]] = {}
    for piece, p in pieces:
        by_file.setdefault(files[piece.name], []).append((piece, p))
    counts = {"dequantized": 0, "mxfp4": 0, "mxfp4_kept": 0, "kept": 0, "quantized": 0}
    with torch.no_grad():
        for file, group in sorted(by_file.items()):
            with safe_open(file, framework="pt", device="cpu") as f:
                for (n, index, source, _shape), p in group:
                    target = params[p][index]
                    # A rank's slice only, unless the tensor must be decoded whole first
                    whole = bool(source) and (
                        (n + SCALE_SUFFIX in files and target.dtype != fp8_ref.FP8)
                        or f.get_slice(n).get_dtype() in PACKED_HEADER_DTYPES
                    )
                    t = f.get_tensor(n) if not source or whole else f.get_slice(n)[source]
                    kept_mxfp4 = target.dtype == torch.uint8  # packed: the stored bytes
                    if kept_mxfp4:
                        t = _kept_mxfp4(n, t, files)
                        counts["mxfp4_kept"] += not n.endswith(SCALE_SUFFIX)
                    elif t.dtype in mxfp4.PACKED_DTYPES and n + SCALE_SUFFIX in files:
                        t = _dequantize_mxfp4(n, t, _read(files, n + SCALE_SUFFIX))
                        counts["mxfp4"] += 1
                    scaled = t.dtype == fp8_ref.FP8 and n + SCALE_SUFFIX in files
                    if kept_mxfp4:
                        pass
                    elif target.dtype == fp8_ref.FP8 and not scaled:
                        if n + SCALE_SUFFIX not in derived:
                            raise ValueError(f"{n}: FP8 weights without {n + SCALE_SUFFIX}")
                        t, scale = fp8_ref.quantize_weight(t)
                        params[p + SCALE_SUFFIX][fp8_ref.scale_index(index)].copy_(scale)
                        counts["quantized"] += 1
                    elif target.dtype == fp8_ref.FP8:
                        counts["kept"] += 1
                    elif scaled:
                        scale = _read(files, n + SCALE_SUFFIX)
                        t = dequantize_fp8(t, scale, model.ctx.args.fp8_block or (128, 128))
                        counts["dequantized"] += 1
                    if whole:
                        t = t[source]
                    if tuple(t.shape) != tuple(target.shape):
                        raise ValueError(
                            f"{n}: checkpoint shape {tuple(t.shape)}, model "
                            f"expects {tuple(target.shape)}"
                        )
                    target.copy_(t)
    if counts["dequantized"]:
        log.info(
            "FP8 block-scaled checkpoint: %d weights dequantized to %s at load",
            counts["dequantized"],
            dtype_of(model),
        )
    if counts["mxfp4"]:
        log.info(
            "MXFP4 checkpoint weights: %d dequantized at load (to %s, or quantized to FP8 "
            "where the stage keeps FP8)",
            counts["mxfp4"],
            dtype_of(model),
        )
    if counts["mxfp4_kept"]:
        log.info("MXFP4 experts kept packed: %d weights (W4A16 experts)", counts["mxfp4_kept"])
    if counts["kept"] or counts["quantized"]:
        log.info(
            "FP8 weights kept for W8A8: %d from the checkpoint, %d quantized at load",
            counts["kept"],
            counts["quantized"],
        )
    return sorted({piece.name for piece, _ in pieces})


def dtype_of(model: StageModel) -> torch.dtype:
    """The stage's compute dtype: that of its norms (FP8 weights are stored, not computed in)."""
    return next(p.dtype for p in model.parameters() if p.dtype != fp8_ref.FP8)


def random_init(model: StageModel, seed: int) -> None:
    """Deterministic per global tensor name, so any PP split builds identical weights. Kept-FP8
    weights are the same draws quantized blockwise (their scales set with them)."""
    sources = tensor_sources(model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(SCALE_SUFFIX):
                continue  # set with its weight
            elif p.dtype == torch.uint8 and name + SCALE_SUFFIX in params:  # MXFP4 kept
                _random_quantized(
                    p, params[name + SCALE_SUFFIX], sources[name], seed, mxfp4.quantize, 2
                )
            elif not p.is_floating_point():
                continue  # an index table (V4's tid2eid) keeps its module's valid values
            elif p.dtype == fp8_ref.FP8:
                _random_quantized(
                    p, params[name + SCALE_SUFFIX], sources[name], seed, fp8_ref.quantize_weight
                )
            else:
                for piece in sources[name]:
                    p[piece.at].copy_(_drawn(piece, p[piece.at].shape, seed, p.device))


def _draw(part: str, shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    """Drawn in fp32 on the parameter's device type (same numbers for any split), per checkpoint
    tensor (a fused or stacked one draws each piece as its own); drawing 8B parameters on the
    CPU would dominate a GPU bench's start-up."""
    g = torch.Generator(device=device)
    g.manual_seed((seed + zlib.crc32(part.encode())) % 2**63)
    return torch.randn(shape, generator=g, dtype=torch.float32, device=device) * 0.02


def _drawn(piece: Piece, shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    """The piece's draw: the whole checkpoint tensor's, sliced where the piece is a slice."""
    if not piece.source:
        return _draw(piece.name, shape, seed, device)
    return _draw(piece.name, torch.Size(piece.shape), seed, device)[piece.source]


def _random_quantized(
    p: torch.Tensor,
    scale: torch.Tensor,
    pieces: list[Piece],
    seed: int,
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    per_element: int = 1,
) -> None:
    """The draws quantized (FP8 blockwise, or MXFP4 with per_element = 2 values a byte), one
    2-D matrix at a time (an expert of a stack), so the fp32 draws stay small."""
    by_matrix: dict[tuple[Any, ...], list[Piece]] = {}
    for piece in pieces:
        index = piece.at
        lead = index[:1] if index and isinstance(index[0], int) else ()
        by_matrix.setdefault(lead, []).append(piece._replace(at=index[len(lead) :]))
    for lead, parts in by_matrix.items():
        rows, cols = p[lead].shape
        full = torch.empty(rows, cols * per_element, dtype=torch.float32, device=p.device)
        for piece in parts:
            full[piece.at] = _drawn(piece, full[piece.at].shape, seed, p.device)
        q, s = quantize(full)
        p[lead].copy_(q)
        scale[lead].copy_(s)


def keep_fp8_weights(args: ModelArgs, quantization: str, device: str | torch.device) -> bool:
    """Whether the stage holds its linears' and experts' weights in FP8 (W8A8): auto = as the
    checkpoint's quantization_config says, fp8 = also quantize a bf16 checkpoint (or random
    weights) blockwise at load. On CPU they are dequantized at load instead; so are blocks other
    than the kernels' 128 x 128."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    wanted = quantization == "fp8" or (quantization == "auto" and args.fp8_block is not None)
    if not wanted:
        return False
    if torch.device(device).type != "cuda":
        log.info("FP8 weights are dequantized at load on %s (W8A8 linears run on CUDA)", device)
        return False
    if args.fp8_block not in (None, (fp8_ref.BLOCK, fp8_ref.BLOCK)):
        log.warning(
            "FP8 blocks of %s: dequantized at load (the W8A8 kernels take 128 x 128)",
            args.fp8_block,
        )
        return False
    return True


def weight_bytes(model: StageModel) -> int:
    """Bytes of the stage's parameters and buffers as held (FP8 weights one byte, their
    scales four per 128 x 128 tile)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def routed_experts(model: StageModel) -> tuple[int, int]:
    """(weight values, bytes as held with their scales) of the stage's routed experts (MXFP4
    kept packed: two values a byte)."""
    params = [(n, p) for n, p in model.named_parameters() if ".experts." in n]
    values = sum(
        p.numel() * (2 if p.dtype == torch.uint8 else 1)
        for n, p in params
        if not n.endswith(SCALE_SUFFIX)
    )
    return values, sum(p.numel() * p.element_size() for _, p in params)


def log_stage_memory(model: StageModel, num_layers: int, kv_bytes_per_token_layer: int) -> None:
    kv = num_layers * kv_bytes_per_token_layer
    log.info(
        "stage memory: weights %.3f GiB, KV %d bytes per token (%d layers x %d)",
        weight_bytes(model) / 2**30,
        kv,
        num_layers,
        kv_bytes_per_token_layer,
    )


@dataclass(frozen=True)
class StageMemory:
    layers: tuple[int, int]
    weight_bytes: int
    kv_bytes_per_token: int  # all the stage's layers
    routed_expert_values: int = 0  # the routed experts' weight values (scales not counted)
    routed_expert_bytes: int = 0  # the same as held, with their scales

    def max_tokens(self, memory_bytes: int) -> int:
        """Tokens of KV that fit beside the weights in `memory_bytes` (0 if they do not fit)."""
        return max(0, memory_bytes - self.weight_bytes) // self.kv_bytes_per_token


def stage_memory_plan(
    args: ModelArgs,
    pp_size: int,
    fp8_weights: bool,
    kv_cache_dtype: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
    tp_size: int = 1,
    mxfp4_experts: str = MXFP4_EXPERTS_DEFAULT,
) -> list[StageMemory]:
    """Per stage of an even PP split: the weight bytes of the stage module the engine would
    build (on the meta device: nothing allocated) and its KV bytes per token; with tp_size > 1,
    those of one GPU, rank 0 of the stage's tensor-parallel ranks (the largest: the last rank's
    vocabulary slice may be shorter). A checkpoint's MXFP4 experts count as held:
    packed (keep) or widened (dequantize: to FP8 with fp8_weights, else `dtype`)."""
    from stages.kernels.registry import select_kernels
    from stages.kv_cache import bytes_per_token_layer
    from stages.partition import layer_ranges

    kernels = select_kernels("cpu", fp8_linear="torch" if fp8_weights else None)
    args = mxfp4_experts_as(args, mxfp4_experts)
    rank_args = args.family.rank_args(args, tp_size)
    per_layer = bytes_per_token_layer(rank_args, dtype, kv_cache_dtype)
    plan = []
    ranges = layer_ranges(args.num_hidden_layers, pp_size)
    for i, (a, b) in enumerate(ranges):
        ctx = StageContext(
            args,
            range(a, b),
            i == 0,
            i == len(ranges) - 1,
            kernels,
            dtype,
            torch.device("meta"),
            TensorParallel(0, tp_size),
        )
        model = args.family.stage()(ctx)
        plan.append(
            StageMemory((a, b), weight_bytes(model), (b - a) * per_layer, *routed_experts(model))
        )
    return plan


def build_stage_model(
    args: ModelArgs,
    model_path: str | None,
    layer_start: int,
    layer_end: int,
    is_first: bool,
    is_last: bool,
    kernels: Kernels,
    dtype: torch.dtype | str,
    device: str | torch.device,
    seed: int = 0,
    tp: TensorParallel | None = None,
) -> StageModel:
    """The stage's module with its weights loaded (or seeded random when model_path is None);
    on a tensor-parallel rank (`tp`), the rank's slices only."""
    ctx = StageContext(
        args,
        range(layer_start, layer_end),
        is_first,
        is_last,
        kernels,
        resolve_dtype(dtype),
        torch.device(device),
        one_rank_unless(tp),
    )
    model: StageModel = args.family.stage()(ctx).requires_grad_(False).eval()
    if model_path is None:
        random_init(model, seed)
    else:
        load_stage_weights(model, model_path)
    return model
