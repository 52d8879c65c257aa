"""The benchmark manifest (app/bench/suite_rows.py), its report and the regression guard."""

import argparse
import importlib
import json
from pathlib import Path

import pytest

from app.bench import compare, suite
from app.bench.suite_rows import HARDWARE, KINDS, ROWS, select


class Parsed(Exception):
    """Raised right after a bench's own parser accepted the row's arguments."""


def test_row_names_unique_and_fields_known():
    names = [r.name for r in ROWS]
    assert len(names) == len(set(names))
    subsets = {s for r in ROWS for s in r.subsets}
    assert not subsets & set(names), "a subset may not share a row's name"
    for r in ROWS:
        assert r.hardware in HARDWARE and r.kind in KINDS, r
        assert "--out" not in r.args, f"{r.name}: the suite picks --out"
    assert {"smoke", "h200-headline", "h200", "h200x2"} <= subsets


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_every_row_parses_with_its_bench_parser(row, monkeypatch):
    # main() builds its parser inside: stop it right after parse_args, before any work
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        ns = real(self, args, namespace)
        raise Parsed(ns)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    main = importlib.import_module(f"app.bench.{row.module}").main
    with pytest.raises(Parsed) as got:
        main(suite.command(row, "/nonexistent/out.json")[3:])
    ns = got.value.args[0]
    assert ns.out == "/nonexistent/out.json"
    assert ns.model_shape == row.shape
    gpus = {"cpu": 1, "1xH200": 1, "2xH200": 2}[row.hardware]
    assert ns.pp * ns.tp == gpus, f"{row.name}: pp {ns.pp} x tp {ns.tp} on {row.hardware}"
    assert (ns.device == "cpu") == (row.hardware == "cpu")


def test_select_by_subset_name_and_device():
    assert [r.name for r in select(["smoke"], None)] == ["smoke-ttft", "smoke-decode"]
    assert all(r.hardware == "1xH200" for r in select(["h200"], "cuda"))
    assert select(["h200-headline"], "cpu") == []
    assert {r.hardware for r in select(None, "cuda")} == {"1xH200", "2xH200"}
    with pytest.raises(ValueError, match="nope"):
        select(["nope"], None)


def result(row, figures, **extra):
    return dict(
        row=row, date="2026-12-03", commit="abc123", hardware="1xH200", figures=figures, **extra
    )


def fig(label, value, unit="s", **distance):
    return {
        "label": label,
        "value": value,
        "unit": unit,
        "higher_is_better": unit != "s",
        "distance": distance,
    }


OLD = [
    result("ttft-llama8b", [fig("TTFT 128K", 10.0), fig("TTFT 64K", 3.0)]),
    result("decode-llama8b-64", [fig("decode auto 64 rows", 6000.0, "tok/s")]),
]
NEW = [
    result("ttft-llama8b", [fig("TTFT 128K", 10.4), fig("TTFT 64K", 3.3)]),  # +4 %, +10 %
    result("decode-llama8b-64", [fig("decode auto 64 rows", 5000.0, "tok/s")]),  # -17 %
]


def test_compare_flags_only_rows_past_the_threshold():
    lines, flagged = compare.compare(OLD, NEW, 0.05)
    assert flagged == ["ttft-llama8b: TTFT 64K", "decode-llama8b-64: decode auto 64 rows"]
    assert sum("REGRESSION" in ln for ln in lines) == 2
    assert compare.compare(OLD, NEW, 0.2)[1] == []
    assert compare.compare(NEW, OLD, 0.05)[1] == []  # faster is never flagged


def test_compare_leaves_figures_of_another_chip_uncompared():
    """An H100's run of an H200 row is slower by its chip, not by a change: listed, not
    flagged; on the same chip it is compared."""
    on_h100 = [dict(r, hardware="1xH100") for r in NEW]
    lines, flagged = compare.compare(OLD, on_h100, 0.05)
    assert flagged == []
    assert sum("not compared: 1xH200 against 1xH100" in ln for ln in lines) == 3
    assert len(compare.compare([dict(r, hardware="1xH100") for r in OLD], on_h100, 0.05)[1]) == 2


def test_compare_exit_code_over_files_and_dirs(tmp_path, capsys):
    for name, results in (("old", OLD), ("new", NEW)):
        (tmp_path / name).mkdir()
        for r in results:
            (tmp_path / name / f"{r['row']}.json").write_text(json.dumps(r))
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    assert compare.main([old, new]) == 1
    assert compare.main([old, new, "--threshold", "0.2"]) == 0
    one = str(tmp_path / "old" / "ttft-llama8b.json")
    assert compare.main([one, one]) == 0
    assert "REGRESSION" in capsys.readouterr().out


