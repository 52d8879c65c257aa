"""The Grafana dashboard is generated from app/dashboard.py's queries; both shipped copies
(deploy/ and the Helm chart's, which Helm can only read inside the chart) are that output."""

import json
from pathlib import Path

from app.dashboard import FILES, dashboard, dashboard_json, skip_hit_ratio

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
