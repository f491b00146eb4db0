"""CacheAwareRouter: the Ray Serve request router of the engine replicas.

A prompt goes to the replica that served the longest run of its leading KV blocks (a conversation's earlier
turns, a shared system prompt), unless that replica holds `imbalance` more requests than the least-loaded one;
then, and for a prompt no replica has seen, the least-loaded one. A request that continues a stored response
(`previous_response_id`) goes where that response's KV is pinned, and unpinning it goes there too.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from engine.types import SamplingParams


def block_hashes(prompt_token_ids: list[int], block_size: int) -> list[int]:
    """One hash per full block of the prompt, each over the blocks before it too (as the prefix cache
    keys its blocks): equal hashes mean equal prefixes up to that block."""
    hashes = []
    previous = 0
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        previous = hash((previous, *prompt_token_ids[start : start + block_size]))
        hashes.append(previous)
    return hashes


class _Lru(OrderedDict):
    """A bounded map that forgets what was used longest ago."""

    def __init__(self, max_entries: int) -> None:
        super().__init__()
        self.max_entries = max_entries

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.max_entries:
            self.popitem(last=False)


class CacheAwareRouter(RequestRouter):
    """Ranks the replica holding a request's prefix (or its pinned conversation) first, then the others by load."""

    def initialize_state(self, block_size: int = 16, imbalance: int = 4, max_entries: int = 100_000) -> None:
        self.block_size = block_size
        self.imbalance = imbalance
        # Where each prompt block was last sent, and where each stored response's KV is pinned.
        self.block_owner: _Lru = _Lru(max_entries)
        self.pin_owner: _Lru = _Lru(max_entries)
        # Requests this router sent and that have not completed, per replica: fresher than routing stats.
        self.in_flight: dict[ReplicaID, int] = {}
        self.in_flight_ids: dict[str, ReplicaID] = {}
        # Routing decisions, for the ingress's log and tests.
        self.num_affinity_hits = 0
        self.num_fallbacks = 0

    def load(self, replica: RunningReplica) -> int:
        """Requests on the replica: its engine's own figure (all ingresses'), or what this router sent it if more."""
        reported = int(replica.routing_stats.get("num_requests", 0))
        return max(reported, self.in_flight.get(replica.replica_id, 0))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        # Ties in random order: idle replicas share new prompts rather than the first taking them all.
        by_load = sorted(candidate_replicas, key=lambda r: (self.load(r), random.random()))
        if pending_request is None or not by_load:
            return [by_load] if by_load else []
        method, args = pending_request.metadata.call_method, pending_request.args
        owner: ReplicaID | None = None
        pinned = False
        if method == "unpin":
            owner, pinned = self.pin_owner.get(args[0]), True
        elif method == "generate":
            _, prompt_token_ids, params = args
            assert isinstance(params, SamplingParams)
            if params.continues is not None and params.continues in self.pin_owner:
                owner, pinned = self.pin_owner[params.continues], True
            else:
                owner = self._prefix_owner(prompt_token_ids)
        preferred = next((r for r in by_load if r.replica_id == owner), None)
        if preferred is None:
            return [[by_load[0]], by_load[1:]] if len(by_load) > 1 else [by_load]
        if not pinned and self.load(preferred) > self.load(by_load[0]) + self.imbalance:
            self.num_fallbacks += 1
            return [[by_load[0]], by_load[1:]]
        self.num_affinity_hits += 1
        return [[preferred], [r for r in by_load if r is not preferred]]

    def _prefix_owner(self, prompt_token_ids: list[int]) -> ReplicaID | None:
        """The replica that was sent the longest run of this prompt's leading blocks."""
        for block_hash in reversed(block_hashes(prompt_token_ids, self.block_size)):
            owner = self.block_owner.get(block_hash)
            if owner is not None:
                return owner
        return None

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        metadata = pending_request.metadata
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self.in_flight_ids[metadata.internal_request_id] = replica_id
        if metadata.call_method != "generate":
            return
        request_id, prompt_token_ids, params = pending_request.args
        for block_hash in block_hashes(prompt_token_ids, self.block_size):
            self.block_owner.put(block_hash, replica_id)
        if params.keep_kv_as is not None:
            self.pin_owner.put(params.keep_kv_as, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight_ids.pop(internal_request_id, None) is not None:
            self.in_flight[replica_id] = max(0, self.in_flight.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)
