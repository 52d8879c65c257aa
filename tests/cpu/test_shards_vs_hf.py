"""Stage shards chained == the whole Hugging Face model, on checkpoints transformers wrote."""

from __future__ import annotations

import pytest
import torch

from stages.forward_batch import ForwardBatch
from stages.kernels.registry import select_kernels
from stages.kv_cache import bytes_per_block, make_kv_cache
from stages.loader import build_stage_model, load_stage_weights
from stages.model_config import BUILTIN_CONFIG, ModelArgs, load_model_args
from stages.models.llama import LlamaStage
from stages.partition import layer_ranges
from tests.cpu.conftest import (
    ARCHS,
    cpu_context,
    hf_model,
    hf_prompt_logits,
    write_tiny_checkpoint,
)

PROMPT = [1, 17, 99, 3, 150, 42, 42, 7, 199, 0, 63, 88, 120, 5, 9, 31, 77, 140, 2, 18, 66, 101, 12]
TOL = 1e-4
TABLE = [7, 2, 9, 0, 5, 11, 3, 8]  # a non-contiguous block table for PROMPT


class Pipeline:
    """Stages of one checkpoint chained in process, each with its own paged KV cache."""

    def __init__(self, path: str | None, num_stages: int, block_size: int = 4,
                 num_blocks: int = 16, seed: int = 0):
        self.args = load_model_args(path)
        kernels = select_kernels("cpu")
        self.block_size = block_size
        self.stages, self.caches = [], []
        for s, (a, b) in enumerate(layer_ranges(self.args.num_hidden_layers, num_stages)):
            first, last = s == 0, s == num_stages - 1
            m = build_stage_model(self.args, path, a, b, first, last, kernels, torch.float32,
                                  "cpu", seed)
            self.stages.append(m)
            self.caches.append(make_kv_cache(self.args, b - a, num_blocks, block_size,
                                            torch.float32, "cpu"))

    @torch.no_grad()
    def hidden(self, token_ids: list[int], rows) -> torch.Tensor:
        batch = ForwardBatch.build(rows, self.block_size, "cpu")
        x = torch.tensor(token_ids, dtype=torch.long)
        for stage, cache in zip(self.stages, self.caches):
            x = stage(x, batch, cache)
        return x, batch

    def logits(self, token_ids, rows, all_positions=False) -> torch.Tensor:
        h, batch = self.hidden(token_ids, rows)
        return self.stages[-1].compute_logits(h if all_positions else h[batch.sample_indices])


def check_chained_stages(path: str, num_stages: int, reference: torch.Tensor) -> None:
    """PROMPT as one chunk through `num_stages` chained stages: every position's logits are
    transformers' `reference`."""
    pipe = Pipeline(path, num_stages)
    n = len(PROMPT)
    logits = pipe.logits(PROMPT, [(0, n, list(range(8)), True)], all_positions=True)
    assert logits.dtype == torch.float32 and logits.shape == (n, 200)
    assert (logits - reference).abs().max().item() <= TOL


def prefill_in_chunks(pipe: Pipeline, size: int = 5) -> torch.Tensor:
    """PROMPT in chunks of `size` over TABLE; the last chunk's logits (its last token's)."""
    for start in range(0, len(PROMPT), size):
        chunk = PROMPT[start:start + size]
        logits = pipe.logits(chunk, [(start, len(chunk), TABLE, True)])
    return logits


@pytest.fixture(scope="module")
def hf_logits():
    """arch -> HF logits [len(PROMPT), V] (same seed as the checkpoints)."""
    return hf_prompt_logits(ARCHS, PROMPT)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_chained_stages_match_hf(tiny_checkpoints, hf_logits, arch, num_stages):
    check_chained_stages(tiny_checkpoints[arch], num_stages, hf_logits[arch])


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_chunked_prefill_then_decode(tiny_checkpoints, hf_logits, arch):
    pipe = Pipeline(tiny_checkpoints[arch], num_stages=2, block_size=4, num_blocks=12)
    logits = prefill_in_chunks(pipe)
    assert (logits[0] - hf_logits[arch][-1]).abs().max().item() <= TOL

    nxt = int(logits[0].argmax())
    decode = pipe.logits([nxt], [(len(PROMPT), 1, TABLE, True)])
    with torch.no_grad():
        ref = hf_model(arch)(torch.tensor([PROMPT + [nxt]])).logits[0, -1]
    assert (decode[0] - ref).abs().max().item() <= TOL


