"""One stage's work for one microbatch: plan -> tensors -> forward -> (sample) -> channels.

The Ray actor (stages/actor.py) is a thin shell over this class, so it runs without Ray too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from stages.channels import PipelineChannels, SendWork, TCPStore
from stages.decode_graphs import DecodeGraphs
from stages.forward_batch import ForwardBatch
from stages.kernels.fallbacks import FALLBACKS
from stages.kernels.registry import (
    Kernels,
    fp8_backend_for,
    kernel_target,
    moe_backend_for,
    select_kernels,
)
from stages.kv_cache import (
    KVCache,
    bytes_per_block,
    bytes_per_token_layer,
    check_block_size,
    make_kv_cache,
)
from stages.loader import build_stage_model, keep_fp8_weights, log_stage_memory, resolve_dtype
from stages.model_config import load_model_args, mxfp4_experts_as
from stages.models.families import GraphSetting
from stages.output_slots import OutputSlots, output_message
from stages.protocol import (
    MicrobatchPlan,
    SampledToken,
    SamplingSpec,
    StageSpec,
    StepResult,
)
from stages.sampler import Picked, PromptScores, RowToSample, Sampler, score_tokens
from stages.stage_context import StageModel
from stages.sync_guard import install_sync_guard
from stages.tensor_parallel import TensorParallel
from stages.timing import Measurement, StageTimer

log = logging.getLogger("ppserve.stage")


@dataclass
class LaunchedStep:
    """A microbatch whose device work is queued. Stages before the last have their result at
    once; the last stage's needs the sampled ids, read by StageRunner.finish (the output
    channel's send is queued before that read, straight from the device)."""

    plan: MicrobatchPlan
    graphed: bool
    picked: Picked | None = None  # last stage: the ids chosen on the device
    timing: Measurement | None = None  # this forward's, on the last stage
    result: StepResult | None = None


# GPU memory kept out of the KV budget for the decode graphs' pool and buffers (measured use is
# logged at capture).
DECODE_GRAPH_RESERVE = 512 << 20


