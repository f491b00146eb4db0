"""OpenAI wire models of what Sluice answers with: completions, chat completions, their streamed
chunks, usage, logprobs, model cards (the requests are app/serving/protocol.py)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, model_serializer

from app.serving.messages import ToolCall


def _absent(value: object) -> bool:
    return value is None


class PromptTokensDetails(BaseModel):
    # Prompt tokens whose K/V came from the prefix cache.
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    # Completion tokens the model thought in (a reasoning model's, split off the answer).
    reasoning_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Only where the output is split into reasoning and answer.
    completion_tokens_details: CompletionTokensDetails | None = Field(None, exclude_if=_absent)


class _Delta(BaseModel):
    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict:
        # OpenAI sends only the fields a delta changes; the final delta is {}.
        return {key: value for key, value in handler(self).items() if value is not None}


class FunctionCallDelta(_Delta):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Delta):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_Delta):
    role: Literal["assistant"] | None = None
    content: str | None = None
    # A reasoning model's thinking, under both names vLLM has given it (`reasoning` is its newer one).
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class Timings(BaseModel):
    """Extension, after llama.cpp: where the time of one choice went."""

    queue_ms: float
    prompt_n: int
    prompt_ms: float
    ttft_ms: float
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float
    draft_n: int
    draft_n_accepted: int
    # Prompt tokens served from the prefix cache (llama.cpp's name).
    cache_n: int


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    timings: Timings | None = Field(None, exclude_if=_absent)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # A reasoning model's thinking, as ChatDelta's.
    reasoning_content: str | None = Field(None, exclude_if=_absent)
    reasoning: str | None = Field(None, exclude_if=_absent)
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_absent)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings | None = Field(None, exclude_if=_absent)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """Both the non-streamed response and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | None = Field(None, exclude_if=_absent)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sluice"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
