"""The ASGI middleware every HTTP request passes: request id, body size limit, response counts.

- **Request id.** An incoming `X-Request-Id` (up to 128 printable ASCII characters)
  is kept, otherwise one is made; it is returned as a response header, set for
  every log line of the request (`request_id` in the log format) and written to its
  audit line.
- **Body limit.** A body over `--max-request-bytes` gets 413 in OpenAI's shape, by its
  Content-Length before anything is read; a chunked body is read here first, and refused as
  soon as it passes the limit.
- **Metrics.** Every response's status, by method and route, in `sluice:http_requests_total`.
- **Audit.** A request to /v1 that started no generation (refused, or answered without one) gets
  its audit line here, with its status and a refusal's reason; a generation's accounting writes its own.

One pure ASGI layer rather than three, outermost (app/server.py puts it outside Starlette's own
error layer, so the 500 of an unexpected error carries the id too). A streamed response's
body messages skip it and every layer below it (`BODY_SEND`): they act only on the response's start.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import OpenAIError, error_response
from app.operations.audit import AnswerRecord, AuditLog
from app.operations.metrics import Metrics

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_VALID_ID = re.compile(r"[\x21-\x7e]{1,128}")
# Scope key of the `send` this layer was given: the server's own. An SSE response sends its body
# events there: the layers in between (this one's request-id header, Starlette's error layer and its
# two exception wrappers) act only on the response's start, and passing each of a stream's events
# through them would cost the event loop time per event at hundreds of streams.
BODY_SEND = "sluice.body_send"


class RequestIdLogFilter(logging.Filter):
    """Puts the current request's id on every log record (`-` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


class FrontDoor:
    def __init__(
        self,
        app: ASGIApp,
        max_request_bytes: int,
        metrics: Callable[[], Metrics | None],
        audit: Callable[[], AuditLog | None],
        id_header: bool = True,
    ) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes
        # False under Ray Serve, whose own layer around the app returns the same id (it sets the request's
        # header first when there is none): a second header would repeat it.
        self.id_header = id_header
        # The server's metrics and audit log once it has started (None before, or without --audit-log).
        self.metrics = metrics
        self.audit = audit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        # The first, as Ray Serve's layer takes it.
        incoming = next((value for name, value in scope["headers"] if name == b"x-request-id"), b"").decode("latin-1")
        # Under Ray Serve the response returns its layer's id, whatever it is: the logs and audit say the same.
        keep = _VALID_ID.fullmatch(incoming) or (not self.id_header and incoming)
        request_id = incoming if keep else uuid.uuid4().hex
        token = request_id_var.set(request_id)
        scope.setdefault("state", {})["request_id"] = request_id
        scope[BODY_SEND] = send
        status = 500
        # An error's body (a small JSON object), for the audit line's reason.
        error_body: list[bytes] = []

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if self.id_header:
                    message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
            elif status >= 400:
                error_body.append(message.get("body", b""))
            await send(message)

        try:
            length = headers.get(b"content-length")
            if length is not None:
                if length.isdigit() and int(length) > self.max_request_bytes:
                    await _send_error(send_with_id, _too_large(self.max_request_bytes))
                    return
            elif scope["method"] in ("POST", "PUT", "PATCH"):
                # A chunked body: read it here, up to the limit, and hand it on whole.
                receive = await self._buffered(receive)
                if receive is None:
                    await _send_error(send_with_id, _too_large(self.max_request_bytes))
                    return
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)
            metrics = self.metrics()
            if metrics is not None:
                route = scope.get("route")
                metrics.http_response(scope["method"], getattr(route, "path", None) or "unmatched", status)
            audit = self.audit()
            if audit is not None and scope["path"].startswith("/v1/") and not scope["state"].get("generation_started"):
                audit.write(_answer_record(scope, request_id, status, b"".join(error_body)))

    async def _buffered(self, receive: Receive) -> Receive | None:
        """`receive` with the whole body read ahead; None once it passes the limit."""
        body, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_request_bytes:
                return None
            body.append(message.get("body", b""))
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(body), "more_body": False}
                break
        replay = [message]

        async def replaying() -> Message:
            return replay.pop() if replay else await receive()

        return replaying


def _answer_record(scope: Scope, request_id: str, status: int, error_body: bytes) -> AnswerRecord:
    client = scope.get("client")
    try:
        error = json.loads(error_body)["error"] if error_body else {}
    except (ValueError, KeyError, TypeError):
        error = {}
    return AnswerRecord(
        request_id=request_id,
        client=f"{client[0]}:{client[1]}" if client else None,
        api_key_id=scope["state"].get("api_key_id"),
        method=scope["method"],
        endpoint=scope["path"],
        status=status,
        code=error.get("code") if isinstance(error, dict) else None,
        reason=error.get("message") if isinstance(error, dict) else None,
    )


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than {limit} bytes (--max-request-bytes).")


async def _send_error(send: Send, error: OpenAIError) -> None:
    await error_response(error)({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
