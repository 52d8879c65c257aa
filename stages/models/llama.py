"""One pipeline stage of a Llama-family model (Llama 2/3, Mistral, Qwen2, Qwen3): GQA attention
(optionally with q/k norms) and a SwiGLU MLP per layer.

Submodules carry the checkpoint's names minus `model.`, so loading is a name map; q, k and v are
one fused projection.
"""

from __future__ import annotations

import torch
from torch import nn

from stages.attention.paged_kv import PagedKVBackend
from stages.forward_batch import ForwardBatch, PagedDecodeBatch
from stages.kernels.registry import Kernels
from stages.kv_cache import PagedKVCache
from stages.model_config import ModelArgs
from stages.models.layers import DecoderLayer, Linear, RMSNorm, SwiGLU, rope_inv_freq, rotate_half
from stages.models.stage import Stage
from stages.stage_context import StageContext
from stages.tensor_parallel import TensorParallel, one_rank_unless


class Attention(nn.Module):
    """GQA attention. On a tensor-parallel stage each rank holds its share of the query and
    K/V heads (and caches only its K/V heads); o_proj sums the ranks' parts."""

    def __init__(
        self,
        args: ModelArgs,
        kernels: Kernels,
        dtype: torch.dtype,
        device: str | torch.device,
        tp: TensorParallel | None = None,
        backend: PagedKVBackend | None = None,
    ):
        """backend: the stage's paged K/V attention (Stage.attention); required to run."""
        super().__init__()
        tp = one_rank_unless(tp)
        h, d = args.hidden_size, args.head_dim
        hq, hkv = args.num_attention_heads, args.num_key_value_heads
        self.hq = tp.part(hq, "num_attention_heads")
        self.hkv = tp.part(hkv, "num_key_value_heads")
        self.d = d
        self.scale = d**-0.5
        self.kernels = kernels
        self._backend = backend
        # q, k and v in one GEMM (the loader concatenates the checkpoint's three tensors)
        self.qkv_proj = Linear(
            h,
            (hq + 2 * hkv) * d,
            args.attention_bias,
            kernels,
            dtype,
            device,
            (("q_proj", hq * d), ("k_proj", hkv * d), ("v_proj", hkv * d)),
            tp=tp,
            split="column",
        )
        self.o_proj = Linear(
            hq * d, h, args.o_proj_bias, kernels, dtype, device, tp=tp, split="row"
        )
        if args.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(d, args.rms_norm_eps, dtype, device)
            self.k_norm: RMSNorm | None = RMSNorm(d, args.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch | PagedDecodeBatch,
        kv: PagedKVCache,
        local_layer: int,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1
        )
        q, k, v = (y.view(t, -1, self.d) for y in (q, k, v))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = self.backend.forward(self, q, k, v, batch, kv, local_layer)
        return self._project_out(o, t)

    @property
    def backend(self) -> PagedKVBackend:
        if self._backend is None:
            raise RuntimeError("this attention was built without its stage's backend")
        return self._backend

    def _project_out(self, o: torch.Tensor, t: int) -> torch.Tensor:
        out: torch.Tensor = self.o_proj(o.reshape(t, self.hq * self.d))
        return out


class LlamaStage(Stage):
    inv_freq: torch.Tensor  # a buffer: registered in __init__

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        self.register_buffer("inv_freq", rope_inv_freq(ctx.args).to(ctx.device), persistent=False)

    def build_layer(self, layer: int) -> nn.Module:
        a, kernels, dtype, device = self.args, self.ctx.kernels, self.ctx.dtype, self.ctx.device
        tp = self.ctx.tp
        mlp = SwiGLU(a.hidden_size, a.intermediate_size, a.mlp_bias, kernels, dtype, device, tp=tp)
        attention = Attention(a, kernels, dtype, device, tp, self.paged_kv)
        return DecoderLayer(a, attention, mlp, dtype, device)

    @property
    def paged_kv(self) -> PagedKVBackend:
        backend = self.attention
        if not isinstance(backend, PagedKVBackend):
            raise TypeError(f"Llama layers attend on paged K/V, not {type(backend).__name__}")
        return backend

    def layer_context(
        self, batch: ForwardBatch | PagedDecodeBatch, kv: PagedKVCache, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq, batch.positions, h.dtype)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotate_half RoPE tables [T, 1, head_dim] (broadcast over heads)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
