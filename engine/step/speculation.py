"""Speculative decoding in a step: proposals for the running decodes before it is scheduled, their
verification after the forward, and the acceptance counters."""

from __future__ import annotations

import ctypes
import logging
import time

import torch

from engine.config import EngineConfig
from engine.kv_cache import BlockManager
from engine.model.causal_lm import PagedCausalLM
from engine.request import Request, RequestStatus
from engine.sampling.masks import StepMasks
from engine.sampling.speculative import DraftProposer, NgramProposer, Proposal, Proposer, verify
from engine.scheduler import Scheduler, StepPlan
from engine.types import TokenLogprob

logger = logging.getLogger(__name__)


class Speculation:
    """Proposes for small batches of running decodes and verifies what the step's forward scored."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        block_manager: BlockManager,
        draft_model: PagedCausalLM | None = None,
        kernels: ctypes.CDLL | None = None,
    ) -> None:
        self.config = config
        # The CPU kernels, for verified tokens' logprobs.
        self.kernels = kernels
        self.scheduler = scheduler
        self.proposer: Proposer | None = None
        if config.speculative is not None and config.speculative.method == "ngram":
            self.proposer = NgramProposer(config.speculative.ngram_min, config.speculative.ngram_max)
        elif config.speculative is not None:
            if draft_model is None:
                raise ValueError("speculative method 'draft' needs a draft model")
            self.proposer = DraftProposer(draft_model, block_manager, config.num_kv_blocks, config.block_size)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # (time, draft tokens, accepted tokens) at the last acceptance log line.
        self._logged = (time.monotonic(), 0, 0)

    @property
    def active(self) -> bool:
        """Whether the next step may propose: a proposer, and no more running requests than the cut-off."""
        spec = self.config.speculative
        return self.proposer is not None and spec is not None and len(self.scheduler.running) <= spec.max_batch_size

    def propose(self) -> dict[Request, Proposal]:
        """Proposals for running decodes, by request; none above the batch-size cut-off."""
        spec = self.config.speculative
        if not self.active:
            return {}
        eligible = [
            r
            for r in self.scheduler.running
            if r.params.speculative
            and r.status == RequestStatus.RUNNING
            and r.num_tokens - r.num_computed_tokens == 1
            and r.channel.unread_tokens < self.config.max_unread_tokens
        ]
        # Never propose past max_tokens (the step adds one token of its own) or the context.
        room = [
            min(
                spec.num_tokens, r.params.max_tokens - r.num_output_tokens - 1, self.config.max_model_len - r.num_tokens
            )
            for r in eligible
        ]
        proposals = self.proposer.propose(eligible, room) if eligible else []
        # A constrained request's proposals end at the first token its grammar forbids.
        proposals = [
            _trim(p, r.constraint.valid_prefix(p.token_ids)) if r.constraint is not None and p.token_ids else p
            for r, p in zip(eligible, proposals)
        ]
        return {r: p for r, p in zip(eligible, proposals) if p.token_ids}

    def verify(
        self,
        plan: StepPlan,
        proposals: dict[Request, Proposal],
        requests: list[Request],
        row_starts: list[int],
        logits: torch.Tensor,
        masks: StepMasks | None,
    ) -> dict[Request, tuple[list[int], list[TokenLogprob]]]:
        """The tokens (and logprobs) each verifying request keeps: its accepted proposals (as many as the
        step had budget for) and one token of the target's own; its rows start at row_starts[i]."""
        trimmed = [_trim(proposals[r], len(plan.proposals[r])) for r in requests]
        rows = [row for start, p in zip(row_starts, trimmed) for row in range(start, start + len(p.token_ids) + 1)]
        mask = None
        if masks is not None:
            mask = masks.for_rows(
                [r for r, p in zip(requests, trimmed) for _ in range(len(p.token_ids) + 1)],
                [offset for p in trimmed for offset in range(len(p.token_ids) + 1)],
            )
        outputs: dict[Request, tuple[list[int], list[TokenLogprob]]] = {}
        verified = verify(requests, trimmed, logits[rows], mask, self.kernels)
        for request, proposal, result in zip(requests, trimmed, verified):
            request.num_draft_tokens += len(proposal.token_ids)
            request.num_accepted_tokens += result.num_accepted
            self.num_draft_tokens += len(proposal.token_ids)
            self.num_accepted_tokens += result.num_accepted
            outputs[request] = (result.token_ids, result.logprobs)
        return outputs

    def log_acceptance(self) -> None:
        """Every 30 s of speculation, log what fraction of proposed tokens the target accepted."""
        now = time.monotonic()
        if now - self._logged[0] < 30 or self.num_draft_tokens == self._logged[1]:
            return
        proposed = self.num_draft_tokens - self._logged[1]
        accepted = self.num_accepted_tokens - self._logged[2]
        logger.info(
            "speculative decoding: %d of %d proposed tokens accepted (%.0f%%)",
            accepted,
            proposed,
            100 * accepted / proposed,
        )
        self._logged = (now, self.num_draft_tokens, self.num_accepted_tokens)


def _trim(proposal: Proposal, length: int) -> Proposal:
    """The first `length` proposed tokens (the scheduler may have had budget for fewer)."""
    if length == len(proposal.token_ids):
        return proposal
    probs = proposal.draft_probs[:length] if proposal.draft_probs is not None else None
    return Proposal(proposal.token_ids[:length], probs)
