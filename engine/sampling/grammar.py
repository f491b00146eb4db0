"""Grammar-constrained decoding with llguidance: specs compiled once, a matcher per choice, and the
step's masks of allowed tokens computed on a worker thread while the step's forward runs.

A mask depends only on tokens a request has already accepted, so it is known before
the forward starts; llguidance computes it in Rust with the GIL released, across its
own threads. A verifying request gets one mask per position: after its last token and
after each of its proposals.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from engine.request import Request

GrammarKind = Literal["json_schema", "regex", "choice", "grammar"]

# Compact JSON (no optional whitespace): small models otherwise pad with whitespace until
# max_tokens, and fixed separators let jump-forward emit keys and punctuation at once.
# A schema's own "x-guidance" options still apply over these defaults.
JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar, schema or regex the engine cannot compile (the client's error)."""


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

    def to_llguidance(self) -> str:
        """The grammar in llguidance's own format."""
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_DEFAULTS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", self.source)
        return llguidance.grammar_from("grammar", self.source)


class Constraint:
    """One choice's position in its grammar; advanced with every token the choice keeps."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def copy(self) -> Constraint:
        return Constraint(self.matcher.deep_copy())

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` the grammar allows next, in order (speculative proposals)."""
        return self.matcher.validate_tokens(token_ids)

    def advance(self, token_ids: list[int]) -> bool:
        """Accept the tokens the request kept; False if the grammar refused one (its matcher
        failed: the masks never allow such a token otherwise)."""
        return self.matcher.consume_tokens(token_ids)

    def forced(self) -> list[int]:
        """Tokens the grammar allows as the only continuation (jump-forward)."""
        return self.matcher.compute_ff_tokens()

    @property
    def done(self) -> bool:
        """Nothing but end-of-sequence may follow: the output is complete."""
        return self.matcher.is_stopped()


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
            grammar = spec.to_llguidance()
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

    def constraint(self, spec: GrammarSpec) -> Constraint:
        return Constraint(self.compile(spec).deep_copy())


@dataclass(frozen=True)
class RowMask:
    """Allowed tokens for some rows of a logits tensor."""

    rows: list[int]
    allowed: torch.Tensor

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` with every forbidden token of the masked rows at -inf (applied
        before penalties' results are sampled and before any top-k candidate set is taken)."""
        masked = logits.clone()
        if len(self.rows) == logits.shape[0]:
            return masked.masked_fill_(~self.allowed, float("-inf"))
        index = torch.tensor(self.rows, device=logits.device)
        masked[index] = masked[index].masked_fill_(~self.allowed, float("-inf"))
        return masked


@dataclass
class StepMasks:
    """The step's masks: `allowed` [rows, vocab] and, per request (by id), its first row; a
    verifying request's rows follow on, one per proposal."""

    allowed: torch.Tensor
    first_row: dict[int, int]

    def share(self, child: Request, parent: Request) -> None:
        """A choice forked off `parent` this step samples from the parent's state."""
        if id(parent) in self.first_row:
            self.first_row[id(child)] = self.first_row[id(parent)]

    def for_rows(self, requests: Sequence[Request], offsets: Sequence[int]) -> RowMask | None:
        """Masks for logits rows where row i belongs to requests[i], `offsets[i]` proposals on."""
        rows, sources = [], []
        for row, (request, offset) in enumerate(zip(requests, offsets)):
            if (first := self.first_row.get(id(request))) is not None:
                rows.append(row)
                sources.append(first + offset)
        if not rows:
            return None
        return RowMask(rows, self.allowed[sources])


class MaskComputer:
    """Fills a step's bitmasks on one worker thread; the engine thread collects them after the forward."""

    def __init__(self, grammars: GrammarCompiler, vocab_size: int, device: torch.device) -> None:
        self.grammars = grammars
        # The model's logits may be wider or narrower than the tokenizer's vocabulary.
        self.vocab_size = vocab_size
        self.device = device
        self._executor = llguidance.LLExecutor()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="sluice-grammar")
        self._bitmask = torch.empty(0, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)

    def start(self, jobs: Sequence[tuple[Request, list[int]]]) -> Future[StepMasks]:
        """Begin computing masks for (request, its proposals) pairs; each request has a constraint."""
        first_row, rows = {}, 0
        for request, drafts in jobs:
            first_row[id(request)] = rows
            rows += len(drafts) + 1
        words = (self.grammars.tokenizer.vocab_size + 31) // 32
        if self._bitmask.numel() < rows * words:
            self._bitmask = torch.empty(rows * words, dtype=torch.int32)
        bitmask = self._bitmask[: rows * words].view(rows, words)
        entries = [(request.constraint.matcher, first_row[id(request)], drafts) for request, drafts in jobs]
        return self._worker.submit(self._fill, entries, bitmask, first_row)

    def _fill(self, entries: list, bitmask: torch.Tensor, first_row: dict[int, int]) -> StepMasks:
        row_bytes = bitmask.shape[1] * 4
        plain = [(matcher, row) for matcher, row, drafts in entries if not drafts]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        drafted = [entry for entry in entries if entry[2]]
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, bitmask.data_ptr(), row_bytes, bitmask.shape[0]
            )
        bits = (bitmask.to(self.device, non_blocking=True).unsqueeze(-1) >> self._shifts) & 1
        allowed = bits.view(bitmask.shape[0], -1).bool()
        if allowed.shape[1] < self.vocab_size:
            # Logits past the tokenizer's vocabulary are padding: never allowed.
            allowed = torch.nn.functional.pad(allowed, (0, self.vocab_size - allowed.shape[1]))
        return StepMasks(allowed[:, : self.vocab_size], first_row)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)
