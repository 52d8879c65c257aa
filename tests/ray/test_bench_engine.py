"""`ppserve bench engine` on CPU with the built-in tiny model: fixed and dynamic chunking both
run, and the engine cuts the prompt exactly as the bench's chunk plan says (the bound needs
one CUDA-event/timer sample per planned chunk and stage, and a run of other chunks has none)."""

from __future__ import annotations

import json

from app.bench.engine import chunk_plan, flow_shop_bound, main, parse_chunking


def test_flow_shop_bound():
    # stage 1 waits for stage 0's chunk, then its own previous one
    assert flow_shop_bound([[1.0, 1.0], [2.0, 2.0]]) == 5.0
    assert flow_shop_bound([[3.0, 1.0], [1.0, 1.0]]) == 5.0


def test_parse_chunking():
    assert parse_chunking("fixed") == ("fixed", None)
    assert parse_chunking("dynamic") == ("dynamic", 0.75)
    assert parse_chunking("dynamic:1.0") == ("dynamic:1.0", 1.0)


def test_bench_engine_fixed_and_dynamic_chunking(tmp_path, capsys):
    out = tmp_path / "engine.json"
    rc = main(["--device", "cpu", "--model-shape", "tiny", "--pp", "2", "--linear", "torch",
               "--runs", "400:64", "--modes", "off-early,auto", "--chunking",
               "fixed,dynamic:1.0", "--reps", "1", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["command"].startswith("python -m app.bench --device cpu")
    rows = {(r["chunking"], r["mode"]): r for r in res["results"]}
    assert set(rows) == {(c, m) for c in ("fixed", "dynamic:1.0") for m in ("off-early", "auto")}
    fixed, dynamic = rows["fixed", "auto"]["chunks"], rows["dynamic:1.0", "auto"]["chunks"]
    assert fixed == [64] * 6 + [16]
    assert sum(dynamic) == 400 and dynamic[0] == 64 and dynamic[1:-1] != [64] * (len(dynamic) - 2)
    assert dynamic[:-1] == sorted(dynamic[:-1], reverse=True)
    for r in res["results"]:
        assert r["bound_own_s"] is not None, r  # the engine ran exactly the planned chunks
        assert len(r["stage_times_s"]) == 2 and len(r["stage_times_s"][0]) == len(r["chunks"])
        assert r["ttft_median_s"] > 0
        # --kv-blocks fit: the blocks the longest run needs, as the engine reports them
        assert r["kv_capacity_tokens"] == ((400 + 256) // 64 + 8) * 64
        assert (r["quantization"], r["kv_cache_dtype"]) == ("auto", "auto")
        want = {"skipped": 0} if r["mode"] == "off-early" else {"missed": 0}
        assert all(r["comm"][k] == v for k, v in want.items()), r
    assert chunk_plan(400, 64, 1.0, res["model"]) == dynamic
