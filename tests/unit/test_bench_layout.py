"""Benchmarks sit beside the serving path (app/bench/): nothing else imports them, they reach the
engine only through app/bench/target.py (and the bench's actors it starts, app/bench/actors.py),
and the serving actors carry no bench knob."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE_MODULES = {"app.engine", "app.coordinator", "app.config", "app.pipeline", "app.server"}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_serving_code_never_imports_the_benches():
    for f in sorted((ROOT / "app").rglob("*.py")) + sorted((ROOT / "stages").rglob("*.py")):
        if "bench" in f.relative_to(ROOT).parts[:2]:
            continue
        bad = {m for m in imported_modules(f) if m == "app.bench" or m.startswith("app.bench.")}
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


def test_benches_reach_the_engine_only_through_the_target():
    for f in sorted((ROOT / "app" / "bench").glob("*.py")):
        if f.name in ("target.py", "actors.py"):
            continue
        bad = imported_modules(f) & ENGINE_MODULES
        assert not bad, f"app/bench/{f.name} imports {sorted(bad)}: use app.bench.target"


BENCH_KNOBS = {"set_policy", "flush_timings", "take_timings", "call", "stage_timings"}


def defined_names(path: Path) -> set[str]:
    """Functions, methods and attributes (self.x = ...) a module defines."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.attr for t in targets if isinstance(t, ast.Attribute))
    return names


def test_serving_code_defines_no_bench_knob():
    for f in sorted((ROOT / "app").rglob("*.py")) + sorted((ROOT / "stages").rglob("*.py")):
        if "bench" in f.relative_to(ROOT).parts[:2]:
            continue
        bad = defined_names(f) & BENCH_KNOBS
        assert not bad, f"{f.relative_to(ROOT)} defines {sorted(bad)}: app/bench/actors.py's"
