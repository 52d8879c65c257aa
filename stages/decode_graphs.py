"""Decode-only microbatches on CUDA: static buffers, paged attention, one CUDA graph per
batch-size bucket (vLLM's and SGLang's idea).

A decode step of a few dozen rows is milliseconds of GPU work spread over hundreds of small
kernels; launched one by one from Python it is bound by the host. Captured once per bucket and
replayed, the step costs one launch. Everything a step changes lives in static device tensors:
the inputs (token ids on stage 0, hidden states elsewhere), and per row its position, KV slot,
length and block-table row, filled by one pinned copy. Block tables are kept on the device, one
row per request slot, and updated only when a plan appends blocks. Rows past the real ones pad
the bucket: length 0 (attention gives zeros) and KV written to a scratch slot nobody reads.

The stage's attention backend (stages/attention/base.py) owns what is attention-specific: the
graphs' shapes per bucket (graph_variants), their static batches (static_batch), the rows
copied in before a replay (replay_meta) and its metadata, built inside the graph from the static
buffers (prepare). DeepSeek's decode (FlashMLA's absorbed MLA, the Triton grouped MoE, V3.2's
indexer and sparse MLA) is captured the same way; V3.2 keeps two graphs per bucket:
rows that all fit in the indexer's top-k attend densely, others score a static width. FP8 weights
(the W8A8 GEMMs, the grouped FP8 MoE) and V3.2's FP8 latent (every row on FlashMLA's sparse FP8
kernel) capture too; the family's paged_decode_graphs asks its attention backends
(can_capture) and its other ops which kernels its graphs need.
DeepSeek-V4 keeps one graph per bucket and bound on the rows' length (V4Backend: its window,
compressed entries and compression groups at static widths); a later stage whose hash-routed
layers read token ids gets a static buffer for them too.

The output channel's send and recv stay outside the graph (the runner does them around it).
With ``eager=True`` the same buffers and kernels run without capture (``--enforce-eager``), so
the two paths compute the same numbers.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from stages.attention.base import AttentionBackend
from stages.forward_batch import PagedDecodeBatch
from stages.kv_cache import KVCache
from stages.protocol import Row

log = logging.getLogger("ppserve.stage")

_META = 4  # positions, slot mapping, lengths, block-table rows


class GraphedModel(Protocol):
    """A stage's model as the graphs use it (stages.models.stage.Stage): its attention backend
    sizes the graphs, builds their static batches and fills them before a replay."""

    attention: AttentionBackend[Any]

    def __call__(
        self, inputs: torch.Tensor, batch: PagedDecodeBatch, kv: Any, *token_ids: torch.Tensor
    ) -> torch.Tensor: ...


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_rows (and max_rows itself)."""
    small = [b for b in (1, 2, 4, 8) if b < max_rows]
    return sorted(set(small + list(range(16, max_rows, 16)) + [max_rows]))


def is_decode_row(r: Row) -> bool:
    return r.num_tokens == 1 and not r.is_prefill and r.sample


