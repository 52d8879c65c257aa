"""The control plane (config, pipeline, coordinator, Engine, Serve app, CLI) imports no torch:
a Serve replica or a driver loads torch only in the stage actors; nor llguidance, which the
first structured-output request loads (app/structured.py)."""

import subprocess
import sys

CONTROL_PLANE = (
    "app.config",
    "app.pipeline",
    "app.coordinator",
    "app.engine",
    "app.server",
    "app.cli",
)


def test_control_plane_imports_no_torch():
    code = (
        f"import sys; import {', '.join(CONTROL_PLANE)}; "
        "print(sorted(m for m in ('torch', 'transformers', 'llguidance') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"the control plane imports {r.stdout.strip()}"
