"""Scheduler: waiting and running queues, admission, chunked prefill, preemption, finish.

There is no prefill or decode phase: every request has `num_tokens` it knows and
`num_computed_tokens` whose K/V are cached, and each step gives requests a share of
a token budget so the second catches up with the first. A decode is a request one
token behind; a prompt longer than the budget is prefilled in chunks across steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field

from engine.encoder_budget import EncoderBudget
from engine.kv_cache import BlockManager
from engine.request import Request, RequestStatus


@dataclass
class StepPlan:
    """What one engine step computes."""

    # (request, number of its tokens computed this step), decodes before prefill chunks.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    # Running requests skipped because their reader is behind.
    num_paused: int = 0
    # Speculative proposals by request, as trimmed to the step's budget; such a request
    # computes its last token plus these in one go.
    proposals: dict[Request, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Decides who runs each step within `max_num_seqs` and `max_num_batched_tokens`."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        max_unread_tokens: int = 256,
        pin_seconds: float = 0.0,
        whole_images: bool = False,
        encoder_cache: Container[int] | None = None,
        max_num_encoder_input_tokens: int = 0,
    ) -> None:
        """`whole_images`: the model's image tokens attend to each other both ways, so a chunk never ends inside
        a request's image block (Request.image_blocks). `encoder_cache` (a vision-language model's: the images
        whose embeddings are kept, by content hash): a step starts new images of at most
        `max_num_encoder_input_tokens` rows, a chunk ending before one that does not fit (EncoderBudget)."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.max_unread_tokens = max_unread_tokens
        self.pin_seconds = pin_seconds
        self.whole_images = whole_images
        self.encoder_cache = encoder_cache
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

    def schedule(self, proposals: dict[Request, list[int]] | None = None) -> StepPlan:
        """Running requests first (decodes ahead of prefill chunks), then admit waiting ones.

        A decode with `proposals` (by request) gets room to verify as many of them as
        the token budget allows.

        A request whose reader has fallen `max_unread_tokens` behind is paused: it keeps
        its KV blocks and its seat but computes nothing until the reader catches up.
        """
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        # A running prompt that waits for room to compute an image whole holds back new admissions, so the
        # budget it needs frees up as the decodes ahead of it finish.
        admit = True
        # Locals: asked of every running request, where a text model's checks cost a jump each.
        whole_images = self.whole_images
        encoder = (
            EncoderBudget(self.encoder_cache, self.max_num_encoder_input_tokens)
            if self.encoder_cache is not None
            else None
        )
        # A stable sort keeps arrival order within each group; decodes go first so a
        # long prompt being prefilled never holds back the tokens of everyone else.
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if request.num_pending and self._reaches_length(request, request.num_tokens):
                continue  # its token on the device is its last (overlapped steps)
            if request.channel.unread_tokens >= self.max_unread_tokens:
                plan.num_paused += 1
                request.was_paused = True
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if whole_images and request.image_blocks:
                num_new = chunk_within_images(request, request.num_computed_tokens, num_new)
                if not num_new:
                    admit = False
                    continue
            if encoder is not None and request.images:
                num_new = encoder.fit(request, request.num_computed_tokens, num_new)
                if not num_new:
                    continue
            if not self._make_room(request, num_new, plan):
                continue
            proposed = proposals.get(request, [])[: budget - num_new] if proposals and num_new == 1 else []
            # Speculation never preempts anyone.
            if proposed and self.block_manager.can_allocate(
                self.block_manager.num_blocks_needed(request, num_new + len(proposed))
            ):
                plan.proposals[request] = proposed
                num_new += len(proposed)
            if encoder is not None and request.images:
                encoder.charge(request, request.num_computed_tokens, num_new)
            self.block_manager.allocate(request, num_new)
            plan.scheduled.append((request, num_new))
            budget -= num_new

        while (
            admit
            and self.waiting
            and budget > 0
            and self._num_seats() + 1 + self.waiting[0].num_pending_forks <= self.max_num_seqs
        ):
            request = self.waiting[0]
            # New or preempted, it holds no blocks: start it on whatever the prefix cache has.
            cached = self.block_manager.cached_prefix(request)
            num_cached = len(cached) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if whole_images and request.image_blocks:
                num_new = chunk_within_images(request, num_cached, num_new)
                if not num_new:
                    break
            if encoder is not None and request.images:
                num_new = encoder.fit(request, num_cached, num_new)
                if not num_new:
                    break
            if not self.block_manager.can_allocate(self.block_manager.num_blocks_to_admit(cached, num_new)):
                break
            if encoder is not None and request.images:
                encoder.charge(request, num_cached, num_new)
            self.waiting.popleft()
            self.block_manager.adopt_prefix(request, cached)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            self.block_manager.allocate(request, num_new)
            plan.scheduled.append((request, num_new))
            budget -= num_new
        return plan

    def _num_seats(self) -> int:
        """Running requests, counting the choices each will still fork."""
        return len(self.running) + sum(r.num_pending_forks for r in self.running)

    def _make_room(self, request: Request, num_new: int, plan: StepPlan) -> bool:
        """Preempt the youngest unscheduled running requests until `request` fits; False if
        it had to be preempted itself."""
        needed = self.block_manager.num_blocks_needed(request, num_new)
        while not self.block_manager.can_allocate(needed):
            scheduled = {r for r, _ in plan.scheduled}
            victims = [r for r in self.running if r not in scheduled and r is not request]
            victim = victims[-1] if victims else request
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free the request's KV and queue it first in line to recompute."""
        self.running.remove(request)
        self.block_manager.deallocate(request)
        request.num_computed_tokens = request.num_draft_computed = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def postprocess(
        self, plan: StepPlan, sampled: dict[Request, list[int]], forced: dict[Request, int] | None = None
    ) -> list[tuple[Request, list[int]]]:
        """Advance counters, append sampled tokens (keyed by request) and latch finishes.

        The last `forced[request]` of a request's tokens were appended by its grammar
        (jump-forward), not computed. Tokens after the one that finishes a request are
        dropped. Returns each sampling request with the tokens it kept.
        """
        kept: list[tuple[Request, list[int]]] = []
        for request, num_new in plan.scheduled:
            token_ids = sampled.get(request)
            if token_ids is not None and request in plan.proposals:
                # K/V is valid up to the last accepted proposal; the rest is rolled back.
                request.num_computed_tokens += len(token_ids) - (forced or {}).get(request, 0)
                self.block_manager.truncate(request, request.num_computed_tokens + 1)
            else:
                request.num_computed_tokens += num_new
            self.block_manager.register(request)
            if token_ids is None:
                continue
            for count, token_id in enumerate(token_ids, start=1):
                request.token_ids.append(token_id)
                # After its last token, a grammar that allows nothing more has completed the output.
                grammar_done = count == len(token_ids) and request.constraint is not None and request.constraint.done
                if self._finishes(request, token_id, request.num_tokens, grammar_done):
                    kept.append((request, token_ids[:count]))
                    break
            else:
                kept.append((request, list(token_ids)))
        return kept

    def launched(self, plan: StepPlan) -> None:
        """Advance the counters of a step launched without waiting for its tokens (overlapped steps):
        its tokens are placeholders until complete()."""
        for request, num_new in plan.scheduled:
            request.num_computed_tokens += num_new

    def complete(
        self, plan: StepPlan, sampling_requests: list[Request], positions: list[int], token_ids: list[int]
    ) -> list[tuple[Request, list[int]]]:
        """postprocess() for a step launched earlier: put each sampler's token in place of its
        placeholder at `positions`, register the blocks and latch finishes. Requests that finished
        meanwhile (cancelled, or a stop the step before found) are skipped, their tokens dropped."""
        kept: list[tuple[Request, list[int]]] = []
        for request, position, token_id in zip(sampling_requests, positions, token_ids):
            if request.is_finished:
                continue
            request.token_ids[position] = token_id
            request.num_pending -= 1
            self._finishes(request, token_id, position + 1)
            kept.append((request, [token_id]))
        for request, _ in plan.scheduled:
            if not request.is_finished:
                self.block_manager.register(request)
        return kept

    def _finishes(self, request: Request, token_id: int, num_tokens: int, grammar_done: bool = False) -> bool:
        """The finish rule of postprocess() and complete() alike, for a request's new token `token_id`
        that makes `num_tokens` (prompt included): a stop token, else the length limit, else a grammar
        that allows nothing more ends it (a finish latched earlier stands), and a finished request is
        freed. Returns whether it finished."""
        if self.is_stop_token(request, token_id):
            request.finish(RequestStatus.FINISHED_STOPPED)
        elif self._reaches_length(request, num_tokens):
            request.finish(RequestStatus.FINISHED_LENGTH)
        elif grammar_done:
            request.finish(RequestStatus.FINISHED_STOPPED)
        if not request.is_finished:
            return False
        self.free(request)
        return True

    def _reaches_length(self, request: Request, num_tokens: int) -> bool:
        """Whether the request's first `num_tokens` tokens (prompt included) are as many as it may have."""
        return num_tokens - request.num_prompt_tokens >= request.params.max_tokens or num_tokens >= self.max_model_len

    def is_stop_token(self, request: Request, token_id: int) -> bool:
        """Whether `token_id` ends `request`: eos (unless ignore_eos) or one of its stop_token_ids."""
        if token_id in request.params.stop_token_ids:
            return True
        return token_id in self.eos_token_ids and not request.params.ignore_eos

    def add_fork(self, parent: Request, child: Request) -> None:
        """Seat a choice forked off `parent`: running beside it when its KV was shared, else
        first in line to recompute."""
        if child.block_table:
            child.status = RequestStatus.RUNNING
            self.running.insert(self.running.index(parent) + 1, child)
        else:
            child.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(child)

    def free(self, request: Request) -> None:
        """Drop a finished request from the queues and return its KV blocks (pinning them first
        when it completed and asked to keep them)."""
        if request.num_pending:
            # A token still on the device is not its output. The K/V of the tokens before it (being
            # computed in stream order, ahead of any later use of the blocks) stay valid to cache.
            del request.token_ids[-request.num_pending :]
            request.num_pending = 0
            self.block_manager.register(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        key = request.params.keep_kv_as
        completed = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if key and completed and request.index == 0:
            self.block_manager.pin(key, request, time.monotonic() + self.pin_seconds)
        self.block_manager.deallocate(request)


def chunk_within_images(request: Request, start: int, num_new: int) -> int:
    """How many of the `num_new` tokens from `start` a chunk of `request` computes so that it ends inside
    none of its image blocks (whose tokens must see each other, all computed in one forward): cut back to
    the block's start, 0 where the chunk would start inside that block (it waits for a step with room)."""
    end = start + num_new
    for block_start, block_end in request.image_blocks:
        if block_start < end < block_end:
            return max(0, block_start - start)
    return num_new
