"""The README's Python example runs as written (it starts and stops its own Ray)."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_example_runs(capsys):
    text = README.read_text()
    section = text.split("## Use it from Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "'sent'" in printed and "'skipped'" in printed
