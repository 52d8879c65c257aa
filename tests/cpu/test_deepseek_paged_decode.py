"""DeepSeek's decode-only microbatches on the static buffers CUDA graphs replay (DecodeGraphs'
paged path, run eagerly here on the torch references) == the general ForwardBatch path: rows of
different lengths over non-consecutive blocks, a bucket padded with rows of length 0, and for
V3.2 both graph shapes (rows within the indexer's top-k attend densely; past it every row
selects over a static width), also with FP8 weights and the FP8 latent cache (V3.2: every row
on the sparse FP8 kernel). tests/gpu/test_deepseek_decode_graphs.py runs the same cases captured
on FlashMLA and the Triton kernels."""

from __future__ import annotations

import pytest
import torch

from stages.decode_graphs import DecodeGraphs
from stages.forward_batch import ForwardBatch
from stages.kernels.registry import Kernels, select_kernels
from stages.kv_cache import make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import ModelArgs
from stages.protocol import Row
from stages.tensor_parallel import TensorParallel
from tests.cpu.conftest import DSA_SPARSE_TOPK, deepseek_config

LENGTHS = (1, 3, 6, 2, 5)  # 5 rows: bucket 8 pads 3
STEPS = 6  # the longest row grows from 7 to 12 keys: past DSA_SPARSE_TOPK


