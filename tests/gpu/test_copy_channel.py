"""The copy output channel on CUDA.

One GPU: two Ray actors share the device (fractional num_gpus), the last stage's end writes
messages through the CUDA IPC ring while its stream is busy, stage 0's end consumes them as the
runner does (decode reads right away, orphans later, skipped plans send nothing), past the
ring's size several times over, then both ends are rebuilt. (An engine at PP=2 cannot share one
GPU: NCCL refuses two ranks on one device, and the hidden link is NCCL.)

Two GPUs: the engine at PP=2 with copy and with nccl gives transformers' greedy tokens, with
run-ahead, every skip mode, an abort and a rebuild.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

WIDTH = 16  # ids per message at most


def _schedule(n, seed):
    """Per plan: (sends, ids in the message, read at once or left to be drained)."""
    rng = random.Random(seed)
    return [(rng.random() < 0.8, rng.randrange(1, WIDTH + 1), rng.random() < 0.6) for _ in range(n)]


def _message(mb, n):
    return [mb * 1000 + i for i in range(n)]


class _End:
    """One end of the copy channel in its own process (a Ray actor)."""

    def __init__(self, consumer: bool):
        self.consumer = consumer
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.store = self.channel = None

    def listen(self, host, port):
        import torch.distributed as dist

        self.store = dist.TCPStore(host, port, is_master=self.consumer, wait_for_workers=False)
        return self.store.port

    def connect(self):
        """Both ends at once, as the pipeline's stages connect: stage 0's serve returns once
        the last stage has mapped the counters."""
        from stages.copy_channel import CopyOutput

        self.channel = CopyOutput(self.device, WIDTH, check=True)
        (self.channel.serve if self.consumer else self.channel.join)(self.store)
        return True

    def produce(self, schedule):
        for mb, (sends, n, _now) in enumerate(schedule):
            torch.cuda._sleep(200_000)  # the stage's compute: the copy queues behind it
            if sends:
                ids = torch.tensor(_message(mb, n), device=self.device)
                self.channel.send(ids, mb)
        torch.cuda.synchronize()
        return self.channel.ring.next_write

    def consume(self, schedule):
        got, pending = {}, []
        for mb, (sends, n, now) in enumerate(schedule):
            while pending and pending[0][0].landed():  # OutputSlots.consume_landed
                self._take(pending.pop(0), got)
            if sends:
                pending.append((self.channel.expect(mb, n), n))
            if now:  # a decode row reads this plan's ids: everything before it first
                while pending:
                    self._take(pending.pop(0), got)
        while pending:
            self._take(pending.pop(0), got)
        torch.cuda.synchronize()
        return {mb: t.tolist() for mb, t in got.items()}

    def _take(self, entry, got):
        pending, n = entry
        buf = pending.wait()
        got[pending.mb_id] = buf[:n].clone()  # the consumer, right behind the stream's wait
        pending.release()

    def counters_name_left(self):
        """Whether the counters' /dev/shm name still exists (stage 0 drops it on connect)."""
        import os

        return os.path.exists(self.channel._counters.path)

    def close(self):
        self.channel.close()
        return True


@pytest.fixture(scope="module")
def ray_one_gpu():
    import ray

    ray.init(address="local", num_gpus=1, num_cpus=4, include_dashboard=False, log_to_driver=True)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray
    ray.shutdown()


def test_two_processes_on_one_gpu_through_the_ring(ray_one_gpu):
    from stages.copy_channel import RING_SLOTS

    ray = ray_one_gpu
    end = ray.remote(num_gpus=0.5, num_cpus=1)(_End)
    host = ray.util.get_node_ip_address()
    for attempt, seed in enumerate((1, 2)):  # the second pair: a rebuilt channel
        stage0, last = end.remote(True), end.remote(False)
        port = ray.get(stage0.listen.remote(host, 0))
        ray.get(last.listen.remote(host, port))
        ray.get([stage0.connect.remote(), last.connect.remote()], timeout=120)
        assert not ray.get(stage0.counters_name_left.remote())  # nothing for a crash to leak
        schedule = _schedule(3 * RING_SLOTS + 7, seed)
        sent, got = ray.get(
            [last.produce.remote(schedule), stage0.consume.remote(schedule)], timeout=120
        )
        want = {mb: _message(mb, n) for mb, (s, n, _) in enumerate(schedule) if s}
        assert sent == len(want) > 2 * RING_SLOTS, attempt
        assert got == want, attempt
        ray.get([stage0.close.remote(), last.close.remote()])
        for actor in (stage0, last):
            ray.kill(actor)


# -- the engine on two GPUs -----------------------------------------------------------------------
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@two_gpus
def test_engine_copy_matches_nccl_and_transformers(tmp_path):
    import ray

    from app import EngineConfig, SamplingParams
    from tests.gpu.test_engine_cuda import MAX_NEW
    from tests.hf_reference import bf16_reference, write_bf16_llama
    from tests.ray import test_output_channel
    from tests.ray.test_output_channel import _AbortingEngine

    path = write_bf16_llama(str(tmp_path / "llama-bf16"), 2048)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 40, 17, 90, 33, 8)]
    refs = [toks for toks, _ in bf16_reference(path, prompts, MAX_NEW)]
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    ray.init(
        address="local",
        num_gpus=2,
        num_cpus=8,
        include_dashboard=False,
        runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0"}},
    )
    ray.cloudpickle.register_pickle_by_value(test_output_channel)  # its _AbortingHost
    try:
        for channel in ("copy", "nccl"):
            for skip in ("off", "sglang", "auto"):
                cfg = EngineConfig(
                    model=path,
                    pp_size=2,
                    device="cuda",
                    chunk_size=16,
                    max_num_seqs=8,
                    max_model_len=512,
                    pp_output_skip=skip,
                    run_ahead=True,
                    channel_check=True,
                    output_channel=channel,
                    gpu_memory_utilization=0.3,
                )
                with _AbortingEngine(cfg) as engine:
                    outs = [o.token_ids for o in engine.generate(prompts, greedy)]
                    if skip == "auto":  # an abort mid-decode: its sends are orphans
                        aborted = engine._actor.abort_one_mid_decode.remote(prompts, greedy)
                        others = ray.get(aborted)
                        assert others == outs[1:], channel
                    stats = engine.stats()
                # bf16 near-ties aside (test_engine_cuda), the first tokens agree
                assert [o[:4] for o in outs] == [r[:4] for r in refs], (channel, skip)
                assert stats["channel_output_sends"] == stats["pp_output_comm"]["sent"]
        _rebuild_with_copy(ray)
    finally:
        ray.shutdown()


def _rebuild_with_copy(ray):
    """A stage killed mid-prefill: the rebuilt pipeline opens a fresh ring, same tokens."""
    from app import Engine, EngineConfig
    from tests.ray.test_stage_failure import GREEDY, _prompt, kill_stage_mid_prefill

    cfg = EngineConfig(
        pp_size=2,
        device="cuda",
        chunk_size=16,
        block_size=16,
        max_num_seqs=1,
        num_kv_blocks=256,
        channel_check=True,
        run_ahead=True,
        output_channel="copy",
        gpu_memory_utilization=0.3,
    )
    short = [_prompt(20, seed) for seed in (1, 2)]
    with Engine(cfg) as engine:
        before = [o.token_ids for o in engine.generate(short, GREEDY)]
        assert kill_stage_mid_prefill(ray, engine, 1, timeout=120).finish_reason == "error"
        assert [o.token_ids for o in engine.generate(short, GREEDY)] == before
        assert engine.stats()["pipeline_failures"] == 1
