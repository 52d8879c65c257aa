"""`ppserve bench compare OLD NEW [--threshold 0.05]`: the regression guard. OLD and NEW are
`ppserve bench suite` result files or directories of them (a run before a change, one after).
Every figure both hold from the same hardware is compared; one more than the threshold worse
(slower TTFT, fewer tok/s, fewer KV tokens) is flagged, and any flag makes the exit status 1.
A figure measured on another chip (an H100 lent for an H200 row) is listed, not compared.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from app.bench.suite import load_results, value_text


def figure_map(results: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(row, label) -> the figure, with its result's hardware."""
    return {
        (r["row"], f["label"]): dict(f, hardware=r.get("hardware"))
        for r in results
        for f in r["figures"]
    }


def worse_by(old: dict[str, Any], new: dict[str, Any]) -> float:
    """How much worse NEW is, as a fraction of OLD (negative: better)."""
    a, b = float(old["value"]), float(new["value"])
    if a == 0:
        return 0.0
    return (a - b) / a if old["higher_is_better"] else (b - a) / a


def compare(
    old: list[dict[str, Any]], new: list[dict[str, Any]], threshold: float
) -> tuple[list[str], list[str]]:
    """(table lines, names of the figures worse by more than threshold)."""
    o, n = figure_map(old), figure_map(new)
    lines, flagged = ["row | figure | old | new | change (+ better)"], []
    for key in [k for k in o if k in n]:
        if o[key]["hardware"] != n[key]["hardware"]:
            lines.append(
                f"{key[0]} | {key[1]} | {value_text(o[key])} | {value_text(n[key])} | "
                f"not compared: {o[key]['hardware']} against {n[key]['hardware']}"
            )
            continue
        w = worse_by(o[key], n[key])
        mark = ""
        if w > threshold:
            mark = "  << REGRESSION"
            flagged.append(f"{key[0]}: {key[1]}")
        lines.append(
            f"{key[0]} | {key[1]} | {value_text(o[key])} | {value_text(n[key])} | "
            f"{(-w or 0.0):+.1%}{mark}"
        )
    for key in sorted(set(o) ^ set(n)):
        lines.append(f"{key[0]} | {key[1]} | only in {'OLD' if key in o else 'NEW'}")
    return lines, flagged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ppserve bench compare", description=__doc__)
    p.add_argument("old", help="suite result file or directory (before)")
    p.add_argument("new", help="suite result file or directory (after)")
    p.add_argument("--threshold", type=float, default=0.05, help="worse by more flags")
    a = p.parse_args(argv)
    lines, flagged = compare(load_results([a.old]), load_results([a.new]), a.threshold)
    print("\n".join(lines))
    if flagged:
        print(f"{len(flagged)} figure(s) worse by more than {a.threshold:.0%}", file=sys.stderr)
        return 1
    print(f"no figure worse by more than {a.threshold:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
