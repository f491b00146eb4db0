"""The plain step: forward, then sample or verify, then advance grammars, all before it returns (every
step on a CPU; on a GPU, the steps the overlapped path cannot take)."""

from __future__ import annotations

from collections.abc import Callable

from engine.model.causal_lm import HeadOutput
from engine.request import Request
from engine.sampling.masks import MaskComputer, StepMasks
from engine.sampling.sampler import Sampler
from engine.sampling.speculative import Proposal
from engine.scheduler import Scheduler, StepPlan
from engine.step.constraints import advance_constraints, start_masks
from engine.step.forking import Choices
from engine.step.speculation import Speculation
from engine.types import TokenLogprob

# The step's forward: (plan, how to resolve placeholders or None) → the requests that sample, and the logits.
Forward = Callable[[StepPlan, Callable | None], tuple[list[Request], HeadOutput]]
Outputs = dict[Request, tuple[list[int], list[TokenLogprob]]]


class PlainStep:
    """Runs a scheduled step to the tokens each request keeps."""

    def __init__(
        self,
        forward: Forward,
        scheduler: Scheduler,
        sampler: Sampler,
        masks: MaskComputer,
        choices: Choices,
        speculation: Speculation,
        jump_forward: bool,
    ) -> None:
        self.forward = forward
        self.scheduler = scheduler
        self.sampler = sampler
        self.masks = masks
        self.choices = choices
        self.speculation = speculation
        self.jump_forward = jump_forward

    def run(
        self, plan: StepPlan, proposals: dict[Request, Proposal]
    ) -> tuple[list[tuple[Request, list[int]]], Outputs]:
        """Each sampling request with the tokens it kept, and every sampler's tokens and logprobs."""
        pending_masks = start_masks(self.masks, plan)
        try:
            sampling_requests, head = self.forward(plan, None)
        finally:
            # Never leave the worker holding matchers this thread is about to advance.
            masks = pending_masks.result() if pending_masks is not None else None
        sampling_requests, row_starts = self.choices.fork(plan, sampling_requests, masks)
        outputs = self._sample(plan, proposals, sampling_requests, row_starts, head, masks)
        forced = advance_constraints(sampling_requests, outputs, self.jump_forward)
        kept = self.scheduler.postprocess(plan, {r: tokens for r, (tokens, _) in outputs.items()}, forced)
        return kept, outputs

    def _sample(
        self,
        plan: StepPlan,
        proposals: dict[Request, Proposal],
        sampling_requests: list[Request],
        row_starts: list[int],
        head: HeadOutput,
        masks: StepMasks | None,
    ) -> Outputs:
        """Tokens (and logprobs) for every sampling request: one sampled, or verified proposals."""
        outputs: Outputs = {}
        logits, block_max = head.logits, head.block_max
        plain = [i for i, r in enumerate(sampling_requests) if r not in plan.proposals]
        if plain:
            requests = [sampling_requests[i] for i in plain]
            starts = [row_starts[i] for i in plain]
            # Rows are already in order when no request verifies proposals: no gather copy.
            if starts != list(range(logits.shape[0])):
                logits = logits[starts]
                block_max = block_max[starts] if block_max is not None else None
            mask = masks.for_rows(requests, [0] * len(requests)) if masks is not None else None
            sampled = self.sampler.sample(requests, logits, mask, block_max)
            for request, token_id, logprob in zip(requests, sampled.token_ids, sampled.logprobs):
                outputs[request] = ([token_id], [logprob] if logprob else [])
        verifying = [i for i, r in enumerate(sampling_requests) if r in plan.proposals]
        if verifying:
            requests = [sampling_requests[i] for i in verifying]
            starts = [row_starts[i] for i in verifying]
            outputs.update(self.speculation.verify(plan, proposals, requests, starts, head.logits, masks))
        return outputs