class DecodeGraphs:
    def __init__(
        self,
        model: GraphedModel,
        kv: KVCache,  # the family's paged cache (K/V pages, MLA latents, V4's components)
        *,
        num_slots: int,
        max_model_len: int,
        scratch_slot: int,
        hidden_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        is_first: bool,
        max_rows: int,
        eager: bool,
        token_ids: bool = False,
    ):
        """token_ids: the stage's layers read their rows' token ids beside its hidden inputs (a
        later stage holding hash-routed layers): a static buffer for them too."""
        self.model, self.kv = model, kv
        self.block_size = kv.block_size
        self.max_model_len = max_model_len
        self.scratch_slot = scratch_slot
        self.device = device
        self.is_first = is_first
        self.eager = eager
        self.buckets = batch_buckets(max_rows)
        top = self.buckets[-1]
        max_blocks = -(-max_model_len // self.block_size)
        self.tables = torch.zeros(num_slots, max_blocks, dtype=torch.int32, device=device)
        if is_first:
            self.inputs = torch.zeros(top, dtype=torch.long, device=device)
        else:
            self.inputs = torch.zeros(top, *hidden_shape, dtype=dtype, device=device)
        self.token_ids = (
            torch.zeros(top, dtype=torch.long, device=device)
            if token_ids and not is_first
            else None
        )
        # (bucket, select width) per graph: one shape per bucket unless the model's attention
        # changes form with the rows' lengths (AttentionBackend.graph_variants)
        self.attention = model.attention
        self.variants = self.attention.graph_variants(max_model_len)
        self.batches: dict[tuple[int, int], PagedDecodeBatch] = {}
        self.meta: dict[int, torch.Tensor] = {}
        for b in self.buckets:
            meta = torch.zeros(_META, b, dtype=torch.long, device=device)
            meta[1].fill_(scratch_slot)
            self.meta[b] = meta
            for _longest, width in self.variants:
                self.batches[b, width] = self.attention.static_batch(
                    b, width, meta, self.tables, self.block_size, scratch_slot
                )
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    # -- setup -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> dict[str, Any]:
        """Run every bucket once (compiles the Triton kernels), then capture each, largest
        first so the smaller ones reuse its memory pool. Returns seconds and bytes it took."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for key, batch in self.batches.items():
                self._forward(key)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = None
        if not self.eager:
            for key in sorted(self.batches, reverse=True):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[key] = self._forward(key)
                pool = graph.pool()
                self.graphs[key] = graph
        torch.cuda.synchronize(self.device)
        info = {
            "graphs": len(self.graphs),
            "buckets": self.buckets,
            "select_widths": [w for _longest, w in self.variants],
            "seconds": round(time.perf_counter() - t0, 3),
            "bytes": int(free_before - torch.cuda.mem_get_info(self.device)[0]),
        }
        log.info("decode graphs: %s", info)
        return info

    def _forward(self, key: tuple[int, int]) -> torch.Tensor:
        extra = () if self.token_ids is None else (self.token_ids[: key[0]],)
        return self.model(self.inputs[: key[0]], self.batches[key], self.kv, *extra)

    def update_tables(self, updates: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """(slot, index of the first new block, new block ids) per request: one copy."""
        if not updates:
            return
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        for slot, first, blocks in updates:
            rows += [slot] * len(blocks)
            cols += range(first, first + len(blocks))
            vals += blocks
        if max(cols) >= self.tables.shape[1]:
            raise ValueError(f"a block table grew past max_model_len {self.max_model_len}")
        host = self._pinned(torch.tensor([rows, cols, vals], dtype=torch.long))
        idx = host.to(self.device, non_blocking=True)
        self.tables[idx[0], idx[1]] = idx[2].to(torch.int32)

    def _pinned(self, host: torch.Tensor) -> torch.Tensor:
        """Pinned for a non-blocking copy (a pageable one makes the host wait); on the CPU
        (the eager path's tests) as it is."""
        return host.pin_memory() if self.device.type == "cuda" else host

    # -- one microbatch ------------------------------------------------------------------------
    def bucket_for(self, rows: tuple[Row, ...]) -> tuple[int, int] | None:
        """(bucket, select width) of the graph a plan replays in, or None when it must run the
        general eager path."""
        n = len(rows)
        if n == 0 or n > self.buckets[-1] or not all(is_decode_row(r) for r in rows):
            return None
        longest = max(r.start for r in rows) + 1
        if longest > self.max_model_len:
            return None
        width = next(w for most, w in self.variants if most >= longest)
        return next(b for b in self.buckets if b >= n), width

    @torch.inference_mode()
    def run(
        self,
        key: tuple[int, int],
        rows: tuple[Row, ...],
        inputs: torch.Tensor,
        block_tables: dict[str, list[int]],
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """key: bucket_for's. inputs: [R] token ids (stage 0) or [R, hidden]; token_ids [R]
        where the graphs hold a buffer for them. Returns hidden [R, hidden]."""
        bucket, n = key[0], len(rows)
        meta = self.attention.replay_meta(
            rows, bucket, block_tables, self.block_size, self.scratch_slot
        )
        host = self._pinned(torch.tensor(meta, dtype=torch.long))
        self.meta[bucket].copy_(host, non_blocking=True)
        self.inputs[:n].copy_(inputs)
        if self.token_ids is not None:
            if token_ids is None:
                raise ValueError("this stage's decode graphs read the rows' token ids")
            self.token_ids[:n].copy_(token_ids)
        out: torch.Tensor
        if self.eager:
            out = self._forward(key)
        else:
            self.graphs[key].replay()
            out = self.outputs[key]
        return out[:n]
