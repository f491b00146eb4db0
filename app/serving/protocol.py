"""OpenAI wire models of what clients send: requests, validated, unknown fields ignored (what Sluice
answers with is app/serving/payloads.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from app.errors import OpenAIError
from app.serving.json_schema import decoded_schema
from app.serving.request_rules import (
    BEST_OF_ONE,
    IMAGE_PART,
    LOGIT_BIAS,
    NOT_NULL_SCHEMA,
    ONE_PROMPT,
    TOKEN_ID,
    TOOL_CHOICE_NEEDS_TOOLS,
    TOOL_MESSAGE,
    TOP_LOGPROBS_NEED_LOGPROBS,
    UNCONSTRAINED,
    array_bounds,
    output_constraint_rules,
    schema_needed,
)
from app.serving.tools import Function, ToolUse, parameters_schema
from engine.types import GrammarSpec, Reasoning, SamplingParams


class _Request(BaseModel):
    # Strict, as OpenAI: 0 is not a boolean, 1.5 not an integer, "2" not a number; what the OpenAPI
    # document says a field takes is what it accepts.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


@dataclass(frozen=True)
class ServingLimits:
    """What a request is checked against beyond its own fields."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    stream_interval: int
    # The operator's cap on max_tokens (--max-tokens-limit); None: the context is the only bound.
    max_tokens_limit: int | None = None
    # Whether the model takes images (a vision-language model's processor); the document allows them only then.
    takes_images: bool = False


MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
# Below this a temperature is greedy in effect, and is sampled as greedy: the sampler's 1 / temperature
# would overflow a float32 (a temperature of 1e-308 failed the engine step with a 500).
MIN_TEMPERATURE = 1e-5


def _whole(value: object) -> object:
    # JSON Schema counts 1.0 as an integer; strict mode alone would refuse it.
    return int(value) if isinstance(value, float) and value.is_integer() else value


