"""A DeepSeek-V4 checkpoint whose routed experts are MXFP4 (as V4 ships them: packed e2m1 in int8
or float4_e2m1fn_x2, ue8m0 `weight_scale_inv` per 32 values along K, `expert_dtype: fp4`):
ppserve keeps them packed (W4A16 experts, the bytes as stored) or, with mxfp4_experts
dequantize, widens them at load, and either way matches transformers on the checkpoint holding
the dequantized values; an unknown expert_dtype is refused at load."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from stages.forward_batch import ForwardBatch
from stages.kernels import mxfp4
from stages.kernels.registry import select_kernels
from stages.kv_cache import make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import load_model_args, mxfp4_experts_as
from tests.deepseek_v4_ref import TINY_V4, write_checkpoint

TOL = 1e-4
BLOCK = 16
PROMPT = torch.randint(2, 96, (20,), generator=torch.Generator().manual_seed(7)).tolist()
ROUTED = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def _copy_with(src: Path, dst: Path, tensors: dict[str, torch.Tensor], **config: object) -> str:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return str(dst)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The checkpoint with its routed experts as MXFP4 (one in float4_e2m1fn_x2, the rest int8),
    the same with those experts' dequantized values (as transformers reads it), and the count."""
    root = tmp_path_factory.mktemp("v4_mxfp4")
    plain = Path(write_checkpoint(str(root / "plain"), TINY_V4))
    tensors = load_file(str(plain / "model.safetensors"))
    fp4, dequantized = dict(tensors), dict(tensors)
    routed = sorted(n for n in tensors if ROUTED.search(n))
    for i, name in enumerate(routed):
        packed, scale = mxfp4.quantize(tensors[name])
        dequantized[name] = mxfp4.dequantize(packed, scale)
        fp4[name] = packed.view(torch.float4_e2m1fn_x2 if i == 0 else torch.int8)
        fp4[name + "_scale_inv"] = scale.view(torch.float8_e8m0fnu)
    return {
        "fp4": _copy_with(plain, root / "fp4", fp4, expert_dtype="fp4"),
        "dequantized": _copy_with(plain, root / "dequantized", dequantized),
        "routed": str(len(routed)),
    }


def _stage(path: str, mode: str = "keep") -> Any:
    args = mxfp4_experts_as(load_model_args(path), mode)
    n = args.num_hidden_layers
    return build_stage_model(args, path, 0, n, True, True, select_kernels("cpu"), "fp32", "cpu")


@torch.no_grad()
def _stage_logits(path: str, mode: str = "keep") -> torch.Tensor:
    stage = _stage(path, mode)
    args = stage.ctx.args
    n = args.num_hidden_layers
    cache = make_kv_cache(args, range(n), 8, BLOCK, torch.float32, "cpu")
    batch = ForwardBatch.build([(0, len(PROMPT), list(range(8)), True)], BLOCK)
    ids = torch.tensor(PROMPT)
    logits: torch.Tensor = stage.compute_logits(stage(ids, batch, cache))
    return logits


