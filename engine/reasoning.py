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
follow the output with one of these, token by token, so both cut it at the same token.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.types import ChannelReasoning, Reasoning

# The longest header a harmony message has (a recipient's name included); an output that goes on
# longer without `<|message|>` is not writing one, and is answer from where the header began.
_MAX_HEADER_TOKENS = 64

# What feed returns: (the thinking tokens, answer tokens held from earlier calls, this call's answer tokens).
Fed = tuple[list[int], list[int], list[int]]


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

    def feed(self, token_ids: Sequence[int]) -> Fed:
        """The next output tokens → (the thinking tokens among them, [], the answer's: the tokens after
        the reasoning and its tags)."""
        thinking: list[int] = []
        for position, token_id in enumerate(token_ids):
            if self.at_start:
                self.at_start = False
                if token_id == self.spec.start_token_id:
                    self.thinking = True
                    continue
            if not self.thinking:
                return thinking, [], list(token_ids[position:])
            if token_id == self.spec.end_token_id:
                self.thinking = False
                return thinking, [], list(token_ids[position + 1 :])
            thinking.append(token_id)
        return thinking, [], []


class ChannelSplit:
    """Follows one choice's harmony output: its analysis messages are thinking, any other message (its header
    included) is answer. A header's tokens are held until its `<|message|>` (or until it is too long to be
    one). An answer's message that ends (`<|end|>`) as the last token of a call makes the next call read a
    header again, so a later analysis message (after a preamble, say) is thinking too; an end inside a
    burst of tokens (speculation) leaves the rest of the burst answer, since the answer's tokens must be
    the last of a call (the output processor cuts stop strings by position), and the text's parser then
    drops such a message as before."""

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

    def feed(self, token_ids: Sequence[int]) -> Fed:
        """The next output tokens → (the thinking tokens among them, the answer's header tokens held from
        earlier calls, this call's answer tokens)."""
        if self.answering:
            if token_ids and token_ids[-1] == self.spec.end_token_id:
                self.answering = False
            return [], [], list(token_ids)
        thinking: list[int] = []
        self._held = len(self._header)
        for position, token_id in enumerate(token_ids):
            if self.thinking:
                if token_id == self.spec.end_token_id:
                    self.thinking = False
                else:
                    thinking.append(token_id)
                continue
            self._header.append(token_id)
            ends = token_id == self.spec.message_token_id
            if ends and self._is_reasoning(self._header):
                self.thinking = True
                self._header, self._held = [], 0
            elif ends or len(self._header) > _MAX_HEADER_TOKENS:
                # The header's tokens from this call start here; the answer is they and all after them.
                start = position + 1 - (len(self._header) - self._held)
                held, self._header = self._header[: self._held], []
                answer = list(token_ids[start:])
                self.answering = answer[-1] != self.spec.end_token_id
                return thinking, held, answer
        return thinking, [], []

    def _is_reasoning(self, header: list[int]) -> bool:
        tail = self.spec.reasoning_header
        return tuple(header[-len(tail) - 1 : -1]) == tail


def split_of(spec: Reasoning | ChannelReasoning) -> ReasoningSplit | ChannelSplit:
    """The split that follows an output against `spec`."""
    return ChannelSplit(spec) if isinstance(spec, ChannelReasoning) else ReasoningSplit(spec)
