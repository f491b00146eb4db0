"""Chunk stream → SSE events (role, deltas, finish, usage, [DONE]) and the non-streamed fold.

Both response kinds read the same channel; a non-streamed response is the fold of
the chunks a stream would have sent.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

from sse_starlette import EventSourceResponse

from app.errors import OpenAIError, error_body
from app.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatResponseMessage,
    Completion,
    CompletionChoice,
    Usage,
)
from engine.channel import Chunk, StreamChannel
from engine.engine import Engine
from engine.request import FinishReason, SamplingParams

Kind = Literal["chat", "text"]

# An SSE comment this often keeps proxies from closing a stream that waits in the queue.
KEEPALIVE_SECONDS = 15


@dataclass
class Generation:
    """One submitted request as the HTTP layer sees it."""

    kind: Kind
    model: str
    num_prompt_tokens: int
    channel: StreamChannel
    completion_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def start(
        cls, engine: Engine, kind: Kind, model: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Generation:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        generation = cls(
            kind=kind,
            model=model,
            num_prompt_tokens=len(prompt_token_ids),
            channel=StreamChannel(asyncio.get_running_loop()),
            completion_id=f"{prefix}-{uuid.uuid4().hex}",
        )
        engine.submit(generation.completion_id, prompt_token_ids, params, generation.channel)
        return generation

    def usage(self, completion_tokens: int) -> Usage:
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.num_prompt_tokens + completion_tokens,
        )

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> str:
        """One SSE data payload carrying a delta and/or the finish reason."""
        if self.kind == "chat":
            delta = ChatDelta(role="assistant" if role else None, content=text)
            choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
            body = ChatCompletionChunk(id=self.completion_id, created=self.created, model=self.model, choices=[choice])
        else:
            body = Completion(
                id=self.completion_id,
                created=self.created,
                model=self.model,
                choices=[CompletionChoice(text=text or "", finish_reason=finish_reason)],
            )
        return body.model_dump_json()

    def usage_chunk(self, completion_tokens: int) -> str:
        usage = self.usage(completion_tokens)
        if self.kind == "chat":
            body = ChatCompletionChunk(
                id=self.completion_id, created=self.created, model=self.model, choices=[], usage=usage
            )
        else:
            body = Completion(id=self.completion_id, created=self.created, model=self.model, choices=[], usage=usage)
        return body.model_dump_json()


async def sse_events(generation: Generation, include_usage: bool) -> AsyncIterator[dict]:
    """SSE events for one generation; leaving early (client gone) cancels it in the engine."""
    event_id = 0

    def event(data: str) -> dict:
        nonlocal event_id
        event_id += 1
        return {"id": str(event_id), "data": data}

    completion_tokens = 0
    try:
        if generation.kind == "chat":
            yield event(generation.chunk("", role=True))
        async for chunk in generation.channel:
            completion_tokens += len(chunk.token_ids)
            if chunk.text:
                yield event(generation.chunk(chunk.text))
            if chunk.finish_reason == FinishReason.ERROR:
                yield event(_error_json(chunk))
            elif chunk.is_terminal:
                yield event(generation.chunk(None if generation.kind == "chat" else "", chunk.finish_reason.value))
        if include_usage:
            yield event(generation.usage_chunk(completion_tokens))
        yield event("[DONE]")
    finally:
        generation.channel.cancel()


async def fold(generation: Generation) -> ChatCompletion | Completion:
    """The whole response at once: the same chunks, concatenated."""
    texts: list[str] = []
    completion_tokens = 0
    last: Chunk | None = None
    try:
        async for last in generation.channel:
            completion_tokens += len(last.token_ids)
            texts.append(last.text)
    finally:
        generation.channel.cancel()
    if last is None or last.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED):
        message = last.error if last and last.error else "the request was cancelled"
        raise OpenAIError(500, message, code="engine_error")
    text, reason, usage = "".join(texts), last.finish_reason.value, generation.usage(completion_tokens)
    ids = {"id": generation.completion_id, "created": generation.created, "model": generation.model}
    if generation.kind == "chat":
        choice = ChatChoice(message=ChatResponseMessage(content=text), finish_reason=reason)
        return ChatCompletion(**ids, choices=[choice], usage=usage)
    return Completion(**ids, choices=[CompletionChoice(text=text, finish_reason=reason)], usage=usage)


def _error_json(chunk: Chunk) -> str:
    body = error_body(500, chunk.error or "generation failed", code="engine_error")
    return json.dumps(body)


def event_stream(generation: Generation, include_usage: bool) -> EventSourceResponse:
    """The SSE response, returned before the first token exists."""
    return EventSourceResponse(
        sse_events(generation, include_usage),
        ping=KEEPALIVE_SECONDS,
        sep="\n",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
