"""Point-to-point channels between the stages of one pipeline (docs/ARCHITECTURE.md#channels).

All stages form one torch.distributed world (rank = stage index; stage * N + tensor-parallel rank
with --tp N). Every *directed* link gets its own group: hidden i -> i+1 for each i, and output
last -> 0; each stage's ranks share one more group for their all-reduces. Hidden and output
never share a group: on one NCCL group an early output recv would sit ahead of the next hidden
send on the same stream and deadlock. Sender and receiver decide from the same plan; shapes come
from the plan.

In check mode every message is preceded by a header (microbatch id, sequence number, byte count)
that the receiver verifies: gloo honours tags, so CPU tests would otherwise miss an ordering bug
that NCCL turns into garbage.

The output link depends on the output channel: "nccl" (its own group, gloo on CPU), "copy" (a
CUDA IPC ring, stages/copy_channel.py; no group) or "host" (nothing: stage 0 reads the ids from
the plans).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

# torch.distributed imports TCPStore from its C extension without re-exporting it by name;
# re-exported here by name for the other stage modules' annotations
from torch.distributed import TCPStore as TCPStore  # type: ignore[attr-defined]

from stages.copy_channel import CopyOutput, PendingCopy

_TIMEOUT = datetime.timedelta(minutes=30)  # a 1M-token chunk on a slow stage is not a hang
# A posted send and its tensor, which must live until the work is waited.
SendWork = tuple[Work, torch.Tensor]


class ChannelError(RuntimeError):
    """A message arrived out of step with the plan: the pipeline must be rebuilt."""


@dataclass
class _Link:
    src: int
    dst: int
    group: ProcessGroup
    seq: int = 0  # messages so far, counted on both ends


@dataclass
class PendingRecv:
    """A posted recv: wait() before touching `buf`."""

    mb_id: int
    buf: torch.Tensor
    works: list[Work]
    header: torch.Tensor | None
    link: _Link
    seq: int

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        if self.header is not None:
            _check_header(self.header, self.mb_id, self.seq, self.buf)
        return self.buf

    def landed(self) -> bool:
        return False  # consumed when a plan needs it (the posting policy decides the rest)

    def release(self) -> None:
        """The buffer is a fresh tensor per message: nothing to give back."""


def _header(mb_id: int, seq: int, t: torch.Tensor) -> torch.Tensor:
    return torch.tensor(
        [mb_id, seq, t.numel() * t.element_size()], dtype=torch.int64, device=t.device
    )


def _check_header(header: torch.Tensor, mb_id: int, seq: int, buf: torch.Tensor) -> None:
    got = header.tolist()  # check mode only: a host sync is acceptable there
    want = [mb_id, seq, buf.numel() * buf.element_size()]
    if got != want:
        raise ChannelError(
            f"channel out of step: header (mb, seq, bytes) = {got}, plan expects {want}"
        )


def open_store(host: str) -> tuple[TCPStore, int]:
    """Stage 0 opens the rendezvous store on its node IP with an OS-chosen port."""
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_TIMEOUT)
    return store, store.port


def _posted(work: Work | None) -> Work:
    """torch returns no work only to a rank outside the link's group."""
    if work is None:
        raise ChannelError("a send or recv was posted on a link this rank is not part of")
    return work


