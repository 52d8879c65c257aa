"""DeepSeek-V4 stages against transformers' DeepseekV4ForCausalLM on checkpoints it wrote:
chained shards (PP 1/2/3), chunked prefill with chunk boundaries inside compression groups,
batched rows, decode, prefix reuse at a block boundary, the config's refusals and the cache's
bytes per block."""

from __future__ import annotations

import json

import pytest
import torch

from stages.forward_batch import ForwardBatch
from stages.kernels.registry import select_kernels
from stages.kv_cache import bytes_per_block, make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import ModelArgs, load_model_args
from stages.partition import layer_ranges
from tests.deepseek_v4_ref import SECOND_V4, TINY_V4, write_checkpoint

TOL = 1e-4
CONFIGS = {"tiny": TINY_V4, "second": SECOND_V4}
PROMPT = torch.randint(2, 96, (45,), generator=torch.Generator().manual_seed(5)).tolist()
BLOCK = 16  # a multiple of both checkpoints' largest rate (8, 16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4")
    return {name: write_checkpoint(str(root / name), cfg) for name, cfg in CONFIGS.items()}


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    from transformers import DeepseekV4ForCausalLM

    return {
        name: DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, path in checkpoints.items()
    }


@pytest.fixture(scope="module")
def hf_logits(hf_models):
    with torch.no_grad():
        return {name: m(torch.tensor([PROMPT])).logits[0] for name, m in hf_models.items()}


