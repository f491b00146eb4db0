"""The step's masks of allowed tokens for constrained requests, computed on a worker thread while
the step's forward runs.

A mask depends only on tokens a request has already accepted, so it is known before
the forward starts; llguidance computes it in Rust with the GIL released, across its
own threads. A verifying request gets one mask per position: after its last token and
after each of its proposals.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from engine.request import Request
from engine.sampling.grammar import GrammarCompiler


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
    """The step's masks: `allowed` [rows, vocab] and, per request, its first row; a verifying
    request's rows follow on, one per proposal."""

    allowed: torch.Tensor
    first_row: dict[Request, int]

    def share(self, child: Request, parent: Request) -> None:
        """A choice forked off `parent` this step samples from the parent's state."""
        if parent in self.first_row:
            self.first_row[child] = self.first_row[parent]

    def for_rows(self, requests: Sequence[Request], offsets: Sequence[int]) -> RowMask | None:
        """Masks for logits rows where row i belongs to requests[i], `offsets[i]` proposals on."""
        rows, sources = [], []
        for row, (request, offset) in enumerate(zip(requests, offsets)):
            if (first := self.first_row.get(request)) is not None:
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
        first_row: dict[Request, int] = {}
        rows = 0
        for request, drafts in jobs:
            first_row[request] = rows
            rows += len(drafts) + 1
        words = (self.grammars.tokenizer.vocab_size + 31) // 32
        if self._bitmask.numel() < rows * words:
            self._bitmask = torch.empty(rows * words, dtype=torch.int32)
        bitmask = self._bitmask[: rows * words].view(rows, words)
        entries = [(request.constraint.matcher, first_row[request], drafts) for request, drafts in jobs]
        openings = [
            (first_row[request], token)
            for request, _ in jobs
            if (token := request.constraint.opening_token) is not None
        ]
        return self._worker.submit(self._fill, entries, bitmask, first_row, openings)

    def _fill(
        self, entries: list, bitmask: torch.Tensor, first_row: dict[Request, int], openings: list[tuple[int, int]]
    ) -> StepMasks:
        """`openings`: (row, token) where the row also allows a token the grammar does not (a
        reasoning's opening tag, which the grammar never sees)."""
        row_bytes = bitmask.shape[1] * 4
        plain = [(matcher, row) for matcher, row, drafts in entries if not drafts]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        drafted = [entry for entry in entries if entry[2]]
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, bitmask.data_ptr(), row_bytes, bitmask.shape[0]
            )
        for row, token in openings:
            bit = 1 << (token & 31)
            # The words are int32: bit 31 is the sign bit.
            bitmask[row, token >> 5] |= bit - (1 << 32) if bit >= 1 << 31 else bit
        bits = (bitmask.to(self.device, non_blocking=True).unsqueeze(-1) >> self._shifts) & 1
        allowed = bits.view(bitmask.shape[0], -1).bool()
        if allowed.shape[1] < self.vocab_size:
            # Logits past the tokenizer's vocabulary are padding: never allowed.
            allowed = torch.nn.functional.pad(allowed, (0, self.vocab_size - allowed.shape[1]))
        return StepMasks(allowed[:, : self.vocab_size], first_row)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)
