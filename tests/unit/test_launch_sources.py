"""`app.bench.v4_decode --stacks` counts a step's small launches by op and the stages/ frame that
made them. Session 33's H100 run gave every frame as "": the profiler records Python stacks
only with its verbose experimental config. On a CPU step each op counts once."""

import pytest
import torch

from app.bench.v4_decode import launch_sources
from stages.kernels import torch_ref


def test_launch_sources_name_the_calling_frame_in_stages():
    x = torch.randn(4, 8)
    got = launch_sources(lambda: torch_ref.swiglu(x[:, :4], x[:, 4:], None), cuda=False)
    frames = {r["frame"] for r in got if r["op"] == "aten::silu"}
    assert frames and all(f.startswith("kernels/torch_ref.py(") for f in frames), got
    assert all(r["launches"] >= 1 for r in got)


def test_fewer_routed_experts_than_a_token_picks_is_refused_before_any_build():
    from app.bench.v4_decode import run

    with pytest.raises(ValueError, match="--routed-experts 5: a token picks 6"):
        run([1], 512, False, "auto", 1, 1, routed_experts=5)
