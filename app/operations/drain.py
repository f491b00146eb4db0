"""Graceful drain on SIGTERM / SIGINT: stop admitting, let running streams finish, then end the rest.

1. The first signal marks the server draining: readiness (/health) answers 503
   `draining` at once and new generation requests get 503 with `Retry-After`;
   liveness (/health/live) stays 200.
2. Running requests finish normally for up to `--shutdown-timeout` seconds.
3. Whatever is still running then ends with an error event and `[DONE]` (the
   engine's abort path: one terminal chunk per choice), resumable streams' logs
   are dropped last, and uvicorn is told to exit; the process exits 0.
A second signal skips step 2 and still sends every terminal event.

sse-starlette would otherwise cut every stream the moment uvicorn sees the signal,
with no terminal event, and uvicorn would re-raise the signal at exit (status -15).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn
from sse_starlette.sse import AppStatus

from app.state import ServerState

logger = logging.getLogger(__name__)

_ABORT_MESSAGE = "the server is shutting down"
# How long ended streams get to write their terminal events before uvicorn closes connections.
_FLUSH_SECONDS = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose exit signals drain the app (`config.app.state.sluice`) first."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._num_signals = 0
        # The drain task, held here: the loop keeps only weak references to tasks.
        self._drain: asyncio.Task | None = None
        self._forced = asyncio.Event()
        # We end the streams ourselves, in order; sse-starlette must not cut them first.
        AppStatus.disable_automatic_graceful_drain()

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = getattr(self.config.app.state, "sluice", None)
        if self._loop is None or state is None:
            # Still starting: there is nothing to drain.
            self.should_exit = True
            return
        self._num_signals += 1
        forced = self._num_signals > 1
        logger.warning("%s: %s", signal.Signals(sig).name, "ending every request now" if forced else "draining")
        self._loop.call_soon_threadsafe(self._begin, state, forced)

    def _begin(self, state: ServerState, forced: bool) -> None:
        if forced:
            self._forced.set()
            return
        state.admission.draining = True
        self._drain = self._loop.create_task(self._run_drain(state))

    async def _run_drain(self, state: ServerState) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        try:
            while _busy(state) and time.monotonic() < deadline and not self._forced.is_set():
                await asyncio.sleep(0.05)
            if _busy(state):
                logger.warning("ending %d requests still running", state.admission.num_in_flight)
                state.engine.abort_all(_ABORT_MESSAGE)
                flush_deadline = time.monotonic() + _FLUSH_SECONDS
                while _busy(state) and time.monotonic() < flush_deadline:
                    await asyncio.sleep(0.02)
            state.streams.drop_all()
        finally:
            AppStatus.should_exit = True
            self.should_exit = True


def _busy(state: ServerState) -> bool:
    """Whether a generation is still in flight: read on the loop, so never a step behind."""
    return state.admission.num_in_flight > 0
