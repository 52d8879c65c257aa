"""The MLA latent attention backends (stages/attention/base.py): dense MLA (DeepSeek-V2/V3) and
V3.2's sparse MLA (DSA), over the stage's LatentKVCache.

Dense: decode rows attend in the absorbed form on mla_decode (FlashMLA) over the latent pages,
one call per layer for every row (MLADecodeRows: their block tables and lengths); prefill
chunks expand their prefix's latent to per-head K/V for the dense attention op.

Sparse: every query attends, in the absorbed form, to the slots its indexer selects
(SparseRows: the rows within index_topk keys attend densely, the others' SelectPlan) on
mla_sparse, or over an FP8 latent on mla_sparse_fp8 (decode rows) and mla_prefill_fp8 (prefill
chunks' tokens): the bf16/FP8 choice is the backend's. A decode-only microbatch whose rows all
fit in index_topk attends on MLA's dense decode over a bf16 latent (read up to each row's
length, not topk slots); over FP8 through the sparse kernel, which alone reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from stages.attention.base import AnyBatch, AttentionBackend, on_torch
from stages.forward_batch import PagedDecodeBatch
from stages.kernels.fallbacks import Refusal
from stages.kernels.flash_mla import PREFIX_KEYS
from stages.kernels.indexer_select import scores_with_maxima, topk_slots
from stages.models.deepseek_config import INDEXER_KEY
from stages.models.dsa import SparseRows
from stages.models.families import FLASH_MLA_PAGE, GraphSetting
from stages.models.mla import MLADecodeRows
from stages.models.mla_cache import LatentKVCache

if TYPE_CHECKING:
    from stages.models.dsa import DSAttention
    from stages.models.mla import MLAttention
    from stages.stage_context import StageContext

# The indexer's static score width is a multiple of its kernel's key blocks.
SELECT_WIDTH_STEP = 128
# Bytes per row and scored key the selecting decode graph holds at once (see graph_workspace):
# two int32 slot tables, fp32 scores, top-k's scratch of the same size
SELECT_BYTES_PER_KEY = 16


def _flash_mla_refusal(setting: GraphSetting, ops: list[str]) -> tuple[str, Refusal] | None:
    """FlashMLA (bf16 latent pages of 64; ops[0] its op) and the other `ops` off their torch
    references, which size tensors from device values (fp8_latent's gathers and loops on the
    host)."""
    if setting.block_size != FLASH_MLA_PAGE:
        return ops[0], Refusal("page_size", f"block size {setting.block_size}, not FlashMLA's 64")
    if setting.dtype != "bfloat16":
        return ops[0], Refusal("dtype", f"{setting.dtype}: FlashMLA takes bfloat16")
    return on_torch(setting, ops)


def _kernel(kernels: Any, op: str) -> Any:
    fn = getattr(kernels, op)
    if fn is None:
        raise RuntimeError(f"MLA attention needs kernels.{op}, which is unset")
    return fn


class MLADenseBackend(AttentionBackend[MLADecodeRows | None]):
    op = "mla_decode"

    def prepare(self, batch: AnyBatch, cache: Any) -> MLADecodeRows | None:
        if isinstance(batch, PagedDecodeBatch):  # every row decodes: no scatter, no chunk rows
            return MLADecodeRows.paged(batch)
        return MLADecodeRows.build(batch, batch.positions.device)

    @classmethod
    def capture_refusal(cls, setting: GraphSetting) -> tuple[str, Refusal] | None:
        return _flash_mla_refusal(setting, ["mla_decode"])

    def forward(
        self,
        layer: MLAttention,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        decode: MLADecodeRows | None,
        batch: AnyBatch,
        kv: LatentKVCache,
        local_layer: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The queries' nope and rotated rope dims [T, H, *] -> per-head values [T, H, v]."""
        if isinstance(batch, PagedDecodeBatch):
            if decode is None:
                raise ValueError("a decode-only microbatch needs its MLADecodeRows")
            return layer.unabsorb(self.decode(layer, q_nope, q_pe, decode, kv, local_layer), dtype)
        t = q_nope.shape[0]
        o = q_nope.new_empty(t, layer.heads, layer.d.v_head_dim, dtype=dtype)
        if decode is not None:
            idx = decode.token_index
            out = self.decode(layer, q_nope[idx], q_pe[idx], decode, kv, local_layer)
            o[idx] = layer.unabsorb(out, dtype)
        q = None  # the chunk rows' queries with their rope dims rotated, built if needed
        for n, off, prefix, one in zip(
            batch.row_lens, batch.row_offsets, batch.prefix_slots, batch.row_decode
        ):
            if one:  # a decode row: attended above
                continue
            if prefix is None:
                raise ValueError("a prefill chunk row has no prefix slots")
            if q is None:
                q = torch.cat((q_nope, q_pe), dim=-1)
            o[off : off + n] = layer.expanded(q[off : off + n], kv.gather(local_layer, prefix))
        return o

    @staticmethod
    def decode(
        layer: MLAttention,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        decode: MLADecodeRows,
        kv: LatentKVCache,
        local_layer: int,
    ) -> torch.Tensor:
        """The decode rows' attention in latent space [R, H, rank] (absorbed form)."""
        out: torch.Tensor = _kernel(layer.kernels, "mla_decode")(
            layer.absorbed_query(q_nope, q_pe),
            kv.pages(local_layer),
            decode.block_table,
            decode.seqlens,
            layer.d.kv_lora_rank,
            layer.scale,
            decode.state,
        )
        return out


