"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache that holds only the latent.

Each token keeps kv_lora_rank + qk_rope_head_dim values per layer (576 for V2/V3 shapes): the
normalised compressed KV and its rotated rope key. Rows of one token (decode) attend in the
absorbed form: q_nope is folded through kv_b_proj's key half into latent space, attention runs
over the latent as one shared head (FlashMLA's layout), and the output is unfolded through the
value half. Rows of several tokens (prefill chunks) expand their prefix's latent into per-head
K/V and run the dense attention kernel (SDPA / cuDNN), which is cheaper for many queries.

On a tensor-parallel stage (`--tp N`) each rank holds num_attention_heads / N query heads: q_proj
(q_b_proj under a q LoRA) and kv_b_proj are split by heads (column), o_proj by its input columns
(row: one all-reduce per layer). The q LoRA (q_a_proj, q_a_layernorm) and the latent's own
projection (kv_a_proj_with_mqa, kv_a_layernorm) are replicated: every rank computes every token's
whole latent and caches it whole, since each of its heads reads all of it. That is the KV-bytes
cost of TP for MLA: the latent has no heads to split, so a stage of N ranks holds N copies of
its latent cache, (kv_lora_rank + qk_rope_head_dim) values per token per layer on every rank
(1152 bytes in bf16 for V2/V3's 512 + 64): a token costs each rank what it costs one GPU without
TP (only the memory the split weights free adds blocks), where GQA's K/V split with the heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stages.forward_batch import ForwardBatch, PagedDecodeBatch
from stages.kernels.registry import Kernels
from stages.model_config import ModelArgs
from stages.models.deepseek_config import DeepseekArgs, softmax_scale, yarn_get_mscale
from stages.models.layers import Device, Linear, RMSNorm, apply_rope
from stages.models.mla_cache import LatentKVCache
from stages.tensor_parallel import TensorParallel, one_rank_unless


def yarn_inv_freq(dim: int, base: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_factor) exactly as transformers' _compute_yarn_parameters."""
    factor = s["factor"]
    orig = s["original_max_position_embeddings"]
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(
                factor, mscale_all_dim
            )
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent a singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def rope_tables(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """(inv_freq [qk_rope_head_dim / 2], cos/sin scale) for the model's rope dims."""
    dim = args.family_args.qk_rope_head_dim
    if args.rope_scaling is None:
        return 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    return yarn_inv_freq(dim, args.rope_theta, args.rope_scaling)


@dataclass
class MLADecodeRows:
    """The batch's decode rows, attended in the absorbed form in one kernel call per layer (a
    prefill chunk of one token is attended as the chunk it would be part of in another batch)."""

    token_index: torch.Tensor  # [R] long: each row's token in T
    block_table: torch.Tensor  # [R, max_blocks] int32, padded with block 0
    seqlens: torch.Tensor  # [R] int32: keys each row attends to (its own included)
    state: dict[str, Any] = field(
        default_factory=dict
    )  # a kernel's per-batch plan, shared by layers

    @classmethod
    def build(cls, batch: ForwardBatch, device: torch.device) -> "MLADecodeRows | None":
        rows = [i for i, d in enumerate(batch.row_decode) if d]
        if not rows:
            return None
        width = max(len(batch.block_tables[i]) for i in rows)
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for j, i in enumerate(rows):
            table[j, : len(batch.block_tables[i])] = torch.tensor(
                batch.block_tables[i], dtype=torch.int32
            )
        host = torch.cat(
            [
                torch.tensor([batch.row_offsets[i] for i in rows], dtype=torch.int32),
                torch.tensor([batch.row_starts[i] + 1 for i in rows], dtype=torch.int32),
                table.reshape(-1),
            ]
        )
        if device.type == "cuda":  # one pinned copy: a pageable one makes the host wait
            host = host.pin_memory().to(device, non_blocking=True)
        r = len(rows)
        return cls(host[:r].long(), host[2 * r :].view(r, width), host[r : 2 * r])

    @classmethod
    def paged(cls, batch: PagedDecodeBatch) -> "MLADecodeRows":
        """Every row of a decode-only microbatch, from its static buffers with device ops only
        (what a CUDA graph replays). Padding rows attend to one key (the kernels' plans count
        every row; SGLang pads FlashMLA's graphs the same way); their outputs are dropped."""
        return cls(
            torch.arange(batch.num_tokens, device=batch.positions.device),
            batch.block_tables.index_select(0, batch.table_rows),
            batch.lengths.clamp(min=1).int(),
        )


class MLAttention(nn.Module):
    """MLA over the latent cache; `heads` are the rank's share of the query heads on a
    tensor-parallel stage (the module docstring says what is split and what replicated)."""

    def __init__(
        self,
        args: ModelArgs,
        kernels: Kernels,
        dtype: torch.dtype,
        device: Device,
        tp: TensorParallel | None = None,
        backend: Any = None,
    ):
        """backend: the stage's MLA attention backend (stages/models/mla_backend.py), which
        the forward calls (required to run)."""
        super().__init__()
        tp = one_rank_unless(tp)
        d: DeepseekArgs = args.family_args
        self._backend = backend
        h, bias, heads = args.hidden_size, args.attention_bias, args.num_attention_heads
        self.d, self.kernels = d, kernels
        self.heads = tp.part(heads, "num_attention_heads")  # the rank's
        self.scale = softmax_scale(d, args.rope_scaling)
        qk = heads * d.qk_head_dim  # the checkpoint's rows: column splits keep the rank's heads
        if d.q_lora_rank is None:
            self.q_proj = Linear(h, qk, False, kernels, dtype, device, tp=tp, split="column")
        else:
            self.q_a_proj = Linear(h, d.q_lora_rank, bias, kernels, dtype, device)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, 1e-6, dtype, device)  # HF's default eps
            self.q_b_proj = Linear(
                d.q_lora_rank, qk, False, kernels, dtype, device, tp=tp, split="column"
            )
        self.kv_a_proj_with_mqa = Linear(h, d.latent_dim, bias, kernels, dtype, device)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, 1e-6, dtype, device)
        # kept in `dtype`: the absorbed form folds its two halves into queries and outputs
        self.kv_b_proj = Linear(
            d.kv_lora_rank,
            heads * (d.qk_nope_head_dim + d.v_head_dim),
            False,
            kernels,
            dtype,
            device,
            fp8=False,
            tp=tp,
            split="column",
        )
        self.o_proj = Linear(
            heads * d.v_head_dim, h, bias, kernels, dtype, device, tp=tp, split="row"
        )

    @property
    def backend(self) -> Any:
        if self._backend is None:
            raise RuntimeError("this attention was built without its stage's backend")
        return self._backend

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight as W_UK [H, nope, rank] and W_UV [H, v, rank]."""
        d = self.d
        w = self.kv_b_proj.weight.view(
            self.heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank
        )
        return w[:, : d.qk_nope_head_dim], w[:, d.qk_nope_head_dim :]

    def project(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch | PagedDecodeBatch,
        kv: LatentKVCache,
        local_layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Writes the tokens' latent to the cache; returns their queries' nope dims [T, H, nope],
        rotated rope dims [T, H, rope] and the q LoRA's normalised output (None without one)."""
        d, t = self.d, x.shape[0]
        if d.q_lora_rank is None:
            q_resid, q = None, self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(t, self.heads, d.qk_head_dim)
        q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos[:, None], sin[:, None], d.rope_interleave)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        k_pe = apply_rope(k_pe, cos, sin, d.rope_interleave)
        kv.write(local_layer, torch.cat((self.kv_a_layernorm(c), k_pe), dim=-1), batch.slot_mapping)
        return q_nope, q_pe, q_resid

    def absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[R, H, rank + rope]: q_nope folded through W_UK into latent space, then q_pe."""
        return torch.cat((torch.einsum("rhn,hnc->rhc", q_nope, self._kv_b()[0]), q_pe), dim=-1)

    def unabsorb(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Attention output in latent space [R, H, rank] -> per-head values [R, H, v]."""
        return torch.einsum("rhc,hvc->rhv", out.to(dtype), self._kv_b()[1])

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        decode: MLADecodeRows | None,
        batch: ForwardBatch | PagedDecodeBatch,
        kv: LatentKVCache,
        local_layer: int,
    ) -> torch.Tensor:
        """decode: the stage's attention backend's metadata (MLADenseBackend.prepare)."""
        q_nope, q_pe, _ = self.project(x, cos, sin, batch, kv, local_layer)
        o = self.backend.forward(self, q_nope, q_pe, decode, batch, kv, local_layer, x.dtype)
        return self._project_out(o, x.shape[0])

    def _project_out(self, o: torch.Tensor, t: int) -> torch.Tensor:
        projected: torch.Tensor = self.o_proj(o.reshape(t, self.heads * self.d.v_head_dim))
        return projected

    def expanded(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """A chunk's queries [n, H, qk] over its prefix's latent [L, rank + rope] expanded to
        per-head K/V (V keeps its own width: the attention kernels take it)."""
        d, length = self.d, latent.shape[0]
        latent = latent.to(q.dtype)
        kv = self.kv_b_proj(latent[:, : d.kv_lora_rank]).view(
            length, self.heads, d.qk_nope_head_dim + d.v_head_dim
        )
        k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
        k_pe = latent[:, None, d.kv_lora_rank :].expand(length, self.heads, d.qk_rope_head_dim)
        k = torch.cat((k_nope, k_pe), dim=-1)
        attended: torch.Tensor = self.kernels.attention(q, k, v, self.scale)
        return attended
