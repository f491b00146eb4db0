"""Chat messages as clients send them: their content parts (text, images), tool calls and tool
definitions, and what a request's tools and tool_choice allow."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from app.errors import OpenAIError
from app.serving.request_rules import IMAGE_PART, TOOL_MESSAGE
from app.serving.tools import Function, ToolUse, parameters_schema
from app.serving.wire import RequestModel


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str
    """A data: URL (PNG, JPEG, WebP, GIF), or an http(s) URL on a host --allowed-media-domains names."""
    detail: Literal["auto", "low", "high"] = "auto"
    """Accepted and not read: the model's processor decides the resolution."""


class ImageContentPart(RequestModel):
    model_config = ConfigDict(json_schema_extra={IMAGE_PART: True})

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]


class FunctionCall(RequestModel):
    name: str
    # The arguments as a JSON text, as OpenAI sends them.
    arguments: str


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def resolve_tool_use(
    functions: list[FunctionDefinition] | None, choice: object, named: str | None, parallel: bool
) -> ToolUse | None:
    """What a request's `tools` and `tool_choice` allow (`named`: the function a named choice names)."""
    if choice is not None and not functions:
        raise OpenAIError(400, "tool_choice is only allowed when tools are specified", param="tool_choice")
    if not functions or choice == "none":
        return None
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise OpenAIError(400, "tools: function names must be unique", param="tools")
    if named is not None and named not in names:
        raise OpenAIError(400, f"tool_choice names the function {named!r}, which is not in tools", param="tool_choice")
    offered = tuple(Function(f.name, f.description, parameters_schema(f.parameters), f.strict) for f in functions)
    return ToolUse(offered, named or choice or "auto", parallel)


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(RequestModel):
    model_config = ConfigDict(json_schema_extra=TOOL_MESSAGE)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn's calls, and a tool result's answer to one of them.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_results_answer_a_call(self) -> ChatMessage:
        # As OpenAI: a tool message without the call it answers, or without content, is refused.
        if self.role == "tool" and (self.tool_call_id is None or self.content is None):
            raise ValueError("a message with role 'tool' needs tool_call_id and content")
        return self

    def text(self) -> str:
        """The message's text parts, joined (its images left out)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextContentPart))

    def image_urls(self) -> list[tuple[int, str]]:
        """The URLs of the message's image parts, each with its part's index in `content`."""
        if not isinstance(self.content, list):
            return []
        return [(i, part.image_url.url) for i, part in enumerate(self.content) if isinstance(part, ImageContentPart)]
