"""The prefix-affinity request router of the Ray Serve replicas (imports Ray: load it only when Ray is installed).

Ray Serve calls :meth:`PrefixAffinityRouter.choose_replicas` for each request to the engine deployment;
the decision itself is :func:`specdecode.server.routing.rank_replicas` (rendezvous hashing of the
request's ``routing_key`` with a queue-length guard), tested without Ray. A request without a key
(not a completion, or an unreadable body) gets Ray Serve's own power of two choices.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RunningReplica

try:  # Ray's own power of two choices (with its locality and multiplexing rules) for keyless requests
    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter as _Base
except ImportError:  # pragma: no cover - a Ray that moved it: the public base, keyless requests get a random pair
    from ray.serve.request_router import FIFOMixin, RequestRouter

    class _Base(FIFOMixin, RequestRouter):  # type: ignore[no-redef]
        async def choose_replicas(self, candidate_replicas, pending_request=None):
            return [random.sample(list(candidate_replicas), k=min(2, len(candidate_replicas)))]

from specdecode.server.routing import rank_replicas


class PrefixAffinityRouter(_Base):
    """Routes requests sharing a prompt prefix (or a conversation) to the same engine replica.

    ``request_router_kwargs``: ``imbalance`` (requests of queue length the preferred replica may be
    ahead of the shortest before load wins; default 8).
    """

    def initialize_state(self, imbalance: int = 8, **kwargs) -> None:
        self.imbalance = int(imbalance)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = None if pending_request is None else (pending_request.kwargs or {}).get("routing_key")
        if key is None:  # no preference: Ray Serve's power of two choices
            return await super().choose_replicas(candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        queue_lens = {i: cache.get(r.replica_id) for i, r in by_id.items()}
        imbalance = getattr(self, "imbalance", 8)
        return [[by_id[i] for i in rank] for rank in rank_replicas(key, list(by_id), queue_lens, imbalance)]
