"""The format a model writes its chat output in: how the output's text becomes content and tool calls,
and the grammar that holds an output to it. Chosen once at start-up from the flag (--tool-call-parser)
or the model's tokenizer, never per request:

- `hermes` (app/serving/tools.py): calls as `<tool_call>` blocks of JSON in the text (Qwen, Hermes, and
  any model whose template does not know tools: the prompt then teaches it the format);
- `harmony` (app/serving/harmony.py): gpt-oss's messages and channels, every chat output parsed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from transformers import PreTrainedTokenizerBase

from app.errors import OpenAIError
from app.serving import harmony
from app.serving.tools import Piece, ToolCallParser, ToolUse
from engine.types import GrammarSpec

logger = logging.getLogger(__name__)

ToolCallParserName = Literal["auto", "hermes", "harmony"]

# A request's own constraint on its output, and the parameter that set it (for its 400).
Requested = tuple[GrammarSpec, str]


class OutputParser(Protocol):
    """A chat output's text → content and tool-call pieces, fed as it is generated."""

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...

    def calls(self) -> list[tuple[str, str, str]]: ...


@dataclass(frozen=True)
class OutputFormat:
    """`parser`: a new parser per choice for a request with these tools, None where the text is all
    content; `grammar`: the constraint the output decodes under."""

    name: str
    parser: Callable[[ToolUse | None], Callable[[], OutputParser] | None]
    grammar: Callable[[Requested | None, ToolUse | None], Requested | None]


def _hermes_grammar(requested: Requested | None, tool_use: ToolUse | None) -> Requested | None:
    """The request's own constraint; with tools, the grammar of calls, whose text alternative may be a
    JSON constraint."""
    if tool_use is None:
        return requested
    if requested is not None and requested[0].kind != "json_schema":
        param = requested[1]
        raise OpenAIError(400, f"{param} cannot be combined with tools; use a JSON schema", param=param)
    return tool_use.grammar(requested[0] if requested else None), "tools"


def _harmony_grammar(requested: Requested | None, tool_use: ToolUse | None) -> Requested | None:
    """The harmony output's grammar (its messages around the request's JSON schema or the calls), or None
    where nothing constrains it."""
    if requested is not None and requested[0].kind != "json_schema":
        param = requested[1]
        raise OpenAIError(
            400, f"{param}: this model writes the harmony format, which takes a JSON schema only", param=param
        )
    spec = harmony.grammar(tool_use, requested[0] if requested else None)
    return None if spec is None else (spec, requested[1] if requested else "tools")


HERMES = OutputFormat("hermes", lambda tool_use: ToolCallParser if tool_use is not None else None, _hermes_grammar)
# Every harmony output is parsed: its headers are never content.
HARMONY = OutputFormat("harmony", lambda tool_use: harmony.HarmonyParser, _harmony_grammar)


def output_format(name: ToolCallParserName, tokenizer: PreTrainedTokenizerBase) -> OutputFormat:
    """The format --tool-call-parser names; `auto`: harmony where the tokenizer is a harmony model's
    (app/serving/harmony.py's is_harmony), else hermes."""
    if name == "hermes":
        return HERMES
    if name == "harmony":
        if not harmony.is_harmony(tokenizer):
            raise ValueError(
                "--tool-call-parser harmony needs a harmony model: its tokens in the vocabulary and a chat "
                "template that writes <|channel|>"
            )
        return HARMONY
    if harmony.is_harmony(tokenizer):
        logger.info("chat output: the harmony format (--tool-call-parser harmony)")
        return HARMONY
    return HERMES
