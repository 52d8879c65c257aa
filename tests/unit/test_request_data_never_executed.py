"""Nothing from a request is ever unpickled or evaluated: request bodies are parsed by `json`
and pydantic (app/openai/body.py, protocol.py); the typed messages that cross processes
(app/messages.py, stages/protocol.py) are built by our own code, and Ray pickles them between
our own processes only. This scan keeps the code base free of the calls that would turn data
into code: eval/exec/compile, pickle-family loads, unsafe YAML, torch.load without
weights_only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILTINS = {"eval", "exec", "compile", "__import__"}
MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            found += [f"import {n}" for n in names if n.split(".")[0] in MODULES]
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id in BUILTINS:
            found.append(f"{fn.id}()")
        if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name):
            owner, attr = fn.value.id, fn.attr
            if owner == "yaml" and attr in ("load", "unsafe_load", "full_load"):
                found.append(f"yaml.{attr}()")
            weights_only = any(
                k.arg == "weights_only"
                and isinstance(k.value, ast.Constant)
                and k.value.value is True
                for k in node.keywords
            )
            if owner == "torch" and attr == "load" and not weights_only:
                found.append("torch.load() without weights_only=True")
    return found


def test_no_code_from_data():
    files = sorted(p for d in ("app", "stages") for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 20
    offences = [f"{p.relative_to(ROOT)}: {o}" for p in files for o in _offences(p)]
    assert offences == [], offences


def test_the_scan_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "sample.py"
    bad.write_text(
        "import pickle\nimport yaml\nimport torch\n"
        "pickle.loads(b'')\neval('1')\nyaml.load('')\ntorch.load('x')\n"
        "torch.load('y', weights_only=True)\nyaml.safe_load('')\n"
    )
    assert _offences(bad) == [
        "import pickle",
        "eval()",
        "yaml.load()",
        "torch.load() without weights_only=True",
    ]
