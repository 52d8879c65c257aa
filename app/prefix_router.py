"""The Ray Serve request router of the PipelineServer deployment: sends a request to the pipeline
most likely to hold its prompt's prefix in its prefix cache, else to the least loaded one.

Thin glue: the decision is app/prefix_routing.py's PrefixRoutingTable, fed with the request's
routing key (computed by the ingress) and Serve's cached queue lengths. It runs inside every
process that holds a handle to the deployment (the ingress), each with its own table.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from app.messages import GenerateRequest
from app.prefix_routing import PrefixKey, PrefixRoutingTable


def _key(pending_request: PendingRequest | None) -> PrefixKey | None:
    """The routing key of a generate call; None for the deployment's other methods."""
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, GenerateRequest):
            return arg.prefix_key
    return None


class PrefixAffinityRouter(RequestRouter):
    # Serve passes the deployment's request_router_kwargs as keywords; the base declares them
    # as **kwargs, so naming them here is an override mypy cannot accept.
    def initialize_state(  # type: ignore[override]
        self, max_queue: int = 64, capacity: int = 4096, min_match: float = 0.1
    ) -> None:
        self.table = PrefixRoutingTable(max_queue, capacity, min_match)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Every candidate, one per rank in the table's order: Serve tries them in turn and
        takes the first whose queue has room (max_ongoing_requests)."""
        replicas = list(candidate_replicas)
        random.shuffle(replicas)  # the table's last tie-break
        by_id = {r.replica_id.unique_id: r for r in replicas}
        cache = self.replica_queue_len_cache
        loads = {rid: cache.get(r.replica_id) for rid, r in by_id.items()}
        if pending_request is not None:
            # Every replica was offered: when none has room, back off before asking again.
            pending_request.routing_context.should_backoff = True
        return [[by_id[rid]] for rid in self.table.rank(_key(pending_request), loads)]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: object
    ) -> None:
        self.table.record(replica_id.unique_id, _key(pending_request))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.table.retain(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)


ROUTER_CLASS = f"{PrefixAffinityRouter.__module__}.{PrefixAffinityRouter.__qualname__}"
