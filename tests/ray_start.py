"""ray.init for the CPU tests' local clusters, once more when the node misses Ray's fixed 30 s
start-up wait: on a loaded 2-core machine the GCS once answered 5 s past it, and the module
whose fixture raised lost every test."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any


def init_local_ray(**kwargs: Any) -> None:
    import ray

    try:
        ray.init(address="local", **kwargs)
    except Exception as err:  # Ray raises a bare Exception for it
        if "timed out during startup" not in str(err):
            raise
        ray.shutdown()
        # the half-started node's processes: no other cluster runs between two modules
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, check=False)
        ray.init(address="local", **kwargs)