class StageRunner:
    def __init__(self, spec: StageSpec):
        self.spec = spec
        self.device = torch.device(spec.device)
        if self.device.type == "cuda" and self.device.index is None:
            # Ray made one GPU visible; NCCL's eager init wants an explicit index.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = resolve_dtype(spec.dtype)
        self.args = mxfp4_experts_as(load_model_args(spec.model_path), spec.mxfp4_experts)
        # This rank's share of a tensor-parallel stage; its group is joined in connect()
        self.tp = TensorParallel(spec.tp_rank, spec.tp_size)
        self.rank_args = self.args.family.rank_args(self.args, spec.tp_size)
        self.fp8_weights = keep_fp8_weights(self.args, spec.quantization, self.device)
        self.kernels = self.kernels_for(spec.linear_backend, spec.attention_backend, "auto")
        self.model: StageModel = build_stage_model(
            self.args,
            None if spec.load_format == "dummy" else spec.model_path,
            spec.layer_start,
            spec.layer_end,
            spec.is_first,
            spec.is_last,
            self.kernels,
            self.dtype,
            self.device,
            spec.seed,
            self.tp,
        )
        self._kv: KVCache | None = None  # the family's cache class (PagedKVCache for K/V pages)
        self.decode_graphs: DecodeGraphs | None = None  # CUDA: decode-only microbatches
        self.decode_graph_info: dict[str, Any] = {}  # buckets, capture seconds and bytes
        self.family = self.args.family
        check_block_size(self.args, spec.block_size)
        # Hash-routed layers read their rows' token ids, which only stage 0 has (decode rows'
        # are on its device, from the output channel): they follow the hidden state over the
        # hidden links, from stage 0 to the last stage holding such a layer.
        id_layers = self.family.token_id_layers(self.args)
        self.receives_token_ids = not spec.is_first and any(
            i >= spec.layer_start for i in id_layers
        )
        self.sends_token_ids = not spec.is_last and any(i >= spec.layer_end for i in id_layers)
        per_token = bytes_per_token_layer(self.rank_args, self.dtype, spec.kv_cache_dtype)
        log.info(
            "KV cache: %d bytes per token per layer (%s, %s); %d bytes per block of %d "
            "tokens over layers [%d, %d)",
            per_token,
            self.family.kv_description,
            spec.kv_cache_dtype,
            bytes_per_block(
                self.rank_args, self.layer_range, spec.block_size, self.dtype, spec.kv_cache_dtype
            ),
            spec.block_size,
            spec.layer_start,
            spec.layer_end,
        )
        log_stage_memory(self.model, len(self.layer_range), per_token)
        self._channels: PipelineChannels | None = None
        self.timer = StageTimer(self.device)
        # Per-request state the plans only send once.
        self.block_tables: dict[str, list[int]] = {}
        self.req_slots: dict[str, int] = {}
        self.sampling: dict[str, SamplingSpec] = {}
        self.prompt_ids: dict[str, tuple[int, ...]] = {}
        self.output_ids: dict[str, list[int]] = {}
        # Stage 0: where decode rows read their input token.
        self.output_slots = OutputSlots(self.device, spec.max_running, spec.output_post)
        self.output_channel = spec.output_channel
        self.pending_sends: list[SendWork] = []  # not yet waited
        self._sampler = Sampler(self.device, spec.seed) if spec.is_last else None
        if spec.channel_check and self.device.type == "cuda":
            install_sync_guard(self.output_slots.recv_posted)

    # -- setup -----------------------------------------------------------------------------------
    def kernels_for(self, linear: str, attention: str, mla_decode: str) -> Kernels:
        """The stage's ops; the FP8 ones (W8A8, experts) follow the linear backend. A backend
        that cannot serve the model is declined under auto (counted), an error when named."""
        dtype = str(self.dtype).removeprefix("torch.")
        return select_kernels(
            self.spec.device,
            linear,
            attention,
            mla_decode,
            moe_backend_for(linear),
            fp8_linear=fp8_backend_for(linear) if self.fp8_weights else None,
            mla_prefill_fp8=self.spec.fp8_prefill_attention,
            target=kernel_target(self.rank_args, dtype, self.spec.block_size),
        )

    @property
    def sends_outputs(self) -> bool:
        """Whether sampled ids travel to stage 0 by a message (not with the host channel)."""
        return self.output_channel != "host"

    @property
    def channels(self) -> PipelineChannels:
        if self._channels is None:
            raise RuntimeError("the stage's channels are not connected: connect() first")
        return self._channels

    @property
    def kv(self) -> KVCache:
        if self._kv is None:
            raise RuntimeError("the stage's KV cache is not allocated: allocate_kv() first")
        return self._kv

    @property
    def sampler(self) -> Sampler:
        if self._sampler is None:
            raise RuntimeError("only the last stage samples")
        return self._sampler

    @property
    def layer_range(self) -> range:
        return range(self.spec.layer_start, self.spec.layer_end)

    @property
    def uses_decode_graphs(self) -> bool:
        """Decode-only microbatches take the paged path (graphed unless enforce_eager) on CUDA
        for the families whose decode step captures under the chosen kernels, block size and
        cache dtype (others decode through their own path)."""
        return (
            self.device.type == "cuda"
            and self.spec.max_model_len > 0
            and self.family.paged_decode_graphs(self.graph_setting)
        )

    @property
    def graph_setting(self) -> GraphSetting:
        return GraphSetting(
            kernels=self.kernels.names,
            block_size=self.spec.block_size,
            kv_cache_dtype=self.spec.kv_cache_dtype,
            dtype=str(self.dtype).removeprefix("torch."),
        )

    def kv_capacity(self) -> int:
        per_block = bytes_per_block(
            self.rank_args,
            self.layer_range,
            self.spec.block_size,
            self.dtype,
            self.spec.kv_cache_dtype,
        )
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * self.spec.gpu_memory_utilization) - used
            if self.uses_decode_graphs:  # the scratch block, graph pools, activations
                budget -= DECODE_GRAPH_RESERVE + per_block
                budget -= self.model.decode_graph_workspace(
                    self.spec.max_running, self.spec.max_model_len
                )
        else:
            budget = self.spec.kv_cache_bytes
        return max(0, budget // max(per_block, 1))

    def allocate_kv(self, num_blocks: int) -> None:
        graphs = self.uses_decode_graphs
        # With decode graphs one block more: the scratch block padding rows write to.
        self._kv = make_kv_cache(
            self.rank_args,
            self.layer_range,
            num_blocks + graphs,
            self.spec.block_size,
            self.dtype,
            self.device,
            self.spec.kv_cache_dtype,
        )
        self.decode_graphs = None
        if graphs:
            self._build_decode_graphs()
        elif self.device.type == "cuda" and self.spec.max_model_len > 0:
            # decode steps run eager: the attention backend says so when it is the reason
            self.model.attention.announce_eager(self.graph_setting)

    def _build_decode_graphs(self) -> None:
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.kv,
            num_slots=self.spec.max_running,
            max_model_len=self.spec.max_model_len,
            scratch_slot=(self.kv.num_blocks - 1) * self.spec.block_size,
            hidden_shape=self.family.hidden_shape(self.args),
            dtype=self.dtype,
            device=self.device,
            is_first=self.spec.is_first,
            max_rows=self.spec.max_running,
            eager=self.spec.enforce_eager,
            token_ids=self.receives_token_ids,
        )
        for req_id, table in self.block_tables.items():  # a recapture keeps live requests
            self.decode_graphs.update_tables([(self.req_slots[req_id], 0, tuple(table))])
        self.decode_graph_info = self.decode_graphs.capture()

    def warm_up(self, chunks: list[tuple[int, int]]) -> dict[str, float]:
        """What a long lone prompt's chunks would otherwise build in its TTFT
        (stages/attention_warmup.py): attention, the top-k, the routed experts."""
        from stages.attention_warmup import warm_up_stage

        out = warm_up_stage(
            self.family, self.rank_args, self.kernels, self._kv is not None, chunks, self.dtype,
            self.device, self.layer_range,
        )  # fmt: skip
        lengths = sorted({n for _prefix, n in chunks})
        out.update(self.model.warm_up_experts(lengths, self.dtype, self.device))
        return out

    def connect(self, host: str, port: int, store: TCPStore | None = None) -> None:
        channels = PipelineChannels(
            self.spec.stage_index,
            self.spec.num_stages,
            self.device,
            self.spec.channel_check,
            self.spec.output_channel,
            self.spec.max_running,
            self.spec.tp_rank,
            self.spec.tp_size,
        )
        self._channels = channels
        self.output_slots.attach(channels)
        channels.connect(host, port, store)
        self.tp.attach(channels.tp_group)

    def close(self) -> None:
        """The pipeline's teardown (abort of a start, rebuild, shutdown)."""
        if self._channels is not None:
            self._channels.close()

    # -- one microbatch --------------------------------------------------------------------------
    def step(self, plan: MicrobatchPlan) -> StepResult:
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: MicrobatchPlan) -> LaunchedStep:
        """Queue the microbatch's work on the device; `finish` reads its results."""
        self._apply_deltas(plan)
        self._wait_sends()
        if self.spec.is_first and self.output_channel == "copy":
            self.output_slots.consume_landed()
        graphs = self.decode_graphs
        bucket = graphs.bucket_for(plan.rows) if graphs is not None else None
        batch = None
        if bucket is None:
            rows = [
                (r.start, r.num_tokens, self.block_tables[r.req_id], r.sample) for r in plan.rows
            ]
            prefixes = self.family.attention_prefixes  # what the family's attention reads
            decode = [not r.is_prefill for r in plan.rows]
            batch = ForwardBatch.build(rows, self.spec.block_size, self.device, prefixes, decode)
        token_ids: torch.Tensor | None
        if self.spec.is_first:
            inputs = token_ids = self.output_slots.input_ids(plan)
        else:
            inputs = self.channels.recv_hidden(
                (plan.num_tokens, *self.family.hidden_shape(self.args)), self.dtype, plan.mb_id
            )
            token_ids = (
                self.channels.recv_hidden((plan.num_tokens,), torch.long, plan.mb_id)
                if self.receives_token_ids
                else None
            )
        self.timer.start(plan.mb_id)
        graphed = False
        if graphs is not None and bucket is not None:  # every row samples: all hidden rows do
            graphed = not graphs.eager
            hidden = graphs.run(bucket, plan.rows, inputs, self.block_tables, token_ids)
        elif batch is None:  # built above whenever no graph serves the plan
            raise RuntimeError(f"microbatch {plan.mb_id}: no ForwardBatch and no decode graph")
        else:
            hidden = (
                self.model(inputs, batch, self.kv, token_ids)
                if self.receives_token_ids and token_ids is not None
                else self.model(inputs, batch, self.kv)
            )
        if not self.spec.is_last:
            self.timer.stop()
            self.pending_sends += self.channels.send_hidden(hidden, plan.mb_id)
            if self.sends_token_ids:
                if token_ids is None:  # a stage that sends them has received them
                    raise RuntimeError(f"stage {self.spec.stage_index} has no token ids to send")
                self.pending_sends += self.channels.send_hidden(token_ids, plan.mb_id)
            if self.spec.is_first and self.sends_outputs:
                self.output_slots.post_outputs(plan)
            return LaunchedStep(
                plan,
                graphed,
                result=StepResult(
                    plan.mb_id,
                    self.spec.stage_index,
                    forward_s=self.timer.last_elapsed(),
                    timings=self.timer.take_finished(),
                    graphed=graphed,
                    fallbacks=FALLBACKS.take_new(),
                ),
            )
        picked = self._pick(plan, hidden, batch)
        timing = self.timer.stop()
        if picked is not None:
            if self.spec.is_first and self.sends_outputs:  # PP=1: a local scatter
                self.output_slots.scatter_local(plan, picked.token_ids)
            picked.copy_to_host()
        return LaunchedStep(plan, graphed, picked, timing)

    def finish(self, launched: LaunchedStep) -> StepResult:
        """The StepResult of the microbatch launched last: waits for its device work."""
        if launched.result is not None:
            return launched.result
        plan = launched.plan
        sampled = Sampler.collect(launched.picked) if launched.picked is not None else []
        rows = [r for r in plan.rows if r.sample]
        for r, p in zip(rows, sampled):
            # A request can be finished (its state dropped) by a plan launched after this one.
            history = self.output_ids.get(r.req_id)
            if history is not None:
                history.append(p.token_id)
        prompt = () if launched.picked is None else launched.picked.prompt_logprobs()
        launched.result = StepResult(
            plan.mb_id,
            self.spec.stage_index,
            prompt_logprobs=prompt,
            sampled=tuple(
                SampledToken(r.req_id, p.token_id, p.logprob, p.top_logprobs)
                for r, p in zip(rows, sampled)
            ),
            forward_s=self.timer.elapsed(launched.timing),
            output_sends=self._channels.output_sends if self._channels else 0,
            timings=self.timer.take_finished(),
            graphed=launched.graphed,
            fallbacks=FALLBACKS.take_new(),
        )
        return launched.result

    def reads_sampled_history(self, plan: MicrobatchPlan) -> bool:
        """Whether sampling this plan reads earlier sampled tokens on the host (penalties):
        those of a launched step are only known once it is finished."""
        new = {n.req_id: n.sampling for n in plan.new_requests}
        specs = (self.sampling.get(r.req_id) or new.get(r.req_id) for r in plan.rows if r.sample)
        return any(spec is not None and spec.needs_history for spec in specs)

    def _apply_deltas(self, plan: MicrobatchPlan) -> None:
        for req_id in plan.finished:  # unknown ids are fine: a rebuilt pipeline never saw them
            for table in (
                self.block_tables,
                self.req_slots,
                self.sampling,
                self.prompt_ids,
                self.output_ids,
            ):
                table.pop(req_id, None)
        for new in plan.new_requests:
            self.block_tables[new.req_id] = []
            self.req_slots[new.req_id] = new.slot
            self.sampling[new.req_id] = new.sampling
            self.prompt_ids[new.req_id] = new.prompt_token_ids
            self.output_ids[new.req_id] = list(new.output_token_ids)
        table_updates = []
        for req_id, blocks in plan.block_updates:
            blocks_so_far = self.block_tables[req_id]
            table_updates.append((self.req_slots[req_id], len(blocks_so_far), blocks))
            blocks_so_far.extend(blocks)
        if self.decode_graphs is not None:
            self.decode_graphs.update_tables(table_updates)

    def _wait_sends(self) -> None:
        # Waited one step later, never right after the send: waiting at once would make the
        # last stage's output send block until stage 0 posts its recv.
        for work, _tensor in self.pending_sends:
            work.wait()
        self.pending_sends = []

    # -- last stage: sample and send ---------------------------------------------------------------
    def _pick(
        self, plan: MicrobatchPlan, hidden: torch.Tensor, batch: ForwardBatch | None
    ) -> Picked | None:
        sample_rows = [r for r in plan.rows if r.sample]
        sends = plan.send_output and self.spec.num_stages > 1 and self.sends_outputs
        prompt = self._prompt_logprobs(plan, hidden, batch)
        if not sample_rows:
            if sends:
                self._send_output(plan, None)
            if not prompt:
                return None
            return Picked(
                torch.empty(0, dtype=torch.long, device=self.device), [], None, prompt=prompt
            )
        rows = hidden if batch is None else hidden[batch.sample_indices]
        logits = self.model.compute_logits(rows)
        masks = dict(plan.token_masks)
        to_sample = [
            RowToSample(
                self.sampling[r.req_id],
                r.output_index,
                self.prompt_ids[r.req_id],
                self.output_ids[r.req_id],
                masks.get(r.req_id),
            )
            for r in sample_rows
        ]
        picked = self.sampler.pick(logits, to_sample)
        picked.prompt = prompt
        if sends:
            self._send_output(plan, picked.token_ids)
        return picked

    def _prompt_logprobs(
        self, plan: MicrobatchPlan, hidden: torch.Tensor, batch: ForwardBatch | None
    ) -> list[PromptScores]:
        """The LM head on the prompt positions of the rows whose requests ask for prompt
        logprobs: position p scores prompt token p + 1 (the first generated token is the
        sampler's)."""
        out: list[PromptScores] = []
        if batch is None:  # a decode-only microbatch: no prompt rows
            return out
        for i, r in enumerate(plan.rows):
            spec = self.sampling.get(r.req_id)
            prompt = self.prompt_ids.get(r.req_id, ())
            if spec is None or spec.prompt_logprobs is None or not r.is_prefill:
                continue
            m = min(r.num_tokens, len(prompt) - 1 - r.start)  # positions with a next token
            if m <= 0:
                continue
            offset = batch.row_offsets[i]
            logits = self.model.compute_logits(hidden[offset : offset + m])
            targets = torch.tensor(prompt[r.start + 1 : r.start + 1 + m], device=self.device)
            out.append(
                (r.req_id, r.start + 1, *score_tokens(logits, targets, spec.prompt_logprobs))
            )
        return out

    def _send_output(self, plan: MicrobatchPlan, token_ids: torch.Tensor | None) -> None:
        message = output_message(plan, token_ids, self.device)
        self.pending_sends += self.channels.send_output(message, plan.mb_id)
