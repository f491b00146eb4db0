"""The plain data the engine shares with its callers: what a request asks for and what comes back.

A leaf: it imports only the standard library, so every layer (the wire, the engine, its kernels) can
name these types without importing one another.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Literal, NamedTuple

GrammarKind = Literal["json_schema", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: a JSON schema (as JSON text), a regex, a JSON list of
    choices, or a grammar (Lark, or llama.cpp's GBNF)."""

    kind: GrammarKind
    source: str

    @classmethod
    def json_schema(cls, schema: dict | bool) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, sort_keys=False, separators=(",", ":")))

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(choices)))


@dataclass(frozen=True)
class Reasoning:
    """Where a request's output thinks before it answers, between two tags of one token each
    (`<think>`, `</think>`): from the output's start when the prompt opened the tag (`open_at_start`),
    or when the output's first token is `start_token_id`, until `end_token_id`. The tags are neither
    reasoning nor answer; stop strings and the output's grammar apply to the answer alone."""

    start_token_id: int
    end_token_id: int
    open_at_start: bool


@dataclass(frozen=True)
class ChannelReasoning:
    """Where a harmony output (engine/harmony.py: messages of a header, `<|message|>`, a body, `<|end|>`)
    thinks: in its leading messages whose header ends with `reasoning_header` (`<|channel|>analysis`). Their
    headers and ends are neither reasoning nor answer; the answer starts with the first other message's
    header. The output's grammar covers the whole output, reasoning included (app/serving/harmony.py
    writes it so); stop strings apply to the answer alone."""

    message_token_id: int
    end_token_id: int
    reasoning_header: tuple[int, ...]


@dataclass(frozen=True)
class SamplingParams:
    """What the client asked for; validated on the wire, immutable inside the engine."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: the sampled token's logprob plus the k most likely.
    logprobs: int | None = None
    n: int = 1
    # Tokens per chunk; a lagging reader gets bigger chunks regardless (see StreamChannel).
    stream_interval: int = 1
    # Whether the engine may speculate for this request (when it speculates at all).
    speculative: bool = True
    # What the output must match (structured output, tool calls); None: free text.
    grammar: GrammarSpec | None = None
    # The reasoning the output starts with, split off from the answer; None: all of it is answer.
    reasoning: Reasoning | ChannelReasoning | None = None
    # Stored conversations: keep this request's KV blocks pinned under this key once it finishes
    # (with stop or length), and the key of the pinned conversation this request continues.
    keep_kv_as: str | None = None
    continues: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"
    # The request asked for what this model cannot do (a grammar its tokens cannot follow): the
    # client's error, where ERROR is the server's.
    REJECTED = "rejected"


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability under the model, and the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Timings:
    """Where one choice's time went (llama.cpp's `timings`, in milliseconds)."""

    queue_ms: float
    prompt_ms: float
    ttft_ms: float
    decode_ms: float
    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # Prompt tokens whose K/V came from the prefix cache.
    cached_tokens: int = 0
    # Whether the request was ever paused for its reader.
    paused: bool = False
    # Output tokens inside the reasoning (its tags not counted, as vLLM counts them).
    reasoning_tokens: int = 0

    @property
    def decode_tokens_per_second(self) -> float:
        # The first token comes out of the prefill; decode speed counts the ones after it.
        if self.completion_tokens < 2 or self.decode_ms <= 0:
            return 0.0
        return (self.completion_tokens - 1) * 1000.0 / self.decode_ms


class Chunk(NamedTuple):
    """Output of one choice since its previous chunk.

    Immutable like the other types that cross the thread boundary, but a NamedTuple rather than a
    frozen dataclass: the engine makes one per stream per step, and a frozen dataclass's __init__
    (a setattr per field) cost 2.7 µs a chunk against 0.7 here."""

    token_ids: tuple[int, ...]
    text: str
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    timings: Timings | None = None
    # The reasoning's text in this chunk, which comes before `text` (see Reasoning).
    reasoning: str = ""

    @property
    def is_terminal(self) -> bool:
        return self.finish_reason is not None

    @staticmethod
    def joined(chunks: list[Chunk]) -> Chunk:
        """Chunks of one choice, in order, as one (the last one's ending)."""
        token_ids: list[int] = []
        texts: list[str] = []
        reasoning: list[str] = []
        logprobs: list[TokenLogprob] = []
        for chunk in chunks:
            token_ids += chunk.token_ids
            texts.append(chunk.text)
            reasoning.append(chunk.reasoning)
            logprobs += chunk.logprobs
        last = chunks[-1]
        return Chunk(
            tuple(token_ids),
            "".join(texts),
            last.index,
            tuple(logprobs),
            last.finish_reason,
            last.error,
            last.timings,
            "".join(reasoning),
        )
