"""The Grafana dashboard is generated from app/dashboard.py's queries; both shipped copies
(deploy/ and the Helm chart's, which Helm can only read inside the chart) are that output."""

import json
from pathlib import Path

from app.dashboard import FILES, dashboard, dashboard_json, prefix_cache_hit_rate, skip_hit_ratio

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


def test_kernel_fallbacks_have_a_panel_by_op_backend_and_reason():
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]
    assert any("ray_ppserve_kernel_fallbacks_total" in e and "op, backend, reason" in e
               for e in exprs)
