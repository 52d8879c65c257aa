"""Decode-only microbatches on CUDA: static buffers, paged attention, one CUDA graph per
batch-size bucket (vLLM's and SGLang's idea).

A decode step of a few dozen rows is milliseconds of GPU work spread over hundreds of small
kernels; launched one by one from Python it is bound by the host. Captured once per bucket and
replayed, the step costs one launch. Everything a step changes lives in static device tensors:
the inputs (token ids on stage 0, hidden states elsewhere), and per row its position, KV slot,
length and block-table row, filled by one pinned copy. Block tables are kept on the device, one
row per request slot, and updated only when a plan appends blocks. Rows past the real ones pad
the bucket: length 0 (attention gives zeros) and KV written to a scratch slot nobody reads.

The output channel's send and recv stay outside the graph (the runner does them around it).
With ``eager=True`` the same buffers and kernels run without capture (``--enforce-eager``), so
the two paths compute the same numbers.
"""

from __future__ import annotations

import logging
import time

import torch

from stages.forward_batch import PagedDecodeBatch
from stages.kernels.triton_paged_decode import num_splits_for
from stages.kv_cache import PagedKVCache
from stages.protocol import Row

log = logging.getLogger("ppserve.stage")

_META = 4  # positions, slot mapping, lengths, block-table rows


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_rows (and max_rows itself)."""
    small = [b for b in (1, 2, 4, 8) if b < max_rows]
    return sorted(set(small + list(range(16, max_rows, 16)) + [max_rows]))


def is_decode_row(r: Row) -> bool:
    return r.num_tokens == 1 and not r.is_prefill and r.sample


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv: PagedKVCache, *, num_slots: int,
                 max_model_len: int, scratch_slot: int, hidden_shape: tuple[int, ...],
                 kv_heads: int, dtype: torch.dtype, device: torch.device, is_first: bool,
                 max_rows: int, eager: bool):
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
        self.batches: dict[int, PagedDecodeBatch] = {}
        self.meta: dict[int, torch.Tensor] = {}
        for b in self.buckets:
            meta = torch.zeros(_META, b, dtype=torch.long, device=device)
            meta[1].fill_(scratch_slot)
            self.meta[b] = meta
            self.batches[b] = PagedDecodeBatch(
                positions=meta[0], slot_mapping=meta[1], lengths=meta[2], table_rows=meta[3],
                block_tables=self.tables, block_size=self.block_size,
                num_splits=num_splits_for(b, kv_heads))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    # -- setup -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> dict:
        """Run every bucket once (compiles the Triton kernels), then capture each, largest
        first so the smaller ones reuse its memory pool. Returns seconds and bytes it took."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for b in self.buckets:
                self.model(self.inputs[:b], self.batches[b], self.kv)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = None
        if not self.eager:
            for b in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[b] = self.model(self.inputs[:b], self.batches[b], self.kv)
                pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        info = {"graphs": len(self.graphs), "buckets": self.buckets,
                "seconds": round(time.perf_counter() - t0, 3),
                "bytes": int(free_before - torch.cuda.mem_get_info(self.device)[0])}
        log.info("decode graphs: %s", info)
        return info

    def update_tables(self, updates: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """(slot, index of the first new block, new block ids) per request: one copy."""
        if not updates:
            return
        rows, cols, vals = [], [], []
        for slot, first, blocks in updates:
            rows += [slot] * len(blocks)
            cols += range(first, first + len(blocks))
            vals += blocks
        if max(cols) >= self.tables.shape[1]:
            raise ValueError(f"a block table grew past max_model_len {self.max_model_len}")
        host = torch.tensor([rows, cols, vals], dtype=torch.long).pin_memory()
        idx = host.to(self.device, non_blocking=True)
        self.tables[idx[0], idx[1]] = idx[2].to(torch.int32)

    # -- one microbatch ------------------------------------------------------------------------
    def bucket_for(self, rows: tuple[Row, ...]) -> int | None:
        """The bucket a plan replays in, or None when it must run the general eager path."""
        n = len(rows)
        if n == 0 or n > self.buckets[-1] or not all(is_decode_row(r) for r in rows):
            return None
        if max(r.start for r in rows) >= self.max_model_len:
            return None
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def run(self, bucket: int, rows: tuple[Row, ...], inputs: torch.Tensor,
            block_tables: dict[str, list[int]]) -> torch.Tensor:
        """inputs: [R] token ids (stage 0) or [R, hidden]. Returns hidden [R, hidden]."""
        n, bs = len(rows), self.block_size
        pad = bucket - n
        meta = [[r.start for r in rows] + [0] * pad,
                [block_tables[r.req_id][r.start // bs] * bs + r.start % bs for r in rows]
                + [self.scratch_slot] * pad,
                [r.start + 1 for r in rows] + [0] * pad,
                [r.slot for r in rows] + [0] * pad]
        host = torch.tensor(meta, dtype=torch.long).pin_memory()
        self.meta[bucket].copy_(host, non_blocking=True)
        self.inputs[:n].copy_(inputs)
        if self.eager:
            out = self.model(self.inputs[:bucket], self.batches[bucket], self.kv)
        else:
            self.graphs[bucket].replay()
            out = self.outputs[bucket]
        return out[:n]
