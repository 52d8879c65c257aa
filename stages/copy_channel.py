"""The copy output channel: sampled ids from the last stage to stage 0 without an SM waiting.

Stage 0 owns a ring of id buffers on its GPU, one "ready" and one "consumed" interprocess CUDA
event per ring slot, and two message counters in shared host memory; it hands them to the last
stage through the pipeline's rendezvous store. The last stage copies each message into its slot
with a cudaMemcpyAsync (a copy engine, no kernel) and records the slot's ready event; stage 0
makes its stream wait on that event just before the consumer (a wait in the stream, not a
kernel), then records the consumed event. stages/output_ring.py is the ordering protocol;
stages/shared_counters.py holds the counters (their /dev/shm name is gone once both ends map it).

One node only, and both processes must see the GPU that holds the ring (the same device, or
all of the node's GPUs visible to each).
"""

from __future__ import annotations

import base64
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from stages.output_ring import OutputRing
from stages.shared_counters import SharedCounters

if TYPE_CHECKING:
    from stages.channels import TCPStore

RING_SLOTS = 64  # messages in flight between the two ends; more than any max_inflight
HEADER = 3  # check mode: (mb id, seq, ids) ahead of a message's ids
_STORE_KEY = "ppserve/copy_channel"
_WAIT_S = 1800.0  # as the NCCL channel's timeout: a long chunk on a slow stage is not a hang


class CopyChannelError(RuntimeError):
    """The copy channel cannot be set up here, or a message is out of step."""


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _unb64(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)


_STORAGES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}


def _export_tensor(t: torch.Tensor) -> dict[str, Any]:
    """torch's CUDA IPC export of `t` (torch.multiprocessing's reduce_tensor) as plain JSON
    fields: the rendezvous store carries data, never pickles."""
    rebuild, args = reduce_tensor(t)
    if rebuild is not rebuild_cuda_tensor or len(args) != 15:
        raise CopyChannelError("this torch's CUDA IPC export has an unexpected layout")
    (
        _cls,
        size,
        stride,
        offset,
        storage_cls,
        _dtype,
        device,
        handle,
        size_bytes,
        offset_bytes,
        _grad,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = args
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": offset,
        "storage": storage_cls.__name__,
        "device": device,
        "handle": _b64(handle),
        "size_bytes": size_bytes,
        "offset_bytes": offset_bytes,
        "ref_handle": _b64(ref_handle),
        "ref_offset": ref_offset,
        "event_handle": _b64(event_handle),
        "event_sync": event_sync,
    }


def _import_tensor(d: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    t: torch.Tensor = rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(d["size"]),
        tuple(d["stride"]),
        d["offset"],
        _STORAGES[d["storage"]],
        dtype,
        d["device"],
        _unb64(d["handle"]),
        d["size_bytes"],
        d["offset_bytes"],
        False,
        _unb64(d["ref_handle"]),
        d["ref_offset"],
        _unb64(d["event_handle"]),
        d["event_sync"],
    )
    return t


def _wait_until(ready: Callable[[], bool], what: str) -> None:
    """Spin (yielding the CPU) until ready(); the other end's host is at most a few plans
    behind."""
    deadline = time.monotonic() + _WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            raise CopyChannelError(f"copy channel: timed out waiting for {what}")
        time.sleep(0)


@dataclass
class PendingCopy:
    """A message stage 0 expects (the copy channel's PendingRecv): wait() queues the stream's
    wait for it and returns its ids; release() after the consumer frees the slot."""

    channel: CopyOutput
    mb_id: int
    seq: int
    num_ids: int

    def landed(self) -> bool:
        """Recorded by the last stage and complete on the device (no host wait)."""
        ring, _ = self.channel.connected()
        return ring.readable(self.seq) and self.channel.ready[ring.slot(self.seq)].query()

    def wait(self) -> torch.Tensor:
        ch = self.channel
        ring, buffers = ch.connected()
        _wait_until(lambda: ring.readable(self.seq), f"the ids of microbatch {self.mb_id}")
        slot = ring.slot(self.seq)
        torch.cuda.current_stream(ch.device).wait_event(ch.ready[slot])
        row = buffers[slot]
        if ch.check:
            got = row[:HEADER].tolist()  # check mode only: a host sync is acceptable there
            if got != [self.mb_id, self.seq, self.num_ids]:
                raise CopyChannelError(
                    f"copy channel out of step: header (mb, seq, ids) = {got}, plan expects "
                    f"{[self.mb_id, self.seq, self.num_ids]}"
                )
            return row[HEADER : HEADER + self.num_ids]
        return row[: self.num_ids]

    def release(self) -> None:
        ch = self.channel
        ring, _ = ch.connected()
        slot = ring.slot(self.seq)
        ch.consumed[slot].record(torch.cuda.current_stream(ch.device))
        ring.read(self.seq)


