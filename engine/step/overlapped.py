"""The overlapped step (on a GPU): a step of plain requests is launched and left in flight, and the next
step is scheduled and launched before the one in flight hands back its tokens (engine/future_tokens.py)."""

from __future__ import annotations

from engine.future_tokens import FutureTokens, InFlightStep
from engine.kv_cache import BlockManager
from engine.request import Request
from engine.sampling.sampler import Sampler
from engine.scheduler import Scheduler, StepPlan
from engine.step.plain import Forward


class OverlappedSteps:
    """At most one launched step in flight; its tokens are read once the step after it is on its way."""

    def __init__(
        self,
        future: FutureTokens,
        forward: Forward,
        scheduler: Scheduler,
        sampler: Sampler,
        block_manager: BlockManager,
    ) -> None:
        self.future = future
        self.forward = forward
        self.scheduler = scheduler
        self.sampler = sampler
        self.block_manager = block_manager
        self.in_flight: InFlightStep | None = None

    def can_follow(self, speculating: bool, fault_pending: bool) -> bool:
        """Whether the next step may be scheduled before the step in flight hands its tokens back: it
        admits and preempts no one (both read or reset whole requests, placeholders included: nobody
        waits, and the pool holds every block the running requests could ask for), speculates for no
        one (proposals read the output), and every running request is plain."""
        scheduler, blocks = self.scheduler, self.block_manager
        if scheduler.waiting or fault_pending or speculating:
            return False
        needed = 0
        for request in scheduler.running:
            if not request.overlappable:
                return False
            remaining = len(request.token_ids) - request.num_computed_tokens
            needed += 1 if remaining <= 1 else blocks.num_blocks_needed(request, remaining)
        return blocks.can_allocate(needed)

    def takes(self, plan: StepPlan) -> bool:
        """Whether `plan` runs overlapped. With a step in flight, can_follow() has found every running
        request plain and nobody proposed for."""
        return self.in_flight is not None or (not plan.proposals and all(r.overlappable for r, _ in plan.scheduled))

    def launch(self, plan: StepPlan) -> list[tuple[Request, list[int]]] | None:
        """Run a step of plain requests without waiting for its tokens: each sampler gets a placeholder,
        and the step launched before it (if any) is completed once this one is on its way: its kept tokens."""
        future = self.future
        sampling_requests, head = self.forward(plan, future.resolve if self.in_flight is not None else None)
        tokens = self.sampler.tokens(sampling_requests, head.logits, block_max=head.block_max)
        self.scheduler.launched(plan)
        positions = [request.num_tokens for request in sampling_requests]
        for request, placeholder in zip(sampling_requests, future.publish(tokens)):
            request.token_ids.append(placeholder)
            request.num_pending += 1
        host_tokens, ready = future.to_host(tokens)
        previous, self.in_flight = self.in_flight, InFlightStep(plan, sampling_requests, positions, host_tokens, ready)
        return self._complete(previous) if previous is not None else None

    def complete(self) -> list[tuple[Request, list[int]]]:
        """Take the step in flight's tokens off the device: each sampler with the token it kept."""
        step, self.in_flight = self.in_flight, None
        return self._complete(step)

    def _complete(self, step: InFlightStep) -> list[tuple[Request, list[int]]]:
        return self.scheduler.complete(step.plan, step.sampling_requests, step.positions, self.future.read(step))
