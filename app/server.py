"""create_app(): the lifespan loads the model and runs the Engine; routes and error handlers are mounted."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app.errors import install_error_handlers
from app.routes import chat, completions, health, models, streams
from app.settings import Settings
from app.state import build_state

logger = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state = await asyncio.to_thread(build_state, settings)
        state.engine.start()
        app.state.sluice = state
        logger.info("serving %s on http://%s:%d", state.model_name, settings.host, settings.port)
        try:
            yield
        finally:
            state.engine.shutdown()

    app = FastAPI(title="Sluice", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(models.router)
    app.include_router(streams.router)
    app.include_router(health.router)
    if settings.enable_fault_injection:
        app.include_router(health.debug_router)
    return app