def decode_case(
    args: ModelArgs,
    kernels: Kernels,
    dtype: torch.dtype,
    device: str,
    block_size: int,
    max_model_len: int,
    lengths: tuple[int, ...],
    steps: int,
    graphed: bool,
    kv_cache_dtype: str = "auto",
    tp: TensorParallel | None = None,
) -> list[tuple[tuple[int, int], torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Prefill `lengths` as one batch, then `steps` greedy decode steps; per step the graph's
    key and the logits of the general path, of DecodeGraphs' eager paged path and (graphed)
    of its replay. `tp`: the model is this rank's part of a tensor-parallel stage."""
    layers = args.num_hidden_layers
    model = build_stage_model(args, None, 0, layers, True, True, kernels, dtype, device, 3, tp)
    rank_args = args.family.rank_args(args, 1 if tp is None else tp.size)
    need = [-(-(n + steps) // block_size) for n in lengths]
    num_blocks = sum(need) + 1  # the last one: the padding rows' scratch block
    kv = make_kv_cache(rank_args, layers, num_blocks, block_size, dtype, device, kv_cache_dtype)
    ids = list(range(num_blocks - 1))
    order = ids[1::2] + ids[::2]  # each row's blocks non-consecutive
    tables, first = [], 0
    for n in need:
        tables.append(order[first : first + n])
        first += n
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, args.vocab_size, (n,), generator=g).tolist() for n in lengths]

    def general(tokens: list[int], rows: list[tuple[int, int, list[int], bool]]) -> torch.Tensor:
        batch = ForwardBatch.build(rows, block_size, device, args.family.attention_prefixes)
        h = model(torch.tensor(tokens, device=device), batch, kv)
        logits: torch.Tensor = model.compute_logits(h[batch.sample_indices])
        return logits

    with torch.inference_mode():
        logits = general(
            [t for p in prompts for t in p],
            [(0, n, table, True) for n, table in zip(lengths, tables)],
        )

        def paged(eager: bool) -> DecodeGraphs:
            graphs = DecodeGraphs(
                model,
                kv,
                num_slots=len(lengths),
                max_model_len=max_model_len,
                scratch_slot=(num_blocks - 1) * block_size,
                hidden_shape=args.family.hidden_shape(args),
                dtype=dtype,
                device=torch.device(device),
                is_first=True,
                max_rows=8,
                eager=eager,
            )
            graphs.update_tables([(i, 0, tuple(t)) for i, t in enumerate(tables)])
            if device.startswith("cuda"):
                graphs.capture()
            return graphs

        variants = [paged(eager=True)] + ([paged(eager=False)] if graphed else [])
        out = []
        for step in range(steps):
            nxt = logits.argmax(dim=-1).tolist()
            starts = [n + step for n in lengths]
            rows = tuple(
                Row(str(i), i, start, 1, None, sample=True, is_prefill=False)
                for i, start in enumerate(starts)
            )
            key = variants[0].bucket_for(rows)
            if key is None or (graphed and key not in variants[1].graphs):
                raise AssertionError(f"no captured graph for this decode step: {key}")
            by_req = {str(i): t for i, t in enumerate(tables)}
            inputs = torch.tensor(nxt, device=device)
            results = [
                model.compute_logits(v.run(key, rows, inputs, by_req)).clone() for v in variants
            ]
            logits = general(nxt, [(s, 1, t, True) for s, t in zip(starts, tables)])
            out.append((key, logits, results[0], results[1] if graphed else None))
    return out


@pytest.mark.parametrize("arch", ["ds_v2", "ds_v3", "ds_v32_sparse", "ds_v32_dense"])
def test_paged_decode_matches_the_general_path(arch):
    args = ModelArgs.from_hf_dict(deepseek_config(arch).to_dict())
    kernels = select_kernels("cpu", linear="torch", attention="torch")
    steps = decode_case(args, kernels, torch.float32, "cpu", 4, 64, LENGTHS, STEPS, False)
    for _key, ref, paged, _ in steps:
        assert (paged - ref).abs().max().item() <= 1e-4
    widths = {key[1] for key, *_ in steps}
    assert {key[0] for key, *_ in steps} == {8}
    if arch == "ds_v32_sparse":  # the dense shape first, then past index_topk the selecting one
        assert steps[0][0][1] == 0 and steps[-1][0][1] > 0 and DSA_SPARSE_TOPK < 12
    else:
        assert widths == {0}


# V3.2 with the FP8 latent's shape (512 + 64) and 128-aligned widths (the W8A8 blocks); keeps
# DSA_SPARSE_TOPK keys, so the decode steps cross from the dense shape to the selecting one
FP8_V32 = {
    "model_type": "deepseek_v32", "vocab_size": 200, "hidden_size": 128,
    "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 512,
    "q_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "topk_method": "noaux_tc", "n_group": 2, "topk_group": 1,
    "routed_scaling_factor": 2.5, "index_topk": DSA_SPARSE_TOPK, "index_n_heads": 8,
    "index_head_dim": 64, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


@pytest.mark.parametrize(
    "fp8_weights,kv_cache_dtype",
    [(True, "auto"), (False, "fp8"), (True, "fp8")],
    ids=["fp8_weights", "fp8_kv", "fp8_both"],
)
def test_fp8_paged_decode_matches_the_general_path(fp8_weights, kv_cache_dtype):
    """The paged path with FP8 weights (W8A8 on fp8_ref) and/or the FP8 latent (fp8_latent's
    sparse reference, dense rows through every slot of their prefix) == the general path.
    Row-independent math up to the matmuls' blocking, which FP8 rounding can amplify by an
    e4m3 step of one value: a relative bound, and the same greedy tokens (8 index heads: the
    relu-ed scores of fewer tie at 0, and top-k breaks ties by layout)."""
    args = ModelArgs.from_hf_dict(FP8_V32)
    kernels = select_kernels(
        "cpu", linear="torch", attention="torch", fp8_linear="torch" if fp8_weights else None
    )
    steps = decode_case(
        args, kernels, torch.float32, "cpu", 4, 64, LENGTHS, STEPS, False, kv_cache_dtype
    )
    for key, ref, paged, _ in steps:
        assert (paged - ref).abs().max().item() <= 5e-3 * ref.abs().max().item(), key
        assert torch.equal(paged.argmax(-1), ref.argmax(-1)), key
    assert steps[0][0] == (8, 0) and steps[-1][0][1] > 0  # both graph shapes


def test_fp8_dense_rows_name_every_slot_of_their_prefix():
    """The FP8 latent's dense shape: each row's indices are its prefix's slots in order through
    its block-table row, -1 past its length (a padding row of length 0 sees one key)."""
    from stages.forward_batch import PagedDecodeBatch
    from stages.models.dsa import SparseRows

    tables = torch.tensor([[3, 1, 0], [2, 0, 0]], dtype=torch.int32)
    lengths = torch.tensor([6, 0, 2])
    batch = PagedDecodeBatch(
        positions=(lengths - 1).clamp(min=0),
        slot_mapping=torch.zeros(3, dtype=torch.long),
        lengths=lengths,
        table_rows=torch.tensor([0, 1, 1]),
        block_tables=tables,
        block_size=4,
        num_splits=1,
    )
    rows = SparseRows.paged_dense(batch, topk=16)
    assert rows.plan is None and rows.dense.dtype == torch.int32
    assert rows.dense.tolist() == [
        [12, 13, 14, 15, 4, 5] + [-1] * 6,  # 12 wide: all the tables hold, below topk
        [8] + [-1] * 11,
        [8, 9] + [-1] * 10,
    ]


def test_deepseek_graphs_need_sync_free_kernels():
    from stages.models.families import DEEPSEEK, GraphSetting

    fast = {"mla_decode": "flash-mla", "mla_sparse": "flash-mla"}
    fast |= {"indexer_logits_rows": "triton", "moe_experts": "triton-persistent"}
    fast |= {"mla_sparse_fp8": "flash-mla"}
    w8a8 = {"fp8_linear": "scaled-mm", "moe_experts_fp8": "triton-persistent"}
    w8a8 |= {"fp8_swiglu_linear": "scaled-mm"}
    triton_w8a8 = {"fp8_linear": "triton-persistent", "fp8_swiglu_linear": "triton-persistent"}
    for ok in (
        GraphSetting(fast, 64, "auto", "bfloat16"),
        GraphSetting(fast, 64, "fp8", "bfloat16"),  # FlashMLA's sparse FP8 kernel
        GraphSetting(fast | w8a8, 64, "auto", "bfloat16"),  # W8A8 GEMMs, grouped FP8 MoE
        GraphSetting(fast | w8a8 | triton_w8a8, 64, "fp8", "bfloat16"),
    ):
        assert DEEPSEEK.paged_decode_graphs(ok), ok
    for bad in (
        GraphSetting(fast | {"moe_experts": "torch"}, 64, "auto", "bfloat16"),  # syncs
        GraphSetting(fast, 16, "auto", "bfloat16"),  # not FlashMLA's page
        GraphSetting(fast | {"mla_sparse_fp8": "torch"}, 64, "fp8", "bfloat16"),
        GraphSetting(fast | w8a8 | {"fp8_linear": "torch"}, 64, "auto", "bfloat16"),
        GraphSetting(fast | w8a8 | {"fp8_swiglu_linear": "torch"}, 64, "auto", "bfloat16"),
        GraphSetting(fast | w8a8 | {"moe_experts_fp8": "torch"}, 64, "auto", "bfloat16"),
        GraphSetting(fast, 64, "auto", "float32"),
    ):
        assert not DEEPSEEK.paged_decode_graphs(bad), bad
