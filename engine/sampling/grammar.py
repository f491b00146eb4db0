"""Grammar-constrained decoding with llguidance: specs compiled once, and a matcher per choice that
follows its output (the step's masks of allowed tokens are engine/sampling/masks.py's)."""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Iterable

import llguidance
import llguidance.hf
from transformers import PreTrainedTokenizerBase

from engine.reasoning import ReasoningSplit
from engine.types import ChannelReasoning, GrammarSpec, Reasoning

# Compact JSON (no optional whitespace): small models otherwise pad with whitespace until
# max_tokens, and fixed separators let jump-forward emit keys and punctuation at once.
# A schema's own "x-guidance" options still apply over these defaults.
JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar, schema or regex the engine cannot compile (the client's error)."""


class Constraint:
    """One choice's position in its grammar; advanced with every token the choice keeps. The grammar
    is the answer's: while the output's reasoning goes on (or may still open), it waits."""

    def __init__(self, matcher: llguidance.LLMatcher, reasoning: ReasoningSplit | None = None) -> None:
        self.matcher = matcher
        # The output against its reasoning until the answer begins; None from then on.
        self.reasoning = reasoning

    def copy(self) -> Constraint:
        return Constraint(self.matcher.deep_copy(), copy.copy(self.reasoning))

    @property
    def masks_next(self) -> bool:
        """Whether the next token is masked: always in the answer; at the start, when the output may
        open its reasoning, the grammar's tokens and the opening tag (`opening_token`); while
        thinking, never."""
        return self.reasoning is None or (self.reasoning.at_start and not self.reasoning.thinking)

    @property
    def opening_token(self) -> int | None:
        """The token the next mask allows beyond the grammar's: the reasoning's opening tag."""
        return self.reasoning.spec.start_token_id if self.reasoning is not None else None

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` the grammar allows next, in order (speculative proposals). While
        thinking, those before the reasoning's end: the token after the end needs the grammar's mask."""
        if self.reasoning is None:
            return self.matcher.validate_tokens(token_ids)
        if not self.reasoning.thinking:
            return 0
        end = self.reasoning.spec.end_token_id
        return token_ids.index(end) if end in token_ids else len(token_ids)

    def advance(self, token_ids: list[int]) -> bool:
        """Accept the tokens the request kept; False if the grammar refused one (its matcher
        failed: the masks never allow such a token otherwise)."""
        if self.reasoning is not None:
            parts = self.reasoning.feed(token_ids)
            if not self.reasoning.answering:
                return True
            self.reasoning = None
            token_ids = parts[-1].token_ids
        return self.matcher.consume_tokens(token_ids)

    def forced(self) -> list[int]:
        """Tokens the grammar allows as the only continuation (jump-forward)."""
        return self.matcher.compute_ff_tokens() if self.reasoning is None else []

    @property
    def done(self) -> bool:
        """Nothing but end-of-sequence may follow: the output is complete."""
        return self.reasoning is None and self.matcher.is_stopped()


class GrammarCompiler:
    """Specs → matchers. Each distinct spec is compiled once (least recently used first out);
    every request gets a copy of its compiled matcher. Safe to call from any thread."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Iterable[int], max_cached: int = 256
    ) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._max_cached = max_cached
        self._compiled: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (it takes about half a second)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer,
                    n_vocab=max(self._vocab_size, len(self._hf_tokenizer)),
                    eos_token=self._eos_token_ids or None,
                )
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The compiled matcher for `spec` (from the cache when it is there); GrammarError when
        the spec is invalid. Compiling a large schema can take a while: call it off the event loop."""
        with self._lock:
            if (matcher := self._compiled.get(spec)) is not None:
                self._compiled.move_to_end(spec)
                return matcher
        try:
            grammar = _llguidance_grammar(spec)
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc
        if error := llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer):
            raise GrammarError(error.strip())
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        with self._lock:
            self._compiled[spec] = matcher
            while len(self._compiled) > self._max_cached:
                self._compiled.popitem(last=False)
        return matcher

    def constraint(self, spec: GrammarSpec, reasoning: Reasoning | ChannelReasoning | None = None) -> Constraint:
        """A new choice's place at the start of `spec`, which waits out the output's `reasoning` (a harmony
        output's grammar covers its reasoning, and starts at once)."""
        split = ReasoningSplit(reasoning) if isinstance(reasoning, Reasoning) else None
        return Constraint(self.compile(spec).deep_copy(), split)


def _llguidance_grammar(spec: GrammarSpec) -> str:
    """The grammar in llguidance's own format."""
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_DEFAULTS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.source)
    return llguidance.grammar_from("grammar", spec.source)
