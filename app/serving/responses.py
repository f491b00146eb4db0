"""A Responses API response from submission to its last event, and the store that keeps them.

A response reads its generation's chunks on a task of its own, into numbered events
(`sequence_number` from 0) and the response object they describe; clients subscribe
from any sequence number (`starting_after`), so a stream resumes after a reload and a
stored response finishes even while nobody is reading. A stored response keeps its
conversation (messages and token ids) for `--response-retention` seconds, so a later
request naming it as `previous_response_id` continues it; the engine keeps its KV
pinned for `--response-kv-ttl` seconds after its last use.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from app.operations.accounting import Accounting
from app.serving.event_log import EventLog
from app.serving.messages import ChatMessage, FunctionCall, ToolCall
from app.serving.output_format import OutputParser
from app.serving.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from app.serving.sse import sse_event
from app.serving.streaming import ENDED_IN_ERROR, ChunkReader, timings_payload
from app.serving.tools import ArgumentsDelta, CallStarted, Content, Piece, ToolUse
from engine.channel import StreamChannel
from engine.types import Chunk, FinishReason

_FINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    # The Responses API has no event of its own for a cancelled response: it ends as a failure
    # whose response says "cancelled".
    "cancelled": "response.failed",
}


@dataclass
class Conversation:
    """What a follow-up needs: the turn's instructions and tools, the messages so far (without the
    instructions) and the token ids the engine computed for them."""

    instructions: str | None
    tool_use: ToolUse | None
    messages: list[ChatMessage]
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    # The reply's content: its text, less the tool calls the output format parsed out of it.
    output_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def with_reply(self) -> list[ChatMessage]:
        """The messages including this turn's reply."""
        content = self.output_content
        if self.tool_calls:
            # Calls become structured again; the text around them is the reply's content.
            content = content.strip()
        return [*self.messages, ChatMessage(role="assistant", content=content, tool_calls=self.tool_calls or None)]


