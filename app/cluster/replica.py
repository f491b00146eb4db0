"""EngineReplica: one Sluice engine in a Ray Serve replica, streaming each request's chunks to the ingress."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import AsyncIterator

from app.cluster.router import routing_stats
from app.settings import Settings
from app.state import build_engine
from engine.channel import StreamChannel
from engine.config import EngineConfig
from engine.engine import Engine
from engine.images import ImageInput
from engine.model.host_memory import keep_freed_memory, return_freed_memory, tune_collector
from engine.types import Chunk, SamplingParams


class EngineReplica:
    """A replica's engine, built and run on one thread of its own (as app/server.py runs it); its load
    figures are the routing stats app/cluster/router.py reads."""

    def __init__(self, settings: Settings) -> None:
        built = threading.Event()
        failure: list[BaseException] = []
        engines: list[Engine] = []

        def engine_thread() -> None:
            try:
                _, engine = build_engine(settings)
                tune_collector()
                return_freed_memory()
            except BaseException as exc:  # noqa: BLE001 - re-raised below: the replica fails its start-up
                failure.append(exc)
                built.set()
                return
            engines.append(engine)
            engine.run(on_running=built.set)

        keep_freed_memory()
        threading.Thread(target=engine_thread, name="sluice-engine", daemon=True).start()
        built.wait()
        if failure:
            raise failure[0]
        self.engine = engines[0]
        # Requests streaming, by the ingress replica that sent them: what each router adds for the others'.
        self.held_for: Counter[str] = Counter()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: tuple[ImageInput, ...] = (),
        origin: str = "",
    ) -> AsyncIterator[Chunk]:
        """The request's chunks up to its last terminal one; cancelled (the ingress's client left), the
        request is cancelled in the engine, which frees its KV blocks at its next step. `origin`: the
        ingress replica that sent it."""
        channel = StreamChannel(asyncio.get_running_loop(), num_choices=params.n)
        self.engine.submit(request_id, prompt_token_ids, params, channel, images)
        self.held_for[origin] += 1
        try:
            async for chunk in channel:
                yield chunk
        finally:
            channel.cancel()
            self.held_for[origin] -= 1
            if not self.held_for[origin]:
                del self.held_for[origin]

    def config(self) -> EngineConfig:
        return self.engine.config

    def unpin(self, key: str) -> None:
        self.engine.unpin(key)

    def inject_fault(self) -> None:
        self.engine.inject_fault()

    def record_routing_stats(self) -> dict[str, float]:
        """The engine's stats and the requests it streams for each ingress replica, to every router: what
        they weigh replicas by, and what the ingress's /health and /metrics show of each replica."""
        return routing_stats(self.engine.stats, self.held_for)

    def check_health(self) -> None:
        """Ray Serve's health check (every 2 s): a replica whose engine thread died is replaced."""
        if not self.engine.alive:
            raise RuntimeError("the engine thread is not running")

    def __del__(self) -> None:
        self.engine.shutdown()