@pytest.mark.parametrize("mode", ["keep", "dequantize"])
def test_mxfp4_experts_match_hf(
    checkpoints: dict[str, str], caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    from transformers import DeepseekV4ForCausalLM

    caplog.set_level(logging.INFO, logger="stages.loader")
    got = _stage_logits(checkpoints["fp4"], mode)
    message = (
        f"MXFP4 experts kept packed: {checkpoints['routed']} weights"
        if mode == "keep"
        else f"MXFP4 checkpoint weights: {checkpoints['routed']} dequantized at load"
    )
    assert any(r.getMessage().startswith(message) for r in caplog.records)
    hf = DeepseekV4ForCausalLM.from_pretrained(checkpoints["dequantized"], dtype=torch.float32)
    with torch.no_grad():
        want = hf.eval()(torch.tensor([PROMPT])).logits[0]
    assert (got - want).abs().max().item() <= TOL


def test_kept_experts_hold_the_checkpoint_bytes(checkpoints: dict[str, str]) -> None:
    """Kept packed, each expert's gate/up/down weights and scales are the stored bytes (gate
    rows then up rows), half a byte a value; dequantized, the same experts take fp32."""
    tensors = load_file(str(Path(checkpoints["fp4"]) / "model.safetensors"))
    stage = _stage(checkpoints["fp4"])
    experts = [(n, m) for n, m in stage.named_modules() if n.endswith("mlp.experts")]
    assert experts
    for n, ex in experts:
        assert ex.mxfp4 and ex.gate_up_proj.dtype == torch.uint8
        layer = int(re.search(r"layers\.(\d+)\.", n).group(1))
        for e in range(ex.gate_up_proj.shape[0]):
            stem = f"model.layers.{layer}.ffn.experts.{e}"
            for part, rows in (
                ("w1", slice(0, ex.gate_up_proj.shape[1] // 2)),
                ("w3", slice(ex.gate_up_proj.shape[1] // 2, None)),
            ):
                w = tensors[f"{stem}.{part}.weight"].view(torch.uint8)
                s = tensors[f"{stem}.{part}.weight_scale_inv"].view(torch.uint8)
                assert torch.equal(ex.gate_up_proj[e, rows], w)
                assert torch.equal(ex.gate_up_proj_scale_inv[e, rows], s)
            assert torch.equal(ex.down_proj[e], tensors[f"{stem}.w2.weight"].view(torch.uint8))
        h = ex.down_proj.shape[1]
        assert ex.gate_up_proj.shape[2] * 2 == h
    wide = _stage(checkpoints["fp4"], "dequantize")
    packed_bytes, wide_bytes = (
        sum(p.numel() * p.element_size() for n, p in m.named_parameters() if ".experts." in n)
        for m in (stage, wide)
    )
    # fp32 (4 bytes) against half a byte + 1/32 of a byte a value
    assert wide_bytes * (0.5 + 1 / 32) == pytest.approx(packed_bytes * 4)


def test_mxfp4_scale_grid_and_unknown_expert_dtype_are_refused(
    checkpoints: dict[str, str], tmp_path: Path
) -> None:
    src = Path(checkpoints["fp4"])
    for where in ("top", "quantization_config"):
        cfg = json.loads((src / "config.json").read_text())
        if where == "top":
            cfg["expert_dtype"] = "int4"
        else:
            cfg.pop("expert_dtype")
            cfg["quantization_config"] = {"quant_method": "fp8", "expert_dtype": "int4"}
        bad = tmp_path / where
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match="expert_dtype 'int4'"):
            load_model_args(str(bad))
    # a packed weight whose scales are not one per 32 values along K: refused, named
    tensors = load_file(str(src / "model.safetensors"))
    name = next(n for n in sorted(tensors) if ROUTED.search(n))
    scale = tensors[name + "_scale_inv"]
    tensors[name + "_scale_inv"] = scale[..., : scale.shape[-1] // 2].contiguous()
    grid = _copy_with(src, tmp_path / "grid", tensors)
    with pytest.raises(ValueError, match=re.escape(name) + ".*is not MXFP4"):
        _stage_logits(grid)


def _rank_experts(tp: Any, path: str) -> tuple[torch.Tensor, list[tuple[int, str]]]:
    """One rank's prompt logits (PP 1) and its experts' (first, weight dtype) per layer."""
    from tests.cpu.test_tensor_parallel_v4 import prompt_logits

    args = load_model_args(path)
    n = args.num_hidden_layers
    stage = build_stage_model(
        args, None, 0, n, True, True, select_kernels("cpu"), torch.float32, "cpu", tp=tp
    )
    held = [
        (m.first, str(m.gate_up_proj.dtype), m.gate_up_proj.shape[0])
        for name, m in stage.named_modules()
        if name.endswith("mlp.experts")
    ]
    return prompt_logits(tp, path, 1), held


def test_tensor_parallel_ranks_keep_their_fp4_experts(checkpoints: dict[str, str]) -> None:
    """--tp 2: each rank holds half the experts, packed, and the split stage's logits equal
    transformers' on the dequantized checkpoint (the ranks bit for bit alike)."""
    from transformers import DeepseekV4ForCausalLM

    from tests.cpu.test_deepseek_v4_vs_hf import PROMPT as TP_PROMPT
    from tests.cpu.tp_ranks import RankPool

    pool = RankPool(2)
    try:
        (got, held), (other, held1) = pool.run(_rank_experts, checkpoints["fp4"])
    finally:
        pool.close()
    experts = load_model_args(checkpoints["fp4"]).family_args.n_routed_experts
    assert {h[1] for h in held + held1} == {"torch.uint8"}
    assert [h[0] for h in held1] == [experts // 2] * len(held1)
    assert all(h[2] == experts // 2 for h in held + held1)
    assert torch.equal(got, other)
    hf = DeepseekV4ForCausalLM.from_pretrained(checkpoints["dequantized"], dtype=torch.float32)
    with torch.no_grad():
        want = hf.eval()(torch.tensor([TP_PROMPT])).logits[0]
    assert (got - want).abs().max().item() <= TOL


def test_fp8_weights_keep_the_experts_fp4(tmp_path: Path) -> None:
    """--quantization fp8 with MXFP4 experts (here W8A8 on the torch reference): the 128-aligned
    linears go FP8 while the routed experts stay packed; with --mxfp4-experts dequantize they
    go FP8 too. Against the fp32 stage W8A8 moves this random model's logits by 0.32 of their
    norm with the experts packed and 0.32 with them in FP8 as well (measured; its layers amplify
    rounding about tenfold, tests/cpu/test_deepseek_v4_fp8_weights.py, so the two differ by
    chance more than by the experts' FP8): the packed experts add no error of their own."""
    from tests.cpu.test_deepseek_v4_fp8_weights import FP8_WEIGHTS_V4

    plain = Path(write_checkpoint(str(tmp_path / "plain"), FP8_WEIGHTS_V4))
    tensors = load_file(str(plain / "model.safetensors"))
    for name in [n for n in tensors if ROUTED.search(n)]:
        packed, scale = mxfp4.quantize(tensors[name])
        tensors[name] = packed.view(torch.int8)
        tensors[name + "_scale_inv"] = scale.view(torch.float8_e8m0fnu)
    path = _copy_with(plain, tmp_path / "fp4", tensors, expert_dtype="fp4")
    fp8_kernels = select_kernels("cpu", fp8_linear="torch")
    args = load_model_args(path)
    n = args.num_hidden_layers
    held = {}
    for mode in ("keep", "dequantize"):
        stage = build_stage_model(
            mxfp4_experts_as(args, mode), path, 0, n, True, True, fp8_kernels, "fp32", "cpu"
        )
        held[mode] = {
            name: p.dtype for name, p in stage.named_parameters() if name.startswith("layers.3.")
        }
    assert held["keep"]["layers.3.mlp.experts.gate_up_proj"] == torch.uint8
    assert held["keep"]["layers.3.self_attn.q_b_proj.weight"] == torch.float8_e4m3fn
    assert held["dequantize"]["layers.3.mlp.experts.gate_up_proj"] == torch.float8_e4m3fn
    want, err = _stage_logits(path), {}
    for mode in ("keep", "dequantize"):
        stage = build_stage_model(
            mxfp4_experts_as(args, mode), path, 0, n, True, True, fp8_kernels, "fp32", "cpu"
        )
        cache = make_kv_cache(args, range(n), 8, BLOCK, torch.float32, "cpu")
        batch = ForwardBatch.build([(0, len(PROMPT), list(range(8)), True)], BLOCK)
        with torch.no_grad():
            got = stage.compute_logits(stage(torch.tensor(PROMPT), batch, cache))
        err[mode] = ((got - want).norm() / want.norm()).item()
    # within 5 %: the two runs' W8A8 roundings differ only in the experts, amplified alike
    assert 0 < err["keep"] <= 1.05 * err["dequantize"] and err["dequantize"] < 0.4