class ResponseRun:
    """One response: its events, its response object and its conversation."""

    def __init__(
        self,
        response: ResponseObject,
        channel: StreamChannel,
        accounting: Accounting | None,
        conversation: Conversation,
        parser: OutputParser | None,
    ) -> None:
        self.response = response
        self.channel = channel
        self.accounting = accounting
        self.conversation = conversation
        # Reads the text into content and tool calls (app/serving/output_format.py); None: all content.
        self._parser = parser
        self._log: EventLog[bytes] = EventLog()
        self._open: OutputReasoning | OutputMessage | OutputFunctionCall | None = None

    @property
    def id(self) -> str:
        return self.response.id

    @property
    def num_events(self) -> int:
        return len(self._log)

    @property
    def done(self) -> bool:
        return self._log.done

    async def run(self) -> None:
        """Read the generation to its end into events and the response object."""
        self._emit("response.created", response=self._snapshot())
        self._emit("response.in_progress", response=self._snapshot())
        terminal: Chunk | None = None
        try:
            async with ChunkReader(self.channel, self.accounting) as chunks:
                async for chunk in chunks:
                    self.conversation.output_ids += chunk.token_ids
                    if chunk.finish_reason in ENDED_IN_ERROR:
                        terminal = chunk
                        break
                    if chunk.reasoning:
                        self._on_reasoning(chunk.reasoning)
                    for piece in self._pieces(chunk):
                        self._on_piece(piece)
                    if chunk.is_terminal:
                        terminal = chunk
        finally:
            self._finish(terminal)
            self._log.close()

    async def wait(self) -> ResponseObject:
        async for _ in self._log.follow(len(self._log)):
            pass
        return self.response

    async def events(self, after: int = -1) -> AsyncIterator[bytes]:
        """Every SSE event with a sequence number above `after`, then live ones to the last."""
        async for _, event in self._log.follow(after + 1):
            yield event

    def cancel(self) -> None:
        self.channel.cancel()

    # Chunks → output items.

    def _pieces(self, chunk: Chunk) -> list[Piece]:
        if self._parser is None:
            return [Content(chunk.text)] if chunk.text else []
        return self._parser.feed(chunk.text) + (self._parser.finish() if chunk.is_terminal else [])

    def _on_reasoning(self, text: str) -> None:
        """The reasoning leads the output: its item is the first, open until the answer begins."""
        item = self._open
        if not isinstance(item, OutputReasoning):
            self._close("completed")
            item = OutputReasoning(id=f"rs_{uuid.uuid4().hex}", status="in_progress", content=[])
            self._open_item(item)
            item.content.append(ReasoningText(text=""))
            part = ReasoningText(text="").model_dump()
            self._emit("response.content_part.added", **self._where(item), content_index=0, part=part)
        item.content[0].text += text
        self._emit("response.reasoning_text.delta", **self._where(item), content_index=0, delta=text)

    def _on_piece(self, piece: Piece) -> None:
        if isinstance(piece, Content):
            self.conversation.output_content += piece.text
            message = self._open if isinstance(self._open, OutputMessage) else self._open_message()
            message.content[0].text += piece.text
            self._emit(
                "response.output_text.delta", **self._where(message), content_index=0, delta=piece.text, logprobs=[]
            )
        elif isinstance(piece, CallStarted):
            self._close("completed")
            call = OutputFunctionCall(
                id=f"fc_{uuid.uuid4().hex}", call_id=piece.call_id, name=piece.name, arguments="", status="in_progress"
            )
            self._open_item(call)
        else:
            assert isinstance(piece, ArgumentsDelta) and isinstance(self._open, OutputFunctionCall)
            self._open.arguments += piece.text
            self._emit("response.function_call_arguments.delta", **self._where(self._open), delta=piece.text)

    def _open_message(self) -> OutputMessage:
        self._close("completed")
        message = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[])
        self._open_item(message)
        message.content.append(OutputText(text=""))
        self._emit("response.content_part.added", **self._where(message), content_index=0, part=_part(""))
        return message

    def _open_item(self, item: OutputReasoning | OutputMessage | OutputFunctionCall) -> None:
        self.response.output.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.response.output) - 1, item=item.model_dump())

    def _close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item.status = status
        if isinstance(item, OutputMessage):
            text = item.content[0].text
            self._emit("response.output_text.done", **self._where(item), content_index=0, text=text, logprobs=[])
            self._emit("response.content_part.done", **self._where(item), content_index=0, part=_part(text))
        elif isinstance(item, OutputReasoning):
            part = item.content[0]
            self._emit("response.reasoning_text.done", **self._where(item), content_index=0, text=part.text)
            self._emit("response.content_part.done", **self._where(item), content_index=0, part=part.model_dump())
        else:
            self._emit("response.function_call_arguments.done", **self._where(item), arguments=item.arguments)
            self.conversation.tool_calls.append(
                ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            )
        self._emit("response.output_item.done", output_index=self.response.output.index(item), item=item.model_dump())

    def _finish(self, terminal: Chunk | None) -> None:
        """Close the open item, settle the status and usage, and send the final event."""
        reason = terminal.finish_reason if terminal is not None else FinishReason.CANCELLED
        status = {
            FinishReason.STOP: "completed",
            FinishReason.LENGTH: "incomplete",
            FinishReason.ERROR: "failed",
            FinishReason.REJECTED: "failed",
        }.get(reason, "cancelled")
        if status in ("completed", "incomplete") and not self.response.output:
            self._open_message()
        self._close("completed" if status == "completed" else "incomplete")
        response = self.response
        response.status = status
        if status == "incomplete":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        elif status == "failed":
            code = "invalid_prompt" if reason == FinishReason.REJECTED else "server_error"
            response.error = ResponseError(code=code, message=terminal.error or "generation failed")
            self._emit("error", code=response.error.code, message=response.error.message, param=None)
        elif status == "cancelled":
            response.error = ResponseError(code="cancelled", message="the response was cancelled")
        timings = terminal.timings if terminal is not None else None
        num_prompt = len(self.conversation.prompt_ids)
        num_output = len(self.conversation.output_ids)
        response.usage = ResponseUsage(
            input_tokens=num_prompt,
            input_tokens_details=InputTokensDetails(cached_tokens=timings.cached_tokens if timings else 0),
            output_tokens=num_output,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=timings.reasoning_tokens if timings else 0),
            total_tokens=num_prompt + num_output,
        )
        if timings is not None:
            response.timings = timings_payload(timings).model_dump()
        self._emit(_FINAL_EVENTS[status], response=self._snapshot())

    # Events.

    def _where(self, item: OutputReasoning | OutputMessage | OutputFunctionCall) -> dict:
        return {"item_id": item.id, "output_index": self.response.output.index(item)}

    def _snapshot(self) -> dict:
        return self.response.model_dump()

    def _emit(self, kind: str, **fields) -> None:
        sequence = len(self._log)
        data = json.dumps({"type": kind, "sequence_number": sequence, **fields}, separators=(",", ":"))
        self._log.append(sse_event(sequence, data, event=kind))


def _part(text: str) -> dict:
    return OutputText(text=text).model_dump()


class ResponseStore:
    """Responses by id: stored ones for `retention_seconds` after they are created, unstored ones
    only while they run (so they can be cancelled). Owned by the event loop."""

    def __init__(self, retention_seconds: float, unpin: Callable[[str], None]) -> None:
        self.retention_seconds = retention_seconds
        self._unpin = unpin
        # id -> (run, expiry), in creation order, so expiries come in order.
        self._runs: dict[str, tuple[ResponseRun, float]] = {}
        self._tasks: set[asyncio.Task] = set()

    def start(self, run: ResponseRun) -> None:
        """Run a new response on a task of its own; keep it if it is stored."""
        self._expire()
        self._runs[run.id] = (run, time.monotonic() + self.retention_seconds)
        task = asyncio.get_running_loop().create_task(run.run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if not run.response.store:
            task.add_done_callback(lambda _: self._runs.pop(run.id, None))

    def get(self, response_id: str) -> ResponseRun | None:
        self._expire()
        entry = self._runs.get(response_id)
        return entry[0] if entry is not None else None

    def delete(self, response_id: str) -> bool:
        entry = self._runs.pop(response_id, None)
        if entry is None:
            return False
        entry[0].cancel()
        self._unpin(response_id)
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        while self._runs:
            response_id, (run, expiry) = next(iter(self._runs.items()))
            if expiry > now or not run.done:
                return
            del self._runs[response_id]
            self._unpin(response_id)
