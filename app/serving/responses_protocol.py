"""The Responses API's wire models: the request, the response object and its output items.

Stream events are built from these in app/serving/responses.py, each with its sequence number.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag
from pydantic.json_schema import SkipJsonSchema

from app.errors import OpenAIError
from app.serving.images import ImagePart
from app.serving.messages import (
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    ImageContentPart,
    ImageURL,
    TextContentPart,
    ToolCall,
    resolve_tool_use,
)
from app.serving.protocol import SamplingRequest
from app.serving.request_rules import (
    IMAGE_PART,
    NOT_NULL_SCHEMA,
    ONLY_JSON_WITH_TOOLS,
    TOOL_CHOICE_NEEDS_TOOLS,
    UNCONSTRAINED,
    array_bounds,
    one_output_constraint,
    schema_needed,
)
from app.serving.response_format import format_grammar
from app.serving.tools import ToolUse
from app.serving.wire import WHOLE, RequestModel
from engine.types import GrammarSpec


class InputText(RequestModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputImage(RequestModel):
    model_config = ConfigDict(json_schema_extra={IMAGE_PART: True})

    type: Literal["input_image"]
    image_url: str
    """A data: URL (PNG, JPEG, WebP, GIF), or an http(s) URL on a host --allowed-media-domains names."""
    detail: Literal["auto", "low", "high"] = "auto"
    """Accepted and not read: the model's processor decides the resolution."""


class MessageInput(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[InputText | InputImage, Field(discriminator="type")]]

    def chat_content(self) -> str | list[TextContentPart | ImageContentPart]:
        """The content as a chat message's: its text, or its parts where it has images."""
        if isinstance(self.content, str):
            return self.content
        if not any(isinstance(part, InputImage) for part in self.content):
            return "".join(part.text for part in self.content if isinstance(part, InputText))
        return [
            ImageContentPart(type="image_url", image_url=ImageURL(url=part.image_url, detail=part.detail))
            if isinstance(part, InputImage)
            else TextContentPart(type="text", text=part.text)
            for part in self.content
        ]


class FunctionCallInput(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputInput(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str


def _item_type(item: Any) -> str:
    # A message item may leave out its type, as `{"role": "user", "content": "hi"}`.
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[MessageInput, Tag("message")]
    | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")],
    Discriminator(_item_type),
]


class TextFormat(RequestModel):
    model_config = ConfigDict(
        extra="ignore", strict=True, populate_by_name=True, json_schema_extra=schema_needed(NOT_NULL_SCHEMA)
    )

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None


class FunctionTool(FunctionDefinition):
    """Responses' flat shape: the function's fields beside its type."""

    type: Literal["function"]


class NamedFunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(SamplingRequest):
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                TOOL_CHOICE_NEEDS_TOOLS,
                ONLY_JSON_WITH_TOOLS,
                one_output_constraint(
                    {
                        **UNCONSTRAINED,
                        "text": {
                            "anyOf": [{"type": "null"}, {"properties": {"format": UNCONSTRAINED["response_format"]}}]
                        },
                    }
                ),
            ]
        }
    )

    input: str | list[InputItem] = Field(json_schema_extra=array_bounds(minItems=1))
    max_tokens: SkipJsonSchema[int | None] = None
    """Not read here (max_output_tokens is), so not in the document."""
    n: Annotated[int, Field(ge=1, le=1), WHOLE] = 1
    """A response is one output: only 1 is accepted."""
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    prompt_param: ClassVar[str] = "input"

    def _max_tokens_given(self) -> dict[str, int | None]:
        return {"max_output_tokens": self.max_output_tokens}

    def check(self) -> None:
        if isinstance(self.input, list) and not self.input:
            raise OpenAIError(400, "input must not be empty", param="input")

    def grammar(self) -> tuple[GrammarSpec, str] | None:
        """`text.format` joins the chat constraints (at most one may be given)."""
        other = super().grammar()
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return other
        if other is not None:
            raise OpenAIError(
                400, f"only one output constraint may be given, got text.format and {other[1]}", param=other[1]
            )
        return format_grammar(fmt.type, fmt.schema_, fmt.strict, "text.format"), "text.format"

    def tool_use(self) -> ToolUse | None:
        named = self.tool_choice.name if isinstance(self.tool_choice, NamedFunctionChoice) else None
        return resolve_tool_use(self.tools, self.tool_choice, named, self.parallel_tool_calls)

    def image_parts(self) -> list[ImagePart]:
        """The input's images in order, named as the request names them (input[1].content[0].image_url)."""
        if isinstance(self.input, str):
            return []
        return [
            ImagePart(part.image_url, f"input[{i}].content[{j}].image_url")
            for i, item in enumerate(self.input)
            if isinstance(item, MessageInput) and isinstance(item.content, list)
            for j, part in enumerate(item.content)
            if isinstance(part, InputImage)
        ]

    def instruction_messages(self) -> list[ChatMessage]:
        return [ChatMessage(role="system", content=self.instructions)] if self.instructions else []

    def input_messages(self) -> list[ChatMessage]:
        """The input as chat messages: function calls join the assistant turn before them, and
        their outputs become tool messages."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        messages: list[ChatMessage] = []
        for item in self.input:
            if isinstance(item, MessageInput):
                messages.append(ChatMessage(role=item.role, content=item.chat_content()))
            elif isinstance(item, FunctionCallInput):
                call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
                if messages and messages[-1].role == "assistant":
                    messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
                else:
                    messages.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
            else:
                messages.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        return messages


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A reasoning model's thinking, before the message it leads to (no summaries: `summary` is empty)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    previous_response_id: str | None = None
    store: bool
    metadata: dict[str, str] = Field(default_factory=dict)
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    tools: list[dict] = Field(default_factory=list)
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    # Extension, as on chat completions: where the time went (see app/serving/protocol.py Timings).
    timings: dict | None = Field(None, exclude_if=lambda value: value is None)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
