"""One pipeline stage of a Llama-family model (Llama 2/3, Mistral, Qwen2, Qwen3).

Submodules carry the checkpoint's names minus `model.`, so loading is a name map. The math follows
Hugging Face transformers op for op (fp32 RMSNorm, rotate_half RoPE, SiLU-gated MLP).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stages.forward_batch import ForwardBatch, PagedDecodeBatch
from stages.kernels.registry import Kernels
from stages.kv_cache import PagedKVCache
from stages.model_config import ModelArgs


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """HF's inv_freq in fp32, including llama3 frequency scaling."""
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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Linear(nn.Module):
    """Holds a checkpoint's weight (and bias); the matmul runs on the chosen kernel backend."""

    def __init__(self, n_in: int, n_out: int, bias: bool, kernels: Kernels, dtype, device,
                 parts: tuple[tuple[str, int], ...] = ()):
        super().__init__()
        # A fused weight: (checkpoint module name, rows) of each tensor it concatenates.
        self.parts = parts
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(n_out, dtype=dtype, device=device)) if bias else None
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, kernels: Kernels, dtype, device):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.hq, self.hkv, self.d = args.num_attention_heads, args.num_key_value_heads, d
        self.scale = d ** -0.5
        self.kernels = kernels
        # q, k and v in one GEMM (the loader concatenates the checkpoint's three tensors)
        self.qkv_proj = Linear(h, (self.hq + 2 * self.hkv) * d, args.attention_bias, kernels,
                               dtype, device, (("q_proj", self.hq * d), ("k_proj", self.hkv * d),
                                               ("v_proj", self.hkv * d)))
        self.o_proj = Linear(self.hq * d, h, args.o_proj_bias, kernels, dtype, device)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(d, args.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch | PagedDecodeBatch, kv: PagedKVCache,
                local_layer: int) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k, v = (y.view(t, -1, self.d) for y in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # New K/V go to the cache first, then each row attends to its whole prefix: decode rows
        # in padded groups (one call per group), the others one call per row.
        kv.write(local_layer, k, v, batch.slot_mapping)
        if isinstance(batch, PagedDecodeBatch):
            k_cache, v_cache = kv.kv[local_layer][0], kv.kv[local_layer][1]
            o = self.kernels.paged_decode(q, k_cache, v_cache, batch.block_tables,
                                          batch.table_rows, batch.lengths, self.scale,
                                          batch.block_size, batch.num_splits)
            return self.o_proj(o.reshape(t, self.hq * self.d))
        if len(batch.row_starts) == 1:  # a lone row (a long prompt's chunk): no output copy
            k_r, v_r = kv.gather(local_layer, batch.block_tables[0], batch.row_starts[0] + t,
                                 batch.prefix_slots[0])
            o = self.kernels.attention(q, k_r.to(q.dtype), v_r.to(q.dtype), self.scale)
            return self.o_proj(o.reshape(t, self.hq * self.d))
        o = torch.empty_like(q)
        for group in batch.decode_groups:
            k_g, v_g = kv.gather_padded(local_layer, group.slots)  # [R, Lmax, Hkv, D]
            o[group.token_index] = self.kernels.decode_attention(
                q[group.token_index], k_g.to(q.dtype), v_g.to(q.dtype), group.mask, self.scale)
        for start, n, off, table, idx in zip(batch.row_starts, batch.row_lens, batch.row_offsets,
                                             batch.block_tables, batch.prefix_slots):
            if idx is None:  # attended in its decode group above
                continue
            k_r, v_r = kv.gather(local_layer, table, start + n, idx)
            o[off:off + n] = self.kernels.attention(q[off:off + n], k_r.to(q.dtype),
                                                    v_r.to(q.dtype), self.scale)
        return self.o_proj(o.reshape(t, self.hq * self.d))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, kernels: Kernels, dtype, device):
        super().__init__()
        h, i, b = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_up_proj = Linear(h, 2 * i, b, kernels, dtype, device,
                                   (("gate_proj", i), ("up_proj", i)))
        self.down_proj = Linear(i, h, b, kernels, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, kernels: Kernels, dtype, device):
        super().__init__()
        self.self_attn = Attention(args, kernels, dtype, device)
        self.mlp = MLP(args, kernels, dtype, device)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)

    def forward(self, h, cos, sin, batch, kv, local_layer):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, kv, local_layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaStage(nn.Module):
    """Layers [layer_start, layer_end) plus the embedding (first) and norm + head (last)."""

    def __init__(self, args: ModelArgs, layer_start: int, layer_end: int, is_first: bool,
                 is_last: bool, kernels: Kernels, dtype: torch.dtype,
                 device: str | torch.device):
        super().__init__()
        if not 0 <= layer_start < layer_end <= args.num_hidden_layers:
            raise ValueError(f"bad layer range [{layer_start}, {layer_end}) for a model with "
                             f"{args.num_hidden_layers} layers")
        self.args = args
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first, self.is_last = is_first, is_last
        self.kernels = kernels
        self.dtype = dtype
        if is_first or (is_last and args.tie_word_embeddings):
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype,
                                             device=device)
        # Keyed by global index so parameter names match the checkpoint's.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, kernels, dtype, device)
                                     for i in range(layer_start, layer_end)})
        if is_last:
            self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
            if not args.tie_word_embeddings:
                self.lm_head = Linear(args.hidden_size, args.vocab_size, False, kernels, dtype,
                                      device)
        self.register_buffer("inv_freq", rope_inv_freq(args).to(device), persistent=False)

    @property
    def num_local_layers(self) -> int:
        return self.layer_end - self.layer_start

    def checkpoint_sources(self) -> dict[str, list[tuple[str, tuple]]]:
        """Fused parameters -> (checkpoint tensor, rows of the parameter) per piece."""
        out = {}
        for module_name, module in self.named_modules():
            if not isinstance(module, Linear) or not module.parts:
                continue
            owner = "model." + module_name.rpartition(".")[0]
            for leaf in ("weight", "bias"):
                if getattr(module, leaf) is None:
                    continue
                pieces, row = [], 0
                for part, rows in module.parts:
                    pieces.append((f"{owner}.{part}.{leaf}", (slice(row, row + rows),)))
                    row += rows
                out[f"{module_name}.{leaf}"] = pieces
        return out

    def forward(self, inputs: torch.Tensor, batch: ForwardBatch | PagedDecodeBatch,
                kv: PagedKVCache) -> torch.Tensor:
        """Token ids [T] (first stage) or hidden [T, hidden] -> hidden [T, hidden], before the
        final norm."""
        h = self.embed_tokens(inputs) if self.is_first else inputs.to(self.dtype)
        freqs = batch.positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(h.dtype)[:, None, :]  # [T, 1, D] broadcasts over heads
        sin = emb.sin().to(h.dtype)[:, None, :]
        for local, layer in enumerate(self.layers.values()):
            h = layer(h, cos, sin, batch, kv, local)
        return h

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the rows that sample: [R, hidden] -> fp32 logits [R, V]."""
        if not self.is_last:
            raise RuntimeError("compute_logits runs on the last stage only")
        h = self.norm(hidden_rows)
        weight = self.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight
        return self.kernels.linear(h, weight).float()
