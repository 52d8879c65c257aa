"""Layers every model family shares: RMSNorm, Linear (optionally fused from several checkpoint
tensors), rotary embedding helpers, the SwiGLU MLP and the pre-norm residual decoder layer.

The math follows Hugging Face transformers op for op (fp32 RMSNorm, rotate_half RoPE, SiLU-gated
MLP), so a stage's logits match the checkpoint's own model.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stages.kernels.fp8_ref import BLOCK as FP8_BLOCK
from stages.kernels.fp8_ref import FP8
from stages.kernels.registry import Kernels
from stages.kernels.torch_ref import swiglu
from stages.model_config import ModelArgs
from stages.stage_context import Piece, Sources
from stages.tensor_parallel import TensorParallel, one_rank_unless

Device = str | torch.device


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """HF's inv_freq in fp32 over head_dim, including llama3 frequency scaling."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = args.rope_scaling
    if s is None:
        return inv_freq
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """Rotate x [..., D] by angles whose cos/sin are [..., D/2]. Interleaved checkpoints pair
    (x0, x1), (x2, x3)...; others pair the two halves. Either way the result is laid out as
    [rotated firsts, rotated seconds]; q and k share the layout, so their dot products are the
    checkpoint's."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: Device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm over fp32: the composite's ops on the CPU (bit for bit), one fused
        # kernel on CUDA in place of the composite's several (as V4RMSNorm)
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


class VocabEmbedding(nn.Module):
    """The token embedding, its rows split over a tensor-parallel stage's ranks (ceil(V / size)
    each, the last rank's padded with zeros): each rank embeds the ids it holds, zeros for the
    others, and the all-reduce adds them up. Also the tied LM head's weight (`head_logits`)."""

    def __init__(
        self, vocab: int, hidden: int, dtype: torch.dtype, device: Device, tp: TensorParallel
    ):
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.span = tp.vocab_span(vocab)
        self.weight = nn.Parameter(
            torch.zeros(tp.vocab_rows(vocab), hidden, dtype=dtype, device=device)
        )

    def checkpoint_sources(self, name: str) -> Sources:
        if not self.tp.enabled:
            return {}
        rows = self.span.stop - self.span.start
        whole = (self.vocab, self.weight.shape[1])
        return {"weight": [Piece(f"{name}.weight", (slice(0, rows),), (self.span,), whole)]}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        local = ids - self.span.start
        mine = (local >= 0) & (local < self.span.stop - self.span.start)
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        return self.tp.all_reduce(out.masked_fill(~mine[:, None], 0))


def vocab_logits(
    h: torch.Tensor, weight: torch.Tensor, vocab: int, tp: TensorParallel, kernels: Kernels
) -> torch.Tensor:
    """fp32 logits [R, vocab] of a head whose rows may be split over the stage's ranks (each
    computes its rows' logits; they are gathered in rank order and the padding cut)."""
    logits: torch.Tensor = kernels.linear(h, weight)
    if tp.enabled:
        logits = tp.all_gather(logits, dim=-1)[:, :vocab]
    return logits.float()


