"""The Grafana dashboard is generated from app/dashboard.py's queries; both shipped copies
(deploy/ and the Helm chart's, which Helm can only read inside the chart) are that output."""

import json
import re
from pathlib import Path

from app.dashboard import (
    FILES,
    SERIES_PREFIX,
    dashboard,
    dashboard_json,
    decode_bytes_per_second,
    fraction_of_peak,
    prefill_flops_per_second,
    prefix_cache_hit_rate,
    skip_hit_ratio,
)

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_dashboards_are_the_generated_one():
    for rel in FILES:
        assert (ROOT / rel).read_text() == dashboard_json(), (
            f"{rel} is stale: run python -m app.dashboard"
        )


def test_skip_hit_ratio_panel_uses_the_one_query():
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]
    assert skip_hit_ratio() in exprs
    assert json.loads(dashboard_json()) == dashboard()
    assert "$__rate_interval" not in skip_hit_ratio("5m") and "[5m]" in skip_hit_ratio("5m")


def test_prefix_cache_hit_rate_panel_divides_hits_by_queries():
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]
    assert prefix_cache_hit_rate() in exprs
    hits, queries = prefix_cache_hit_rate("5m").split(" / ", 1)
    assert "prefix_cache_hits_total" in hits and "prefix_cache_queries_total" in queries


def test_rebuild_counter_has_a_panel():
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]
    assert any("ray_ppserve_pipeline_rebuilds_total" in e for e in exprs)


def _exported_names() -> set[str]:
    """The series EngineMetrics exports, read from app/metrics.py's source (no Ray needed):
    the names it gives _counter, _gauge and _hist, histograms with their _bucket series."""
    import ast

    tree = ast.parse((ROOT / "app" / "metrics.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("_counter", "_gauge", "_hist")
        ):
            name = SERIES_PREFIX + node.args[0].value
            names |= {name, name + "_bucket"} if node.func.attr == "_hist" else {name}
    return names


def test_every_panel_reads_series_the_server_exports():
    exported = _exported_names()
    assert len(exported) >= 20, exported
    for p in dashboard()["panels"]:
        for t in p["targets"]:
            used = set(re.findall(r"ray_ppserve_\w+", t["expr"]))
            assert used and used <= exported, (p["title"], used - exported)


def test_distance_to_the_hardware_panels():
    panels = {p["title"]: p for p in dashboard()["panels"]}
    prefill = panels["Prefill: achieved TFLOP/s and fraction of peak"]
    decode = panels["Decode: bytes read per second and fraction of HBM bandwidth"]
    exprs = [t["expr"] for t in prefill["targets"]]
    assert exprs[0] == prefill_flops_per_second()
    flops, busy = prefill_flops_per_second("5m").split(" / ")
    assert 'model_flops_total{phase="prefill"}' in flops and "[5m]" in flops
    assert 'stage_busy_seconds_total{phase="prefill"}' in busy
    for dtype in ("bf16", "fp8"):  # the peak is the server's gauge, not a constant here
        assert (
            fraction_of_peak(exprs[0], f'hardware_peak_flops_per_second{{dtype="{dtype}"}}')
            in exprs
        )
    exprs = [t["expr"] for t in decode["targets"]]
    assert exprs[0] == decode_bytes_per_second()
    read, busy = decode_bytes_per_second("5m").split(" / ")
    assert "decode_read_bytes_total" in read and 'stage_busy_seconds_total{phase="decode"}' in busy
    assert fraction_of_peak(exprs[0], "hardware_peak_memory_bytes_per_second") in exprs
    # the rates on the left axis, their fractions of peak on the right, in percent
    for p in (prefill, decode):
        assert p["fieldConfig"]["defaults"]["unit"] in ("flops", "Bps")
        (right,) = p["fieldConfig"]["overrides"]
        fractions = [
            t["legendFormat"]
            for t in p["targets"]
            if re.fullmatch(right["matcher"]["options"], t["legendFormat"])
        ]
        assert len(fractions) == (2 if p is prefill else 1)
        assert {"id": "unit", "value": "percentunit"} in right["properties"]


def test_kernel_fallbacks_have_a_panel_by_op_backend_and_reason():
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]
    assert any(
        "ray_ppserve_kernel_fallbacks_total" in e and "op, backend, reason" in e for e in exprs
    )
