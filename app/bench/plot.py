"""Draw the lone-prompt engine bench (`ppserve bench engine` JSON files) as one PNG.

    python -m app.bench.plot docs/bench/engine_*.json --out docs/bench/ttft.png

One panel per prompt length; in each, a group of bars per (chunk, linear backend, PP, attention
backend), one bar per skip mode / posting policy (TTFT median), and the no-contention bound of
the group as a black line across it. matplotlib is an optional extra: pip install 'ppserve[bench]'.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

MODE_ORDER = ["off-early", "off-late", "off-sm1", "sglang", "auto"]
COLORS = {"off-early": "#9e9e9e", "off-late": "#607d8b", "off-sm1": "#795548",
          "sglang": "#ff9800", "auto": "#1976d2"}


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def load_rows(paths: list[str]) -> dict[int, dict[tuple[Any, ...], dict[str, Any]]]:
    """{prompt_len: {(chunk, linear, pp, attention): {mode: row}}}; a later file wins."""
    panels: dict[int, dict[tuple[Any, ...], dict[str, Any]]] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for r in data.get("results", []):
            attention = (r.get("kernels") or {}).get("attention", "torch")
            key = (r["chunk"], r["linear"], r["pp"], attention)
            group = panels.setdefault(r["prompt_len"], {}).setdefault(key, {})
            if r["mode"] in group:
                print(f"note: {path} replaces {r['mode']} of {_k(r['prompt_len'])} {key}",
                      file=sys.stderr)
            group[r["mode"]] = dict(r, source=path)
    return panels


def _label(key: tuple[Any, ...], prompt_len: int) -> str:
    chunk, linear, pp, attention = key
    lines = [f"PP={pp}", "no chunks" if chunk >= prompt_len else f"{_k(chunk)} chunks",
             linear.replace("triton-persistent", "persistent GEMM")]
    if attention not in ("torch", "auto"):
        lines.append(attention)
    return "\n".join(lines)


def draw(panels: dict[int, dict[tuple[Any, ...], dict[str, Any]]], out: str,
         title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(panels)
    most = max(len(panels[n]) for n in lengths)
    fig, axes = plt.subplots(len(lengths), 1, figsize=(1.7 * most + 1.6, 3.8 * len(lengths) + 0.8),
                             squeeze=False)
    seen_modes: dict[str, Any] = {}
    for ax, n in zip(axes[:, 0], lengths):
        groups = sorted(panels[n].items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0],
                                                          kv[0][3]))
        for gi, (key, by_mode) in enumerate(groups):
            modes = [m for m in MODE_ORDER if m in by_mode] + sorted(set(by_mode) - set(MODE_ORDER))
            width = 0.8 / len(modes)
            for mi, mode in enumerate(modes):
                r = by_mode[mode]
                x = gi - 0.4 + width * (mi + 0.5)
                bar = ax.bar(x, r["ttft_median_s"], width * 0.92, color=COLORS.get(mode, "#4caf50"),
                             label=mode if mode not in seen_modes else None)
                seen_modes[mode] = bar
                eff = f" ({r['efficiency']:.2f})" if r.get("efficiency") else ""
                ax.text(x, r["ttft_median_s"] * 0.97, f"{r['ttft_median_s']:.2f}{eff}",
                        ha="center", va="top", fontsize=6.5, rotation=90, color="white")
            bounds = [r["bound_s"] for r in by_mode.values() if r.get("bound_s")]
            if bounds:
                ax.hlines(bounds[0], gi - 0.45, gi + 0.45, colors="black", linewidth=1.6,
                          label="bound" if "bound" not in seen_modes else None)
                seen_modes["bound"] = True
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([_label(k, n) for k, _ in groups], fontsize=7)
        ax.set_xlim(-0.6, max(len(groups), most) - 0.4)
        ax.set_title(f"{_k(n)}-token prompt")
        ax.set_ylabel("TTFT (s), median")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    order = MODE_ORDER + ["bound"]
    pairs = sorted(zip(labels, handles), key=lambda lh: order.index(lh[0]) if lh[0] in order
                   else len(order))
    labels, handles = [lh[0] for lh in pairs], [lh[1] for lh in pairs]
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False,
               bbox_to_anchor=(0.5, 1.0))
    fig.suptitle(title or "Lone long prompt: median TTFT per skip mode, s (efficiency = bound / "
                 "TTFT); black line: no-contention bound", y=0.965, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(out, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="JSON files written by `ppserve bench engine`")
    p.add_argument("--out", default="ttft.png")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("bench_plot needs matplotlib, an optional extra: pip install 'ppserve[bench]' "
              "(or pip install 'matplotlib>=3.7')", file=sys.stderr)
        return 2
    panels = load_rows(a.files)
    if not panels:
        print("no results in the given files", file=sys.stderr)
        return 1
    draw(panels, a.out, a.title)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