class CopyOutput:
    """One end of the copy channel: stage 0 (the consumer) or the last stage (the producer)."""

    def __init__(self, device: torch.device, width: int, check: bool) -> None:
        self.device = device
        self.width = width + (HEADER if check else 0)
        self.check = check
        self.buffers: torch.Tensor | None = None
        self.ready: list[torch.cuda.Event] = []
        self.consumed: list[torch.cuda.Event] = []
        self.ring: OutputRing | None = None
        self._counters: SharedCounters | None = None

    # -- setup (inside PipelineChannels.connect, after the process group is up) --------------
    def connected(self) -> tuple[OutputRing, torch.Tensor]:
        """The ring and its buffers, once serve() or join() has set them up."""
        if self.ring is None or self.buffers is None:
            raise CopyChannelError("the copy output channel is used before it is connected")
        return self.ring, self.buffers

    def serve(self, store: TCPStore) -> None:
        """Stage 0: allocate the ring and publish its handles."""
        if self.device.type != "cuda":
            raise CopyChannelError("the copy output channel needs CUDA")
        self.buffers = torch.zeros(RING_SLOTS, self.width, dtype=torch.long, device=self.device)
        self.ready = [torch.cuda.Event(interprocess=True) for _ in range(RING_SLOTS)]
        self.consumed = [torch.cuda.Event(interprocess=True) for _ in range(RING_SLOTS)]
        torch.cuda.synchronize(self.device)  # the zeroed ring exists before anyone maps it
        self._counters = SharedCounters.create()
        self.ring = OutputRing(RING_SLOTS, self._counters)
        try:
            store.set(
                _STORE_KEY,
                json.dumps(
                    {
                        "host": socket.gethostname(),
                        "counters": self._counters.path,
                        "buffers": _export_tensor(self.buffers),
                        "ready": [_b64(e.ipc_handle()) for e in self.ready],
                        "consumed": [_b64(e.ipc_handle()) for e in self.consumed],
                    }
                ),
            )
        except BaseException:
            self._counters.unlink()
            raise
        # A name in /dev/shm outlives a crash: it goes as soon as the peer has mapped it.
        self._counters.unlink_once_mapped(store, _WAIT_S)

    def join(self, store: TCPStore) -> None:
        """The last stage: open stage 0's ring, events and counters."""
        info = json.loads(store.get(_STORE_KEY))
        try:  # the counters first: stage 0 waits for this end to be done with their name
            if info["host"] != socket.gethostname():
                raise CopyChannelError(
                    f"the copy output channel needs stage 0 and the last stage on one node "
                    f"(stage 0 is on {info['host']}, the last stage on {socket.gethostname()}); "
                    "use --output-channel nccl or host"
                )
            self._counters = SharedCounters(info["counters"], create=False)
        finally:
            SharedCounters.done_with_name(store)
        self.ring = OutputRing(RING_SLOTS, self._counters)
        try:
            self.buffers = _import_tensor(info["buffers"], torch.long)
            self.ready = [
                torch.cuda.Event.from_ipc_handle(self.device, _unb64(h)) for h in info["ready"]
            ]
            self.consumed = [
                torch.cuda.Event.from_ipc_handle(self.device, _unb64(h)) for h in info["consumed"]
            ]
        except RuntimeError as e:
            raise CopyChannelError(
                "the copy output channel could not open stage 0's buffer by CUDA IPC (both "
                f"stages must see stage 0's GPU): {e}"
            ) from e

    # -- the last stage ------------------------------------------------------------------------
    def send(self, ids: torch.Tensor, mb_id: int) -> None:
        """Queue the copy of `ids` into the next slot on the current stream (after the sampling
        that produced them) and record the slot's ready event."""
        ring, buffers = self.connected()
        if ids.numel() + (HEADER if self.check else 0) > self.width:
            raise CopyChannelError(
                f"microbatch {mb_id}: {ids.numel()} ids exceed the ring's width {self.width}"
            )
        _wait_until(ring.writable, f"stage 0 to read message {ring.next_write - RING_SLOTS}")
        seq, slot = ring.next_write, ring.slot(ring.next_write)
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.consumed[slot])  # stage 0's use of the slot's last message
        if self.check:
            header = torch.tensor([mb_id, seq, ids.numel()], dtype=torch.long).pin_memory()
            ids = torch.cat([header.to(self.device, non_blocking=True), ids])
        buffers[slot, : ids.numel()].copy_(ids, non_blocking=True)  # cudaMemcpyAsync
        self.ready[slot].record(stream)
        ring.written()

    # -- stage 0 -------------------------------------------------------------------------------
    def expect(self, mb_id: int, num_ids: int) -> PendingCopy:
        ring, _ = self.connected()
        return PendingCopy(self, mb_id, ring.expect(), num_ids)

    def close(self) -> None:
        """Unmap the counters and drop the ring's handles (the pipeline's teardown), once this
        end's queued copies and waits are done."""
        if self.buffers is not None:
            torch.cuda.synchronize(self.device)
        if self._counters is not None:
            self._counters.close()
            self._counters = None
        self.ring = self.buffers = None
        self.ready, self.consumed = [], []
