"""EngineClient: what a server asks of an engine. Engine is one; app/cluster/'s ReplicaPool, the engines of
Ray Serve replicas behind one handle, is the other, and a ReplicaSet too: what /health and /metrics show
of each replica and of the routing."""

from __future__ import annotations

from typing import Protocol

from engine.channel import StreamChannel
from engine.config import EngineConfig, EngineStats
from engine.detokenizer import TokenBytes
from engine.images import ImageInput
from engine.sampling.grammar import GrammarCompiler
from engine.types import SamplingParams


class EngineClient(Protocol):
    """Submit a request with its channel; every submitted request gets exactly one terminal chunk per choice."""

    config: EngineConfig
    token_bytes: TokenBytes
    grammars: GrammarCompiler

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        channel: StreamChannel,
        images: tuple[ImageInput, ...] = (),
    ) -> None: ...

    def unpin(self, key: str) -> None: ...

    def abort_all(self, message: str) -> None: ...

    def inject_fault(self) -> None: ...

    def shutdown(self) -> None: ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def alive(self) -> bool: ...


class ReplicaSet(Protocol):
    """The engine replicas behind a cluster's ingress, as its router last heard from them."""

    def replica_stats(self) -> dict[str, EngineStats]:
        """Each serving replica's last published stats, by replica id."""
        ...

    def routing_decisions(self) -> dict[str, int]:
        """How many requests this ingress routed each way (to the prefix's replica, to a pin, ...)."""
        ...
