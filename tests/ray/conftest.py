"""One local Ray cluster per test module, shut down at the end of the module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from tests.ray_start import init_local_ray

    # 2 physical cores: give Ray enough logical CPUs for a coordinator and 3 stages.
    init_local_ray(num_cpus=8, include_dashboard=False, log_to_driver=False,
                   runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