class Pipeline:
    """Stages of one checkpoint chained in process, each with its own paged cache."""

    def __init__(self, path: str, num_stages: int, num_blocks: int = 12):
        self.args = load_model_args(path)
        kernels = select_kernels("cpu")
        self.stages, self.caches = [], []
        for s, (a, b) in enumerate(layer_ranges(self.args.num_hidden_layers, num_stages)):
            self.stages.append(
                build_stage_model(
                    self.args,
                    path,
                    a,
                    b,
                    s == 0,
                    s == num_stages - 1,
                    kernels,
                    torch.float32,
                    "cpu",
                )
            )
            self.caches.append(
                make_kv_cache(self.args, range(a, b), num_blocks, BLOCK, torch.float32, "cpu")
            )

    @torch.no_grad()
    def logits(self, token_ids: list[int], rows, all_positions: bool = False) -> torch.Tensor:
        batch = ForwardBatch.build(rows, BLOCK)
        ids = torch.tensor(token_ids, dtype=torch.long)
        x = ids
        for stage, cache in zip(self.stages, self.caches):
            # later stages with hash layers get the ids as the runner forwards them
            x = stage(x, batch, cache, None if stage.is_first else ids)
        last = self.stages[-1]
        return last.compute_logits(x if all_positions else x[batch.sample_indices])


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_chained_stages_match_hf(checkpoints, hf_logits, name, num_stages):
    pipe = Pipeline(checkpoints[name], num_stages)
    n = len(PROMPT)
    got = pipe.logits(PROMPT, [(0, n, list(range(4)), True)], all_positions=True)
    assert (got - hf_logits[name]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_prefill_then_decode_matches_hf_generate(checkpoints, hf_models, hf_logits, name):
    """Odd chunks (boundaries inside CSA and HCA groups), scattered blocks, PP=2; then greedy
    decode against transformers' own cached generate."""
    pipe = Pipeline(checkpoints[name], num_stages=2)
    table = [9, 2, 7, 0, 11]
    start, outs = 0, []
    for n in (7, 1, 13, 3, 5, 16):
        outs.append(
            pipe.logits(PROMPT[start : start + n], [(start, n, table, False)], all_positions=True)
        )
        start += n
    assert (torch.cat(outs) - hf_logits[name]).abs().max().item() <= TOL
    tokens = [int(outs[-1][-1].argmax())]
    while len(tokens) < 8:
        logits = pipe.logits([tokens[-1]], [(len(PROMPT) + len(tokens) - 1, 1, table, True)])
        tokens.append(int(logits[0].argmax()))
    ids = torch.tensor([PROMPT])
    ref = hf_models[name].generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert tokens == ref[0, len(PROMPT) :].tolist()


def test_batched_rows_and_prefix_reuse(checkpoints, hf_logits):
    """Two requests in one forward, one mid-prompt; then a third that reuses the first's two
    full blocks (a prefix-cache hit resumes at a block, hence group, boundary)."""
    pipe = Pipeline(checkpoints["tiny"], num_stages=3)
    a, b = [0, 1, 2], [8, 6, 4]
    pipe.logits(PROMPT[:10], [(0, 10, b, False)])
    got = pipe.logits(
        PROMPT + PROMPT[10:], [(0, len(PROMPT), a, True), (10, len(PROMPT) - 10, b, True)]
    )
    for row in got:
        assert (row - hf_logits["tiny"][-1]).abs().max().item() <= TOL
    hit = 2 * BLOCK
    got = pipe.logits(
        PROMPT[hit:], [(hit, len(PROMPT) - hit, a[:2] + [10], True)], all_positions=False
    )
    assert (got[0] - hf_logits["tiny"][-1]).abs().max().item() <= TOL


def test_batched_rows_match_rows_run_alone(checkpoints):
    """One microbatch of rows at different positions (tiny: window 8, CSA rate 4, HCA rate 8):
    decode rows mid-group, completing a CSA group, completing groups of both rates, far past
    the window, and a chunk across a group boundary, against each row's own forward on the same
    cache (a forward rewrites the same values, so the order does not matter)."""
    pipe = Pipeline(checkpoints["tiny"], num_stages=1, num_blocks=16)
    # (prefilled tokens, new tokens) per request; its blocks are 3r, 3r+1, 3r+2
    cases = [(13, 1), (11, 1), (15, 1), (40, 1), (18, 5), (3, 1)]
    tables = [[3 * r, 3 * r + 1, 3 * r + 2] for r in range(len(cases))]
    for (done, _), table in zip(cases, tables):
        pipe.logits(PROMPT[:done], [(0, done, table, False)])
    ids = [t for done, n in cases for t in PROMPT[done : done + n]]
    rows = [(done, n, table, True) for (done, n), table in zip(cases, tables)]
    batched = pipe.logits(ids, rows)
    for i, ((done, n), table) in enumerate(zip(cases, tables)):
        alone = pipe.logits(PROMPT[done : done + n], [(done, n, table, True)])
        assert (batched[i] - alone[0]).abs().max().item() <= 1e-5, (i, done, n)


def test_config_reads_fields_and_refuses_unsupported(checkpoints):
    with open(f"{checkpoints['tiny']}/config.json") as f:
        d = json.load(f)
    a = ModelArgs.from_hf_dict(d).family_args
    assert a.layer_types == tuple(TINY_V4["layer_types"]) and a.hash_layers == (0, 1)
    assert (a.rope_dim, a.max_rate, a.compress_rope.yarn["factor"]) == (8, 8, 4.0)
    for key, value in (
        ("n_shared_experts", 2),
        ("scoring_func", "softmax"),
        ("num_key_value_heads", 2),
        ("norm_topk_prob", False),
        ("layer_types", ["sliding_attention"]),
        ("o_groups", 3),
    ):
        with pytest.raises(ValueError, match=key if key != "o_groups" else "o_groups"):
            ModelArgs.from_hf_dict({**d, key: value})
    with pytest.raises(ValueError, match="multiple of 8"):
        make_kv_cache(ModelArgs.from_hf_dict(d), range(0, 4), 4, 12, torch.float32, "cpu")


def test_bytes_per_block_counts_every_component(checkpoints):
    args = load_model_args(checkpoints["tiny"])
    a = args.family_args
    d, di, b = a.head_dim, a.index_head_dim, 16
    sliding = b * d
    csa = b * d + b * 4 * d + b // 4 * d + b * 4 * di + b // 4 * di
    hca = b * d + b * 2 * d + b // 8 * d
    assert bytes_per_block(args, range(0, 4), b, torch.bfloat16) == 2 * (sliding + csa + hca + csa)
    assert bytes_per_block(args, range(2, 3), b, torch.float32) == 4 * hca


def test_token_ids_reach_only_the_stages_up_to_the_last_hash_layer(checkpoints):
    """The second checkpoint hashes at layers 0 and 3: on PP=3 ([0, 2), [2, 4), [4, 5)) stage 0
    sends its ids to stage 1, which reads them and sends nothing on; stage 2 never sees them."""
    from app.config import EngineConfig
    from stages.runner import StageRunner

    ranges = layer_ranges(SECOND_V4["num_hidden_layers"], 3)
    assert ranges == [(0, 2), (2, 4), (4, 5)]
    config = EngineConfig(model=checkpoints["second"], pp_size=3, load_format="dummy",
                          block_size=BLOCK, kv_cache_memory_bytes=1 << 20)
    flags = []
    for s, (a, b) in enumerate(ranges):
        runner = StageRunner(config.stage_spec(s, (a, b), max_model_len=0, output_channel="nccl"))
        flags.append((runner.receives_token_ids, runner.sends_token_ids))
    assert flags == [(False, True), (True, False), (False, False)]


def test_block_size_defaults_to_whole_compression_groups(tmp_path):
    """No --block-size: 64, raised to a multiple of the largest compression rate (V4-Flash's 128);
    an explicit block size is kept."""
    from transformers import DeepseekV4Config

    from app.config import EngineConfig
    from stages.model_config import load_model_args
    from tests.deepseek_v4_ref import FLASH_LIKE_V4

    DeepseekV4Config(**FLASH_LIKE_V4).save_pretrained(tmp_path)
    args = load_model_args(str(tmp_path))
    assert EngineConfig(model=str(tmp_path)).for_model(args).block_size == 128
    assert EngineConfig(model=str(tmp_path), block_size=256).for_model(args).block_size == 256
    assert EngineConfig().for_model(load_model_args(None)).block_size == 64


def test_v4_flash_bench_shape_is_the_leading_layers_one_h200_holds():
    """The bench shape: V4-Flash's config in bf16 cut to the most leading layers whose weights
    (bf16 experts) and a 256K-token KV cache fit one H200 (with the activation reserve),
    patterns kept; its routed experts MXFP4, as the checkpoint ships them."""
    from app.bench import memory
    from app.bench.target import V4_FLASH_CONFIG, V4_FLASH_CONTEXT, shape_config
    from stages.loader import stage_memory_plan

    with open(V4_FLASH_CONFIG) as f:
        full = json.load(f)
    cfg = shape_config("deepseek-v4-flash")
    n = cfg["num_hidden_layers"]
    assert "quantization_config" not in cfg and cfg["hidden_size"] == full["hidden_size"]
    assert cfg["expert_dtype"] == "fp4" and "expert_dtype" not in full
    assert cfg["layer_types"] == full["layer_types"][:n]
    assert cfg["mlp_layer_types"] == full["mlp_layer_types"][:n]
    assert {"moe", "hash_moe"} <= set(cfg["mlp_layer_types"])
    assert {"compressed_sparse_attention", "heavily_compressed_attention"} <= set(
        cfg["layer_types"]
    )
    budget = int(memory.H200_BYTES * memory.UTILIZATION) - memory.ACTIVATION_BYTES

    def need(layers: int) -> int:
        args = ModelArgs.from_hf_dict(memory.leading_layers(full, layers))
        (stage,) = stage_memory_plan(args, 1, False)
        return stage.weight_bytes + V4_FLASH_CONTEXT * stage.kv_bytes_per_token

    assert need(n) <= budget < need(n + 1)
