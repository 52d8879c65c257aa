"""One pipeline stage of a DeepSeek-V4 model. Between stages the hidden state is the residual
streams [tokens, hc_mult, hidden]; stage 0 expands the embedding into them, the last collapses
them (hc_head) before the final norm. Parameter names are the checkpoint's minus `model.`."""

from __future__ import annotations

import torch
from torch import nn

from stages.forward_batch import ForwardBatch
from stages.kernels.registry import Kernels
from stages.models.deepseek_v4.attention import V4Attention, V4Row
from stages.models.deepseek_v4.cache import V4Cache
from stages.models.deepseek_v4.config import SLIDING, V4Args
from stages.models.deepseek_v4.layers import HyperConnection, HyperHead, Rotary, V4RMSNorm
from stages.models.deepseek_v4.moe import V4MoE
from stages.models.deepseek_v4.names import checkpoint_tensor, expert_sources
from stages.models.llama import Linear


class V4DecoderLayer(nn.Module):
    def __init__(self, a: V4Args, layer: int, kernels: Kernels, dtype: torch.dtype,
                 device: str | torch.device):
        super().__init__()
        self.is_sliding = a.layer_types[layer] == SLIDING
        self.self_attn = V4Attention(a, layer, kernels, dtype, device)
        self.mlp = V4MoE(a, layer, kernels, dtype, device)
        self.input_layernorm = V4RMSNorm(a.hidden_size, a.rms_norm_eps, device)
        self.post_attention_layernorm = V4RMSNorm(a.hidden_size, a.rms_norm_eps, device)
        self.attn_hc = HyperConnection(a, device)
        self.ffn_hc = HyperConnection(a, device)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                rows: list[V4Row], batch: ForwardBatch, cache: V4Cache, local: int,
                token_ids: torch.Tensor | None) -> torch.Tensor:
        post, comb, x = self.attn_hc(h)
        out = self.self_attn(self.input_layernorm(x), positions, rotary, rows,
                             batch.slot_mapping, cache, local)
        h = HyperConnection.merge(h, out, post, comb)
        post, comb, x = self.ffn_hc(h)
        return HyperConnection.merge(h, self.mlp(self.post_attention_layernorm(x), token_ids),
                                     post, comb)


class DeepseekV4Stage(nn.Module):
    """Layers [layer_start, layer_end) plus the embedding (first) and hc_head, norm and head
    (last)."""

    def __init__(self, a: V4Args, layer_start: int, layer_end: int, is_first: bool,
                 is_last: bool, kernels: Kernels, dtype: torch.dtype,
                 device: str | torch.device):
        super().__init__()
        if not 0 <= layer_start < layer_end <= a.num_hidden_layers:
            raise ValueError(f"bad layer range [{layer_start}, {layer_end}) for a model with "
                             f"{a.num_hidden_layers} layers")
        self.a = a
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first, self.is_last = is_first, is_last
        self.kernels, self.dtype = kernels, dtype
        if is_first or (is_last and a.tie_word_embeddings):
            self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, dtype=dtype,
                                             device=device)
        self.layers = nn.ModuleDict({str(i): V4DecoderLayer(a, i, kernels, dtype, device)
                                     for i in range(layer_start, layer_end)})
        if is_last:
            self.hc_head = HyperHead(a, device)
            self.norm = V4RMSNorm(a.hidden_size, a.rms_norm_eps, device)
            if not a.tie_word_embeddings:
                self.lm_head = Linear(a.hidden_size, a.vocab_size, False, kernels, dtype, device)
        self.main_rotary = Rotary(a, a.main_rope, device)
        self.compress_rotary = Rotary(a, a.compress_rope, device)

    @property
    def needs_token_ids(self) -> bool:
        """Whether a layer of this stage routes by token id (hash MoE)."""
        return any(self.a.is_hash(i) for i in range(self.layer_start, self.layer_end))

    def checkpoint_sources(self) -> dict[str, list[tuple[str, tuple]]]:
        """Every parameter's tensor(s) in the checkpoint (names as transformers writes them)."""
        a = self.a
        return {n: (expert_sources(n, a.n_routed_experts, a.moe_intermediate_size)
                    if ".experts." in n else [(checkpoint_tensor(n), ())])
                for n, _ in self.named_parameters()}

    def forward(self, inputs: torch.Tensor, batch: ForwardBatch, cache: V4Cache,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [T] (first stage) or streams [T, hc_mult, hidden] -> streams."""
        if self.is_first:
            token_ids = inputs
            e = self.embed_tokens(inputs)
            h = e.unsqueeze(1).expand(-1, self.a.hc_mult, -1).contiguous()
        else:
            h = inputs.to(self.dtype)
        device = h.device
        tables = [torch.tensor(t, dtype=torch.long) for t in batch.block_tables]
        flat = torch.cat(tables).to(device) if tables else torch.empty(0, dtype=torch.long)
        per_row = flat.split([len(t) for t in tables])
        rows = [V4Row(s, n, o, tab) for s, n, o, tab in zip(
            batch.row_starts, batch.row_lens, batch.row_offsets, per_row)]
        for local, layer in enumerate(self.layers.values()):
            rotary = self.main_rotary if layer.is_sliding else self.compress_rotary
            h = layer(h, batch.positions, rotary, rows, batch, cache, local, token_ids)
        return h

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """hc_head, final norm and LM head on the rows that sample: [R, hc, hidden] -> fp32
        logits [R, V]."""
        if not self.is_last:
            raise RuntimeError("compute_logits runs on the last stage only")
        h = self.norm(self.hc_head(hidden_rows))
        weight = self.embed_tokens.weight if self.a.tie_word_embeddings else self.lm_head.weight
        return self.kernels.linear(h, weight).float()
