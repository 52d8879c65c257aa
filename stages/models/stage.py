"""The shell of one pipeline stage every family shares: layers [layer_start, layer_end) keyed by
their global index (so parameter names are the checkpoint's minus `model.`), the embedding on the
first stage (and on the last with tied embeddings), the final norm and LM head on the last, and
logits for the sampling rows only. A family subclass builds its layers and the per-forward
context they share (rope tables, attention row metadata)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stages.attention.base import AttentionBackend
from stages.model_config import ModelArgs
from stages.models.layers import RMSNorm, VocabEmbedding, vocab_logits
from stages.models.moe import warm_up_experts
from stages.stage_context import Sources, StageContext

if TYPE_CHECKING:
    from stages.stage_context import StageModel


class Stage(nn.Module):
    def __init__(self, ctx: StageContext):
        super().__init__()
        self.ctx = ctx
        # the kernels the stage's own ops call (the head): swappable, as each layer's are
        self.kernels = ctx.kernels
        # the attention backend of the family's cache kind, built once; before the layers,
        # which call it (stages/attention/base.py)
        self.attention: AttentionBackend[Any] = ctx.args.family.attention_backend(ctx.args)(ctx)
        args, dtype, device = ctx.args, ctx.dtype, ctx.device
        vocab, hidden = args.vocab_size, args.hidden_size
        if ctx.holds_embedding:
            self.embed_tokens = VocabEmbedding(vocab, hidden, dtype, device, ctx.tp)
        self.layers = nn.ModuleDict({str(i): self.build_layer(i) for i in ctx.layers})
        if ctx.is_last:
            self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
            if not args.tie_word_embeddings:  # split by vocabulary rows, as the embedding
                self.lm_head = VocabEmbedding(vocab, hidden, dtype, device, ctx.tp)

    @property
    def args(self) -> ModelArgs:
        return self.ctx.args

    @property
    def layer_start(self) -> int:
        return self.ctx.layer_start

    @property
    def layer_end(self) -> int:
        return self.ctx.layer_end

    @property
    def is_first(self) -> bool:
        return self.ctx.is_first

    @property
    def is_last(self) -> bool:
        return self.ctx.is_last

    @property
    def dtype(self) -> torch.dtype:
        return self.ctx.dtype

    def build_layer(self, layer: int) -> nn.Module:
        """The decoder layer of global index `layer`, built with self.ctx's kernels, dtype and
        device."""
        raise NotImplementedError

    def layer_context(self, batch: Any, kv: Any, h: torch.Tensor) -> tuple[Any, ...]:
        """What every layer of one forward shares, passed to each before the batch (the
        attention backend's metadata among it: prepared once per forward)."""
        raise NotImplementedError

    def decode_graph_variants(self, max_model_len: int) -> tuple[tuple[int, int], ...]:
        """The decode-graph shapes of one batch-size bucket: the attention backend's."""
        return self.attention.graph_variants(max_model_len)

    def decode_graph_workspace(self, max_rows: int, max_model_len: int) -> int:
        """Bytes of the decode graphs' temporaries that grow with max_model_len, beyond the
        runner's fixed reserve (the KV budget leaves them out): the attention backend's."""
        return self.attention.graph_workspace(max_rows, max_model_len)

    @property
    def num_local_layers(self) -> int:
        return self.ctx.num_local_layers

    def warm_up_experts(
        self, lengths: list[int], dtype: torch.dtype, device: torch.device
    ) -> dict[str, float]:
        """The routed experts' kernels at each chunk length (stages/models/moe.py); {} for a
        stage without a MoE routed by scores."""
        return warm_up_experts(self.modules(), lengths, dtype, device)

    def checkpoint_sources(self) -> Sources:
        """Parameters not stored under their own name (fused or stacked) -> their pieces."""
        out: Sources = {}
        for module_name, module in self.named_modules():
            sources = getattr(module, "checkpoint_sources", None)
            if module is self or sources is None:
                continue
            prefix = "" if module_name == "lm_head" else "model."  # the head's own name
            for leaf, pieces in sources(prefix + module_name).items():
                out[f"{module_name}.{leaf}"] = pieces
        return out

    def forward(self, inputs: torch.Tensor, batch: Any, kv: Any) -> torch.Tensor:
        """Token ids [T] (first stage) or hidden [T, hidden] -> hidden [T, hidden], before the
        final norm."""
        h = self.embed_tokens(inputs) if self.is_first else inputs.to(self.dtype)
        context = self.layer_context(batch, kv, h)
        for local, layer in enumerate(self.layers.values()):
            h = layer(h, context, batch, kv, local)
        return h

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the rows that sample: [R, hidden] -> fp32 logits [R, V]."""
        if not self.is_last:
            raise RuntimeError("compute_logits runs on the last stage only")
        h = self.norm(hidden_rows)
        weight = self.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight
        return vocab_logits(h, weight, self.args.vocab_size, self.ctx.tp, self.kernels)


if TYPE_CHECKING:  # what the engine calls a stage's module: every Stage is one
    _STAGE_IS_A_STAGE_MODEL: type[StageModel] = Stage
