"""A strict reader of raw SSE streams, for asserting on the wire format itself: what the end-to-end tests
and bench/soak.py read streams with."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import httpx


@dataclass
class Event:
    id: str | None
    data: str

    def json(self) -> dict:
        return json.loads(self.data)


def read_events(response: httpx.Response) -> list[Event]:
    return parse_events(response.iter_lines())


def parse_events(lines: Iterable[str]) -> list[Event]:
    return list(iter_events(lines))


def iter_events(lines: Iterable[str]) -> Iterator[Event]:
    """Events as they arrive (`event:` names are not kept: payloads carry their type)."""
    event_id, data = None, []
    for line in lines:
        if line == "":
            if data:
                yield Event(event_id, "\n".join(data))
            event_id, data = None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))


def stream_text(events: list[Event]) -> tuple[str, str | None]:
    """Concatenated chat deltas and the finish reason, from a chat completion stream."""
    text, reason = "", None
    for event in events:
        if event.data == "[DONE]":
            break
        for choice in event.json()["choices"]:
            text += choice["delta"].get("content") or ""
            reason = choice["finish_reason"] or reason
    return text, reason
