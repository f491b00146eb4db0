"""The Ray Serve request routers of a cluster's deployments.

CacheAwareRouter, the engine replicas': a prompt goes to the replica this router sent the longest run of its
leading KV blocks (a conversation's earlier turns, a shared system prompt); a prompt it has not seen goes to
its first block's home, the replica that block hashes to (rendezvous hashing over the serving replicas), so
every ingress replica's router sends a new conversation's turns to the same replica without sharing state.
Either goes instead to the least-loaded replica when it holds `imbalance` more requests than that one, and so
does a prompt shorter than a block. A request that continues a stored response (`previous_response_id`) goes
where that response's KV is pinned, and unpinning it goes there too.

PowerOfTwoRouter: Ray Serve's default policy, for comparison.

IngressRouter, the ingress replicas': a forwarded request (app/cluster/forwarding.py) goes to the ingress
replica its id names; everything else, as Ray's default router does, to the shorter queue of two.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter, OrderedDict
from dataclasses import fields

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from app.cluster import router_registry
from engine.config import EngineStats
from engine.types import SamplingParams

_STATS_FIELDS = tuple(f.name for f in fields(EngineStats))


def routing_stats(stats: EngineStats) -> dict[str, float]:
    """What a replica publishes to the routers (Ray Serve's routing stats, numbers only): all its stats."""
    return {name: float(getattr(stats, name)) for name in _STATS_FIELDS}


def engine_stats(published: dict[str, float]) -> EngineStats:
    """A replica's stats from what it published; before it first did, a replica Ray runs is taken as alive
    and idle."""
    return EngineStats(
        alive=bool(published.get("alive", True)),
        **{name: kind(published.get(name, 0)) for name, kind in _NUMBERS.items()},
    )


# Every figure but `alive`, by the type it has in EngineStats.
_NUMBERS = {f.name: int if f.type in ("int", int) else float for f in fields(EngineStats) if f.name != "alive"}


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


def home_of(first_block: int, replicas: list[str]) -> str:
    """The replica (by id) a prompt's first block hashes to: the one whose hash with it is highest (rendezvous
    hashing), the same in every process; when a replica leaves, only the blocks homed on it move."""
    return max(
        replicas, key=lambda replica: hashlib.blake2b(f"{first_block}:{replica}".encode(), digest_size=8).digest()
    )


def _home(candidates: list[RunningReplica], first_block: int) -> RunningReplica:
    home = home_of(first_block, [r.replica_id.unique_id for r in candidates])
    return next(r for r in candidates if r.replica_id.unique_id == home)


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
        # Routing decisions, by kind (see app/operations/metrics.py's sluice:routing_decisions).
        self.decisions: Counter[str] = Counter()
        self._decided: _Lru = _Lru(max_entries)
        router_registry.register(self.app_name, self)

    def replica_stats(self) -> dict[str, EngineStats]:
        """Each serving replica's stats as it last published them (every second), by replica id."""
        return {r.replica_id.unique_id: engine_stats(r.routing_stats) for r in self.curr_replicas.values()}

    def load(self, replica: RunningReplica) -> int:
        """Requests on the replica: its engine's own figure (all ingresses'), or what this router sent it if more."""
        published = replica.routing_stats
        reported = int(sum(published.get(name, 0) for name in ("num_running", "num_waiting", "num_paused")))
        return max(reported, self.in_flight.get(replica.replica_id, 0))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        # Ties in random order: idle replicas share new prompts rather than the first taking them all.
        by_load = sorted(candidate_replicas, key=lambda r: (self.load(r), random.random()))
        if pending_request is None or not by_load:
            return [by_load] if by_load else []
        method, args = pending_request.metadata.call_method, pending_request.args
        preferred: RunningReplica | None = None
        decision = "least_loaded"
        if method == "unpin":
            preferred, decision = self._replica(by_load, self.pin_owner.get(args[0])), "pinned"
        elif method == "generate":
            # generate(request_id, prompt_token_ids, params, images)
            prompt_token_ids, params = args[1], args[2]
            assert isinstance(params, SamplingParams)
            hashes = block_hashes(prompt_token_ids, self.block_size)
            if params.continues is not None and params.continues in self.pin_owner:
                preferred, decision = self._replica(by_load, self.pin_owner[params.continues]), "pinned"
            elif (preferred := self._replica(by_load, self._prefix_owner(hashes))) is not None:
                decision = "affinity"
            elif hashes:
                preferred, decision = _home(by_load, hashes[0]), "home"
        if preferred is None:
            decision, ranks = "least_loaded", [[by_load[0]], by_load[1:]]
        elif decision != "pinned" and self.load(preferred) > self.load(by_load[0]) + self.imbalance:
            decision, ranks = "fallback", [[by_load[0]], by_load[1:]]
        else:
            ranks = [[preferred], [r for r in by_load if r is not preferred]]
        if method == "generate":
            # Counted once routed: a request whose replicas all refuse it is chosen for again.
            self._decided.put(pending_request.metadata.internal_request_id, decision)
        return [rank for rank in ranks if rank]

    def _prefix_owner(self, hashes: list[int]) -> ReplicaID | None:
        """The replica that was sent the longest run of these leading blocks."""
        for block_hash in reversed(hashes):
            owner = self.block_owner.get(block_hash)
            if owner is not None:
                return owner
        return None

    @staticmethod
    def _replica(candidates: list[RunningReplica], replica_id: ReplicaID | None) -> RunningReplica | None:
        return next((r for r in candidates if r.replica_id == replica_id), None)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        metadata = pending_request.metadata
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self.in_flight_ids[metadata.internal_request_id] = replica_id
        if metadata.call_method != "generate":
            return
        if (decision := self._decided.pop(metadata.internal_request_id, None)) is not None:
            self.decisions[decision] += 1
        prompt_token_ids, params = pending_request.args[1], pending_request.args[2]
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


class PowerOfTwoRouter(CacheAwareRouter):
    """Ray Serve's default policy (two replicas at random, then the shorter queue, which Ray's probes pick),
    blind to prefixes and pins, kept a CacheAwareRouter for the replicas' figures /health and /metrics show:
    `--request-router power-of-two`, what cache-aware routing is measured against."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]


class IngressRouter(RequestRouter):
    """A forwarded request to the ingress replica its first argument names (or, that one gone, to any, which
    answers 410); any other request to the shorter queue of two at random, as Ray's default router does."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None and pending_request.metadata.call_method == "forwarded":
            holder = pending_request.args[0]
            named = [r for r in candidate_replicas if r.replica_id.unique_id == holder]
            return [named or candidate_replicas]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
