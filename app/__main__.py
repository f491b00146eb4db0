"""`sluice` / `python -m app`: parse flags into Settings and run uvicorn."""

from __future__ import annotations

import logging

import uvicorn
from pydantic_settings import CliApp

from app.server import create_app
from app.settings import Settings
from app.transport import bounded_http_protocol


def main() -> None:
    settings = CliApp.run(Settings)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        http=bounded_http_protocol(settings.write_buffer_kib * 1024),
    )


if __name__ == "__main__":
    main()