def test_report_table_one_line_per_figure_in_manifest_order(tmp_path, capsys):
    ttft = fig("TTFT 128K pp1 auto torch", 11.57, tflops=547.4, of_bf16=0.693, of_fp8=0.346)
    dec = fig(
        "decode auto 64 rows", 6654.0, "tok/s", weights_gb=16.06, kv_gb=1.68, step_ms=9.6,
        of_hbm=0.385,
    )  # fmt: skip
    (tmp_path / "b.json").write_text(json.dumps(result("decode-llama8b-64", [dec])))
    (tmp_path / "a.json").write_text(json.dumps(result("ttft-llama8b", [ttft])))
    table = suite.report(suite.load_results([str(tmp_path)])).splitlines()
    assert table[0].startswith("| figure | value | distance")
    assert table[2] == (
        "| TTFT 128K pp1 auto torch | 11.570 s | 547.4 TFLOP/s: 69% of bf16, 35% of FP8 | "
        "2026-12-03 | abc123 | 1xH200 | `ttft-llama8b` |"
    )
    assert "6,654 tok/s" in table[3] and "38% of HBM" in table[3]
    assert suite.main(["--report", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().splitlines() == table


def test_value_text_keeps_a_short_latencys_digits():
    assert suite.value_text(fig("ITL p50 auto fp8 1 rows", 2.9339, "ms")) == "2.93 ms"
    assert suite.value_text(fig("ITL p50 auto 512 rows", 117.18, "ms")) == "117 ms"
    assert suite.value_text(fig("decode auto 64 rows", 6654.2, "tok/s")) == "6,654 tok/s"
    assert suite.value_text(fig("TTFT 64K", 0.7761)) == "0.776 s"


def test_performance_doc_opens_with_the_generated_table():
    # the headline table is `ppserve bench suite --report docs/bench/latest`, never hand-edited
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "PERFORMANCE.md").read_text()
    begin, end = "<!-- suite report: begin -->\n", "\n<!-- suite report: end -->"
    table = doc[doc.index(begin) + len(begin) : doc.index(end)]
    results = suite.load_results([str(root / "docs" / "bench" / "latest")])
    assert {r["row"] for r in results} <= {r.name for r in ROWS}
    assert table == suite.report(results)


def test_commit_from_the_environment_where_git_is_missing(monkeypatch):
    monkeypatch.setenv("PPSERVE_COMMIT", "deadbeef")
    assert suite.commit() == "deadbeef"
    monkeypatch.delenv("PPSERVE_COMMIT")
    assert suite.commit() != "deadbeef"


def test_decode_distance_takes_the_step_from_the_rows_tok_s():
    """A step gives each row one token, so its time is rows / tok/s. At 512 V4 rows (the H200
    run on record) the ITL p50 is shorter than that (merged deltas share a gap) and is not
    the step the roofline divides the bytes by."""
    root = Path(__file__).resolve().parents[2]
    raw = json.loads((root / "docs/bench/latest/decode-v4-flash-512-fp8.json").read_text())["raw"]
    tok_s, itl = suite.decode_figures(raw)[:2]
    step_ms = 512 / tok_s["value"] * 1e3
    assert tok_s["distance"]["step_ms"] == itl["distance"]["step_ms"] == round(step_ms, 3)
    assert itl["value"] < step_ms
    read = tok_s["distance"]["weights_gb"] + tok_s["distance"]["kv_gb"]
    assert tok_s["distance"]["of_hbm"] == round(read / step_ms / 4.8, 3)


def test_a_closed_lockstep_window_gives_no_decode_rate():
    """Session 22's H200 run of the 512-row FP8 row: its window held no whole gap, so the
    bench gave no steady rate; the report then has no decode figure (not the run's 3,460 tok/s
    with the prefill inside, nor the sliver's 78,939), only the KV capacity."""
    root = Path(__file__).resolve().parents[2]
    path = root / "docs/bench/session22/call2/suite/decode-v4-flash-512-fp8.json"
    raw = json.loads(path.read_text())["raw"]
    for part in [raw["decode"], *raw["decode"]["runs"]]:
        summary = part.get("summary", {}).get("auto", part)
        summary["steady_tokens_per_s"], summary["itl_p50_ms"] = None, None
    assert [f["label"] for f in suite.decode_figures(raw)] == ["KV capacity fp8"]


def test_a_row_is_labelled_with_the_chip_that_ran_it():
    """An H100 lent for an H200 row says H100 in the report, and its decode rows' fraction of
    HBM divides by the H100's bandwidth; a run with no GPU says cpu."""
    row = next(r for r in ROWS if r.name == "decode-v4-flash-512-fp8")
    h100 = {"gpus": ["NVIDIA H100 80GB HBM3"]}
    assert suite.measured_hardware(row, h100) == "1xH100"
    assert suite.measured_hardware(row, {"gpus": ["NVIDIA H200"] * 8}) == "1xH200"
    assert suite.measured_hardware(row, {}) == "cpu"
    smoke = next(r for r in ROWS if r.hardware == "cpu")
    assert suite.measured_hardware(smoke, h100) == "cpu"
    root = Path(__file__).resolve().parents[2]
    raw = json.loads((root / "docs/bench/latest/decode-v4-flash-512-fp8.json").read_text())["raw"]
    on_h200 = suite.figures(row, raw, "1xH200")[0]["distance"]["of_hbm"]
    on_h100 = suite.figures(row, raw, "1xH100")[0]["distance"]["of_hbm"]
    assert on_h100 == pytest.approx(on_h200 * 4.8 / 3.35, abs=2e-3)


SESSION32_DG = "docs/bench/session32/call3/ttft_fp8_deepgemm.json"  # the engine bench's JSON


def test_adopt_a_run_of_the_rows_bench_made_outside_the_suite(tmp_path, monkeypatch, capsys):
    """A device call that ran the engine bench directly (its log kept): its JSON becomes the
    row's result, labelled with the chip and commit that ran it, as run_row writes it."""
    root = Path(__file__).resolve().parents[2]
    raw_path = str(root / SESSION32_DG)
    monkeypatch.setenv("PPSERVE_COMMIT", "fb273e6")
    out = str(tmp_path / "latest")
    assert suite.main(["--adopt", f"ttft-v4-flash-fp8={raw_path}", "--out", out,
                       "--date", "2026-12-07"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[2].startswith("| TTFT 64K pp1 auto auto fp8 | 0.793 s |")
    assert "| 2026-12-07 | fb273e6 | 1xH100 | `ttft-v4-flash-fp8` |" in lines[4]
    [written] = suite.load_results([out])
    assert written["adopted_from"] == raw_path and written["returncode"] == 0
    assert written["command"].startswith("python -m app.bench --model-shape deepseek-v4-flash")
    assert suite.report([written]).splitlines() == lines


def test_adopt_refuses_another_rows_run_and_a_run_without_its_commit(tmp_path, monkeypatch):
    root = Path(__file__).resolve().parents[2]
    raw_path = str(root / SESSION32_DG)
    rows = {r.name: r for r in ROWS}
    monkeypatch.setenv("PPSERVE_COMMIT", "fb273e6")
    with pytest.raises(ValueError, match="--quantization none"):
        suite.adopt(rows["ttft-v4-flash"], raw_path, str(tmp_path))  # the bf16 row
    monkeypatch.delenv("PPSERVE_COMMIT")
    with pytest.raises(ValueError, match="names no commit"):
        suite.adopt(rows["ttft-v4-flash-fp8"], raw_path, str(tmp_path))
    assert not list(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        suite.main(["--adopt", f"no-such-row={raw_path}", "--out", str(tmp_path)])


def test_environment_names_the_commit_and_the_kernel_libraries(monkeypatch):
    from app.bench import target

    monkeypatch.setenv("PPSERVE_COMMIT", "deadbeef")
    env = target.environment()
    assert env["commit"] == "deadbeef"
    libs = env["kernel_libraries"]
    assert set(libs) == set(target.KERNEL_LIBRARIES)
    assert libs["deep_gemm"] is None  # not built on a CPU machine


def test_a_timed_out_row_keeps_what_its_bench_wrote(tmp_path, monkeypatch):
    """Session 32's suite row timed out on a fresh machine's compiles with no output at all:
    the bench's output up to the kill now stays in the row's log (and its result's tail)."""
    import sys

    script = "print('compiling the kernels', flush=True); import time; time.sleep(60)"
    monkeypatch.setattr(suite, "command", lambda row, out: [sys.executable, "-c", script])
    row = next(r for r in ROWS if r.name == "smoke-ttft")
    result = suite.run_row(row, str(tmp_path), timeout=5)
    assert result["returncode"] == 124 and result["figures"] == []
    log = (tmp_path / "smoke-ttft.log").read_text()
    assert "compiling the kernels" in log and "timed out after 5" in log
    assert "compiling the kernels" in result["output_tail"]
