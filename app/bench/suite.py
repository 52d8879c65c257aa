"""`ppserve bench suite`: run rows of the benchmark manifest (app/bench/suite_rows.py), one
subprocess of its bench module each, and write one JSON a row: the commit, the environment,
the exact command, the bench's raw output and the figures read from it, each with its distance
to the hardware (app/bench/roofline.py). `--report DIR` prints the markdown table that opens
docs/PERFORMANCE.md from such files; `ppserve bench compare` guards against regressions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from app.bench.load import decode_parts
from app.bench.roofline import decode_distance, prefill_distance
from app.bench.suite_rows import ROWS, Row, select
from app.bench.target import commit
from app.model_cost import H200_HBM_TBS, HBM_TBS, expert_bytes_held

Figure = dict[str, Any]  # label, value, unit, higher_is_better, distance


def command(row: Row, out: str) -> list[str]:
    return [sys.executable, "-m", f"app.bench.{row.module}", *row.args, "--out", out]


def _quant(r: dict[str, Any]) -> str:
    fp8 = r.get("quantization") == "fp8" or r.get("kv_cache_dtype") == "fp8"
    return " fp8" if fp8 else ""


def ttft_figures(raw: dict[str, Any]) -> list[Figure]:
    """One figure per (PP, linear, prompt, chunking, mode) of an engine bench's output."""
    figures = []
    for r in raw["results"]:
        n = r["prompt_len"]
        length = f"{n // 1024}K" if n >= 1024 else str(n)
        tp = r.get("tp", 1)  # files from before --tp have none
        label = (
            f"TTFT {length} pp{r['pp']}{f' tp{tp}' if tp > 1 else ''} {r['mode']} {r['linear']}"
            f"{'' if r.get('chunking', 'fixed') == 'fixed' else ' ' + r['chunking']}{_quant(r)}"
        )
        t = r["ttft_median_s"]
        # files from before chunking was recorded cut fixed chunks
        chunks = r.get("chunks") or [r["chunk"]] * (n // r["chunk"]) + [n % r["chunk"]] * (
            n % r["chunk"] > 0
        )
        figures.append(
            {
                "label": label,
                "value": t,
                "unit": "s",
                "higher_is_better": False,
                "distance": prefill_distance(raw["model"], chunks, t, r["pp"] * tp),
            }
        )
    return figures


def decode_figures(raw: dict[str, Any], hbm_tbs: float = H200_HBM_TBS) -> list[Figure]:
    """tok/s and ITL per skip mode of each of a load bench's decode parts (one per
    concurrency), and the KV capacity; bytes a step against hbm_tbs."""
    engine = raw.get("engine", {})
    fp8_w = engine.get("quantization") == "fp8"
    fp8_kv = engine.get("kv_cache_dtype") == "fp8"
    figures: list[Figure] = []
    for d in decode_parts(raw):
        tag = (" fp8" if fp8_w or fp8_kv else "") + f" {d['concurrency']} rows"
        for mode, s in (d.get("summary") or _summary(d["runs"])).items():
            # a step gives each row one token: rows over the steady tok/s (every request past
            # its first token; older files have the whole run's). Not the ITL p50, which falls
            # below the step where a stream behind gets tokens merged (each token a share of
            # the gap): at 512 V4 rows 12.5 ms against a 22 ms step
            if "steady_tokens_per_s" in s and s["steady_tokens_per_s"] is None:
                continue  # no lockstep window (stream_timing.steady_decode): no rate to give
            tok_s = s.get("steady_tokens_per_s") or s.get("tokens_per_s")
            itl = s.get("itl_p50_ms")
            step = itl / 1e3 if itl else s.get("stage_forward_s")
            if tok_s:
                step = d["concurrency"] / tok_s
            # the context a step reads, on average over the run
            context = d["short_len"] + d["decode_tokens"] // 2
            dist = (
                decode_distance(
                    raw["model"],
                    d["concurrency"],
                    context,
                    step,
                    1.0 if fp8_w else 2.0,
                    1.0 if fp8_kv else 2.0,
                    expert_bytes_held(raw["model"], engine.get("mxfp4_experts", "dequantize")),
                    hbm_tbs,
                )
                if step
                else {}
            )
            figures.append(
                {
                    "label": f"decode {mode}{tag}",
                    "value": tok_s,
                    "unit": "tok/s",
                    "higher_is_better": True,
                    "distance": dict(dist, step_ms=round(step * 1e3, 3)) if step else dist,
                }
            )
            if itl:
                figures.append(
                    {
                        "label": f"ITL p50 {mode}{tag}",
                        "value": itl,
                        "unit": "ms",
                        "higher_is_better": False,
                        "distance": figures[-1]["distance"],  # the same step
                    }
                )
    if engine.get("kv_capacity_tokens") and raw.get("command", "").count("--kv-blocks memory"):
        figures.append(
            {
                "label": f"KV capacity{' fp8' if fp8_kv else ''}",
                "value": engine["kv_capacity_tokens"],
                "unit": "tokens",
                "higher_is_better": True,
                "distance": {},
            }
        )
    return figures


