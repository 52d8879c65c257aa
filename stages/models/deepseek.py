"""One pipeline stage of a DeepSeek-V2/V3/V3.2 model: MLA attention (V3.2: sparse, DSA), MoE (or
dense) MLP per layer.

Parameter names are the checkpoint's minus `model.`, except the stacked routed experts, which
`checkpoint_sources` maps to the checkpoint's per-expert tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from stages.forward_batch import ForwardBatch
from stages.kernels.registry import Kernels
from stages.mla_cache import LatentKVCache
from stages.model_config import ModelArgs
from stages.models.dsa import DSAttention, SparseRows
from stages.models.llama import Linear, RMSNorm
from stages.models.mla import MLADecodeRows, MLAttention, rope_tables
from stages.models.moe import MoE, SwiGLU


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, kernels: Kernels, dtype, device):
        super().__init__()
        attention = MLAttention if args.deepseek.indexer is None else DSAttention
        self.self_attn = attention(args, kernels, dtype, device)
        if args.deepseek.is_moe_layer(layer):
            self.mlp = MoE(args, kernels, dtype, device)
        else:
            self.mlp = SwiGLU(args.hidden_size, args.intermediate_size, args.mlp_bias, kernels,
                              dtype, device)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)

    def forward(self, h, cos, sin, batch, rows, kv, local_layer):
        """rows: the forward's per-row attention metadata (MLADecodeRows or SparseRows)."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, rows, kv, local_layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekStage(nn.Module):
    """Layers [layer_start, layer_end) plus the embedding (first) and norm + head (last)."""

    def __init__(self, args: ModelArgs, layer_start: int, layer_end: int, is_first: bool,
                 is_last: bool, kernels: Kernels, dtype: torch.dtype,
                 device: str | torch.device):
        super().__init__()
        if args.deepseek is None:
            raise ValueError(f"{args.model_type} is not a DeepSeek model")
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
        self.layers = nn.ModuleDict({str(i): DeepseekDecoderLayer(args, i, kernels, dtype, device)
                                     for i in range(layer_start, layer_end)})
        if is_last:
            self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
            if not args.tie_word_embeddings:
                self.lm_head = Linear(args.hidden_size, args.vocab_size, False, kernels, dtype,
                                      device)
        inv_freq, self.rope_scale = rope_tables(args)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    @property
    def num_local_layers(self) -> int:
        return self.layer_end - self.layer_start

    def checkpoint_sources(self) -> dict[str, list[tuple[str, tuple]]]:
        """Parameters not stored under their own name: the stacked routed experts."""
        out = {}
        for i, layer in self.layers.items():
            if isinstance(layer.mlp, MoE):
                own = f"layers.{i}.mlp.experts"
                for name, pieces in layer.mlp.experts.checkpoint_sources("model." + own).items():
                    out[f"{own}.{name}"] = pieces
        return out

    def forward(self, inputs: torch.Tensor, batch: ForwardBatch,
                kv: LatentKVCache) -> torch.Tensor:
        """Token ids [T] (first stage) or hidden [T, hidden] -> hidden [T, hidden], before the
        final norm."""
        h = self.embed_tokens(inputs) if self.is_first else inputs.to(self.dtype)
        freqs = batch.positions[:, None].float() * self.inv_freq[None, :]
        cos = (freqs.cos() * self.rope_scale).to(h.dtype)  # [T, rope / 2]
        sin = (freqs.sin() * self.rope_scale).to(h.dtype)
        indexer = self.args.deepseek.indexer
        rows = (MLADecodeRows.build(batch, h.device) if indexer is None
                else SparseRows.build(batch, kv.block_size, indexer.topk, h.device))
        for local, layer in enumerate(self.layers.values()):
            h = layer(h, cos, sin, batch, rows, kv, local)
        return h

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the rows that sample: [R, hidden] -> fp32 logits [R, V]."""
        if not self.is_last:
            raise RuntimeError("compute_logits runs on the last stage only")
        h = self.norm(hidden_rows)
        weight = self.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight
        return self.kernels.linear(h, weight).float()
