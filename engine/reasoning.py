"""One choice's output against its reasoning: which tokens are thinking, and where the answer begins.

Tags (`<think>…</think>`, ReasoningSplit):

    prompt ... <think> | thinking tokens ... </think> | answer tokens ...
                       ^ output starts here (open_at_start), or the output's first token is <think>

Harmony's channels (gpt-oss, ChannelSplit; engine/harmony.py):

    prompt ...<|start|>assistant | <|channel|>analysis<|message|> | thinking ... | <|end|> | answer ...
                                   ^ a header: held until its <|message|>        the answer starts with the
                                     says whose message it is                    first other message's header:
                                                                                 <|start|>assistant<|channel|>final...

The output processor (what the client reads) and the grammar (what the answer must match) each
follow the output with one of these, token by token, so both cut it at the same token. A call of
`feed` takes any number of tokens (a speculative burst, a grammar's jump-forward) and returns what
token-at-a-time calls would have: its thinking and answer as Parts, in the output's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from engine.types import ChannelReasoning, Reasoning

# The longest header a harmony message has (a recipient's name included); an output that goes on
# longer without `<|message|>` is not writing one, and is answer from where the header began.
_MAX_HEADER_TOKENS = 64


class Part(NamedTuple):
    """A run of output tokens that is all thinking or all answer, from one call of feed. A NamedTuple, as
    engine/types.py's Chunk is, for its cheap construction: the output processor makes one a token.

    call's tokens:          [ t0 t1 t2 t3 t4 t5 ]
    an answer Part:   h0 h1  t0 t1 t2              end = 3
                      ^ a header's tokens held from earlier calls lead it (no more than one Part's)
    """

    thinking: bool
    token_ids: list[int]
    # How many of the call's tokens come up to the Part's end: where a stop string found in it cuts the call.
    end: int


class ReasoningSplit:
    """Follows one choice's output tokens; once `answering`, every later token is answer."""

    # Whether the answer, once begun, runs to the output's end (no later token is thinking).
    answer_is_final = True

    def __init__(self, spec: Reasoning) -> None:
        self.spec = spec
        self.thinking = spec.open_at_start
        # No output token yet: the first may open the reasoning (or repeat the prompt's opening tag).
        self.at_start = True

    @property
    def answering(self) -> bool:
        return not self.at_start and not self.thinking

    def feed(self, token_ids: Sequence[int]) -> list[Part]:
        """The next output tokens → the thinking among them, then (once the answer has begun, even with
        no token yet) the answer's: the tokens after the reasoning and its tags."""
        thinking: list[int] = []
        for position, token_id in enumerate(token_ids):
            if self.at_start:
                self.at_start = False
                if token_id == self.spec.start_token_id:
                    self.thinking = True
                    continue
            if not self.thinking:
                return [Part(False, list(token_ids[position:]), len(token_ids))]
            if token_id == self.spec.end_token_id:
                self.thinking = False
                answer = Part(False, list(token_ids[position + 1 :]), len(token_ids))
                return [Part(True, thinking, position), answer] if thinking else [answer]
            thinking.append(token_id)
        return [Part(True, thinking, len(token_ids))] if thinking else []


class ChannelSplit:
    """Follows one choice's harmony output: its analysis messages are thinking, any other message (its header
    included) is answer, and the headers and ends of analysis messages are neither. A header's tokens are
    held until its `<|message|>` (or until it is too long to be one), across calls. After an answer's
    message ends (`<|end|>`) the next header is read again, so a later analysis message (after a preamble,
    say) is thinking too, wherever the calls' bounds fall."""

    answer_is_final = False

    def __init__(self, spec: ChannelReasoning) -> None:
        self.spec = spec
        self.thinking = False
        self.answering = False
        # The header being read, and how many of its tokens came in earlier calls of feed.
        self._header: list[int] = []
        self._held = 0

    @property
    def at_start(self) -> bool:
        """Whether the output is still between messages (nothing of a header read yet)."""
        return not self.answering and not self.thinking and not self._header

    def feed(self, token_ids: Sequence[int]) -> list[Part]:
        """The next output tokens → their thinking and answer Parts in order; an answer's first Part may
        begin with its header's tokens held from earlier calls."""
        end_token_id, message_token_id = self.spec.end_token_id, self.spec.message_token_id
        parts: list[Part] = []
        self._held = len(self._header)
        # Where the run being read began in this call (an answer's may reach back: its held header).
        start = 0
        for position, token_id in enumerate(token_ids):
            if self.answering:
                if token_id == end_token_id:
                    self.answering = False
                    parts.append(self._answer(token_ids, start, position + 1))
                continue
            if self.thinking:
                if token_id == end_token_id:
                    self.thinking = False
                    if position > start:
                        parts.append(Part(True, list(token_ids[start:position]), position))
                continue
            self._header.append(token_id)
            ends = token_id == message_token_id
            if ends and self._is_reasoning(self._header):
                self.thinking = True
                self._header, self._held = [], 0
                start = position + 1
            elif ends or len(self._header) > _MAX_HEADER_TOKENS:
                # The answer is the header (its tokens from this call start here) and all after it.
                start = position + 1 - (len(self._header) - self._held)
                self.answering = True
        if self.answering:
            parts.append(self._answer(token_ids, start, len(token_ids)))
        elif self.thinking and len(token_ids) > start:
            parts.append(Part(True, list(token_ids[start:]), len(token_ids)))
        return parts

    def _answer(self, token_ids: Sequence[int], start: int, end: int) -> Part:
        """The answer's run [start, end) of this call, led by its header's tokens from earlier calls."""
        held, self._header, self._held = self._header[: self._held], [], 0
        return Part(False, held + list(token_ids[start:end]), end)

    def _is_reasoning(self, header: list[int]) -> bool:
        tail = self.spec.reasoning_header
        return tuple(header[-len(tail) - 1 : -1]) == tail


def split_of(spec: Reasoning | ChannelReasoning) -> ReasoningSplit | ChannelSplit:
    """The split that follows an output against `spec`."""
    return ChannelSplit(spec) if isinstance(spec, ChannelReasoning) else ReasoningSplit(spec)
