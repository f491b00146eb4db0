"""Chunk stream → OpenAI payloads (role, deltas with logprobs, finish with timings, usage, [DONE])
and the non-streamed fold of the same chunks.

Both response kinds read one StreamChannel, so a non-streamed response is exactly
what the stream would have carried, concatenated.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from app.errors import OpenAIError, error_body
from app.operations.accounting import Accounting
from app.serving.logprobs import chat_logprobs, completion_logprobs
from app.serving.messages import FunctionCall, ToolCall
from app.serving.output_format import OutputParser
from app.serving.payloads import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatResponseMessage,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionTokensDetails,
    FunctionCallDelta,
    PromptTokensDetails,
    Timings,
    ToolCallDelta,
    Usage,
)
from app.serving.tools import ArgumentsDelta, CallStarted, Content, Piece
from engine import types as engine_types
from engine.channel import StreamChannel
from engine.detokenizer import TokenBytes
from engine.engine_client import EngineClient
from engine.images import ImageInput
from engine.types import Chunk, FinishReason, SamplingParams, TokenLogprob

Kind = Literal["chat", "text"]

DONE = "[DONE]"
# A delta's text as JSON, as pydantic renders it; built once (json.dumps with a non-default option
# builds a new encoder on every call, and this runs once per chunk of every stream).
_json_text = json.JSONEncoder(ensure_ascii=False).encode
# Stands for a delta's text while a chunk template is rendered; never in an id or a model name.
_TEXT_SLOT = "\u0001sluice-text\u0001"
# Finish reasons that end a choice with an error event instead of its last delta.
ENDED_IN_ERROR = (FinishReason.ERROR, FinishReason.REJECTED, FinishReason.CANCELLED)


class ChunkReader:
    """A response's reading of its channel: every chunk it reads is accounted for, and leaving (at the
    end, on an error or the client's disconnect) cancels the request in the engine and closes its
    accounting, abandoned if a choice had not finished."""

    def __init__(self, channel: StreamChannel, accounting: Accounting | None, num_choices: int = 1) -> None:
        self.channel = channel
        self.accounting = accounting
        self.open_choices = num_choices

    async def __aenter__(self) -> ChunkReader:
        return self

    async def __aexit__(self, *_) -> None:
        self.channel.cancel()
        if self.accounting is not None:
            self.accounting.close(abandoned=self.open_choices > 0)

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        async for chunk in self.channel:
            if self.accounting is not None:
                self.accounting.on_chunk(chunk)
            self.open_choices -= chunk.is_terminal
            yield chunk


@dataclass
class _Choice:
    """What the fold gathers for one choice."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    timings: engine_types.Timings | None = None


