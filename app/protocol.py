"""OpenAI wire models: requests (validated, unknown fields ignored), responses, chunks."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from app.errors import OpenAIError
from engine.request import SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    """Extension (as vLLM): keep the k most likely tokens; 0 or -1 keeps all."""
    seed: int | None = None
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """Check what the engine cannot serve yet or would overflow the context, then freeze."""
        if self.n != 1:
            raise OpenAIError(400, "only n=1 is supported", param="n")
        if self.stop:
            raise OpenAIError(400, "stop sequences are not supported yet", param="stop")
        room = max_model_len - num_prompt_tokens
        max_tokens = self._max_tokens()
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise OpenAIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + (max_tokens or 1)} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens or 1} for the completion).",
                param="max_tokens" if room >= 1 else "messages",
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else room,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=self.seed,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        """The one prompt this request carries; batches of prompts are refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if self.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        if not prompt:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        return prompt


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict:
        # OpenAI sends only the fields a delta changes; the final delta is {}.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """Both the non-streamed response and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sluice"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
