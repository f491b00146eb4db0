"""The harmony format (gpt-oss) on the wire: its output's text back into OpenAI's content and
`tool_calls`, whole or as stream deltas, and the grammar that holds an output to it.

The engine shows the format's syntax tokens in the text (engine/harmony.py) and splits the analysis
messages off as reasoning (engine/reasoning.py), so the text read here is the answer's messages:

    <|start|>assistant<|channel|>final<|message|>The answer
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}

(without `<|start|>assistant` where no analysis came first: the generation prompt ends with it). A
message to `functions.NAME` is a call of NAME, its body the arguments; a `final` message's body, or a
`commentary` one's without a recipient (a preamble), is content; an `analysis` message is dropped (one
reaches the text only where the engine does not split the reasoning off). `<|call|>` and `<|return|>`
end the output (they are the model's end-of-sequence tokens) and never show.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from app.serving.json_schema import decoded_schema
from app.serving.tools import ArgumentsDelta, CallStarted, Content, Piece, ToolUse, new_call_id
from engine.harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, START, syntax_token_ids
from engine.sampling.grammar import JSON_DEFAULTS
from engine.types import ChannelReasoning, GrammarSpec

ANALYSIS = "analysis"
# A header that does not end within this many characters is not one: its text is content.
_MAX_HEADER_CHARS = 512
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w+)")
_FUNCTION = "functions."


def is_harmony(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the model writes harmony: its vocabulary has the syntax tokens and its chat template
    writes channels (gpt-oss's)."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return CHANNEL in template and syntax_token_ids(tokenizer) is not None


@dataclass(frozen=True)
class HarmonyChannels:
    """The reasoning parser for harmony (--reasoning-parser harmony): the analysis channel is reasoning."""

    spec: ChannelReasoning
    name: str = "harmony"

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> HarmonyChannels:
        ids = syntax_token_ids(tokenizer)
        if ids is None:
            raise ValueError(
                "--reasoning-parser harmony needs the harmony format's tokens "
                f"({', '.join((START, CHANNEL, MESSAGE, END, CONSTRAIN))}) in the model's vocabulary"
            )
        # The channel's name as it tokenizes after <|channel|> (between two special tokens).
        header = tokenizer.encode(f"{CHANNEL}{ANALYSIS}{MESSAGE}", add_special_tokens=False)
        return cls(ChannelReasoning(ids[MESSAGE], ids[END], tuple(header[:-1])))

    def for_prompt(self, prompt_ids: list[int]) -> ChannelReasoning:
        # The generation prompt ends `<|start|>assistant`: the output starts with a header.
        return self.spec


@dataclass
class HarmonyParser:
    """Harmony output text → content and tool-call pieces, fed as it is generated (the interface of
    app/serving/tools.py's ToolCallParser): a message's header is held until its `<|message|>`, then its
    body goes out as content or as a call's arguments, holding back only what may begin `<|end|>`."""

    num_calls: int = 0
    _buffer: str = ""
    # The message being read: None while in a header, else "content", "call" or "dropped".
    _body: str | None = None
    _calls: list[tuple[str, str, list[str]]] = field(default_factory=list)

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            if self._body is None:
                if not self._read_header(pieces):
                    return pieces
            end = self._buffer.find(END)
            if end < 0:
                cut = len(self._buffer) - _partial_suffix(self._buffer, END)
                self._emit(self._buffer[:cut], pieces)
                self._buffer = self._buffer[cut:]
                return pieces
            self._emit(self._buffer[:end], pieces)
            self._buffer, self._body = self._buffer[end + len(END) :], None

    def finish(self) -> list[Piece]:
        """Whatever is held back, at the end of the output (a header never ended is content)."""
        pieces: list[Piece] = []
        rest, self._buffer = self._buffer, ""
        if self._body is None:
            if rest.strip():
                pieces.append(Content(rest))
        else:
            self._emit(rest, pieces)
        return pieces

    def calls(self) -> list[tuple[str, str, str]]:
        """(id, name, arguments) of every call seen so far."""
        return [(call_id, name, "".join(parts)) for call_id, name, parts in self._calls]

    def _read_header(self, pieces: list[Piece]) -> bool:
        """Read the header the buffer starts with; False while it has not ended."""
        at = self._buffer.find(MESSAGE)
        if at < 0:
            if len(self._buffer) <= _MAX_HEADER_CHARS and _may_start_header(self._buffer):
                return False
            # Text outside any message: content, to the next message's end.
            self._body = "content"
            return True
        header, self._buffer = self._buffer[:at], self._buffer[at + len(MESSAGE) :]
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient is not None and recipient.group(1).startswith(_FUNCTION):
            name = recipient.group(1).removeprefix(_FUNCTION)
            self._calls.append((new_call_id(), name, []))
            pieces.append(CallStarted(self.num_calls, self._calls[-1][0], name))
            self.num_calls += 1
            self._body = "call"
        elif channel is not None and channel.group(1) == ANALYSIS:
            self._body = "dropped"
        else:
            self._body = "content"
        return True

    def _emit(self, text: str, pieces: list[Piece]) -> None:
        if not text or self._body == "dropped":
            return
        if self._body == "call":
            self._calls[-1][2].append(text)
            pieces.append(ArgumentsDelta(len(self._calls) - 1, text))
        else:
            pieces.append(Content(text))


def _may_start_header(text: str) -> bool:
    """Whether `text` may be (the beginning of) a header: it opens with <|start|> or <|channel|>, or a
    recipient (` to=...`, which may precede the channel right after the generation prompt)."""
    stripped = text.lstrip()
    return any(marker.startswith(stripped) or stripped.startswith(marker) for marker in (START, CHANNEL, "to="))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that starts `marker` (it may yet become it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def grammar(tool_use: ToolUse | None, answer: GrammarSpec | None) -> GrammarSpec | None:
    """The grammar of a harmony output: optional leading analysis (free text), then with a required
    tool choice a call of an offered function (its arguments matching their schema), else a `final`
    message matching `answer`, a JSON schema (or, with tool choice auto, one or the other). None where
    nothing constrains the output (the model's own format is parsed as it comes)."""
    calls = tool_use is not None and tool_use.choice != "auto"
    if not calls and answer is None:
        return None
    alternatives = []
    if tool_use is not None and (calls or answer is not None):
        for function in tool_use.functions:
            if tool_use.choice in ("auto", "required", function.name):
                schema = {"x-guidance": JSON_DEFAULTS, **decoded_schema(function.parameters, function.strict)}
                head = json.dumps(f"commentary to={_FUNCTION}{function.name} ")
                alternatives.append(f'{CHANNEL} {head} {CONSTRAIN} "json" {MESSAGE} %json {json.dumps(schema)} {CALL}')
    if answer is not None and not calls:
        schema = json.loads(answer.source)
        if isinstance(schema, dict):
            schema = {"x-guidance": JSON_DEFAULTS, **schema}
        alternatives.append(f'{CHANNEL} "final" {MESSAGE} %json {json.dumps(schema)}')
    lines = [
        f'start: ({CHANNEL} {json.dumps(ANALYSIS)} {MESSAGE} THOUGHT {END} {START} "assistant")? answer',
        "answer: " + " | ".join(f"({alternative})" for alternative in alternatives),
        "THOUGHT: /(?s:.*)/",
    ]
    return GrammarSpec("grammar", "\n".join(lines))
