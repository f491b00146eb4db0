"""The audit log: one JSON line per request to the API (/v1), to a file or stderr (`--audit-log`).

A generation's line (AuditRecord) says who asked for what and what it cost: time, request
id, client address, API-key id (a hash, never the key), model, endpoint, prompt / completion
/ cached tokens, finish reasons, TTFT, duration, and whether the request was cancelled,
resumed or paused; prompts and outputs only with `--audit-log-content`. Every other request
(AnswerRecord) gets its method, endpoint, status and, when refused (401, 413, 429, 400, ...),
the error's code and message: failed authentication is what an audit log is first read for.
Lines are written by the event loop as requests finish; a line is small and the file is
line-buffered.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO


@dataclass
class AuditRecord:
    request_id: str
    client: str | None
    api_key_id: str | None
    model: str
    endpoint: str
    completion_id: str
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    ttft_ms: float | None = None
    duration_ms: float = 0.0
    cancelled: bool = False
    resumed: int = 0
    paused: bool = False
    streamed: bool = True
    prompt: object | None = None
    output: list[str] | None = None


@dataclass
class AnswerRecord:
    """A request that started no generation: refused, or answered without one (models, a stored response)."""

    request_id: str
    client: str | None
    # None when the server has no keys or the request's key was missing or wrong.
    api_key_id: str | None
    method: str
    endpoint: str
    status: int
    # A refusal's error code and message (never the key: no message quotes it).
    code: str | None = None
    reason: str | None = None


class AuditLog:
    def __init__(self, path: Path, with_content: bool) -> None:
        self.with_content = with_content
        self._out: TextIO = sys.stderr if str(path) == "-" else open(path, "a", buffering=1)  # noqa: SIM115

    def write(self, record: AuditRecord | AnswerRecord) -> None:
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **asdict(record)}
        if isinstance(record, AuditRecord) and not self.with_content:
            line.pop("prompt")
            line.pop("output")
        self._out.write(json.dumps(line, ensure_ascii=False) + "\n")

    def close(self) -> None:
        if self._out is not sys.stderr:
            self._out.close()