# After a field's own constraints in its Annotated (before them, pydantic drops them from the JSON schema).
WHOLE = BeforeValidator(_whole)
Int = Annotated[int, WHOLE]
TokenId = Annotated[int, Field(json_schema_extra={TOKEN_ID: True, "minimum": 0}), WHOLE]


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    model_config = ConfigDict(
        json_schema_extra=schema_needed(
            {"required": ["json_schema"], "properties": {"json_schema": {"type": "object", **NOT_NULL_SCHEMA}}}
        )
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> GrammarSpec | None:
        fmt = self.json_schema
        return format_grammar(self.type, fmt.schema_ if fmt else None, fmt.strict if fmt else None, "response_format")


class StructuredOutputs(_Request):
    """Extension (as vLLM's `structured_outputs`): exactly one of these constrains the output."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                *(
                    {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
                    for name in ("json", "regex", "choice", "grammar")
                ),
                {"required": ["json_object"], "properties": {"json_object": {"const": True}}},
            ]
        }
    )

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    def spec(self, param: str) -> GrammarSpec:
        found = [
            *([_json_spec(self.json_, f"{param}.json")] if self.json_ is not None else []),
            *([GrammarSpec("regex", self.regex)] if self.regex is not None else []),
            *([GrammarSpec.choice(self.choice)] if self.choice is not None else []),
            *([GrammarSpec("grammar", self.grammar)] if self.grammar is not None else []),
            *([format_grammar("json_object", None, None, param)] if self.json_object else []),
        ]
        if len(found) != 1:
            raise OpenAIError(
                400, f"{param} needs exactly one of json, regex, choice, grammar, json_object", param=param
            )
        return found[0]


def format_grammar(kind: str, schema: dict | bool | None, strict: bool | None, param: str) -> GrammarSpec | None:
    """The grammar of an output format (chat's `response_format`, Responses' `text.format`); a schema
    is read as strict mode reads it unless `strict` is False (json_schema.py)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_schema({"type": "object"})
    if schema is None:
        raise OpenAIError(400, f"{param} of type json_schema needs a schema", param=param)
    return _json_spec(schema, param, strict)


def _json_spec(schema: dict | bool | str, param: str, strict: bool | None = None) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise OpenAIError(400, f"{param} is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, (dict, bool)):
        raise OpenAIError(400, f"{param} must be a JSON schema (an object)", param=param)
    return GrammarSpec.json_schema(decoded_schema(schema, strict))


class _SamplingRequest(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Annotated[int, Field(ge=-1), WHOLE] = 0
    """Extension (as vLLM): keep the k most likely tokens; 0 or -1 keeps all."""
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    """Extension (as vLLM): drop tokens less likely than min_p times the most likely one."""
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64), WHOLE] | None = None
    n: Annotated[int, Field(ge=1, le=128), WHOLE] = 1
    stop: str | list[str] | None = Field(None, json_schema_extra=array_bounds(maxItems=MAX_STOP_SEQUENCES))
    stop_token_ids: list[TokenId] | None = None
    """Extension (as vLLM): token ids that end the output; the token's text is not included."""
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    """Extension (as vLLM and HF): >1 discourages any token already in the prompt or output."""
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra=LOGIT_BIAS)
    ignore_eos: bool = False
    """Extension (as vLLM): keep generating past end-of-sequence, for fixed-length benchmarks."""
    stream_interval: Annotated[int, Field(ge=1, le=1024), WHOLE] | None = None
    """Extension: tokens per streamed chunk (the server default is --stream-interval)."""
    resumable: bool = False
    """Extension: the stream survives a disconnect for the resume window (GET /v1/streams/{id})."""
    speculative: bool = True
    """Extension: false keeps this request out of speculative decoding."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    """Extension (as vLLM): constrain the output to a JSON schema, regex, choice or grammar."""
    guided_json: dict[str, Any] | bool | str | None = None
    """Extension (vLLM's older name): the output matches this JSON schema."""
    guided_regex: str | None = None
    """Extension (vLLM's older name): the output matches this regular expression."""
    guided_choice: list[str] | None = Field(None, min_length=1)
    """Extension (vLLM's older name): the output is one of these strings."""
    guided_grammar: str | None = None
    """Extension (vLLM's older name): the output matches this grammar (Lark, or llama.cpp's GBNF)."""

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"values must be between -100 and 100, got {value} for token {key}")
        return bias

    # The output length when the request gives none; None: all the context leaves.
    default_max_tokens: ClassVar[int | None] = None

    def _max_tokens_given(self) -> dict[str, int | None]:
        """The request's limits on its output length, by parameter, the one that counts first."""
        return {"max_tokens": self.max_tokens}

    def _logprobs(self) -> int | None:
        """How many top alternatives to report per token; None: no logprobs at all."""
        return None

    def grammar(self) -> tuple[GrammarSpec, str] | None:
        """What the output must match and the parameter that said so; at most one may."""
        found = []
        if self.response_format is not None and (spec := self.response_format.grammar()) is not None:
            found.append((spec, "response_format"))
        if self.structured_outputs is not None:
            found.append((self.structured_outputs.spec("structured_outputs"), "structured_outputs"))
        if self.guided_json is not None:
            found.append((_json_spec(self.guided_json, "guided_json"), "guided_json"))
        if self.guided_regex is not None:
            found.append((GrammarSpec("regex", self.guided_regex), "guided_regex"))
        if self.guided_choice is not None:
            found.append((GrammarSpec.choice(self.guided_choice), "guided_choice"))
        if self.guided_grammar is not None:
            found.append((GrammarSpec("grammar", self.guided_grammar), "guided_grammar"))
        if len(found) > 1:
            names = " and ".join(param for _, param in found)
            raise OpenAIError(400, f"only one output constraint may be given, got {names}", param=found[1][1])
        return found[0] if found else None

    def to_sampling_params(
        self,
        num_prompt_tokens: int,
        limits: ServingLimits,
        grammar: GrammarSpec | None = None,
        reasoning: Reasoning | None = None,
    ) -> SamplingParams:
        """Check what the fields alone cannot (vocabulary, context, seats), then freeze."""
        if self.n > limits.max_num_seqs:
            raise OpenAIError(400, f"n must be at most {limits.max_num_seqs} (--max-num-seqs)", param="n")
        bias = {int(key): value for key, value in (self.logit_bias or {}).items()}
        for param, ids in (("logit_bias", bias), ("stop_token_ids", self.stop_token_ids or ())):
            if bad := [t for t in ids if not 0 <= t < limits.vocab_size]:
                raise OpenAIError(400, f"{param}: token id {bad[0]} is not in the vocabulary", param=param)
        room = limits.max_model_len - num_prompt_tokens
        given = self._max_tokens_given()
        max_tokens = next((value for value in given.values() if value is not None), None)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + (max_tokens or 1)} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens or 1} for the completion).",
                param="max_tokens" if room >= 1 else "messages",
                code="context_length_exceeded",
            )
        cap = limits.max_tokens_limit
        for param, value in given.items():
            if cap is not None and value is not None and value > cap:
                raise OpenAIError(400, f"{param} must be at most {cap} on this server", param=param)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_tokens=max_tokens
            if max_tokens is not None
            else min(room, cap or room, self.default_max_tokens or room),
            temperature=self.temperature if self.temperature >= MIN_TEMPERATURE else 0.0,
            top_p=self.top_p,
            # 0 keeps every token, as does a k at or past the vocabulary (which would overflow the
            # sampler's int32: a top_k of 2**40 failed the engine step with a 500).
            top_k=self.top_k if 0 < self.top_k < limits.vocab_size else 0,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple(sorted(bias.items())),
            stop=tuple(s for s in stop if s),
            stop_token_ids=frozenset(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self._logprobs(),
            n=self.n,
            stream_interval=self.stream_interval or limits.stream_interval,
            speculative=self.speculative,
            grammar=grammar,
            reasoning=reasoning,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str
    """A data: URL (PNG, JPEG, WebP, GIF), or an http(s) URL on a host --allowed-media-domains names."""
    detail: Literal["auto", "low", "high"] = "auto"
    """Accepted and not read: the model's processor decides the resolution."""


class ImageContentPart(_Request):
    model_config = ConfigDict(json_schema_extra={IMAGE_PART: True})

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]


