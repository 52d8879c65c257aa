"""The import rules (docs/ARCHITECTURE.md#import-rules), checked on the source with `ast` (nothing
is imported)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE = ["app/scheduler", "app/request.py", "app/prefix_routing.py", "app/model_cost.py",
        "stages/protocol.py", "stages/partition.py", "stages/model_config.py",
        "stages/models/families.py", "stages/models/deepseek_config.py"]
MAX_LINES = 500


def py_files(rel):
    p = ROOT / rel
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.rglob("*.py") if "__pycache__" not in f.parts)
    return []


def top_imports(path):
    """Top-level package names a file imports (relative imports are resolved to their package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel_pkg = path.relative_to(ROOT).parts[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(rel_pkg if node.level else (node.module or "").split(".")[0])
    return names


@pytest.mark.parametrize("rel", PURE)
def test_pure_modules_import_no_torch_or_ray(rel):
    files = py_files(rel)
    assert files, f"{rel} is listed as a pure module but does not exist"
    for f in files:
        bad = top_imports(f) & {"torch", "ray"}
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


def test_stages_never_import_app_and_only_the_actor_imports_ray():
    for f in py_files("stages"):
        names = top_imports(f)
        rel = f.relative_to(ROOT).as_posix()
        assert "app" not in names, f"{rel} imports app/"
        if rel != "stages/actor.py":
            assert "ray" not in names, f"{rel} imports ray (only stages/actor.py may)"


def test_no_file_over_the_line_limit():
    for f in py_files("app") + py_files("stages"):
        n = len(f.read_text().splitlines())
        assert n <= MAX_LINES, f"{f.relative_to(ROOT)} has {n} lines (limit {MAX_LINES})"


def test_scheduler_imports_only_the_standard_library():
    import sys

    allowed = set(sys.stdlib_module_names) | {"app", "stages", "__future__"}
    for f in py_files("app/scheduler"):
        extra = top_imports(f) - allowed
        assert not extra, f"{f.relative_to(ROOT)} imports {sorted(extra)}"


def test_scheduler_reaches_stages_only_through_the_protocol():
    for f in py_files("app/scheduler"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module.split(".")[0] == "stages":
                    assert node.module == "stages.protocol", f"{f.name} imports {node.module}"


# Code that must not know which model family it runs: everything in app/ and stages/ except the
# families themselves (stages/models/), the benches (app/bench/ builds named model shapes) and
# the estimate of the model's work from its config.json keys that bench and server share.
FAMILY_AWARE = ("stages/models/", "app/bench/", "app/model_cost.py")
FAMILY_TABLE = "stages.models.families"


def test_nothing_outside_the_models_names_a_family():
    """Outside FAMILY_AWARE, a module reaches stages/models/ only through the family table
    (no import of a family's module), and reads no family-specific attribute: neither
    `family_args` (a family's own arguments) nor one named after a family (`args.deepseek`)."""
    from stages.models.families import FAMILIES

    banned_attrs = {"family_args"} | {family.name for family in FAMILIES}
    for f in py_files("app") + py_files("stages"):
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith(FAMILY_AWARE):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                base = node.module or ""
                modules = ([f"{base}.{a.name}" for a in node.names] if base == "stages.models"
                           else [base])
            else:
                modules = []
            for m in modules:
                assert not m.startswith("stages.models.") or m == FAMILY_TABLE, (
                    f"{rel} imports {m}: outside stages/models/ use {FAMILY_TABLE}")
            if isinstance(node, ast.Attribute):
                assert node.attr not in banned_attrs, (
                    f"{rel}:{node.lineno} reads .{node.attr}: a family branch outside "
                    "stages/models/ (declare it in the family instead)")


def test_model_files_share_no_six_line_stretch():
    """What two families share lives in one place (stages/models/layers.py, moe.py, stage.py):
    no run of 6 non-blank code lines (whitespace stripped) appears in two files of
    stages/models/. Imports and function signatures are left out: a subclass restates its base's
    constructor signature, which one parameter per line spreads over many lines."""
    import itertools

    def skipped(node):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return range(node.lineno, node.end_lineno + 1)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return range(node.lineno, node.body[0].lineno)
        return range(0)

    def runs(path, n=6):
        text = path.read_text()
        left_out = {i for node in ast.walk(ast.parse(text)) for i in skipped(node)}
        lines = [line.strip() for i, line in enumerate(text.splitlines(), 1)
                 if line.strip() and i not in left_out]
        return {tuple(lines[i:i + n]) for i in range(len(lines) - n + 1)}

    files = {f: runs(f) for f in py_files("stages/models")}
    for a, b in itertools.combinations(files, 2):
        shared = files[a] & files[b]
        assert not shared, (f"{a.relative_to(ROOT)} and {b.relative_to(ROOT)} share the lines "
                            f"{list(next(iter(shared)))}")
