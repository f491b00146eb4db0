"""create_app(): the lifespan loads the model and runs the Engine; routes and error handlers are mounted."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ERROR_RESPONSES, install_error_handlers
from app.openapi import install_openapi
from app.operations.front_door import FrontDoor
from app.routes import chat, completions, health, models, playground, responses, streams
from app.settings import Settings
from app.state import ServerState, build_state
from engine.model.families import ModelFolderError
from engine.model.host_memory import keep_freed_memory, return_freed_memory, tune_collector

logger = logging.getLogger(__name__)


async def _start_engine_thread(settings: Settings) -> ServerState:
    """Build the state on a new thread, then run the engine loop on that same thread: every
    torch op of the process (loading included) then runs on one thread and one OpenMP pool."""
    loop = asyncio.get_running_loop()
    built: asyncio.Future[ServerState] = loop.create_future()

    def engine_thread() -> None:
        try:
            state = build_state(settings)
            tune_collector()
            return_freed_memory()
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which fails start-up with it
            loop.call_soon_threadsafe(built.set_exception, exc)
            return
        state.engine.run(on_running=lambda: loop.call_soon_threadsafe(built.set_result, state))

    keep_freed_memory()
    threading.Thread(target=engine_thread, name="sluice-engine", daemon=True).start()
    return await built


class _SluiceApp(FastAPI):
    """FastAPI with the front door outermost, outside Starlette's ServerErrorMiddleware (which
    `add_middleware` cannot place anything outside): the 500 of an unexpected error then carries the
    request id, in its header and its log line, and a stream's events go straight to the server's
    `send` (front_door.BODY_SEND)."""

    def __init__(self, max_request_bytes: int, id_header: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_request_bytes = max_request_bytes
        self.id_header = id_header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            send = _refusal_in_one_line(send)
        await super().__call__(scope, receive, send)

    def build_middleware_stack(self) -> ASGIApp:
        return FrontDoor(
            super().build_middleware_stack(),
            max_request_bytes=self.max_request_bytes,
            metrics=lambda: self.state.sluice.metrics if hasattr(self.state, "sluice") else None,
            audit=lambda: self.state.sluice.audit if hasattr(self.state, "sluice") else None,
            id_header=self.id_header,
        )


def _refusal_in_one_line(send: Send) -> Send:
    """A model folder refused at start-up is reported by its one-line message (the file and what it lacks)
    where Starlette sends the failed start-up's traceback, which uvicorn logs before it exits with 3."""

    async def sending(message: Message) -> None:
        # Starlette sends the failure from inside its `except` block: the exception being handled is the cause.
        cause = sys.exc_info()[1]
        if message["type"] == "lifespan.startup.failed" and isinstance(cause, ModelFolderError):
            message = {**message, "message": str(cause)}
        await send(message)

    return sending


def create_app(
    settings: Settings,
    start: Callable[[Settings], Awaitable[ServerState]] = _start_engine_thread,
    *,
    id_header: bool = True,
) -> FastAPI:
    """The app; its lifespan builds the state with `start`: by default this process's own engine, in a
    cluster's ingress the replicas' (app/cluster/), where Ray Serve returns the request id's header itself
    (`id_header` False)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state = await start(settings)
        app.state.sluice = state
        logger.info("serving %s on http://%s:%d", state.model_name, settings.host, settings.port)
        try:
            yield
        finally:
            state.engine.shutdown()
            await state.media_client.aclose()
            if state.audit is not None:
                state.audit.close()

    app = _SluiceApp(
        settings.max_request_bytes, id_header, title="Sluice", lifespan=lifespan, responses=ERROR_RESPONSES
    )
    install_error_handlers(app)
    install_openapi(app, lambda: app.state.sluice.limits if hasattr(app.state, "sluice") else None)
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(responses.router)
    app.include_router(models.router)
    app.include_router(streams.router)
    app.include_router(health.router)
    app.include_router(playground.router)
    if settings.enable_fault_injection:
        app.include_router(health.debug_router)
    return app
