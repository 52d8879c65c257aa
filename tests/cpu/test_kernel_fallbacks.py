"""Nothing falls back silently (stages/kernels/fallbacks.py): a backend that cannot serve a model
is declined when the stage is built (auto: the op takes torch; named: an error), and one that
routes a call elsewhere says so, in the log once and in the counter every time."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from stages.kernels import fallbacks, flash_mla, flash_mla_v4, registry, torch_ref
from stages.kernels.fallbacks import FALLBACKS, KernelTarget, OpShape, Refusal
from stages.kernels.registry import kernel_target, select_kernels
from stages.model_config import BUILTIN_CONFIG, ModelArgs
from stages.protocol import FallbackCount

# DeepSeek-V3.2 at test size: a latent of 16 + rope 8 (FlashMLA reads 512 + 64), 4 heads.
TINY_V32 = {
    "model_type": "deepseek_v32", "vocab_size": 200, "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
    "index_topk": 8, "index_n_heads": 16, "index_head_dim": 64, "bos_token_id": 1,
    "eos_token_id": 2,
}  # fmt: skip
# The same with V3.2's real attention widths (512 + 64, 128 heads).
FULL_V32 = {**TINY_V32, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 128}


@pytest.fixture(autouse=True)
def fresh_counts():
    FALLBACKS.reset()
    yield
    FALLBACKS.reset()


def target(config: dict, dtype: str = "bfloat16", block_size: int = 64) -> KernelTarget:
    return kernel_target(ModelArgs.from_hf_dict(config), dtype, block_size)


def test_the_family_declares_the_shapes_its_ops_are_called_with():
    tiny = target(TINY_V32).shapes
    assert tiny["mla_decode"] == OpShape(heads=4, head_dim=24, v_dim=16)
    assert tiny["mla_sparse"] == tiny["mla_sparse_fp8"] == tiny["mla_decode"]
    assert tiny["indexer_logits_rows"] == OpShape(heads=16, head_dim=64)
    assert "attention" not in tiny  # V3.2's layers attend sparsely only
    llama = target(BUILTIN_CONFIG).shapes
    assert llama == {"attention": OpShape(heads=4, head_dim=32, v_dim=32)}


def test_flash_mla_refuses_a_latent_other_than_512_plus_64():
    refusal = flash_mla.supports("mla_decode", target(TINY_V32))
    assert refusal is not None and refusal.reason == "head_dim"
    assert "16 + rope 8" in refusal.detail
    full = target(FULL_V32)
    for op in ("mla_decode", "mla_sparse", "mla_sparse_fp8", "mla_prefill_fp8"):
        assert flash_mla.supports(op, full) is None, op
    assert flash_mla.supports("mla_decode", target(FULL_V32, "float32")).reason == "dtype"
    assert flash_mla.supports("mla_decode", target(FULL_V32, block_size=16)).reason == "page_size"
    more_heads = target({**FULL_V32, "num_attention_heads": 256})
    assert flash_mla.supports("mla_sparse", more_heads).reason == "heads"
    assert flash_mla.supports("mla_decode", more_heads) is None  # the dense decode takes them
    # an op the model never calls is nobody's business
    assert flash_mla.supports("mla_decode", target(BUILTIN_CONFIG, "float32")) is None


def test_flash_mla_v4_and_cudnn_and_the_indexer_check_their_shapes():
    from tests.deepseek_v4_ref import TINY_V4

    v4 = target(dict(TINY_V4, model_type="deepseek_v4"))
    assert flash_mla_v4.supports("sparse_sink_attention", v4).reason == "head_dim"  # 32 wide
    v4_wide = KernelTarget({"sparse_sink_attention": OpShape(64, 512, 512)})
    assert flash_mla_v4.supports("sparse_sink_attention", v4_wide) is None
    from stages.kernels import cudnn_attention, triton_indexer

    assert cudnn_attention.supports("attention", target(BUILTIN_CONFIG)) is None
    assert cudnn_attention.supports("attention", target(BUILTIN_CONFIG, "float32")).reason == (
        "dtype"
    )
    assert triton_indexer.supports("indexer_logits_rows", target(TINY_V32)) is None
    few_heads = target({**TINY_V32, "index_n_heads": 4})
    assert triton_indexer.supports("indexer_logits_rows", few_heads).reason == "heads"
    assert triton_indexer.supports("indexer_logits", few_heads) is None  # no decode tiles


@pytest.fixture
def refusing_backend(monkeypatch):
    """A test-only mla_decode backend, first under auto, whose supports() refuses what it is
    told to refuse."""
    module = types.ModuleType("refusing_kernels")
    module.mla_decode = torch_ref.mla_decode  # type: ignore[attr-defined]
    module.is_available = lambda _device: True  # type: ignore[attr-defined]
    module.refuse = True  # type: ignore[attr-defined]

    def supports(op, target):
        if module.refuse and op in target.shapes:
            return Refusal("head_dim", f"{target.shapes[op].head_dim} wide, not 576")
        return None

    module.supports = supports  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "refusing_kernels", module)
    monkeypatch.setitem(
        registry.BACKENDS, "mla_decode",
        {**registry.BACKENDS["mla_decode"], "refusing": "refusing_kernels:mla_decode"},
    )  # fmt: skip
    monkeypatch.setitem(registry.PRIORITY, "mla_decode", ("refusing", "torch"))
    return module


def test_auto_declines_a_refusing_backend_when_the_stage_is_built(refusing_backend, caplog):
    caplog.set_level(logging.INFO, logger=fallbacks.__name__)
    kernels = select_kernels("cpu", target=target(TINY_V32))
    assert kernels.names["mla_decode"] == "torch"
    assert kernels.mla_decode is torch_ref.mla_decode
    assert FALLBACKS.counts() == {("mla_decode", "refusing", "head_dim"): 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "kernel fallback: mla_decode on refusing (head_dim: a head or latent width the kernel "
        "does not take): declined for this model: 24 wide, not 576"
    ]
    assert FALLBACKS.take_new() == (FallbackCount("mla_decode", "refusing", "head_dim", 1),)
    # a model it serves keeps it, without a word
    refusing_backend.refuse = False
    caplog.clear()
    assert select_kernels("cpu", target=target(TINY_V32)).names["mla_decode"] == "refusing"
    assert FALLBACKS.take_new() == () and not caplog.records
    # without a target (benches, memory plans) nothing is checked
    refusing_backend.refuse = True
    assert select_kernels("cpu").names["mla_decode"] == "refusing"


def test_a_named_backend_that_refuses_the_model_is_an_error(refusing_backend):
    with pytest.raises(ValueError, match=r"mla_decode backend 'refusing' cannot serve this model"):
        select_kernels("cpu", mla_decode="refusing", target=target(TINY_V32))
    # Llama never calls mla_decode: nothing to refuse
    kernels = select_kernels("cpu", mla_decode="refusing", target=target(BUILTIN_CONFIG))
    assert kernels.names["mla_decode"] == "refusing"


def test_flash_mla_routes_the_tiny_latent_to_torch_and_says_so(caplog):
    """What failed at startup inside FlashMLA ('Only head_size_k == 576 or 512'): a bf16 call
    with a 16 + 8 latent now takes the torch reference, counted per call, logged once."""
    caplog.set_level(logging.WARNING, logger=fallbacks.__name__)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, generator=g).bfloat16()
    pages = torch.randn(3, 64, 1, 24, generator=g).bfloat16()
    table, seqlens = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32), torch.tensor([70, 5])
    for _ in range(3):
        out = flash_mla.mla_decode(q, pages, table, seqlens, 16, 0.2, {})
    assert torch.equal(out, torch_ref.mla_decode(q, pages, table, seqlens, 16, 0.2, {}))
    assert FALLBACKS.counts() == {("mla_decode", "flash-mla", "head_dim"): 3}
    assert [r.getMessage() for r in caplog.records] == [
        "kernel fallback: mla_decode on flash-mla (head_dim: a head or latent width the kernel "
        "does not take): queries 24 wide, output 16 -> torch reference"
    ]


def test_a_call_time_fallback_is_logged_once_and_counted_every_time(caplog):
    """A call FlashMLA cannot take (here fp32 queries) runs the torch reference: the log says
    so once, the counter counts each call, and take_new hands each count over once."""
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(3, 4, 512, generator=g), torch.randn(10, 512, generator=g)
    indices, sinks = torch.tensor([[0, 3, -1], [1, -1, -1], [9, 8, 7]]), torch.zeros(4)
    caplog.set_level(logging.WARNING, logger=fallbacks.__name__)
    for _ in range(2):
        out = flash_mla_v4.sparse_sink_attention(q, kv, indices, sinks, 0.1)
    assert torch.equal(out, torch_ref.sparse_sink_attention(q, kv, indices, sinks, 0.1))
    key = ("sparse_sink_attention", "flash-mla", "dtype")
    assert FALLBACKS.counts() == {key: 2}
    assert [r.getMessage() for r in caplog.records] == [
        "kernel fallback: sparse_sink_attention on flash-mla (dtype: a dtype the kernel does not "
        "take): queries in torch.float32, keys in torch.float32 (FlashMLA takes bfloat16) -> "
        "torch reference"
    ]
    assert FALLBACKS.take_new() == (FallbackCount(*key, 2),)
    flash_mla_v4.sparse_sink_attention(q, kv, indices, sinks, 0.1)
    assert FALLBACKS.take_new() == (FallbackCount(*key, 1),)
    assert FALLBACKS.take_new() == ()
    assert len(caplog.records) == 1


def test_a_route_by_design_is_counted_and_logged_at_info(caplog):
    """cuDNN leaves short chunks (decode steps) to SDPA on purpose: counted as few_rows, its one
    log line at info."""
    from stages.kernels import cudnn_attention

    caplog.set_level(logging.INFO, logger=fallbacks.__name__)
    q, k = torch.randn(3, 2, 8), torch.randn(5, 2, 8)
    out = cudnn_attention.attention(q, k, k, 0.3)
    assert torch.equal(out, torch_ref.attention(q, k, k, 0.3))
    assert FALLBACKS.counts() == {("attention", "cudnn", "few_rows"): 1}
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_reasons_are_a_fixed_set():
    with pytest.raises(ValueError, match="unknown fallback reason"):
        fallbacks.record_fallback("linear", "triton", "K=4097 is odd")
    with pytest.raises(ValueError, match="unknown fallback reason"):
        Refusal("because", "")
    assert FALLBACKS.counts() == {}


def test_an_attention_backend_that_cannot_capture_says_so(caplog):
    """A stage on CUDA whose attention backend cannot capture its decode step (the runner asks
    when it allocates the cache: AttentionBackend.announce_eager) says so: the op that refuses
    and why, in the log once and in the counter each time; a backend that captures says
    nothing."""
    from stages.attention.paged_kv import PagedKVBackend
    from stages.models.families import GraphSetting
    from stages.stage_context import StageContext

    args = ModelArgs.from_hf_dict(TINY_V32)
    ctx = StageContext(args, range(0, 1), True, True, select_kernels("cpu"), torch.float32,
                       torch.device("cpu"))  # fmt: skip
    mla = args.family.attention_backend(args)(ctx)
    names = dict(select_kernels("cpu").names, mla_decode="flash-mla", mla_sparse="flash-mla",
                 indexer_logits_rows="triton")  # fmt: skip
    caplog.set_level(logging.WARNING, logger=fallbacks.__name__)
    assert not mla.announce_eager(GraphSetting(names, 64, "auto", "bfloat16"))
    assert FALLBACKS.counts() == {} and not caplog.records
    for _ in range(2):  # blocks of 16: not FlashMLA's page
        assert mla.announce_eager(GraphSetting(names, 16, "auto", "bfloat16"))
    assert FALLBACKS.counts() == {("mla_sparse", "flash-mla", "page_size"): 2}
    assert mla.announce_eager(GraphSetting(names, 64, "fp8", "bfloat16"))  # mla_sparse_fp8 torch
    assert FALLBACKS.counts()[("mla_sparse_fp8", "torch", "eager")] == 1
    assert [r.getMessage() for r in caplog.records] == [
        "kernel fallback: mla_sparse on flash-mla (page_size: a KV page (block) size the kernel "
        "does not take): decode steps run eager: block size 16, not FlashMLA's 64",
        "kernel fallback: mla_sparse_fp8 on torch (eager: a kernel a CUDA graph cannot capture: "
        "decode steps run eager): decode steps run eager: mla_sparse_fp8 on the torch reference "
        "syncs with the host",
    ]
    assert PagedKVBackend.can_capture(GraphSetting({"paged_decode": "triton"}, 16, "auto", "x"))
    refused = PagedKVBackend.capture_refusal(GraphSetting({"paged_decode": "triton"}, 24, "", ""))
    assert refused is not None and refused[0] == "paged_decode"
    assert refused[1].reason == "page_size"


def test_deepgemm_moe_is_never_auto_off_sm90_and_a_cpu_call_is_counted():
    """moe_experts_fp8's deepgemm backend (DeepGEMM, built from source, SM90 only): auto passes
    it by on CPU, naming it is an error there, and a call handed CPU tensors runs the FP8
    reference through triton-persistent's route, which says so."""
    from stages.kernels import deepgemm_moe, fp8_ref

    kernels = select_kernels("cpu", fp8_linear="auto")
    assert kernels.names["moe_experts_fp8"] == "torch"
    with pytest.raises(ValueError, match="'deepgemm' is not available on device 'cpu'"):
        registry._select("moe_experts_fp8", "deepgemm", "cpu")
    g = torch.Generator().manual_seed(2)
    gate_up, gu_s = fp8_ref.quantize_weight(torch.randn(4, 256, 128, generator=g) / 20)
    down, d_s = fp8_ref.quantize_weight(torch.randn(4, 128, 128, generator=g) / 20)
    x, ids = torch.randn(3, 128, generator=g), torch.tensor([[0, 1], [2, -1], [3, 0]])
    wt = torch.rand(3, 2, generator=g)
    out = deepgemm_moe.moe_experts(x, gate_up, gu_s, down, d_s, ids, wt)
    assert torch.equal(out, fp8_ref.moe_experts(x, gate_up, gu_s, down, d_s, ids, wt))
    assert FALLBACKS.counts() == {("moe_experts_fp8", "triton-persistent", "device"): 1}
