"""Who may come in: API keys on /v1 routes, and whether a new generation is admitted (drain, queue bound).

Every refusal is an OpenAI-shaped error: 401 without a valid key, 503 with
`Retry-After` while draining, 429 with `Retry-After` when `--max-queue` requests
already wait. Retry-After for 429 comes from the measured rate at which requests
finish: the time the queue ahead of the client takes to drain.

The queue is counted on the event loop, not read from the engine's stats: those are
published after each step, and a burst arriving within one step would all see the
queue as it was before it. Requests in flight (admitted, not yet finished) beyond
the engine's seats (`--max-num-seqs`) are the ones waiting.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import Request

from app.errors import OpenAIError
from app.settings import Settings

# Finish-rate samples older than this are dropped; the rate is measured over what is left.
_RATE_WINDOW_SECONDS = 30.0


def load_api_keys(settings: Settings) -> tuple[bytes, ...]:
    """Every key from --api-key and --api-key-file, as bytes for constant-time comparison."""
    keys = list(settings.api_key)
    if settings.api_key_file is not None:
        for line in Path(settings.api_key_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    return tuple(key.encode() for key in keys)


def key_id(key: bytes) -> str:
    """What logs and the audit log name a key by: a short hash, never the key."""
    return hashlib.sha256(key).hexdigest()[:12]


def authenticate(request: Request, keys: tuple[bytes, ...]) -> str | None:
    """The id of the request's valid key; None when the server has no keys. Raises 401 otherwise.

    Every configured key is compared, in constant time, whatever matches first, so the
    time taken says nothing about which key or how much of it was right."""
    if not keys:
        return None
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    candidate = presented.strip().encode()
    matched = None
    for key in keys:
        if hmac.compare_digest(candidate, key) and scheme.lower() == "bearer":
            matched = key
    if matched is None:
        raise OpenAIError(
            401,
            "Incorrect API key provided. Send it as `Authorization: Bearer KEY`.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return key_id(matched)


async def require_api_key(request: Request) -> None:
    """Dependency of every /v1 route (and /metrics with --protect-metrics)."""
    request.state.api_key_id = authenticate(request, request.app.state.sluice.api_keys)


class Admission:
    """Admits new generations unless the server drains or its queue is full."""

    def __init__(self, max_queue: int | None, num_seats: int) -> None:
        self.max_queue = max_queue
        self.num_seats = num_seats
        self.draining = False
        # Generations started and not yet finished; kept by started() and finished().
        self.num_in_flight = 0
        self._num_finished = 0
        # (time, requests finished so far), sampled at each admission check.
        self._finished: deque[tuple[float, int]] = deque()

    def finished(self) -> None:
        self.num_in_flight -= 1
        self._num_finished += 1

    def withdraw(self) -> None:
        """An admitted request that ended before its generation started (a 400, a dropped client)."""
        self.num_in_flight -= 1

    def admit(self) -> None:
        """Check, then count the request as in flight at once: requests that arrive together each see
        the ones admitted before them, even before any of them has started its generation."""
        self.check()
        self.num_in_flight += 1

    def check(self) -> None:
        now = time.monotonic()
        num_waiting = max(0, self.num_in_flight - self.num_seats)
        self._finished.append((now, self._num_finished))
        while len(self._finished) > 2 and now - self._finished[0][0] > _RATE_WINDOW_SECONDS:
            self._finished.popleft()
        if self.draining:
            raise OpenAIError(
                503, "The server is shutting down; retry on another replica.", code="draining", headers=_retry(1)
            )
        if self.max_queue is not None and num_waiting >= self.max_queue:
            raise OpenAIError(
                429,
                f"Too many requests are waiting ({num_waiting}, --max-queue {self.max_queue}); retry later.",
                code="queue_full",
                headers=_retry(self._seconds_to_drain(num_waiting + 1 - self.max_queue)),
            )

    def _seconds_to_drain(self, places: int) -> int:
        """How long until `places` queued requests have left, at the measured finish rate."""
        (first_time, first_count), (last_time, last_count) = self._finished[0], self._finished[-1]
        if last_time - first_time < 0.5 or last_count == first_count:
            return 1
        rate = (last_count - first_count) / (last_time - first_time)
        return max(1, math.ceil(places / rate))


def _retry(seconds: int) -> dict[str, str]:
    return {"Retry-After": str(seconds)}


async def admit(request: Request) -> AsyncIterator[None]:
    """Dependency of the generation routes: admits the request, and withdraws it if the route ends
    without starting a generation (whose accounting then owns the place and frees it when done)."""
    admission = request.app.state.sluice.admission
    admission.admit()
    request.state.generation_started = False
    try:
        yield
    finally:
        if not request.state.generation_started:
            admission.withdraw()
