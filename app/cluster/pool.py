"""ReplicaPool: the engines of a cluster's replicas as one EngineClient, what the ingress's routes submit to.

Each submitted request is relayed: a task on the ingress's loop streams the replica's chunks (through a
DeploymentHandle with `stream=True`; app/cluster/router.py picks the replica) into the request's own
StreamChannel, so the routes, the renderer and the stream registry run here exactly as over a local engine.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from dataclasses import dataclass, field, fields

from ray.serve.handle import DeploymentHandle

from app.cluster import router_registry
from engine.channel import StreamChannel
from engine.config import EngineConfig, EngineStats
from engine.images import ImageInput
from engine.model.loader import ServedModel
from engine.sampling.grammar import GrammarCompiler
from engine.types import Chunk, FinishReason, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Relay:
    """One request's chunks on their way from its replica to its channel; how it ends if cut short."""

    channel: StreamChannel
    num_choices: int
    # What the open choices end with when the relay is cut short: the client's cancel unless abort() says otherwise.
    reason: FinishReason = FinishReason.CANCELLED
    error: str | None = None
    task: asyncio.Task | None = field(default=None, repr=False)

    def end_open_choices(self) -> None:
        """A terminal chunk for every choice that has none yet (the channel drops the others)."""
        for index in range(self.num_choices):
            chunk = Chunk((), "", index, finish_reason=self.reason, error=self.error)
            if self.channel.accept(chunk):
                self.channel.deliver(chunk)

    def abort(self, reason: FinishReason, error: str | None) -> None:
        self.reason, self.error = reason, error
        if self.task is not None:
            self.task.cancel()


class ReplicaPool:
    """The replicas behind `handle` as one engine: every request submitted gets one terminal chunk per choice,
    its replica's, or an error if the replica fails or goes away, or a cancel's. Also the ReplicaSet of
    /health and /metrics, as the handle's router last heard from the replicas."""

    def __init__(self, handle: DeploymentHandle, config: EngineConfig, served: ServedModel, origin: str = "") -> None:
        self.config = config
        # This ingress replica's id, sent with each request: the engine replicas count requests by it.
        self.origin = origin
        self.token_bytes = served.token_bytes
        # Grammars are compiled here too: a bad one is the route's 400 before anything is sent.
        self.grammars = GrammarCompiler(served.tokenizer, served.vocab_size, served.eos_token_ids)
        self._handle = handle
        self._streams = handle.options(stream=True)
        self._relays: set[_Relay] = set()
        self._closed = False

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        channel: StreamChannel,
        images: tuple[ImageInput, ...] = (),
    ) -> None:
        relay = _Relay(channel, params.n)
        if self._closed:
            relay.abort(FinishReason.ERROR, "the engine is shutting down")
            relay.end_open_choices()
            return
        # In a context of its own: Ray Serve cancels the handle calls made in an HTTP request's context when
        # that request ends, and a resumable stream outlives its first reader's request. Cancels reach the
        # replica through the channel instead.
        relay.task = contextvars.Context().run(
            channel.loop.create_task, self._run(relay, request_id, prompt_token_ids, params, images)
        )
        self._relays.add(relay)
        relay.task.add_done_callback(lambda _: self._relays.discard(relay))
        channel.on_cancel = lambda: relay.abort(FinishReason.CANCELLED, None)

    async def _run(
        self,
        relay: _Relay,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: tuple[ImageInput, ...],
    ) -> None:
        chunks = self._streams.generate.remote(request_id, prompt_token_ids, params, images, self.origin)
        try:
            async for chunk in chunks:
                if relay.channel.accept(chunk):
                    relay.channel.deliver(chunk)
            # A replica ends its stream after its last terminal chunk; anything still open was lost.
            relay.reason, relay.error = FinishReason.ERROR, "the replica ended the stream early"
        except asyncio.CancelledError:
            chunks.cancel()
        except Exception as exc:  # noqa: BLE001 - a replica's failure (it died, it raised) ends the streams it served
            logger.warning("request %s: its replica failed: %s", request_id, exc)
            relay.reason, relay.error = FinishReason.ERROR, f"the replica serving this request failed: {exc}"
        relay.end_open_choices()

    def unpin(self, key: str) -> None:
        # The router sends it to the replica that pinned `key`.
        self._handle.unpin.remote(key)

    def abort_all(self, message: str) -> None:
        for relay in list(self._relays):
            relay.abort(FinishReason.ERROR, message)

    def inject_fault(self) -> None:
        self._handle.inject_fault.remote()

    def shutdown(self) -> None:
        self._closed = True
        self.abort_all("the engine is shutting down")

    def replica_stats(self) -> dict[str, EngineStats]:
        router = router_registry.router_of(self._handle.app_name)
        return router.replica_stats() if router is not None else {}

    def routing_decisions(self) -> dict[str, int]:
        router = router_registry.router_of(self._handle.app_name)
        return dict(router.decisions) if router is not None else {}

    @property
    def stats(self) -> EngineStats:
        """The serving replicas' figures added up (as each last published them, within a second)."""
        serving = [s for s in self.replica_stats().values() if s.alive]
        total = {f.name: sum(getattr(s, f.name) for s in serving) for f in fields(EngineStats) if f.name != "alive"}
        return EngineStats(alive=not self._closed and bool(serving), **total)

    @property
    def alive(self) -> bool:
        """Open, with at least one replica serving."""
        return not self._closed and any(s.alive for s in self.replica_stats().values())
