"""OpenAI wire models of what clients send: requests, validated, unknown fields ignored (what Sluice
answers with is app/serving/payloads.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from app.errors import OpenAIError
from app.serving.messages import ChatMessage, NamedToolChoice, ToolDefinition, resolve_tool_use
from app.serving.request_rules import (
    BEST_OF_ONE,
    LOGIT_BIAS,
    ONE_PROMPT,
    ONLY_JSON_WITH_TOOLS,
    TOOL_CHOICE_NEEDS_TOOLS,
    TOP_LOGPROBS_NEED_LOGPROBS,
    UNCONSTRAINED,
    array_bounds,
    one_output_constraint,
)
from app.serving.response_format import ResponseFormat, StructuredOutputs, json_spec
from app.serving.tools import ToolUse
from app.serving.wire import WHOLE, Int, RequestModel, TokenId
from engine.types import GrammarSpec, Reasoning, SamplingParams


class StreamOptions(RequestModel):
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
# Below this a repetition penalty is applied as this one, whose seen tokens already outweigh every other by
# orders of magnitude: in float32 a smaller one overflows a logit it divides (1e-300 rounds to 0), and
# infinite logits sampled tokens of no text.
MIN_REPETITION_PENALTY = 1e-5


class SamplingRequest(RequestModel):
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
    # The field that holds the prompt, named by the errors about it.
    prompt_param: ClassVar[str] = "messages"

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
            found.append((json_spec(self.guided_json, "guided_json"), "guided_json"))
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
        if num_prompt_tokens < 1:
            # A text of control characters can tokenize to nothing, and a step of no tokens fails.
            raise OpenAIError(400, "The prompt is empty once tokenized", param=self.prompt_param)
        room = limits.max_model_len - num_prompt_tokens
        given = self._max_tokens_given()
        max_tokens = next((value for value in given.values() if value is not None), None)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + (max_tokens or 1)} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens or 1} for the completion).",
                param="max_tokens" if room >= 1 else self.prompt_param,
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
            repetition_penalty=max(self.repetition_penalty, MIN_REPETITION_PENALTY),
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


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                TOP_LOGPROBS_NEED_LOGPROBS,
                TOOL_CHOICE_NEEDS_TOOLS,
                ONLY_JSON_WITH_TOOLS,
                one_output_constraint(UNCONSTRAINED),
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


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [BEST_OF_ONE, one_output_constraint(UNCONSTRAINED)]})

    prompt: str | list[Int] | list[str] | list[list[Int]] = Field(json_schema_extra=ONE_PROMPT)
    """One prompt: a text or its token ids (a batch of one is accepted too)."""
    max_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    """16 when not given, as OpenAI (or less, where the context or --max-tokens-limit leaves less)."""
    default_max_tokens: ClassVar[int | None] = 16
    prompt_param: ClassVar[str] = "prompt"
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
