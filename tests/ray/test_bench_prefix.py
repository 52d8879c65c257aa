"""`ppserve bench prefix` on CPU with the built-in tiny model and tiny lengths: every part runs
with the cache on and off, and the JSON holds the rows, the hits where the cache can hit and
none where it cannot (no timing is checked)."""

from __future__ import annotations

import json

from app.bench.prefix import main

BLOCK = 16


def test_bench_prefix_smoke(ray_cluster, tmp_path, capsys):
    out = tmp_path / "prefix.json"
    argv = ["--device", "cpu", "--model-shape", "tiny", "--docs", "96,160", "--questions", "2",
            "--question-len", "8", "--chat-turns", "3", "--chat-len", "120", "--chat-reply", "4",
            "--distinct", "2", "--distinct-len", "48", "--chunk-size", "32", "--block-size",
            str(BLOCK), "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "next (on) / first (off)" in printed and "distinct: on / off" in printed
    res = json.loads(out.read_text())
    assert res["command"] == "ppserve bench prefix " + " ".join(argv)
    assert "torch" in res["environment"] and res["model_shape"] == "tiny"
    assert res["engines"]["on"]["enable_prefix_caching"] is True
    assert res["engines"]["off"]["enable_prefix_caching"] is False

    rows = {(r["part"], r["cache"], r.get("doc_len")): r for r in res["rows"]}
    assert set(rows) == {(part, cache, doc) for cache in ("on", "off")
                         for part, doc in (("docs", 96), ("docs", 160), ("chat", None),
                                           ("distinct", None))}
    for (part, cache, doc_len), r in rows.items():
        assert all(t > 0 for t in r["ttft_s"]), r
        assert len(r["prefix_hits"]) == len(r["ttft_s"]) == len(r["prompt_lens"])
        if cache == "off" or part == "distinct":
            assert r["prefix_hits"] == [0] * len(r["ttft_s"]), r
            continue
        # cold first request; each later one finds at least the shared full blocks
        assert r["prefix_hits"][0] == 0, r
        shared = doc_len if part == "docs" else None
        for i, hits in enumerate(r["prefix_hits"][1:], start=1):
            if shared is None:  # chat: the previous turn's whole prompt
                shared = r["prompt_lens"][i - 1]
            assert hits >= shared // BLOCK * BLOCK, (part, i, r)
            shared = None if part == "chat" else shared
    docs = rows[("docs", "on", 160)]
    assert docs["prompt_lens"] == [168] * 3
    assert rows[("chat", "on", None)]["prompt_lens"] == [36, 76, 116]

    s = res["summary"]
    assert set(s["docs"]) == {"96", "160"} and "next_on_over_first_off" in s["docs"]["160"]
    assert len(s["chat"]["on"]["turn_ttft_s"]) == 3
    assert s["distinct"]["on"]["n"] == s["distinct"]["off"]["n"] == 2
    assert s["distinct"]["on_over_off"] > 0
