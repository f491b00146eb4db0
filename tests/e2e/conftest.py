"""A real Sluice server process on 127.0.0.1 serving the default model."""

import os
import socket
import subprocess
import sys
import time
from typing import IO

import httpx
import pytest

from tests.conftest import CACHE_DIR


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*flags: str, stderr: IO[bytes] | None = None) -> tuple[subprocess.Popen, str]:
    """A server process with these flags, once /health answers 200 (its stderr to `stderr` if given).
    On the CPU on every machine: what these tests check (outputs that do not depend on the batch above
    all) is the CPU kernels' promise; the GPU path has its own tests (tests/unit) and benchmark
    (bench/gpu.py)."""
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", SLUICE_CACHE_DIR=str(CACHE_DIR))
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "--port", str(port), "--log-level", "warning", "--device", "cpu", *flags],
        env=env,
        stderr=stderr,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, "server exited during start-up"
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy"
        time.sleep(0.3)
    return proc, base


def _serve(*flags: str):
    proc, base = start_server(*flags)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def server(default_model_path):
    """The server as `make serve` runs it, plus the fault-injection hook."""
    yield from _serve("--enable-fault-injection")


@pytest.fixture(scope="module")
def own_server(default_model_path):
    """A default server for one test module, for tests that need the server's state to themselves."""
    yield from _serve()


@pytest.fixture(scope="session")
def flow_server(default_model_path):
    """Tight flow-control settings, so back-pressure, keep-alive and resume expiry happen within seconds."""
    yield from _serve(
        "--max-unread-tokens",
        "16",
        "--write-buffer-kib",
        "4",
        "--keepalive-seconds",
        "0.3",
        "--resume-window-seconds",
        "3",
    )


@pytest.fixture(scope="session")
def model_name(server) -> str:
    return httpx.get(f"{server}/v1/models").json()["data"][0]["id"]


@pytest.fixture
def health(server):
    def read() -> dict:
        return httpx.get(f"{server}/health", timeout=5).json()

    return read
