"""The audit log: one JSON line per finished request, to a file or stderr (`--audit-log`).

Who asked for what and what it cost: time, request id, client address, API-key id
(a hash, never the key), model, endpoint, prompt / completion / cached tokens,
finish reasons, TTFT, duration, and whether the request was cancelled, resumed or
paused. Prompts and outputs only with `--audit-log-content`. Lines are written by
the event loop as requests finish; a line is small and the file is line-buffered.
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


class AuditLog:
    def __init__(self, path: Path, with_content: bool) -> None:
        self.with_content = with_content
        self._out: TextIO = sys.stderr if str(path) == "-" else open(path, "a", buffering=1)  # noqa: SIM115

    def write(self, record: AuditRecord) -> None:
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **asdict(record)}
        if not self.with_content:
            line.pop("prompt")
            line.pop("output")
        self._out.write(json.dumps(line, ensure_ascii=False) + "\n")

    def close(self) -> None:
        if self._out is not sys.stderr:
            self._out.close()
