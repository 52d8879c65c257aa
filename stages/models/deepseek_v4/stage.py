"""One pipeline stage of a DeepSeek-V4 model on the shared stage shell. Between stages the hidden
state is the residual streams [tokens, hc_mult, hidden]: stage 0 expands the embedding into them,
the last collapses them (hc_head) before the final norm. Hash-routed layers read their rows'
token ids (stage 0's inputs, forwarded to later stages by the runner).

On a tensor-parallel stage (ctx.tp) the streams are whole on every rank: each rank holds its
attention's whole output groups and their heads (V4Attention), its routed experts and its
share of the shared expert's columns (v4_moe), and its rows of the vocabulary (the shared
embedding and head); two all-reduces a layer. The hyper-connections, norms, routers,
compressors and indexers are whole on every rank, and so is the cache."""

from __future__ import annotations

import torch
from torch import nn

from stages.forward_batch import ForwardBatch, PagedDecodeBatch
from stages.kernels.registry import Kernels
from stages.models.deepseek_v4.attention import V4Attention
from stages.models.deepseek_v4.backend import V4Backend
from stages.models.deepseek_v4.cache import V4Cache
from stages.models.deepseek_v4.config import SLIDING, V4Args
from stages.models.deepseek_v4.layers import (
    ForwardAngles,
    HyperConnection,
    HyperHead,
    Rotary,
    V4RMSNorm,
)
from stages.models.deepseek_v4.moe import v4_moe
from stages.models.deepseek_v4.names import checkpoint_pieces, piece_tensor
from stages.models.deepseek_v4.plan import V4Plan
from stages.models.layers import Device
from stages.models.stage import Stage
from stages.stage_context import Sources, StageContext
from stages.tensor_parallel import TensorParallel


class V4DecoderLayer(nn.Module):
    """Attention then MoE, each between two hyper-connection mixes of the streams."""

    def __init__(
        self,
        a: V4Args,
        layer: int,
        kernels: Kernels,
        dtype: torch.dtype,
        device: Device,
        tp: TensorParallel | None = None,
        backend: V4Backend | None = None,
    ):
        super().__init__()
        self.is_sliding = a.layer_types[layer] == SLIDING
        self.self_attn = V4Attention(a, layer, kernels, dtype, device, tp, backend)
        self.mlp = v4_moe(a, layer, kernels, dtype, device, tp)
        self.input_layernorm = V4RMSNorm(a.hidden_size, a.rms_norm_eps, device, kernels)
        self.post_attention_layernorm = V4RMSNorm(a.hidden_size, a.rms_norm_eps, device, kernels)
        self.attn_hc = HyperConnection(a, kernels, device)
        self.ffn_hc = HyperConnection(a, kernels, device)

    def forward(
        self,
        h: torch.Tensor,
        angles: ForwardAngles,
        plan: V4Plan,
        batch: ForwardBatch | PagedDecodeBatch,
        cache: V4Cache,
        local: int,
        token_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        post, comb, x = self.attn_hc(h, self.input_layernorm)  # x normed
        out = self.self_attn(x, angles, plan, batch.slot_mapping, cache, local)
        h = self.attn_hc.merge(h, out, post, comb)
        post, comb, x = self.ffn_hc(h, self.post_attention_layernorm)
        out = self.mlp(x, token_ids)
        return self.ffn_hc.merge(h, out, post, comb)


class DeepseekV4Stage(Stage):
    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        a: V4Args = ctx.args.family_args
        self.a = a
        device = ctx.device
        if ctx.is_last:  # V4 keeps its norms' weights in fp32
            self.norm = V4RMSNorm(a.hidden_size, a.rms_norm_eps, device, ctx.kernels)
            self.hc_head = HyperHead(a, device)
        self.main_rotary = Rotary(a, a.main_rope, ctx.kernels, device)
        self.compress_rotary = Rotary(a, a.compress_rope, ctx.kernels, device)

    def build_layer(self, layer: int) -> nn.Module:
        c = self.ctx
        a = c.args.family_args
        return V4DecoderLayer(a, layer, c.kernels, c.dtype, c.device, c.tp, self.v4_attention)

    @property
    def v4_attention(self) -> V4Backend:
        backend = self.attention
        if not isinstance(backend, V4Backend):
            raise TypeError(f"V4 layers attend on V4Backend, not {type(backend).__name__}")
        return backend

    @property
    def rates(self) -> dict[int, tuple[bool, bool]]:
        """Compression rate -> (an HCA layer attends every entry, a CSA layer selects) of the
        stage's compressed layers (its attention backend's)."""
        return self.v4_attention.rates

    @property
    def needs_token_ids(self) -> bool:
        """Whether a layer of this stage routes by token id (hash MoE)."""
        return any(self.a.is_hash(i) for i in range(self.layer_start, self.layer_end))

    def checkpoint_sources(self) -> Sources:
        """Every parameter's tensors in the checkpoint (names as transformers writes them): the
        pieces the modules name (fused, stacked, a tensor-parallel rank's slices) renamed, the
        rest under its own name's."""
        named = super().checkpoint_sources()
        return {
            n: (
                [piece._replace(name=piece_tensor(piece.name)) for piece in named[n]]
                if n in named
                else checkpoint_pieces(n)
            )
            for n, _ in self.named_parameters()
        }

    def forward(
        self,
        inputs: torch.Tensor,
        batch: ForwardBatch | PagedDecodeBatch,
        kv: V4Cache,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids [T] (first stage) or streams [T, hc_mult, hidden] -> streams."""
        if self.is_first:
            token_ids = inputs
            h = self.embed_tokens(inputs).unsqueeze(1).expand(-1, self.a.hc_mult, -1)
            h = h.contiguous()
        else:
            h = inputs.to(self.dtype)
        plan = self.plan(batch, kv, h.device)
        angles: dict[bool, ForwardAngles] = {}  # per rotary (sliding or not), once per forward
        for local, layer in enumerate(self.layers.values()):
            sliding = bool(layer.is_sliding)
            if sliding not in angles:
                angles[sliding] = self.angles(sliding, batch.positions, plan, h.dtype)
            h = layer(h, angles[sliding], plan, batch, kv, local, token_ids)
        out: torch.Tensor = h
        return out

    def plan(
        self, batch: ForwardBatch | PagedDecodeBatch, kv: V4Cache, device: torch.device
    ) -> V4Plan:
        """The index arithmetic of the forward, shared by the stage's layers: its attention
        backend's metadata (V4Backend.prepare)."""
        plan: V4Plan = self.attention.prepare(batch, kv)
        return plan

    def angles(
        self, sliding: bool, positions: torch.Tensor, plan: V4Plan, dtype: torch.dtype
    ) -> ForwardAngles:
        """The main rotary's angles (sliding layers) or the compress rotary's (compressed
        layers: also at the groups the forward completes)."""
        if sliding:
            return ForwardAngles.build(self.main_rotary, positions, {}, dtype)
        groups = {rate: p.groups.positions for rate, p in plan.rates.items() if p.groups.count}
        return ForwardAngles.build(self.compress_rotary, positions, groups, dtype)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """hc_head, final norm and LM head on the rows that sample: [R, hc, hidden] -> fp32
        logits [R, V]."""
        if not self.is_last:
            raise RuntimeError("compute_logits runs on the last stage only")
        logits: torch.Tensor = super().compute_logits(self.hc_head(hidden_rows))
        return logits
