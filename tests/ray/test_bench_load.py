"""`ppserve bench load` on CPU with the built-in tiny model: both parts run and write sane JSON.

The mixed load's token budget defaults to 2 chunks (64 tokens here), and the 4 decoding requests
(16-token prompts, 64 tokens in all) are admitted in one microbatch, so they decode in lockstep
and every other microbatch (PP=2) is decode-free and holds chunks of both long prompts: a
multi-request prefill-only microbatch, which `sglang` sends (missed) and `auto` skips.
"""

from __future__ import annotations

import json

from app.bench.load import main
from app.bench.stream_timing import percentile


def test_percentile():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 99) == 1.99
    assert percentile([5.0], 99) == 5.0


def test_bench_load_smoke(tmp_path, capsys):
    out = tmp_path / "load.json"
    rc = main(["--device", "cpu", "--model-shape", "tiny", "--pp", "2", "--long-len", "200",
               "--num-long", "2", "--num-decode", "4", "--decode-tokens", "8", "--reps", "1",
               "--chunk-size", "32", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "mixed load" in printed and "decode throughput" in printed
    res = json.loads(out.read_text())
    assert res["command"].startswith("ppserve bench load --device cpu")
    assert "torch" in res["environment"] and "ray" in res["environment"]
    engine = res["engine"]
    assert engine["kv_capacity_tokens"] == engine["num_kv_blocks"] * engine["block_size"]

    mixed = res["mixed"]
    assert {r["mode"] for r in mixed["runs"]} == {"sglang", "auto"}
    for r in mixed["runs"]:
        assert len(r["ttft_s"]) == 2 and all(t > 0 for t in r["ttft_s"])
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["decodes_outlasted"], r
    s, a = mixed["summary"]["sglang"], mixed["summary"]["auto"]
    assert a["comm"]["missed"] == 0 and a["skip_hit_ratio"] == 1.0
    assert s["comm"]["missed"] > 0
    assert a["comm"]["skipped"] > s["comm"]["skipped"]
    assert s["comm"]["sent"] > a["comm"]["sent"]

    dec = res["decode"]
    assert set(dec["summary"]) == {"off", "auto"}
    for mode, row in dec["summary"].items():
        assert row["tokens_per_s"] > 0, mode
    for r in dec["runs"]:
        assert r["output_tokens"] == 64 * 8
    assert dec["summary"]["off"]["comm"]["skipped"] == 0
    assert dec["summary"]["auto"]["comm"]["missed"] == 0