class MLASparseBackend(AttentionBackend[MLADecodeRows | SparseRows]):
    op = "mla_sparse"

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        self.topk: int = ctx.args.family_args.indexer.topk

    def prepare(self, batch: AnyBatch, cache: Any) -> MLADecodeRows | SparseRows:
        """A decode-only microbatch's from its static buffers; over an FP8 latent every row
        attends through the sparse kernel."""
        if isinstance(batch, PagedDecodeBatch):
            if batch.select_width:
                return SparseRows.paged(batch, self.topk)
            if cache.fp8:  # within index_topk, on the sparse FP8 kernel
                return SparseRows.paged_dense(batch, self.topk)
            return MLADecodeRows.paged(batch)  # within index_topk: dense MLA decode
        return SparseRows.build(batch, cache.block_size, self.topk, batch.positions.device)

    @classmethod
    def capture_refusal(cls, setting: GraphSetting) -> tuple[str, Refusal] | None:
        """FlashMLA dense and sparse, the Triton indexer; over an FP8 latent FlashMLA's sparse
        FP8 kernel alone, its scheduler plan built inside the graph."""
        ops = ["mla_sparse", "mla_decode", "indexer_logits_rows"]
        if setting.kv_cache_dtype == "fp8":
            ops.append("mla_sparse_fp8")
        return _flash_mla_refusal(setting, ops)

    def graph_variants(self, max_model_len: int) -> tuple[tuple[int, int], ...]:
        """A decode-only microbatch whose rows all fit in the indexer's top-k attends densely;
        one with a longer row scores a static width (max_model_len rounded up)."""
        if max_model_len <= self.topk:
            return super().graph_variants(max_model_len)
        width = -(-max_model_len // SELECT_WIDTH_STEP) * SELECT_WIDTH_STEP
        return ((self.topk, 0), (max_model_len, width))

    def graph_workspace(self, max_rows: int, max_model_len: int) -> int:
        """The selecting shape's per-row [width] temporaries of the largest bucket: the slot
        table and its int32 intermediate, the fp32 scores, top-k's scratch."""
        width = max(w for _longest, w in self.graph_variants(max_model_len))
        return max_rows * width * SELECT_BYTES_PER_KEY

    def forward(
        self,
        layer: DSAttention,
        x: torch.Tensor,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        q_resid: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: MLADecodeRows | SparseRows | None,
        batch: AnyBatch,
        kv: LatentKVCache,
        local_layer: int,
    ) -> torch.Tensor:
        """-> per-head values [T, H, v] over the selected slots."""
        if isinstance(rows, MLADecodeRows) and isinstance(batch, PagedDecodeBatch):
            out = MLADenseBackend.decode(layer, q_nope, q_pe, rows, kv, local_layer)
            return layer.unabsorb(out, x.dtype)
        if not isinstance(rows, SparseRows):
            raise TypeError(f"DSA layers take the stage's SparseRows, got {type(rows).__name__}")
        indices = self.select(layer, x, q_resid, cos, sin, rows, kv, local_layer)
        pages = kv.pages(local_layer)
        q = layer.absorbed_query(q_nope, q_pe)
        if kv.fp8:
            out = self.fp8_attention(layer, q, pages, indices, rows)
        else:
            mla_sparse = _kernel(layer.kernels, "mla_sparse")
            dv = layer.d.kv_lora_rank
            out = mla_sparse(q, pages.view(-1, 1, pages.shape[-1]), indices, dv, layer.scale)
        return layer.unabsorb(out, x.dtype)

    @staticmethod
    def fp8_attention(
        layer: DSAttention,
        q: torch.Tensor,
        pages: torch.Tensor,
        indices: torch.Tensor,
        rows: SparseRows,
    ) -> torch.Tensor:
        """Over the FP8 latent pages: prefill chunks' tokens on mla_prefill_fp8 (their prefix
        keys in rows.state), decode rows' on mla_sparse_fp8, split where a batch holds both."""
        kernels = layer.kernels
        if kernels.mla_sparse_fp8 is None:
            raise RuntimeError("an FP8 latent cache needs kernels.mla_sparse_fp8, which is unset")
        decode, prefill = kernels.mla_sparse_fp8, kernels.mla_prefill_fp8
        dv, state, scale = layer.d.kv_lora_rank, rows.state, layer.scale
        if not rows.chunked or prefill is None:
            return cast(torch.Tensor, decode(q, pages, indices, dv, scale, state))
        if PREFIX_KEYS not in state:
            state[PREFIX_KEYS] = rows.prefix_keys(pages.shape[0] * pages.shape[1])
        if rows.split is None:
            return cast(torch.Tensor, prefill(q, pages, indices, dv, scale, state))
        chunk, single = rows.split
        out = q.new_empty(q.shape[0], q.shape[1], dv)
        out[chunk] = prefill(q[chunk], pages, indices[chunk], dv, scale, state)
        out[single] = decode(q[single], pages, indices[single], dv, scale, state)
        return out

    @staticmethod
    def select(
        layer: DSAttention,
        x: torch.Tensor,
        q_resid: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: SparseRows,
        kv: LatentKVCache,
        local_layer: int,
    ) -> torch.Tensor:
        """[T, topk] int32 slot ids each query attends to (-1: none): the dense rows' fixed
        ones, the selecting rows' top-k of the layer's indexer scores."""
        if rows.plan is None:
            return rows.dense
        if q_resid is None:
            raise ValueError("DSA's indexer reads the q LoRA's output: q_lora_rank must be set")
        indexer_logits_rows = _kernel(layer.kernels, "indexer_logits_rows")
        plan, indices = rows.plan, rows.dense.clone()
        q, weights = layer.indexer.queries(x, q_resid, cos, sin)
        pages = kv.pages(local_layer, INDEXER_KEY)  # [blocks, block_size, 1, width]
        logits, maxima = scores_with_maxima(
            indexer_logits_rows,
            q[plan.token_index],
            pages.view(pages.shape[0], pages.shape[1], pages.shape[-1]),
            weights[plan.token_index],
            layer.indexer.scale,
            plan,
        )
        indices[plan.token_index] = topk_slots(
            logits, plan, indices.shape[1], _kernel(layer.kernels, "index_topk"), maxima
        )
        return indices