def _summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Medians per mode, for load files from before the bench wrote its summary."""
    modes = {r["mode"] for r in runs}
    return {
        m: {
            k: statistics.median(r[k] for r in runs if r["mode"] == m and r.get(k))
            for k in ("tokens_per_s", "stage_forward_s")
            if any(r.get(k) for r in runs if r["mode"] == m)
        }
        for m in sorted(modes)
    }


def figures(row: Row, raw: dict[str, Any], hardware: str | None = None) -> list[Figure]:
    hbm = HBM_TBS.get((hardware or row.hardware).partition("x")[2], H200_HBM_TBS)
    return ttft_figures(raw) if row.kind == "ttft" else decode_figures(raw, hbm)


def measured_hardware(row: Row, env: dict[str, Any]) -> str:
    """What ran the row, in the manifest's spelling ("1xH200", "cpu"): the row's GPU count and
    the chip the environment names (an H100 lent for an H200 row is said to be one)."""
    gpus = env.get("gpus") or []
    if not gpus or row.hardware == "cpu":  # a CPU row runs on the CPU wherever it is run
        return "cpu"
    chip = re.search(r"\b([A-Z]\d{2,3})\b", gpus[0])
    count = row.hardware.partition("x")[0] if "x" in row.hardware else str(len(gpus))
    return f"{count}x{chip.group(1) if chip else gpus[0].replace(' ', '_')}"


def run_row(row: Row, out_dir: str, timeout: float | None = None) -> dict[str, Any]:
    """Run one row; its result (also written to OUT_DIR/NAME.json), failed or not, and the
    bench's whole output in OUT_DIR/NAME.log (a timed-out run's too, up to where it stopped)."""
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = os.path.join(tmp, "raw.json")
        cmd = command(row, raw_path)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:  # what it wrote until then stays in its log
            rc, output = 124, _text(e.stdout) + _text(e.stderr) + f"\ntimed out after {e.timeout} s"
        raw = json.load(open(raw_path)) if os.path.exists(raw_path) else None
    result = _result(row, raw, _environment(), commit(), datetime.date.today().isoformat())
    result.update(returncode=rc, wall_s=round(time.perf_counter() - t0, 1))
    if rc:
        result["output_tail"] = output[-4000:]
    _write(result, out_dir)
    with open(os.path.join(out_dir, f"{row.name}.log"), "w") as f:
        f.write(output)
    return result


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def adopt(row: Row, raw_path: str, out_dir: str, date: str | None = None) -> dict[str, Any]:
    """The row's result from a run of its bench made outside the suite (a device call that ran
    the bench directly, keeping its log): the bench's own JSON, its command holding the row's
    arguments, its environment naming the commit (or PPSERVE_COMMIT here). Written to
    OUT_DIR/NAME.json as run_row writes it, with `adopted_from`."""
    with open(raw_path) as f:
        raw = json.load(f)
    ran = str(raw.get("command", ""))
    words = ran.split()
    missing = [
        " ".join(pair)
        for pair in _arg_pairs(row.args)
        if not any(words[i : i + len(pair)] == pair for i in range(len(words)))
    ]
    if missing:
        raise ValueError(f"{raw_path} did not run row {row.name}: its command lacks {missing}")
    env = raw.get("environment") or {}
    at = env.get("commit") or os.environ.get("PPSERVE_COMMIT")
    if not at:
        raise ValueError(f"{raw_path} names no commit: set PPSERVE_COMMIT to the one that ran")
    day = date or datetime.date.fromtimestamp(os.path.getmtime(raw_path)).isoformat()
    result = _result(row, raw, env, at, day)
    result.update(command=ran, returncode=0, adopted_from=raw_path)
    _write(result, out_dir)
    return result


def _arg_pairs(args: tuple[str, ...]) -> list[list[str]]:
    """A row's arguments as [flag, value] (a flag alone where no value follows)."""
    pairs: list[list[str]] = []
    for a in args:
        if a.startswith("--") or not pairs:
            pairs.append([a])
        else:
            pairs[-1].append(a)
    return pairs


