"""Constrained requests in a step: their masks started before the forward, then their grammars moved past
the step's tokens and on through the tokens the grammar forces next (jump-forward)."""

from __future__ import annotations

from concurrent.futures import Future

from engine.request import Request, RequestStatus
from engine.sampling.masks import MaskComputer, StepMasks
from engine.scheduler import StepPlan
from engine.types import TokenLogprob

NO_TOKENS_FOR_GRAMMAR = (
    "the output's grammar cannot be followed with this model's tokens: it asks for text (a character or byte) "
    "that no token of the model's vocabulary can write"
)


def start_masks(masks: MaskComputer, plan: StepPlan) -> Future[StepMasks] | None:
    """Start the masks of the constrained requests that sample this step (they depend only on
    tokens already kept, so they are computed while the forward runs); one still thinking has none."""
    jobs = [
        (request, plan.proposals.get(request, []))
        for request, num_new in plan.scheduled
        if request.constraint is not None
        and request.constraint.masks_next
        and (request in plan.proposals or request.num_computed_tokens + num_new == request.num_tokens)
    ]
    return masks.start(jobs) if jobs else None


def advance_constraints(
    sampling_requests: list[Request], outputs: dict[Request, tuple[list[int], list[TokenLogprob]]], jump_forward: bool
) -> dict[Request, int]:
    """Move each constrained request's grammar past its new tokens, then (with `jump_forward`) append the
    tokens the grammar forces next. Returns how many were appended, by request."""
    forced: dict[Request, int] = {}
    for request in sampling_requests:
        if request.constraint is None:
            continue
        token_ids = outputs[request][0]
        if not request.constraint.advance(token_ids):
            # The masks come from the grammar, so a token they allowed that it then refuses means the
            # grammar wants text no token of this vocabulary holds (llguidance allows a wrong token
            # there rather than none): e.g. a character whose first byte has no token of its own.
            request.finish(RequestStatus.FINISHED_REJECTED, NO_TOKENS_FOR_GRAMMAR)
            continue
        # Forced tokens have no logprobs of their own, so a request that asked for them samples every token.
        if not jump_forward or request.params.logprobs is not None or request.constraint.done:
            continue
        if extra := request.constraint.forced():
            # Forced bytes no token holds come back as other tokens (or none), which the grammar refuses.
            if not request.constraint.advance(extra):
                request.finish(RequestStatus.FINISHED_REJECTED, NO_TOKENS_FOR_GRAMMAR)
                continue
            token_ids.extend(extra)
            forced[request] = len(extra)
    return forced
