"""Inbox: what other threads hand the engine thread (requests and control messages), taken between steps."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from engine.request import Request


@dataclass(frozen=True)
class AbortAll:
    """End every request the engine holds, with this error (drain timeout)."""

    message: str


@dataclass(frozen=True)
class Unpin:
    """Release the KV blocks pinned under this key (a deleted stored conversation)."""

    key: str


class InjectedFault(RuntimeError):
    """The step failure a test asked for (Engine.inject_fault)."""


_FAULT = object()


class Inbox:
    """A queue into the engine thread that closes once: after close() nothing more is accepted.

    An injected fault is taken here and raised by the next forward (raise_injected_fault)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Request | AbortAll | Unpin | object | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.closed = False
        self.fault_pending = False

    def put_request(self, request: Request) -> bool:
        """Queue a request; False once closed (the caller ends it)."""
        with self._lock:
            if not self.closed:
                self._queue.put(request)
                return True
        return False

    def put(self, message: AbortAll | Unpin) -> None:
        self._queue.put(message)

    def inject_fault(self) -> None:
        self._queue.put(_FAULT)

    def close(self) -> None:
        """Refuse every later request, and wake the engine thread if it waits for one."""
        with self._lock:
            self.closed = True
        self._queue.put(None)

    def take(self, timeout: float) -> list[Request | AbortAll | Unpin]:
        """Every queued item, in order, waiting up to `timeout` seconds for the first (0: no wait)."""
        items: list[Request | AbortAll | Unpin] = []
        try:
            item = self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait()
            while True:
                if item is _FAULT:
                    self.fault_pending = True
                elif item is not None:
                    items.append(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            pass
        return items

    def raise_injected_fault(self) -> None:
        """Raise the injected fault, once, if one is pending (called after each step's forward)."""
        if self.fault_pending:
            self.fault_pending = False
            raise InjectedFault("injected fault")
