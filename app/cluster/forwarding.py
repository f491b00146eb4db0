"""Requests for state another ingress replica holds, forwarded to it.

A cluster's ingress replicas each hold their own streams' event logs and stored responses, and the ids they
make end with their replica's tag (`chatcmpl-<hex>.<tag>`, ServerState.new_id). A request that addresses one
of those ids (resume, GET or DELETE of a stream or a response, a response's cancel, a response continuing
one through `previous_response_id`) may reach any ingress replica; that one's Forwarder sends it through a
handle to the replica the tag names (IngressRouter routes by it), whose own app answers it there, and
streams the answer back: status, headers, then the body as the app sends it. A tag that names no replica
serving any more gets 410: what it held went with it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import error_body

# The paths whose last id names a stream or a response (resume, GET, DELETE, cancel).
_ADDRESSED = re.compile(r"/v1/(?:streams|responses)/([^/]+)(?:/cancel)?")
_RESPONSES = "/v1/responses"


def holder_of(resource_id: str) -> str | None:
    """The ingress replica's tag an id ends with, or None for an id without one."""
    head, dot, tag = resource_id.rpartition(".")
    return tag if dot and head and tag else None


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as another ingress replica received it: the ASGI scope's plain parts and the body."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    client: tuple[str, int] | None
    body: bytes

    def scope(self) -> Scope:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "scheme": "http",
            "method": self.method,
            "path": self.path,
            "raw_path": self.path.encode(),
            "root_path": "",
            "query_string": self.query_string,
            "headers": self.headers,
            "client": self.client,
            "server": None,
        }


class Forwarder:
    """ASGI middleware of an ingress replica: a request addressing what another replica holds is answered
    by that one (`forward`), everything else by `app` here."""

    def __init__(
        self,
        app: ASGIApp,
        own_tag: str,
        forward: Callable[[str, ForwardedRequest], AsyncIterator[Message]],
        max_body_bytes: int,
    ) -> None:
        self.app = app
        self.own_tag = own_tag
        self._forward = forward
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body: bytes | None = None
        holder = None
        if match := _ADDRESSED.fullmatch(scope["path"]):
            holder = holder_of(match.group(1))
        elif scope["method"] == "POST" and scope["path"] == _RESPONSES:
            body, complete = await _read_body(receive, self._max_body_bytes)
            holder = _previous_response_holder(body) if complete else None
            receive = _replaying(body, complete, receive)
        if holder is None or holder == self.own_tag:
            await self.app(scope, receive, send)
            return
        if body is None:
            # Past the limit, what was read is enough for the holder's app to refuse it with 413.
            body, _ = await _read_body(receive, self._max_body_bytes)
        client = scope.get("client")
        request = ForwardedRequest(
            method=scope["method"],
            path=scope["path"],
            query_string=scope.get("query_string", b""),
            headers=list(scope["headers"]),
            client=tuple(client) if client else None,
            body=body,
        )
        # Leaving early (the client went) cancels the call, which ends the request where it runs.
        started = False
        try:
            async for message in self._forward(holder, request):
                started = started or message["type"] == "http.response.start"
                await send(message)
        except Exception as exc:  # noqa: BLE001 - the holder failed or went away while answering
            if started:
                raise
            message = f"The ingress replica `{holder}` that holds this id did not answer: {exc}"
            for part in json_response(503, error_body(503, message, code="replica_unavailable")):
                await send(part)


async def answer_forwarded(
    app: ASGIApp, own_tag: str, holder: str, request: ForwardedRequest
) -> AsyncIterator[Message]:
    """The ASGI messages `app` answers a forwarded request with, or a 410 where this replica is not
    `holder` (the one the id names is gone, and the router sent it here instead)."""
    if holder != own_tag:
        message = (
            f"The ingress replica `{holder}` that held this id is gone (restarted or removed): its streams and "
            "stored responses went with it."
        )
        for part in json_response(410, error_body(410, message, code="replica_gone")):
            yield part
        return
    # Bounded: the app waits on a slow reader as it would on its socket.
    messages: asyncio.Queue[Message | None] = asyncio.Queue(maxsize=16)
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(request.scope(), receive, messages.put)
        finally:
            await messages.put(None)

    task = asyncio.get_running_loop().create_task(run())
    try:
        while (message := await messages.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
    except BaseException:
        # Closed early: the asking replica's client left.
        disconnected.set()
        task.cancel()
        raise
    disconnected.set()
    # What the app does after its answer (accounting, logs) finishes; its errors were its 500 already.
    await asyncio.gather(task, return_exceptions=True)


def json_response(status: int, body: dict) -> list[Message]:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    return [
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": raw, "more_body": False},
    ]


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The body and True, or, when it is longer than `limit`, its first part and False."""
    parts: list[bytes] = []
    size = 0
    while size <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts), True
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if not message.get("more_body", False):
            return b"".join(parts), True
    return b"".join(parts), False


def _replaying(body: bytes, complete: bool, receive: Receive) -> Receive:
    """`receive` with what was read of the body as its first message, then the rest as it comes."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": not complete}

    return replay


def _previous_response_holder(body: bytes) -> str | None:
    """The tag of a Responses request's previous_response_id (None where it has none, or is no JSON: the app
    answers that here)."""
    try:
        previous = json.loads(body).get("previous_response_id")
    except (ValueError, AttributeError):
        return None
    return holder_of(previous) if isinstance(previous, str) else None