def test_two_requests_in_one_batch(tiny_checkpoints, hf_logits):
    # Request A prefills its whole prompt; request B (already holding 10 tokens) runs a chunk.
    pipe = Pipeline(tiny_checkpoints["qwen2"], num_stages=2, block_size=4, num_blocks=16)
    table_a, table_b = [0, 1, 2, 3, 4, 5], [15, 14, 13, 12, 11, 10]
    pipe.logits(PROMPT[:10], [(0, 10, table_b, False)])
    logits = pipe.logits(PROMPT + PROMPT[10:],
                         [(0, len(PROMPT), table_a, True), (10, len(PROMPT) - 10, table_b, True)])
    assert logits.shape == (2, 200)
    for row in logits:
        assert (row - hf_logits["qwen2"][-1]).abs().max().item() <= TOL


def test_sharded_checkpoint_reads_only_own_tensors(tmp_path, hf_logits, tensor_reads):
    path = write_tiny_checkpoint(tmp_path, "qwen2", max_shard_size="100KB")
    assert len(list(tmp_path.glob("qwen2-sharded/*.safetensors"))) >= 3

    read = tensor_reads
    args = load_model_args(path)
    model = LlamaStage(cpu_context(args, range(1, 3), False, False))
    names = load_stage_weights(model, path)
    assert sorted(read) == names
    assert all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in read)
    assert len(read) == 2 * 12  # q/k/v weight+bias, o, gate/up/down, two norms

    read.clear()
    pipe = Pipeline(path, num_stages=3)
    assert "lm_head.weight" in read and "model.embed_tokens.weight" in read
    assert len(read) == len(set(read))  # every tensor read once, by its one stage
    logits = pipe.logits(PROMPT, [(0, len(PROMPT), list(range(8)), True)], all_positions=True)
    assert (logits - hf_logits["qwen2"]).abs().max().item() <= TOL


def test_missing_tensor_is_a_clear_error(tiny_checkpoints):
    # A tied checkpoint has no lm_head.weight; an untied model's last stage needs it.
    args = load_model_args(tiny_checkpoints["llama"])
    model = LlamaStage(cpu_context(args, range(2, 4), False, True))
    with pytest.raises(KeyError, match="lm_head.weight"):
        load_stage_weights(model, tiny_checkpoints["llama_tied"])


def test_random_model_is_the_same_for_every_split():
    prompt = [256, 72, 101, 108, 108, 111]
    rows = [(0, len(prompt), [0, 1], True)]
    ref = Pipeline(None, 1, block_size=4, num_blocks=4, seed=3).logits(prompt, rows)
    assert ref.shape == (1, 320)
    for s in (2, 4):
        out = Pipeline(None, s, block_size=4, num_blocks=4, seed=3).logits(prompt, rows)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    other = Pipeline(None, 2, block_size=4, num_blocks=4, seed=4).logits(prompt, rows)
    assert not torch.allclose(other, ref)


def test_model_args_from_both_config_layouts(tiny_checkpoints):
    qwen2 = load_model_args(tiny_checkpoints["qwen2"])
    qwen3 = load_model_args(tiny_checkpoints["qwen3"])
    assert (qwen2.attention_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen3.attention_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 16)
    v5 = load_model_args(tiny_checkpoints["llama3"])  # transformers 5 writes rope_parameters
    v4 = ModelArgs.from_hf_dict({  # what Llama 3.1's config.json on the Hub looks like
        "model_type": "llama", "vocab_size": 200, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        "bos_token_id": 1, "eos_token_id": [2, 5]})
    assert v4.rope_scaling == v5.rope_scaling and v4.rope_theta == v5.rope_theta == 500000.0
    assert v4.eos_token_ids == (2, 5) and v5.eos_token_ids == (2,)
    builtin = load_model_args(None)
    assert (builtin.vocab_size, builtin.num_hidden_layers) == (320, 4)
    assert builtin.eos_token_ids == (257,) and builtin.bos_token_id == 256
    assert bytes_per_block(builtin, 2, 64, torch.bfloat16) == 2 * 2 * 64 * 2 * 32 * 2
    with pytest.raises(ValueError, match="model_type"):
        ModelArgs.from_hf_dict({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope"):
        ModelArgs.from_hf_dict({**BUILTIN_CONFIG, "rope_scaling": {"type": "yarn", "factor": 4.0}})

