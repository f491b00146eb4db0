"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with matching status codes."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    410: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


# Every status the server answers with besides 200, documented on every route of the OpenAPI document.
ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "Invalid parameters, or a prompt longer than the context"),
        (401, "Missing or wrong API key (only when the server requires one)"),
        (404, "Unknown model, stream or route"),
        (405, "Method not allowed"),
        (410, "In a cluster: the ingress replica that held this stream or response is gone"),
        (413, "Request body over --max-request-bytes"),
        (429, "Queue full (--max-queue); see Retry-After"),
        (500, "The engine failed the request"),
        (503, "The server is draining or the engine is not serving; see Retry-After"),
    )
}


class OpenAIError(Exception):
    """An error the client caused or can act on; becomes an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(
        error_body(error.status_code, error.message, error.param, error.code), error.status_code, headers=error.headers
    )


def _allowed_methods(request: Request) -> str | None:
    """The methods the OpenAPI document gives the request's path, if it documents that path."""
    for template, operations in request.app.openapi()["paths"].items():
        if re.fullmatch(re.sub(r"\{[^/}]+\}", "[^/]+", template), request.url.path):
            return ", ".join(sorted(method.upper() for method in operations))
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # Of a union's branches, the one that got furthest into the value is the one the client meant.
        first = max(exc.errors(), key=lambda error: len(error.get("loc", ())))
        param = ".".join(_field_path(first.get("loc", ()))) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if param:
            message = f"{param}: {message}"
        return JSONResponse(error_body(400, message, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = exc.headers
        if exc.status_code == 405 and (allowed := _allowed_methods(request)) is not None:
            # `Allow` lists every method of the path (RFC 9110); Starlette's names only the first
            # route that matched it (GET of /v1/responses/{id}, not its DELETE).
            headers = {**(headers or {}), "Allow": allowed}
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {exc}"), 500)


# Branch labels pydantic puts in an error's location for a union's scalar members.
_SCALAR_BRANCHES = frozenset({"str", "int", "float", "bool", "none"})


def _field_path(loc: tuple[int | str, ...]) -> list[str]:
    """An error's location as the request's own fields: without "body", a union's branch labels
    ("str", "list[tagged-union[...]]") and a tagged union's tag (`messages.0.content.0.image_url.url`,
    not `...content.list[tagged-union[TextContentPart,ImageContentPart]].0.image_url.image_url.url`)."""
    path: list[str] = []
    tag = None  # where a tagged union's tag comes: "next" part, or after the list "index"
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and ("[" in part or part in _SCALAR_BRANCHES):
            if "tagged-union[" in part:
                tag = "index" if part.startswith("list[") else "next"
            continue
        if tag == "next" and isinstance(part, str):
            tag = None
            continue
        if tag == "index" and isinstance(part, int):
            tag = "next"
        path.append(str(part))
    return path
