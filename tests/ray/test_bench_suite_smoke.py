"""`ppserve bench suite --only smoke`: the suite's own path (subprocess per row, the bench's JSON
read back, figures with their distance, the report) on the tiny model on CPU, so it cannot rot.
Each row starts its own local Ray in its subprocess: no cluster fixture."""

import json

from app.bench import compare, suite


def test_smoke_subset_runs_and_reads_back(tmp_path, capsys):
    out = tmp_path / "suite"
    assert suite.main(["--only", "smoke", "--out", str(out), "--timeout", "120"]) == 0
    files = sorted(p.name for p in out.glob("*.json"))
    assert files == ["smoke-decode.json", "smoke-ttft.json"]
    # each bench's whole output beside its result: what a device call keeps when a row fails
    logs = sorted(p.name for p in out.glob("*.log"))
    assert logs == ["smoke-decode.log", "smoke-ttft.log"]
    assert "TTFT" in (out / "smoke-ttft.log").read_text()
    for name in files:
        r = json.loads((out / name).read_text())
        assert r["returncode"] == 0 and r["raw"] and r["figures"]
        assert r["commit"] and r["environment"]["torch"]
        assert r["command"].startswith("python -m app.bench.")
        assert all(f["value"] > 0 and f["distance"] for f in r["figures"])
    # the decode row sweeps two concurrencies on one engine: figures for each
    decode = json.loads((out / "smoke-decode.json").read_text())["figures"]
    assert {f["label"] for f in decode} >= {"decode auto 2 rows", "decode auto 4 rows"}
    table = capsys.readouterr().out
    assert "`smoke-ttft`" in table and "`smoke-decode`" in table
    # a run against itself is no regression
    assert compare.main([str(out), str(out)]) == 0
