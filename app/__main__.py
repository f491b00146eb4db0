"""`sluice` / `python -m app`: parse flags into Settings and run uvicorn, draining on SIGTERM / SIGINT.
`sluice cluster --replicas N ...`: the same server on Ray Serve (app/cluster/serve.py, the `ray` extra)."""

from __future__ import annotations

import logging
import os
import sys

# OpenMP's threads (torch's and the CPU kernels') wait for work asleep rather than spinning, unless the
# operator sets OMP_WAIT_POLICY: it is read once, when torch loads, so before anything imports it.
# Spinning threads take the CPU from the engine thread, the event loop and everything else on the
# machine between a step's parallel regions; on a shared machine that made a server many times slower
# (docs/performance.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import uvicorn  # noqa: E402
from pydantic_settings import CliApp  # noqa: E402

from app.operations.drain import DrainingServer  # noqa: E402
from app.operations.front_door import RequestIdLogFilter  # noqa: E402
from app.operations.transport import bounded_http_protocol  # noqa: E402
from app.server import create_app  # noqa: E402
from app.settings import Settings  # noqa: E402


def main() -> None:
    if sys.argv[1:2] == ["cluster"]:
        from app.cluster.serve import main as cluster_main

        cluster_main(sys.argv[2:])
        return
    settings = CliApp.run(Settings)
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdLogFilter())
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s",
        handlers=[handler],
    )
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        http=bounded_http_protocol(settings.write_buffer_kib * 1024),
        timeout_keep_alive=settings.timeout_keep_alive,
    )
    server = DrainingServer(config, settings.shutdown_timeout)
    server.run()
    status = 0 if server.started else 3  # uvicorn's exit status for a failed start-up
    # Everything is shut down by now (streams ended, engine thread joined, audit log closed), so the
    # interpreter's teardown is skipped: where Triton is installed (the dev extras; transformers
    # imports it through torch._dynamo), its nanobind extension printed a screenful of warnings about
    # some 580 objects still alive at teardown after every shutdown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