def _result(
    row: Row, raw: dict[str, Any] | None, env: dict[str, Any], at: str, date: str
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "row": row.name,
        "shape": row.shape,
        "hardware": measured_hardware(row, env),
        "row_hardware": row.hardware,
        "target": row.target,
        "date": date,
        "commit": at,
        "environment": env,
        "command": f"python -m app.bench.{row.module} " + " ".join(row.args),
        "returncode": 0,
        "wall_s": None,
        "figures": [],
        "raw": raw,
    }
    try:
        result["figures"] = figures(row, raw, result["hardware"]) if raw else []
    except (KeyError, TypeError, ZeroDivisionError) as e:  # a killed run's partial output
        result["error"] = f"could not read the figures: {e!r}"
    return result


def _write(result: dict[str, Any], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{result['row']}.json"), "w") as f:
        json.dump(result, f, indent=1)


def _environment() -> dict[str, Any]:
    from app.bench.target import environment

    return environment()


def distance_text(d: dict[str, Any]) -> str:
    if "tflops" in d:
        return f"{d['tflops']} TFLOP/s: {d['of_bf16']:.0%} of bf16, {d['of_fp8']:.0%} of FP8"
    if "of_hbm" in d:
        return (
            f"{d['weights_gb']} GB weights + {d['kv_gb']} GB KV a step "
            f"({d['step_ms']} ms): {d['of_hbm']:.0%} of HBM"
        )
    return ""


def value_text(f: Figure) -> str:
    v, unit = f["value"], f["unit"]
    if unit == "s":
        return f"{v:.3f} s"
    if unit == "ms" and v < 100:  # a one-row ITL of 2.93 ms is not "3 ms"
        return f"{v:.2f} ms"
    return f"{v:,.0f} {unit}"


def load_results(paths: list[str]) -> list[dict[str, Any]]:
    """Suite results from files and directories (every *.json in them), in manifest order."""
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, n) for n in os.listdir(p) if n.endswith(".json"))
        else:
            files.append(p)
    results = [json.load(open(f)) for f in files]
    order = {r.name: i for i, r in enumerate(ROWS)}
    return sorted(results, key=lambda r: order.get(r.get("row", ""), len(order)))


def report(results: list[dict[str, Any]]) -> str:
    """The markdown table of figures, one line each, with date, commit, hardware and row."""
    lines = [
        "| figure | value | distance to the hardware | date | commit | hardware | suite row |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for f in r["figures"]:
            lines.append(
                f"| {f['label']} | {value_text(f)} | {distance_text(f['distance'])} | "
                f"{r['date']} | {r['commit']} | {r['hardware']} | `{r['row']}` |"
            )
        if r.get("returncode"):
            lines.append(f"| `{r['row']}` failed (exit {r['returncode']}) | | | {r['date']} | "
                         f"{r['commit']} | {r['hardware']} | `{r['row']}` |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ppserve bench suite", description=__doc__)
    p.add_argument("--only", default=None, help="comma-separated row or subset names")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="keep these rows")
    p.add_argument("--out", default="bench_suite", help="directory of the rows' JSON files")
    p.add_argument("--list", action="store_true", help="print the rows and exit")
    p.add_argument("--timeout", type=float, default=None, help="seconds a row may run")
    p.add_argument("--report", nargs="+", metavar="PATH", help="table of these results")
    p.add_argument(
        "--adopt",
        nargs="+",
        metavar="ROW=RAW.json",
        help="write each row's result (to --out) from its bench's JSON of a run made outside "
        "the suite, then print their lines of the table",
    )
    p.add_argument("--date", default=None, help="--adopt: the runs' date (default: the files')")
    a = p.parse_args(argv)
    if a.report:
        print(report(load_results(a.report)))
        return 0
    if a.adopt:
        by_name = {r.name: r for r in ROWS}
        adopted = []
        for item in a.adopt:
            name, _, path = item.partition("=")
            if name not in by_name or not path:
                p.error(f"--adopt takes ROW=RAW.json with a row of the manifest, got {item!r}")
            try:
                adopted.append(adopt(by_name[name], path, a.out, a.date))
            except (OSError, ValueError) as e:
                p.error(str(e))
        print(report(adopted))
        return 0
    rows = select(a.only.split(",") if a.only else None, a.device)
    if a.list:
        for r in rows:
            print(f"{r.name:26s} {r.hardware:7s} {','.join(r.subsets):20s} {r.target}")
        return 0
    results = []
    for row in rows:
        print(f"suite: {row.name} ({row.hardware}) ...", flush=True)
        results.append(run_row(row, a.out, a.timeout))
        print(report(results[-1:]).splitlines()[-1], flush=True)
    print(report(results))
    failed = [r["row"] for r in results if r["returncode"] or not r["figures"]]
    if failed:
        print(f"suite: failed {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
