"""EngineConfig: the options CLI flags, Serve args and Helm values become, validated at once."""

import pytest

from app.config import EngineConfig


def test_dynamic_chunking_and_warmup_options_from_cli_names():
    cfg = EngineConfig.from_dict({"pp": 2, "enable-dynamic-chunking": True,
                                  "dynamic_chunk_smooth": 1.0, "warmup-len": 0})
    assert (cfg.pp_size, cfg.enable_dynamic_chunking, cfg.dynamic_chunk_smooth,
            cfg.warmup_len) == (2, True, 1.0, 0)
    default = EngineConfig()
    assert not default.enable_dynamic_chunking and default.dynamic_chunk_smooth == 0.75
    assert default.warmup_len is None  # the longest prompt that fits


@pytest.mark.parametrize("bad,match", [({"dynamic_chunk_smooth": 1.5}, "dynamic_chunk_smooth"),
                                       ({"dynamic_chunk_smooth": -0.1}, "dynamic_chunk_smooth"),
                                       ({"warmup_len": -1}, "warmup_len"),
                                       ({"enable_dynamic_chunk": True}, "unknown")])
def test_bad_values_are_rejected_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_dict(bad)


def test_run_ahead_defaults_on_for_cuda_only_and_can_be_turned_off():
    from app.cli import build_parser

    assert EngineConfig(device="cuda").resolved_run_ahead
    assert EngineConfig(device="cuda").inflight == 4  # 2 x pp: step t+1 leaves while t runs
    assert not EngineConfig(device="cpu").resolved_run_ahead
    assert not EngineConfig(device="cuda", run_ahead=False).resolved_run_ahead
    assert EngineConfig(device="cuda", run_ahead=False).scheduler_config(
        100, 256, None).run_ahead is False
    a = build_parser().parse_args(["serve", "--device", "cuda", "--no-run-ahead"])
    assert a.run_ahead is False


def test_a_stage_is_told_the_resolved_output_channel():
    cfg = EngineConfig(output_channel="auto")
    assert cfg.stage_spec(0, (0, 2), 64, "host").output_channel == "host"
    for unresolved in ("auto", "ipc"):
        with pytest.raises(ValueError, match="resolved output channel"):
            cfg.stage_spec(0, (0, 2), 64, unresolved)


def test_mxfp4_experts_option_reaches_the_stage():
    """--mxfp4-experts: dequantize by default, from CLI names, to every StageSpec; a bad value is
    refused by name."""
    from app.cli import build_parser

    assert EngineConfig().mxfp4_experts == "dequantize"
    cfg = EngineConfig.from_dict({"mxfp4-experts": "keep"})
    assert cfg.stage_spec(0, (0, 2), 64, "nccl").mxfp4_experts == "keep"
    assert EngineConfig().stage_spec(0, (0, 2), 64, "nccl").mxfp4_experts == "dequantize"
    a = build_parser().parse_args(["serve", "--mxfp4-experts", "dequantize"])
    assert a.mxfp4_experts == "dequantize"
    with pytest.raises(ValueError, match="mxfp4_experts"):
        EngineConfig.from_dict({"mxfp4_experts": "fp8"})