@dataclass
class CompletionRenderer:
    """One submitted chat or text completion, its chunks rendered as OpenAI's payloads: streamed
    (`events`) or folded into one response (`fold`)."""

    kind: Kind
    model: str
    num_prompt_tokens: int
    num_choices: int
    wants_logprobs: bool
    include_usage: bool
    channel: StreamChannel
    token_bytes: TokenBytes
    completion_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    # Metrics and the audit line; None where nobody accounts for the request (benchmarks).
    accounting: Accounting | None = None
    # Makes the parser of each choice's text into content and tool calls (app/serving/output_format.py);
    # None where the text is all content.
    parser: Callable[[], OutputParser] | None = None
    # Whether the output's reasoning comes apart from its answer (a reasoning model's chat).
    splits_reasoning: bool = False
    # Per choice: a content chunk's JSON before and after its text.
    _text_templates: dict[int, tuple[str, str]] = field(default_factory=dict)
    # Whether every chunk with text and nothing else is one content delta (see content_delta).
    _text_only: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._text_only = not (self.wants_logprobs or self.parser or self.splits_reasoning)

    @classmethod
    def start(
        cls,
        engine: EngineClient,
        kind: Kind,
        model: str,
        completion_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        include_usage: bool,
        accounting: Callable[[str], Accounting] | None = None,
        parser: Callable[[], OutputParser] | None = None,
        splits_reasoning: bool = False,
        images: tuple[ImageInput, ...] = (),
    ) -> CompletionRenderer:
        """Submit the request (with its prompt's `images`); `accounting`, given the completion id, makes its
        accounting."""
        renderer = cls(
            kind=kind,
            model=model,
            num_prompt_tokens=len(prompt_token_ids),
            num_choices=params.n,
            wants_logprobs=params.logprobs is not None,
            include_usage=include_usage,
            channel=StreamChannel(asyncio.get_running_loop(), num_choices=params.n),
            token_bytes=engine.token_bytes,
            completion_id=completion_id,
            parser=parser,
            splits_reasoning=splits_reasoning,
        )
        if accounting is not None:
            renderer.accounting = accounting(renderer.completion_id)
        engine.submit(renderer.completion_id, prompt_token_ids, params, renderer.channel, images)
        return renderer

    async def events(self) -> AsyncIterator[str]:
        """Every SSE data payload of the stream, ending in [DONE] on every path; leaving early
        cancels the request in the engine."""
        cached_tokens = reasoning_tokens = 0
        text_offsets = [0] * self.num_choices
        parsers = [self.parser() for _ in range(self.num_choices)] if self.parser is not None else None
        async with ChunkReader(self.channel, self.accounting, self.num_choices) as chunks:
            if self.kind == "chat":
                for index in range(self.num_choices):
                    yield self._chat_chunk(index, ChatDelta(role="assistant", content=""))
            async for chunk in chunks:
                if (payload := self.content_delta(chunk)) is not None:
                    yield payload
                    continue
                if chunk.finish_reason in ENDED_IN_ERROR:
                    yield _error_json(chunk)
                    break
                if chunk.reasoning:
                    # The reasoning comes first; its delta carries the chunk's logprobs.
                    yield self._reasoning_delta(chunk)
                    chunk = chunk._replace(logprobs=())
                if parsers is not None:
                    parser = parsers[chunk.index]
                    pieces = parser.feed(chunk.text) + (parser.finish() if chunk.is_terminal else [])
                    for payload in self._tool_deltas(chunk.index, pieces, chunk.logprobs):
                        yield payload
                elif chunk.text or chunk.logprobs:
                    yield self._delta(chunk, text_offsets)
                if chunk.is_terminal:
                    cached_tokens = max(cached_tokens, chunk.timings.cached_tokens if chunk.timings else 0)
                    reasoning_tokens += chunk.timings.reasoning_tokens if chunk.timings else 0
                    yield self._finish(chunk, bool(parsers and parsers[chunk.index].calls()))
            else:
                if self.include_usage:
                    # The channel's count: chunks written through (see content_delta) never pass here.
                    yield self._usage_chunk(self.channel.read_tokens, cached_tokens, reasoning_tokens)
            yield DONE

    async def fold(self) -> ChatCompletion | Completion:
        """The whole response at once: the same chunks, concatenated per choice."""
        choices = [_Choice() for _ in range(self.num_choices)]
        completion_tokens = 0
        async with ChunkReader(self.channel, self.accounting, self.num_choices) as chunks:
            async for chunk in chunks:
                if chunk.finish_reason == FinishReason.REJECTED:
                    raise OpenAIError(400, chunk.error or "the request cannot be served by this model")
                if chunk.finish_reason in ENDED_IN_ERROR:
                    raise OpenAIError(500, chunk.error or "the request was cancelled", code="engine_error")
                completion_tokens += len(chunk.token_ids)
                choice = choices[chunk.index]
                choice.text.append(chunk.text)
                choice.reasoning.append(chunk.reasoning)
                choice.logprobs.extend(chunk.logprobs)
                if chunk.is_terminal:
                    choice.finish_reason, choice.timings = chunk.finish_reason.value, chunk.timings
        ids = {"id": self.completion_id, "created": self.created, "model": self.model}
        # The last choice to finish has seen the whole request through.
        last = max((c.timings for c in choices if c.timings), key=lambda t: t.ttft_ms + t.decode_ms, default=None)
        usage = self._usage(
            completion_tokens,
            max((c.timings.cached_tokens for c in choices if c.timings), default=0),
            sum(c.timings.reasoning_tokens for c in choices if c.timings),
        )
        timings = timings_payload(last)
        if self.kind == "chat":
            chat_choices = [
                ChatChoice(
                    index=index,
                    message=self._message("".join(c.text), "".join(c.reasoning)),
                    logprobs=self._chat_logprobs(c.logprobs),
                    finish_reason=c.finish_reason,
                )
                for index, c in enumerate(choices)
            ]
            for choice in chat_choices:
                if choice.message.tool_calls and choice.finish_reason == FinishReason.STOP.value:
                    choice.finish_reason = "tool_calls"
            return ChatCompletion(**ids, choices=chat_choices, usage=usage, timings=timings)
        text_choices = [
            CompletionChoice(
                index=index,
                text="".join(c.text),
                logprobs=self._completion_logprobs(c.logprobs, 0)[0],
                finish_reason=c.finish_reason,
            )
            for index, c in enumerate(choices)
        ]
        return Completion(**ids, choices=text_choices, usage=usage, timings=timings)

    def _message(self, text: str, reasoning: str) -> ChatResponseMessage:
        """The assistant's message: its text, or with tools its text and calls apart; its reasoning
        (none is absent) under both its names."""
        thought = {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
        if self.parser is None:
            return ChatResponseMessage(content=text, **thought)
        parser = self.parser()
        pieces = parser.feed(text) + parser.finish()
        content = "".join(p.text for p in pieces if isinstance(p, Content))
        calls = [
            ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))
            for call_id, name, arguments in parser.calls()
        ]
        return ChatResponseMessage(content=content or (None if calls else ""), tool_calls=calls or None, **thought)

    # Payloads.

    def _tool_deltas(self, index: int, pieces: list[Piece], logprobs: Sequence[TokenLogprob]) -> list[str]:
        """Chat chunks for parsed output: content, a call's start (id, name), its argument fragments."""
        scores = self._chat_logprobs(logprobs) if logprobs else None
        if scores is not None and not pieces:
            # The text is held back (it may open a call), but its tokens' scores go out now.
            pieces = [Content("")]
        payloads = []
        for piece in pieces:
            if isinstance(piece, Content):
                delta = ChatDelta(content=piece.text)
            elif isinstance(piece, CallStarted):
                function = FunctionCallDelta(name=piece.name, arguments="")
                delta = ChatDelta(
                    tool_calls=[ToolCallDelta(index=piece.index, id=piece.call_id, type="function", function=function)]
                )
            else:
                assert isinstance(piece, ArgumentsDelta)
                delta = ChatDelta(
                    tool_calls=[ToolCallDelta(index=piece.index, function=FunctionCallDelta(arguments=piece.text))]
                )
            payloads.append(self._chat_chunk(index, delta, scores))
            scores = None
        return payloads

    def content_delta(self, chunk: Chunk) -> str | None:
        """The payload of a chunk that carries only text (not a choice's last, no logprobs, no tool
        parsing), which is all `events` yields for it (its first step); None for any other chunk. The
        fast path writes these itself (app/serving/sse.py), so they must need no state of `events`.
        The hot path, once per chunk of every stream: a pre-rendered chunk with the text spliced in."""
        if chunk.finish_reason is not None or not chunk.text or not self._text_only:
            return None
        return self._text_delta(chunk)

    def _reasoning_delta(self, chunk: Chunk) -> str:
        delta = ChatDelta(reasoning_content=chunk.reasoning, reasoning=chunk.reasoning)
        return self._chat_chunk(chunk.index, delta, self._chat_logprobs(chunk.logprobs) if chunk.logprobs else None)

    def _delta(self, chunk: Chunk, text_offsets: list[int]) -> str:
        if not self.wants_logprobs:
            return self._text_delta(chunk)
        if self.kind == "chat":
            return self._chat_chunk(chunk.index, ChatDelta(content=chunk.text), self._chat_logprobs(chunk.logprobs))
        logprobs, text_offsets[chunk.index] = self._completion_logprobs(chunk.logprobs, text_offsets[chunk.index])
        return self._text_chunk(CompletionChoice(index=chunk.index, text=chunk.text, logprobs=logprobs))

    def _text_delta(self, chunk: Chunk) -> str:
        prefix, suffix = self._text_templates.get(chunk.index) or self._text_template(chunk.index)
        return prefix + _json_text(chunk.text) + suffix

    def _text_template(self, index: int) -> tuple[str, str]:
        """Choice `index`'s content chunk rendered once by its pydantic model, split where the text goes,
        so every delta is byte for byte what the model would render."""
        if self.kind == "chat":
            rendered = self._chat_chunk(index, ChatDelta(content=_TEXT_SLOT))
        else:
            rendered = self._text_chunk(CompletionChoice(index=index, text=_TEXT_SLOT))
        prefix, suffix = rendered.split(json.dumps(_TEXT_SLOT))
        self._text_templates[index] = (prefix, suffix)
        return prefix, suffix

    def _finish(self, chunk: Chunk, called: bool = False) -> str:
        reason, timings = chunk.finish_reason.value, timings_payload(chunk.timings)
        if called and chunk.finish_reason == FinishReason.STOP:
            reason = "tool_calls"
        if self.kind == "chat":
            return self._chat_chunk(chunk.index, ChatDelta(), finish_reason=reason, timings=timings)
        return self._text_chunk(CompletionChoice(index=chunk.index, text="", finish_reason=reason), timings)

    def _chat_chunk(
        self,
        index: int,
        delta: ChatDelta,
        logprobs: ChoiceLogprobs | None = None,
        finish_reason: str | None = None,
        timings: Timings | None = None,
    ) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return ChatCompletionChunk(
            id=self.completion_id, created=self.created, model=self.model, choices=[choice], timings=timings
        ).model_dump_json()

    def _text_chunk(self, choice: CompletionChoice, timings: Timings | None = None) -> str:
        return Completion(
            id=self.completion_id, created=self.created, model=self.model, choices=[choice], timings=timings
        ).model_dump_json()

    def _usage_chunk(self, completion_tokens: int, cached_tokens: int, reasoning_tokens: int) -> str:
        ids = {"id": self.completion_id, "created": self.created, "model": self.model}
        usage = self._usage(completion_tokens, cached_tokens, reasoning_tokens)
        if self.kind == "chat":
            return ChatCompletionChunk(**ids, choices=[], usage=usage).model_dump_json()
        return Completion(**ids, choices=[], usage=usage).model_dump_json()

    def _usage(self, completion_tokens: int, cached_tokens: int, reasoning_tokens: int) -> Usage:
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.num_prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=(
                CompletionTokensDetails(reasoning_tokens=reasoning_tokens) if self.splits_reasoning else None
            ),
        )

    # Logprobs in OpenAI's two shapes (app/serving/logprobs.py), for requests that asked for them.

    def _chat_logprobs(self, logprobs: Sequence[TokenLogprob]) -> ChoiceLogprobs | None:
        return chat_logprobs(self.token_bytes, logprobs) if self.wants_logprobs else None

    def _completion_logprobs(
        self, logprobs: Sequence[TokenLogprob], offset: int
    ) -> tuple[CompletionLogprobs | None, int]:
        return completion_logprobs(self.token_bytes, logprobs, offset) if self.wants_logprobs else (None, offset)


def timings_payload(timings: engine_types.Timings | None) -> Timings | None:
    if timings is None:
        return None
    return Timings(
        queue_ms=round(timings.queue_ms, 3),
        prompt_n=timings.prompt_tokens,
        prompt_ms=round(timings.prompt_ms, 3),
        ttft_ms=round(timings.ttft_ms, 3),
        predicted_n=timings.completion_tokens,
        predicted_ms=round(timings.decode_ms, 3),
        predicted_per_second=round(timings.decode_tokens_per_second, 3),
        draft_n=timings.draft_tokens,
        draft_n_accepted=timings.accepted_tokens,
        cache_n=timings.cached_tokens,
    )


def _error_json(chunk: Chunk) -> str:
    if chunk.finish_reason == FinishReason.CANCELLED:
        body = error_body(499, "the stream was cancelled", code="cancelled")
    elif chunk.finish_reason == FinishReason.REJECTED:
        body = error_body(400, chunk.error or "the request cannot be served by this model")
    else:
        body = error_body(500, chunk.error or "generation failed", code="engine_error")
    return json.dumps(body)
