"""The output channel's message and stage 0's side of it: the slots decode rows read from.

The last stage's sampled ids come back as one message per plan (nccl: an irecv; copy: a ring
slot); stage 0 scatters each into `next_tokens` before the first decode row that reads it
(docs/ARCHITECTURE.md#run-ahead-decoding).
"""

from __future__ import annotations

from collections import deque

import torch

from stages.channels import ChannelError, PendingRecv, PipelineChannels
from stages.copy_channel import PendingCopy
from stages.protocol import MicrobatchPlan


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small index tensor on `device`. Pinned and non-blocking on CUDA: a pageable copy would
    make stage 0's host wait for its stream, i.e. for a pending recv."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def output_message(
    plan: MicrobatchPlan, token_ids: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """The last stage's sampled ids as sent, straight from the device: one entry per row, -1
    where the row sampled nothing (the fixed-size `off` message)."""
    sampling = [i for i, r in enumerate(plan.rows) if r.sample]
    if token_ids is not None and len(sampling) == len(plan.rows):
        return token_ids
    out = torch.full((len(plan.rows),), -1, dtype=torch.long, device=device)
    if token_ids is not None:
        out[to_device(sampling, device)] = token_ids
    return out


class OutputSlots:
    """Stage 0's input ids and the output messages it expects, in plan order."""

    def __init__(self, device: torch.device, max_running: int, output_post: str) -> None:
        self.device = device
        self.output_post = output_post  # "early" or "late": when the recvs are posted
        self.next_tokens = torch.zeros(max_running, dtype=torch.long, device=device)
        self.slot_writer = [-1] * max_running  # mb whose output last wrote each slot
        # None until posted (nccl: an irecv; copy: a PendingCopy). The host channel has none:
        # decode rows carry their token.
        self.pending_outputs: deque[tuple[MicrobatchPlan, PendingRecv | PendingCopy | None]] = (
            deque()
        )
        self._channels: PipelineChannels | None = None

    def attach(self, channels: PipelineChannels) -> None:
        self._channels = channels

    @property
    def channels(self) -> PipelineChannels:
        if self._channels is None:
            raise RuntimeError("stage 0's output recvs need the channels: connect() first")
        return self._channels

    def input_ids(self, plan: MicrobatchPlan) -> torch.Tensor:
        host_ids: list[int] = []
        decode_pos: list[int] = []
        decode_slots: list[int] = []
        for r in plan.rows:
            if r.token_ids is not None:
                host_ids.extend(r.token_ids)
                continue
            self.ensure_output(r.input_from_mb)
            if self.slot_writer[r.slot] != r.input_from_mb:
                raise ChannelError(
                    f"decode row of {r.req_id} reads slot {r.slot} expecting mb "
                    f"{r.input_from_mb}, but its last write came from mb "
                    f"{self.slot_writer[r.slot]} (a skipped output must never be read)"
                )
            decode_pos.append(len(host_ids))
            decode_slots.append(r.slot)
            host_ids.append(0)
        ids = to_device(host_ids, self.device)
        if decode_pos:
            pos = to_device(decode_pos, self.device)
            slots = to_device(decode_slots, self.device)
            ids[pos] = self.next_tokens[slots]
        return ids

    def post_outputs(self, plan: MicrobatchPlan) -> None:
        """Queue this plan's output recv: posted now ("early") or just before it is needed or
        after the next plan's compute ("late")."""
        late = self.output_post == "late"
        if late:  # post the earlier plans' recvs behind this plan's compute
            self.post_queued()
        if plan.send_output:
            self.pending_outputs.append((plan, None))
            if not late:
                self.post_queued()

    def recv_posted(self) -> bool:
        return any(pending is not None for _plan, pending in self.pending_outputs)

    def post_queued(self) -> None:
        for i, (plan, pending) in enumerate(self.pending_outputs):
            if pending is None:
                posted = self.channels.post_output_recv(len(plan.rows), plan.mb_id)
                self.pending_outputs[i] = (plan, posted)

    def ensure_output(self, mb_id: int | None) -> None:
        """Complete output recvs in order up to the one carrying mb_id."""
        if mb_id is None:
            return
        while self.pending_outputs and self.pending_outputs[0][0].mb_id <= mb_id:
            self.post_queued()
            self._consume_head()

    def consume_landed(self) -> None:
        """Copy channel: consume the messages that are already on the device, in order, so
        that ring slots of outputs nobody reads (orphans, `off` sends) come free; the
        stream waits then cost nothing."""
        self.post_queued()
        while self.pending_outputs:
            pending = self.pending_outputs[0][1]
            if pending is None or not pending.landed():
                break
            self._consume_head()

    def _consume_head(self) -> None:
        """Scatter the oldest posted output message into next_tokens (the stream waits for
        it just before), then give its buffer back."""
        plan, pending = self.pending_outputs.popleft()
        if pending is None:
            raise RuntimeError(f"output recv of mb {plan.mb_id} consumed before it was posted")
        buf = pending.wait()
        rows = [i for i, r in enumerate(plan.rows) if r.sample]
        if rows:
            idx = to_device(rows, self.device)
            slots = to_device([plan.rows[i].slot for i in rows], self.device)
            self.next_tokens[slots] = buf[idx]
            for i in rows:
                self.slot_writer[plan.rows[i].slot] = plan.mb_id
        pending.release()

    def scatter_local(self, plan: MicrobatchPlan, token_ids: torch.Tensor) -> None:
        """PP=1: the sampled ids go straight into next_tokens, no message."""
        if not plan.send_output:
            return
        slots = [r.slot for r in plan.rows if r.sample]
        self.next_tokens[to_device(slots, self.device)] = token_ids
        for s in slots:
            self.slot_writer[s] = plan.mb_id