def project(
    kernels: Kernels,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) on the stage's kernels: W8A8 where the weight is FP8 with its
    128 x 128 `scale_inv`, else the plain linear (Linear's matmul, and a stacked expert's)."""
    if scale_inv is None:
        out: torch.Tensor = kernels.linear(x, weight, bias)
        return out
    if kernels.fp8_linear is None:
        raise RuntimeError("FP8 weights need kernels.fp8_linear, which is unset")
    out = kernels.fp8_linear(x, weight, scale_inv, bias)
    return out


def project_swiglu(
    kernels: Kernels,
    gate_up: torch.Tensor,
    limit: float | None,
    weight: torch.Tensor,
    scale_inv: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """project(swiglu(gate, up, limit)) of gate_up [..., 2 * in] (gate | up). With FP8 weights
    the swiglu is folded into the activations' quantizer (fp8_swiglu_linear): one kernel where
    the clamps, silu, product and quantizer took five."""
    fused = kernels.fp8_swiglu_linear
    if scale_inv is None or fused is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return project(kernels, swiglu(gate, up, limit), weight, scale_inv, bias)
    out: torch.Tensor = fused(gate_up, limit, weight, scale_inv, bias)
    return out


class Linear(nn.Module):
    """Holds a checkpoint's weight (and bias); the matmul runs on the chosen kernel backend.

    When FP8 weights stay FP8 (`kernels.fp8_linear` set) and `fp8` is not turned off, the weight
    is float8_e4m3fn [N, K] with its `weight_scale_inv` [N/128, K/128] (the checkpoint's names)
    and the matmul is W8A8; a fused weight whose parts are not 128-row aligned stays in `dtype`.

    On a tensor-parallel stage `split` says how the rank holds it: "column" keeps its share of
    the output rows (of each fused part), "row" its share of the input columns, summed over the
    ranks after the matmul (the bias, whole on every rank, added once after the sum). n_in,
    n_out and parts' rows are the checkpoint's.
    """

    def __init__(
        self,
        n_in: int,
        n_out: int,
        bias: bool,
        kernels: Kernels,
        dtype: torch.dtype,
        device: Device,
        parts: tuple[tuple[str, int], ...] = (),
        fp8: bool = True,
        tp: TensorParallel | None = None,
        split: str | None = None,
    ):
        super().__init__()
        if split not in (None, "column", "row"):
            raise ValueError(f"split must be None, 'column' or 'row', got {split!r}")
        self.tp = one_rank_unless(tp)
        self.split = split if self.tp.enabled else None
        # A fused weight: (checkpoint module name, rows) of each tensor it concatenates.
        self.parts = parts
        self.n_in_total, self.n_out_total = n_in, n_out
        if self.split == "column":
            self.parts = tuple((name, self.tp.part(rows, name)) for name, rows in parts)
            n_out = self.tp.part(n_out, "output rows")
        elif self.split == "row":
            n_in = self.tp.part(n_in, "input columns")
        self.fp8 = (
            fp8
            and kernels.fp8_linear is not None
            and all(rows % FP8_BLOCK == 0 for _, rows in self.parts)
            and (self.split is None or (n_in % FP8_BLOCK == 0 and n_out % FP8_BLOCK == 0))
        )
        self.weight = nn.Parameter(
            torch.empty(n_out, n_in, dtype=FP8 if self.fp8 else dtype, device=device)
        )
        self.weight_scale_inv = (
            nn.Parameter(
                torch.empty(
                    -(-n_out // FP8_BLOCK),
                    -(-n_in // FP8_BLOCK),
                    dtype=torch.float32,
                    device=device,
                )
            )
            if self.fp8
            else None
        )
        bias_rows = n_out if self.split == "column" else self.n_out_total
        self.bias = (
            nn.Parameter(torch.empty(bias_rows, dtype=dtype, device=device)) if bias else None
        )
        self.kernels = kernels

    @property
    def unreduced_bias(self) -> torch.Tensor | None:
        """The bias forward(reduce=False) leaves out: a row-split one's (None: none left out)."""
        return self.bias if self.split == "row" else None

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """reduce=False (row split): the rank's partial sum, bias not added, for a caller that
        adds several partial sums before one all-reduce (then `unreduced_bias`)."""
        bias = None if self.split == "row" else self.bias
        out = project(self.kernels, x, self.weight, self.weight_scale_inv, bias)
        return self._reduced(out, reduce)

    def forward_swiglu(
        self, gate_up: torch.Tensor, limit: float | None, reduce: bool = True
    ) -> torch.Tensor:
        """forward(swiglu(gate, up, limit)) of gate_up [..., 2 * in] (gate | up), as
        project_swiglu."""
        bias = None if self.split == "row" else self.bias
        out = project_swiglu(self.kernels, gate_up, limit, self.weight, self.weight_scale_inv, bias)
        return self._reduced(out, reduce)

    def _reduced(self, out: torch.Tensor, reduce: bool) -> torch.Tensor:
        if self.split == "row":
            if not reduce:
                return out
            out = self.tp.all_reduce(out)
            if self.bias is not None:
                out = out + self.bias
        return out

    def checkpoint_sources(self, name: str) -> Sources:
        """A fused weight's pieces (the rows each sibling tensor of `name` fills) and, on a
        tensor-parallel rank, the slice of each the rank holds (with the whole tensor's
        shape)."""
        if not self.parts and self.split is None:
            return {}
        owner, _, own = name.rpartition(".")
        parts = self.parts or ((own, self.weight.shape[0]),)  # the rank's rows of each
        size, rank = self.tp.size, self.tp.rank
        out: Sources = {}
        for leaf in ("weight", "bias", "weight_scale_inv"):
            if getattr(self, leaf) is None:
                continue
            per = FP8_BLOCK if leaf == "weight_scale_inv" else 1  # a scale per 128 x 128 tile
            cols = () if leaf == "bias" else (-(-self.n_in_total // per),)
            pieces, row = [], 0
            for part, rows in parts:
                full = f"{owner}.{part}.{leaf}"
                index = (slice(row // per, (row + rows) // per),)
                source: tuple[Any, ...]
                if self.split == "column":
                    r = rank * rows
                    source = (slice(r // per, (r + rows) // per),)
                    pieces.append(Piece(full, index, source, (-(-rows * size // per), *cols)))
                elif self.split == "row" and leaf != "bias":
                    c, width = rank * self.weight.shape[1], self.weight.shape[1]
                    source = (slice(None), slice(c // per, (c + width) // per))
                    pieces.append(Piece(full, index, source, (-(-rows // per), *cols)))
                else:
                    pieces.append(Piece(full, index))
                row += rows
            out[leaf] = pieces
        return out


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up in one GEMM (the loader concatenates the
    checkpoint's gate_proj and up_proj); `limit` clamps both first (DeepSeek-V4). On a
    tensor-parallel stage each rank holds its share of the intermediate columns and the down
    projection sums the ranks' parts (reduce=False leaves the sum, and then the down
    projection's `unreduced_bias`, to the caller)."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        bias: bool,
        kernels: Kernels,
        dtype: torch.dtype,
        device: Device,
        limit: float | None = None,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.limit = limit
        self.gate_up_proj = Linear(
            hidden,
            2 * inter,
            bias,
            kernels,
            dtype,
            device,
            (("gate_proj", inter), ("up_proj", inter)),
            tp=tp,
            split="column",
        )
        self.down_proj = Linear(inter, hidden, bias, kernels, dtype, device, tp=tp, split="row")

    @property
    def unreduced_bias(self) -> torch.Tensor | None:
        return self.down_proj.unreduced_bias

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self.down_proj.forward_swiglu(self.gate_up_proj(x), self.limit, reduce)


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: h + attn(norm(h)), then h + mlp(norm(h)). The attention takes the
    stage's per-forward context (rope tables, row metadata), the batch, the cache and its local
    layer index."""

    def __init__(
        self,
        args: ModelArgs,
        self_attn: nn.Module,
        mlp: nn.Module,
        dtype: torch.dtype,
        device: Device,
    ):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)

    def forward(
        self, h: torch.Tensor, context: tuple[Any, ...], batch: Any, kv: Any, local_layer: int
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), *context, batch, kv, local_layer)
        out: torch.Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out
