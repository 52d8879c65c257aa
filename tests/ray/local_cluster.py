"""A local multi-node Ray cluster for tests: `ray.cluster_utils.Cluster` with named nodes."""

from __future__ import annotations

import contextlib
import socket

NODE_RESOURCE = "ppserve_test_node"  # prefix of each node's custom resource: its name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _no_address_file():
    """Cluster records its address in /tmp/ray/ray_current_cluster (and deletes that file at
    shutdown), where every plain `ray.init()` on the machine would find it and join this
    cluster: other test runs sharing the machine must not. The driver connects by address."""
    from ray._common import utils as common_utils
    from ray._private import utils as private_utils

    write, reset = private_utils.write_ray_address, common_utils.reset_ray_address
    private_utils.write_ray_address = lambda *args, **kwargs: None
    common_utils.reset_ray_address = lambda *args, **kwargs: None
    try:
        yield
    finally:
        private_utils.write_ray_address, common_utils.reset_ray_address = write, reset


class LocalCluster:
    """A head and worker raylets on this machine, each with its own logical CPUs and a custom
    resource `ppserve_test_node_<name>` that names it (head, w0, w1, ...)."""

    def __init__(self, head_cpus: int, worker_cpus: list[int]):
        import ray
        from ray.cluster_utils import Cluster

        with _no_address_file():
            self.cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": head_cpus, "resources": {f"{NODE_RESOURCE}_head": 1},
                "gcs_server_port": _free_port(), "include_dashboard": False})
        self.workers = {}  # node id -> Node
        for i, cpus in enumerate(worker_cpus):
            self.add_worker(f"w{i}", cpus)
        ray.init(address=self.cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        self.cluster.wait_for_nodes()

    def add_worker(self, name: str, cpus: int = 1):
        node = self.cluster.add_node(num_cpus=cpus, resources={f"{NODE_RESOURCE}_{name}": 1})
        self.workers[node.node_id] = node
        return node

    def remove_worker(self, node_id: str) -> None:
        self.cluster.remove_node(self.workers.pop(node_id))

    @staticmethod
    def node_names() -> dict[str, str]:
        """Live node id -> the name its custom resource gives it."""
        import ray

        return {n["NodeID"]: next(r[len(NODE_RESOURCE) + 1:] for r in n["Resources"]
                                  if r.startswith(NODE_RESOURCE))
                for n in ray.nodes() if n["Alive"]}

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        with _no_address_file():
            self.cluster.shutdown()
