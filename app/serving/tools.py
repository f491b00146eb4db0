"""Tool calling: tool definitions into the prompt, the grammar a call must follow, and the model's
output back into OpenAI's `tool_calls`, whole or as stream deltas.

Calls are written in the Hermes format (Qwen, Hermes and many fine-tunes use it):

    <tool_call>
    {"name":"get_weather","arguments":{"city":"Paris"}}
    </tool_call>

one block per call, separated by a newline. The grammar makes that format exact
whatever the model, so the parser below can stream a call's arguments as they are
generated.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal

from app.serving.json_schema import decoded_schema
from engine.sampling.grammar import JSON_DEFAULTS
from engine.types import GrammarSpec

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"

# For chat templates that know nothing of tools (the default model's among them), the
# definitions go into the system prompt in the words Hermes-format models were trained on.
_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{definitions}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

# Free text may say anything but open a call; a call then follows, or nothing does.
_TEXT_TERMINAL = r"TEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/"

_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    # JSON schema of the arguments object, as the request sent it (and the prompt shows it).
    parameters: dict
    # The definition's `strict`: only False decodes the arguments under plain JSON Schema (json_schema.py).
    strict: bool | None = None


@dataclass(frozen=True)
class ToolUse:
    """The tools a chat request offers and how it lets the model use them."""

    functions: tuple[Function, ...]
    # "auto": text or calls; "required": one call or more; a function's name: a call of it.
    choice: Literal["auto", "required"] | str
    parallel: bool = True

    def system_prompt(self) -> str:
        definitions = "\n".join(
            json.dumps(
                {
                    "type": "function",
                    "function": {
                        "name": f.name,
                        **({"description": f.description} if f.description else {}),
                        "parameters": f.parameters,
                    },
                }
            )
            for f in self.functions
        )
        return _SYSTEM_PROMPT.format(definitions=definitions)

    def grammar(self, answer: GrammarSpec | None = None) -> GrammarSpec:
        """A Lark grammar for the output: calls of the offered functions whose arguments match their
        schemas, and with "auto" the alternative of an answer (free text, or `answer` when it is a
        JSON schema)."""
        callable_ = [f for f in self.functions if self.choice in ("auto", "required", f.name)]
        schema = {
            "x-guidance": JSON_DEFAULTS,
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": f.name}, "arguments": decoded_schema(f.parameters, f.strict)},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in callable_
            ],
        }
        # Calls follow one another a line break apart and may end with a line break or a blank line: the
        # default model writes a blank line after its call where it would stop, and made to go on, it
        # opened call after call (2.9 calls a request on average, 3 of 40 cut by the length limit; 1.1 and 1 of 40 now).
        calls = 'call ("\\n" call)* END?' if self.parallel else "call END?"
        lines = [
            f"calls: {calls}",
            f'call: "{CALL_START}\\n" %json {json.dumps(schema)} "\\n{CALL_END}"',
            "END: /\\n\\n?/",
        ]
        if self.choice != "auto":
            return GrammarSpec("grammar", "\n".join(["start: calls", *lines]))
        if answer is not None and answer.kind == "json_schema":
            schema_answer = json.loads(answer.source)
            if isinstance(schema_answer, dict):
                schema_answer = {"x-guidance": JSON_DEFAULTS, **schema_answer}
            return GrammarSpec("grammar", "\n".join([f"start: %json {json.dumps(schema_answer)} | calls", *lines]))
        return GrammarSpec("grammar", "\n".join(["start: TEXT | TEXT? calls", *lines, _TEXT_TERMINAL]))


def parameters_schema(parameters: dict | None) -> dict:
    return parameters if parameters else _NO_PARAMETERS


def render_call(name: str, arguments: str) -> str:
    """An earlier call in the history, as the model would have written it."""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        parsed = arguments
    body = json.dumps({"name": name, "arguments": parsed}, separators=(",", ":"), ensure_ascii=False)
    return f"{CALL_START}\n{body}\n{CALL_END}"


def render_result(content: str) -> str:
    """A tool's result, as Hermes-format models expect it back (in a user turn)."""
    return f"<tool_response>\n{content}\n</tool_response>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Piece = Content | CallStarted | ArgumentsDelta

# Where a call's arguments begin: `{"name":"<name>","arguments":`, whitespace tolerated.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
# What may close a call after its arguments: the outer brace, then the end tag.
_CALL_TAIL = re.compile(r"\}\s*" + re.escape(CALL_END))


@dataclass
class ToolCallParser:
    """Output text → content and tool-call pieces, fed as it is generated.

    Text is content until a call opens; a call's name is known once its head is complete,
    and its arguments stream from then on, holding back only what may be the call's
    closing brace and end tag.
    """

    num_calls: int = 0
    _buffer: str = ""
    _in_call: bool = False
    _named: bool = False
    _calls: list[tuple[str, str, list[str]]] = field(default_factory=list)

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(CALL_START)
                if start < 0:
                    cut = len(self._buffer) - _partial_suffix(self._buffer, CALL_START)
                    emit, self._buffer = self._buffer[:cut], self._buffer[cut:]
                    if emit and (self.num_calls == 0 or emit.strip()):
                        pieces.append(Content(emit))
                    return pieces
                before = self._buffer[:start]
                if before and (self.num_calls == 0 or before.strip()):
                    pieces.append(Content(before))
                self._buffer = self._buffer[start + len(CALL_START) :]
                self._in_call, self._named = True, False
            if not self._named:
                head = _CALL_HEAD.match(self._buffer)
                if head is None:
                    return pieces
                name = json.loads(f'"{head.group(1)}"')
                self._calls.append((new_call_id(), name, []))
                pieces.append(CallStarted(self.num_calls, self._calls[-1][0], name))
                self._buffer = self._buffer[head.end() :]
                self._named = True
            tail = _CALL_TAIL.search(self._buffer)
            if tail is None:
                cut = _arguments_safe_end(self._buffer)
                if cut:
                    pieces.append(self._arguments(self._buffer[:cut]))
                    self._buffer = self._buffer[cut:]
                return pieces
            if tail.start():
                pieces.append(self._arguments(self._buffer[: tail.start()]))
            self._buffer = self._buffer[tail.end() :]
            self._in_call = False
            self.num_calls += 1

    def finish(self) -> list[Piece]:
        """Whatever is held back, at the end of the output (a call cut short keeps what it has)."""
        rest, self._buffer = self._buffer, ""
        if not rest:
            return []
        if not self._in_call:
            return [Content(rest)] if self.num_calls == 0 or rest.strip() else []
        if not self._named:
            return []
        return [self._arguments(rest)]

    def calls(self) -> list[tuple[str, str, str]]:
        """(id, name, arguments) of every call seen so far."""
        return [(call_id, name, "".join(parts)) for call_id, name, parts in self._calls]

    def _arguments(self, text: str) -> ArgumentsDelta:
        self._calls[-1][2].append(text)
        return ArgumentsDelta(len(self._calls) - 1, text)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that starts `marker` (it may yet become it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _arguments_safe_end(text: str) -> int:
    """How much of a call's body can go out as arguments: all but a last `}` that only whitespace and
    a beginning of the end tag follow (it may be the call's closing brace)."""
    brace = text.rfind("}")
    if brace >= 0:
        after = text[brace + 1 :].lstrip()
        if CALL_END.startswith(after):
            return brace
    return len(text) - _partial_suffix(text, CALL_END)
