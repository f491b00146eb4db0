"""One choice's output against its reasoning: which tokens are thinking, and where the answer begins.

    prompt ... <think> | thinking tokens ... </think> | answer tokens ...
                       ^ output starts here (open_at_start), or the output's first token is <think>

The output processor (what the client reads) and the grammar (what the answer must match) each
follow the output with one of these, token by token, so both cut it at the same token.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.types import Reasoning


class ReasoningSplit:
    """Follows one choice's output tokens; once `answering`, every later token is answer."""

    def __init__(self, spec: Reasoning) -> None:
        self.spec = spec
        self.thinking = spec.open_at_start
        # No output token yet: the first may open the reasoning (or repeat the prompt's opening tag).
        self.at_start = True

    @property
    def answering(self) -> bool:
        return not self.at_start and not self.thinking

    def feed(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """The next output tokens → (the thinking tokens among them, how many of `token_ids` the
        reasoning takes, its tags included: they lead the list, the answer is the rest)."""
        thinking: list[int] = []
        for position, token_id in enumerate(token_ids):
            if self.at_start:
                self.at_start = False
                if token_id == self.spec.start_token_id:
                    self.thinking = True
                    continue
            if not self.thinking:
                return thinking, position
            if token_id == self.spec.end_token_id:
                self.thinking = False
                return thinking, position + 1
            thinking.append(token_id)
        return thinking, len(token_ids)