class PipelineChannels:
    """This rank's ends of the pipeline's links, and its stage's tensor-parallel group.

    With --tp N every stage is N ranks (global rank = stage * N + tp rank) and each link is N
    links, rank r of stage i to rank r of stage i + 1: every rank of a stage holds the whole
    hidden state (stages/tensor_parallel.py), so each sends its own copy and no rank waits on a
    broadcast. The output link likewise joins rank r of the last stage to rank r of stage 0."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        device: torch.device,
        check: bool,
        output_channel: str,
        max_ids: int,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        """max_ids: the most ids one output message carries (the copy ring's width)."""
        self.stage, self.num_stages = stage, num_stages
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.rank = self._global(stage, tp_rank)
        self.world = num_stages * tp_size
        self.device = device
        self.check = check
        self.output_channel = output_channel
        self.hidden_links: list[_Link] = []  # this rank's, by sending stage
        self.output_link: _Link | None = None
        self.tp_group: ProcessGroup | None = None  # the stage's ranks, when tp_size > 1
        self.copy: CopyOutput | None = None
        if output_channel == "copy" and stage in (0, num_stages - 1):
            self.copy = CopyOutput(device, max_ids, check)
        self.output_sends = 0  # the channel's own count, compared with the plan's in tests

    def _global(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank

    def connect(self, host: str, port: int, store: TCPStore | None = None) -> None:
        cuda = self.device.type == "cuda"
        if store is None:
            store = TCPStore(host, port, is_master=False, timeout=_TIMEOUT)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=store,
            rank=self.rank,
            world_size=self.world,
            timeout=_TIMEOUT,
            device_id=self.device if cuda else None,
        )
        # Every rank creates every group, in the same order.
        g, last = self._global, self.num_stages - 1
        for i in range(self.num_stages - 1):
            for r in range(self.tp_size):
                group = dist.new_group([g(i, r), g(i + 1, r)])
                if r == self.tp_rank:
                    self.hidden_links.append(_Link(g(i, r), g(i + 1, r), group))
        if self.output_channel == "nccl" and self.num_stages > 1:
            for r in range(self.tp_size):
                group = dist.new_group([g(last, r), g(0, r)])
                if r == self.tp_rank:
                    self.output_link = _Link(g(last, r), g(0, r), group)
        if self.tp_size > 1:
            for i in range(self.num_stages):
                group = dist.new_group([g(i, r) for r in range(self.tp_size)])
                if i == self.stage:
                    self.tp_group = group
        self._warm()
        if self.copy is not None:
            if self.stage == 0:
                self.copy.serve(store)
            else:
                self.copy.join(store)

    def _warm(self) -> None:
        """One element over each link in link order, and one all-reduce in the stage's group:
        a first NCCL send otherwise blocks until its peer joins, in the middle of real work."""
        for link in [*self.hidden_links, *([self.output_link] if self.output_link else [])]:
            t = torch.ones(1, device=self.device)
            if self.rank == link.src:
                dist.send(t, dst=link.dst, group=link.group)
            elif self.rank == link.dst:
                dist.recv(t, src=link.src, group=link.group)
        if self.tp_group is not None:
            dist.all_reduce(torch.ones(1, device=self.device), group=self.tp_group)

    # -- hidden states, i -> i+1 ---------------------------------------------------------------
    def send_hidden(self, t: torch.Tensor, mb_id: int) -> list[SendWork]:
        return self._isend(self.hidden_links[self.stage], t, mb_id)

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype, mb_id: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return self._irecv(self.hidden_links[self.stage - 1], buf, mb_id).wait()

    # -- sampled ids, last -> 0 ------------------------------------------------------------------
    def send_output(self, t: torch.Tensor, mb_id: int) -> list[SendWork]:
        self.output_sends += 1
        if self.copy is not None:
            self.copy.send(t, mb_id)
            return []
        return self._isend(self._output(), t, mb_id)

    def post_output_recv(self, num_ids: int, mb_id: int) -> PendingRecv | PendingCopy:
        """A PendingRecv (nccl) or PendingCopy (copy) of one message of num_ids ids."""
        if self.copy is not None:
            return self.copy.expect(mb_id, num_ids)
        buf = torch.empty(num_ids, dtype=torch.long, device=self.device)
        return self._irecv(self._output(), buf, mb_id)

    def close(self) -> None:
        """The pipeline's teardown: release the copy ring (the process groups go with the
        process: destroying one whose peer died can block)."""
        if self.copy is not None:
            self.copy.close()

    # -- plumbing --------------------------------------------------------------------------------
    def _output(self) -> _Link:
        if self.output_link is None:
            raise ChannelError(
                f"no output link: the output channel is {self.output_channel!r} (or the "
                "channels are not connected)"
            )
        return self.output_link

    def _isend(self, link: _Link, t: torch.Tensor, mb_id: int) -> list[SendWork]:
        works: list[SendWork] = []
        if self.check:
            hdr = _header(mb_id, link.seq, t)
            works.append((_posted(dist.isend(hdr, dst=link.dst, group=link.group)), hdr))
        works.append((_posted(dist.isend(t.contiguous(), dst=link.dst, group=link.group)), t))
        link.seq += 1
        return works

    def _irecv(self, link: _Link, buf: torch.Tensor, mb_id: int) -> PendingRecv:
        works: list[Work] = []
        header: torch.Tensor | None = None
        if self.check:
            header = torch.empty(3, dtype=torch.int64, device=self.device)
            works.append(_posted(dist.irecv(header, src=link.src, group=link.group)))
        works.append(_posted(dist.irecv(buf, src=link.src, group=link.group)))
        pending = PendingRecv(mb_id, buf, works, header, link, link.seq)
        link.seq += 1
        return pending