class FunctionCall(_Request):
    name: str
    # The arguments as a JSON text, as OpenAI sends them.
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Request):
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


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Request):
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


class ChatCompletionRequest(_SamplingRequest):
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                TOP_LOGPROBS_NEED_LOGPROBS,
                TOOL_CHOICE_NEEDS_TOOLS,
                *output_constraint_rules(UNCONSTRAINED),
            ]
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), WHOLE] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """Extension (as vLLM): extra variables for the chat template, e.g. {"enable_thinking": false}."""

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        return self

    def tool_use(self) -> ToolUse | None:
        """The tools the model may call on this request; None when it answers in text only."""
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        functions = [t.function for t in self.tools] if self.tools else None
        return resolve_tool_use(functions, self.tool_choice, named, self.parallel_tool_calls)

    def _max_tokens_given(self) -> dict[str, int | None]:
        return {"max_completion_tokens": self.max_completion_tokens, "max_tokens": self.max_tokens}

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [BEST_OF_ONE, *output_constraint_rules(UNCONSTRAINED)]})

    prompt: str | list[Int] | list[str] | list[list[Int]] = Field(json_schema_extra=ONE_PROMPT)
    """One prompt: a text or its token ids (a batch of one is accepted too)."""
    max_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    """16 when not given, as OpenAI (or less, where the context or --max-tokens-limit leaves less)."""
    default_max_tokens: ClassVar[int | None] = 16
    echo: bool = Field(False, json_schema_extra={"const": False})
    """Not supported: only false is accepted."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), WHOLE] | None = None
    best_of: Annotated[int, Field(ge=1), WHOLE] | None = None
    """Accepted only equal to n: there is no server-side choice among candidates."""
    suffix: str | None = Field(
        None, json_schema_extra={"anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}]}
    )
    """Not supported: only empty or null is accepted."""

    def _logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt this request carries; batches of prompts are refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if self.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        if self.best_of not in (None, self.n):
            raise OpenAIError(400, "best_of is not supported; use n", param="best_of")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        if not prompt:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        return prompt
