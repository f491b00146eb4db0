"""EngineReplica: one Sluice engine in a Ray Serve replica, streaming each request's chunks to the ingress."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

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

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: tuple[ImageInput, ...] = (),
    ) -> AsyncIterator[Chunk]:
        """The request's chunks up to its last terminal one; cancelled (the ingress's client left), the
        request is cancelled in the engine, which frees its KV blocks at its next step."""
        channel = StreamChannel(asyncio.get_running_loop(), num_choices=params.n)
        self.engine.submit(request_id, prompt_token_ids, params, channel, images)
        try:
            async for chunk in channel:
                yield chunk
        finally:
            channel.cancel()

    def config(self) -> EngineConfig:
        return self.engine.config

    def unpin(self, key: str) -> None:
        self.engine.unpin(key)

    def inject_fault(self) -> None:
        self.engine.inject_fault()

    def record_routing_stats(self) -> dict[str, float]:
        """What the router weighs replicas by: requests held (running, waiting, paused) and the KV in use."""
        stats = self.engine.stats
        return {
            "num_requests": stats.num_running + stats.num_waiting + stats.num_paused,
            "kv_used": stats.kv_blocks_used / max(1, stats.kv_blocks_total),
        }

    def __del__(self) -> None:
        self.engine.shutdown()
