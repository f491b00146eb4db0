"""A Sluice server as a child process on a free local port, healthy before it is handed over: what the
end-to-end tests and the benchmarks start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, base: str, name: str, timeout: float = 600) -> None:
    """Poll `base`/health until it answers 200; stop the server and raise if it exits or never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} during start-up")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    # SIGTERM first: a `sluice cluster` then shuts its Ray processes down, which SIGKILL would orphan.
    stop(proc)
    raise RuntimeError(f"{name} did not start within {timeout:g} s")


def start(
    flags: Sequence[str],
    entry: Sequence[str] = ("-m", "app"),
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    stderr: IO[bytes] | None = None,
    timeout: float = 600,
) -> tuple[subprocess.Popen, str]:
    """A server with `flags` (and --port, logging warnings only) and its base URL, once /health answers
    200. `entry` is what Python runs (a script that wraps the server, as bench/stub_accelerator.py does),
    from `cwd` (another checkout, for a before / after comparison) or this one; `env` is added to this
    process's environment."""
    port = free_port()
    command = [sys.executable, *entry, "--port", str(port), "--log-level", "warning", *flags]
    proc = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, cwd=cwd, stderr=stderr)
    base = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, base, f"sluice {' '.join(flags)!r}", timeout)
    return proc, base


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (the server drains, then exits), then SIGKILL if it has not exited within `timeout` s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
