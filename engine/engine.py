"""Engine: the one thread that owns the model; submit() in, chunks out through each StreamChannel."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from engine.channel import StreamChannel
from engine.detokenizer import IncrementalDetokenizer, StopMatcher
from engine.future_tokens import FutureTokens, InFlightStep
from engine.kv_cache import BlockManager
from engine.model.causal_lm import HeadOutput, PagedCausalLM
from engine.model.graphs import run_eagerly
from engine.model.loader import LoadedModel
from engine.model.runner import ModelRunner
from engine.output import OutputProcessor
from engine.request import Request, RequestStatus
from engine.sampling.grammar import GrammarCompiler
from engine.sampling.masks import MaskComputer, StepMasks
from engine.sampling.sampler import Sampler, device_kernel
from engine.sampling.speculative import DraftProposer, NgramProposer, Proposal, Proposer, verify
from engine.scheduler import Scheduler, StepPlan
from engine.types import SamplingParams, TokenLogprob

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: Literal["ngram", "draft"]
    num_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    # Above this many running requests the engine stops speculating: verification costs
    # compute a large batch does not have to spare.
    max_batch_size: int = 4


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    # A request whose reader is this many tokens behind is paused until it catches up.
    max_unread_tokens: int = 256
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None
    # Constrained requests append the tokens their grammar forces without sampling them.
    jump_forward: bool = True
    # Stored conversations: how long a finished turn's KV stays pinned after its last use, and
    # the most of the pool pins may hold (the oldest pin goes first past it).
    pinned_kv_seconds: float = 300.0
    max_pinned_kv_fraction: float = 0.25
    # On a GPU, run decode steps eagerly instead of replaying CUDA graphs captured at start-up (still
    # padded to the graphs' batch buckets, so they compute what the graphs would).
    enforce_eager: bool = False


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every step; readers never touch live state."""

    alive: bool
    num_running: int
    num_waiting: int
    num_paused: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_steps: int
    num_preemptions: int
    num_draft_tokens: int
    num_accepted_tokens: int
    kv_blocks_cached: int
    # Blocks held for stored conversations (counted in kv_blocks_used too).
    kv_blocks_pinned: int
    # Prompt tokens looked up in the prefix cache, and how many it held.
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int


class _InjectedFault(RuntimeError):
    pass


_FAULT = object()


@dataclass(frozen=True)
class _AbortAll:
    message: str


@dataclass(frozen=True)
class _Unpin:
    key: str


_SHUTDOWN_MESSAGE = "the engine is shutting down"
_NO_TOKENS_FOR_GRAMMAR = (
    "the output's grammar cannot be followed with this model's tokens: it asks for text (a character or byte) "
    "that no token of the model's vocabulary can write"
)


class Engine:
    """Continuous batching on one thread; every submitted request gets exactly one terminal chunk."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, draft_model: PagedCausalLM | None = None) -> None:
        self.config = config
        self.token_bytes = loaded.token_bytes
        self.block_manager = BlockManager(
            config.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            max_pinned_blocks=int(config.num_kv_blocks * config.max_pinned_kv_fraction),
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_ids=loaded.eos_token_ids,
            max_unread_tokens=config.max_unread_tokens,
            pin_seconds=config.pinned_kv_seconds,
        )
        self.output = OutputProcessor(self.scheduler)
        self.runner = ModelRunner(loaded.model, config.num_kv_blocks, config.block_size)
        # Overlapped steps, where the forward runs apart from this thread: on a GPU. (On a CPU the
        # forward is this thread's own work, and there is nothing to overlap it with.)
        on_gpu = loaded.model.device.type == "cuda"
        self.future = FutureTokens(config.max_num_seqs, loaded.model.device) if on_gpu else None
        self._in_flight: InFlightStep | None = None
        if on_gpu:
            self.runner.placeholders = self.future.buffer
            self._capture_graphs()
        self.sampler = Sampler(loaded.cpu_kernels, device_kernel(loaded.model.device))
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.model.vocab_size, loaded.eos_token_ids)
        self.masks = MaskComputer(self.grammars, loaded.model.vocab_size, loaded.model.device)
        self._inbox: queue.SimpleQueue[Request | object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopping = False
        self._fault_pending = False
        self._num_steps = 0
        self._num_paused = 0
        self._num_draft_tokens = 0
        self._num_accepted_tokens = 0
        self._pins_checked = 0.0
        # (time, draft tokens, accepted tokens) at the last acceptance log line.
        self._acceptance_logged = (time.monotonic(), 0, 0)
        self.proposer: Proposer | None = None
        if config.speculative is not None and config.speculative.method == "ngram":
            self.proposer = NgramProposer(config.speculative.ngram_min, config.speculative.ngram_max)
        elif config.speculative is not None:
            if draft_model is None:
                raise ValueError("speculative method 'draft' needs a draft model")
            self.proposer = DraftProposer(draft_model, self.block_manager, config.num_kv_blocks, config.block_size)
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._stats = self._snapshot(alive=False)

    def _capture_graphs(self) -> None:
        eager = self.config.enforce_eager
        try:
            captured = self.runner.capture_decode_graphs(
                self.config.max_num_seqs, self.config.max_model_len, capture=run_eagerly if eager else None
            )
        except Exception as exc:
            if eager:
                raise
            raise RuntimeError(
                "capturing the decode steps as CUDA graphs failed; --enforce-eager runs without them"
            ) from exc
        if captured and eager:
            logger.info("CUDA graphs off (--enforce-eager): decode steps run eagerly, padded to the graphs' buckets")
        elif not captured:
            logger.info(
                "CUDA graphs off: they need the Triton paged decode kernel (a cache block of 16 or more) and no int4"
            )

    # Event loop side (any thread).

    def start(self) -> None:
        """Run the engine loop on a new thread."""
        self._thread.start()
        self._stats = self._snapshot(alive=True)

    def run(self, on_running: Callable[[], None] | None = None) -> None:
        """Run the engine loop on the calling thread until shutdown(); `on_running` is called
        once the engine counts as alive.

        Call it on the thread that built the model: torch's OpenMP workers belong to the
        thread that first ran a parallel op, and a second thread running the forward
        competes with them (measured here: a decode step takes 1.4x as long).
        """
        self._thread = threading.current_thread()
        self._stats = self._snapshot(alive=True)
        if on_running is not None:
            on_running()
        self._run()

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, channel: StreamChannel
    ) -> None:
        """Queue a request without waiting; after shutdown it is ended at once with an error.

        With `params.n` > 1 the channel must expect n choices; they are forked off this
        request once its prompt is prefilled.
        """
        request = self._new_request(request_id, prompt_token_ids, params, channel, index=0)
        with self._lock:
            if not self._stopping:
                self._inbox.put(request)
                return
        self.output.end(request, RequestStatus.FINISHED_ERROR, _SHUTDOWN_MESSAGE)
        self.output.flush()

    def abort_all(self, message: str) -> None:
        """End every request the engine holds now, at its next step, with an error chunk (drain timeout)."""
        self._inbox.put(_AbortAll(message))

    def unpin(self, key: str) -> None:
        """Release the KV blocks pinned under `key` (a deleted stored conversation), at the next step."""
        self._inbox.put(_Unpin(key))

    def inject_fault(self) -> None:
        """Make the next step raise (for tests of the fault path)."""
        self._inbox.put(_FAULT)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread and end every request it still holds with an error chunk."""
        with self._lock:
            self._stopping = True
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("engine thread did not stop within %.0f s", timeout)
        # Requests submitted before _stopping was set may still sit in the inbox.
        self._drain_inbox(timeout=0)
        self._fail_all(_SHUTDOWN_MESSAGE)
        self.output.flush()
        self.masks.shutdown()
        self._stats = self._snapshot(alive=False)

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # Engine thread.

    def _run(self) -> None:
        worked = True
        while not self._stopping:
            # Idle: sleep until a request comes. Every live request paused on its reader:
            # look again soon rather than spin.
            self._drain_inbox(timeout=0 if worked else 0.005 if self.scheduler.has_unfinished else 0.5)
            if self._stopping:
                break
            try:
                worked = self.step()
            except Exception as exc:  # noqa: BLE001 - any step failure must end streams, not the engine
                logger.exception("engine step failed; ending all live requests")
                self._in_flight = None
                self._fail_all(f"engine step failed: {exc}")
            self.output.flush()
            self._stats = self._snapshot(alive=True)
            self._log_acceptance()
            self._expire_pins()

    def _expire_pins(self) -> None:
        """At most once a second: release the pins whose conversations went unused too long."""
        now = time.monotonic()
        if now >= self._pins_checked + 1.0:
            self._pins_checked = now
            self.block_manager.expire_pins(now)

    def _log_acceptance(self) -> None:
        """Every 30 s of speculation, log what fraction of proposed tokens the target accepted."""
        now = time.monotonic()
        if now - self._acceptance_logged[0] < 30 or self._num_draft_tokens == self._acceptance_logged[1]:
            return
        proposed = self._num_draft_tokens - self._acceptance_logged[1]
        accepted = self._num_accepted_tokens - self._acceptance_logged[2]
        logger.info(
            "speculative decoding: %d of %d proposed tokens accepted (%.0f%%)",
            accepted,
            proposed,
            100 * accepted / proposed,
        )
        self._acceptance_logged = (now, self._num_draft_tokens, self._num_accepted_tokens)

    def step(self) -> bool:
        """Observe cancels, propose, schedule, forward, sample or verify, then push at most one
        chunk per choice. Returns whether anything was computed.

        With overlapped steps (a GPU), a step of plain requests is launched and left in flight: the
        next call schedules and launches the step after it first, then streams this one's tokens."""
        self._reap_cancelled()
        if self._in_flight is not None and not self._can_overlap():
            self._complete(self._in_flight)
        proposals = self._propose() if self._in_flight is None else {}
        plan = self.scheduler.schedule({key: p.token_ids for key, p in proposals.items()})
        self._num_paused = plan.num_paused
        if plan.is_empty:
            if self._in_flight is None:
                return False
            self._complete(self._in_flight)
            return True
        # With a step in flight, _can_overlap() has found every running request plain and nobody proposed for.
        if self.future is not None and (
            self._in_flight is not None or (not plan.proposals and all(r.overlappable for r, _ in plan.scheduled))
        ):
            self._launch(plan)
            return True
        pending_masks = self._start_masks(plan)
        try:
            samplers, head = self.runner.execute(plan)
        finally:
            # Never leave the worker holding matchers this thread is about to advance.
            masks = pending_masks.result() if pending_masks is not None else None
        if self._fault_pending:
            self._fault_pending = False
            raise _InjectedFault("injected fault")
        samplers, row_starts = self._fork_choices(plan, samplers, masks)
        outputs = self._sample(plan, proposals, samplers, row_starts, head, masks)
        forced = self._advance_constraints(samplers, outputs)
        kept = self.scheduler.postprocess(plan, {key: tokens for key, (tokens, _) in outputs.items()}, forced)
        self._emit(kept, outputs)
        self._num_steps += 1
        return True

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the step in flight hands its tokens back: it
        admits and preempts no one (both read or reset whole requests, placeholders included: nobody
        waits, and the pool holds every block the running requests could ask for), speculates for no
        one (proposals read the output), and every running request is plain."""
        scheduler, spec, blocks = self.scheduler, self.config.speculative, self.block_manager
        running = scheduler.running
        if scheduler.waiting or self._fault_pending:
            return False
        if self.proposer is not None and spec is not None and len(running) <= spec.max_batch_size:
            return False
        needed = 0
        for request in running:
            if not request.overlappable:
                return False
            remaining = len(request.token_ids) - request.num_computed_tokens
            needed += 1 if remaining <= 1 else blocks.num_blocks_needed(request, remaining)
        return blocks.can_allocate(needed)

    def _launch(self, plan: StepPlan) -> None:
        """Run a step of plain requests without waiting for its tokens: each sampler gets a placeholder,
        and the step launched before it (if any) is completed once this one is on its way."""
        future = self.future
        samplers, head = self.runner.execute(plan, future.resolve if self._in_flight is not None else None)
        if self._fault_pending:
            self._fault_pending = False
            raise _InjectedFault("injected fault")
        tokens = self.sampler.tokens(samplers, head.logits, block_max=head.block_max)
        self.scheduler.launched(plan)
        positions = [request.num_tokens for request in samplers]
        for request, placeholder in zip(samplers, future.publish(tokens)):
            request.token_ids.append(placeholder)
            request.num_pending += 1
        host_tokens, ready = future.to_host(tokens)
        previous, self._in_flight = self._in_flight, InFlightStep(plan, samplers, positions, host_tokens, ready)
        if previous is not None:
            self._complete(previous)

    def _complete(self, step: InFlightStep) -> None:
        """Take a launched step's tokens off the device and stream them."""
        if step is self._in_flight:
            self._in_flight = None
        kept = self.scheduler.complete(step.plan, step.samplers, step.positions, self.future.read(step))
        self._emit(kept, None)
        self._num_steps += 1

    def _emit(
        self, kept: list[tuple[Request, list[int]]], outputs: dict[Request, tuple[list[int], list]] | None
    ) -> None:
        now = time.monotonic()
        for request, token_ids in kept:
            if request.first_token_time is None:
                request.first_token_time = now
            if request.channel.cancelled:
                # Cancelled while the step ran: none of this burst goes out.
                self.scheduler.free(request)
                self.output.end(request, RequestStatus.FINISHED_CANCELLED)
                continue
            self.output.emit(request, token_ids, outputs[request][1][: len(token_ids)] if outputs else [])

    def _propose(self) -> dict[Request, Proposal]:
        """Proposals for running decodes, by request; none above the batch-size cut-off."""
        spec = self.config.speculative
        if self.proposer is None or spec is None or len(self.scheduler.running) > spec.max_batch_size:
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

    def _start_masks(self, plan: StepPlan) -> Future[StepMasks] | None:
        """Start the masks of the constrained requests that sample this step (they depend only on
        tokens already kept, so they are computed while the forward runs)."""
        jobs = [
            (request, plan.proposals.get(request, []))
            for request, num_new in plan.scheduled
            if request.constraint is not None
            and (request in plan.proposals or request.num_computed_tokens + num_new == request.num_tokens)
        ]
        return self.masks.start(jobs) if jobs else None

    def _advance_constraints(
        self, samplers: list[Request], outputs: dict[Request, tuple[list[int], list[TokenLogprob]]]
    ) -> dict[Request, int]:
        """Move each constrained request's grammar past its new tokens, then append the tokens the
        grammar forces next (jump-forward). Returns how many were appended, by request."""
        forced: dict[Request, int] = {}
        for request in samplers:
            if request.constraint is None:
                continue
            token_ids = outputs[request][0]
            if not request.constraint.advance(token_ids):
                # The masks come from the grammar, so a token they allowed that it then refuses means the
                # grammar wants text no token of this vocabulary holds (llguidance allows a wrong token
                # there rather than none): e.g. a character whose first byte has no token of its own.
                request.finish(RequestStatus.FINISHED_REJECTED, _NO_TOKENS_FOR_GRAMMAR)
                continue
            # Forced tokens have no logprobs of their own, so a request that asked for them samples every token.
            if not self.config.jump_forward or request.params.logprobs is not None or request.constraint.done:
                continue
            if extra := request.constraint.forced():
                # Forced bytes no token holds come back as other tokens (or none), which the grammar refuses.
                if not request.constraint.advance(extra):
                    request.finish(RequestStatus.FINISHED_REJECTED, _NO_TOKENS_FOR_GRAMMAR)
                    continue
                token_ids.extend(extra)
                forced[request] = len(extra)
        return forced

    def _sample(
        self,
        plan: StepPlan,
        proposals: dict[Request, Proposal],
        samplers: list[Request],
        row_starts: list[int],
        head: HeadOutput,
        masks: StepMasks | None,
    ) -> dict[Request, tuple[list[int], list[TokenLogprob]]]:
        """Tokens (and logprobs) for every sampling request: one sampled, or verified proposals."""
        outputs: dict[Request, tuple[list[int], list[TokenLogprob]]] = {}
        logits, block_max = head.logits, head.block_max
        plain = [i for i, r in enumerate(samplers) if r not in plan.proposals]
        if plain:
            requests = [samplers[i] for i in plain]
            starts = [row_starts[i] for i in plain]
            # Rows are already in order when no request verifies proposals: no gather copy.
            if starts != list(range(logits.shape[0])):
                logits = logits[starts]
                block_max = block_max[starts] if block_max is not None else None
            mask = masks.for_rows(requests, [0] * len(requests)) if masks is not None else None
            sampled = self.sampler.sample(requests, logits, mask, block_max)
            for request, token_id, logprob in zip(requests, sampled.token_ids, sampled.logprobs):
                outputs[request] = ([token_id], [logprob] if logprob else [])
        verifying = [i for i, r in enumerate(samplers) if r in plan.proposals]
        if verifying:
            requests = [samplers[i] for i in verifying]
            trimmed = [_trim(proposals[r], len(plan.proposals[r])) for r in requests]
            rows = [
                row
                for i, p in zip(verifying, trimmed)
                for row in range(row_starts[i], row_starts[i] + len(p.token_ids) + 1)
            ]
            mask = None
            if masks is not None:
                mask = masks.for_rows(
                    [r for r, p in zip(requests, trimmed) for _ in range(len(p.token_ids) + 1)],
                    [offset for p in trimmed for offset in range(len(p.token_ids) + 1)],
                )
            verified = verify(requests, trimmed, head.logits[rows], mask)
            for request, proposal, result in zip(requests, trimmed, verified):
                request.num_draft_tokens += len(proposal.token_ids)
                request.num_accepted_tokens += result.num_accepted
                self._num_draft_tokens += len(proposal.token_ids)
                self._num_accepted_tokens += result.num_accepted
                outputs[request] = (result.token_ids, result.logprobs)
        return outputs

    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, channel: StreamChannel, index: int
    ) -> Request:
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            channel=channel,
            detokenizer=IncrementalDetokenizer(self.token_bytes),
            stop_matcher=StopMatcher(params.stop),
            index=index,
            # Choices forked later copy the first choice's state instead.
            constraint=self.grammars.constraint(params.grammar) if params.grammar and index == 0 else None,
        )

    def _fork_choices(
        self, plan: StepPlan, samplers: list[Request], masks: StepMasks | None
    ) -> tuple[list[Request], list[int]]:
        """Fork the other n-1 choices off each request whose prompt just finished prefilling.

        They share its full KV blocks, get copies of its last partial one and sample
        their first token from its logits row. A choice that finds no free block
        waits and prefills the prompt itself. Returns every sampling request with the
        first logits row it reads.
        """
        row_starts, row = [], 0
        for request in samplers:
            row_starts.append(row)
            row += 1 + len(plan.proposals.get(request, ()))
        num_new = {r: n for r, n in plan.scheduled}
        for parent, parent_row in list(zip(samplers, row_starts)):
            if not parent.num_pending_forks:
                continue
            parent.num_pending_forks = 0
            for index in range(1, parent.params.n):
                child = self._new_request(
                    parent.request_id, parent.prompt_token_ids, parent.params, parent.channel, index
                )
                child.arrival_time, child.first_scheduled_time = parent.arrival_time, parent.first_scheduled_time
                if parent.constraint is not None:
                    # Every choice keeps its own grammar state, starting where the parent's is now.
                    child.constraint = parent.constraint.copy()
                    if masks is not None:
                        masks.share(child, parent)
                copies = self.block_manager.fork(parent, child, parent.num_tokens)
                if copies is not None:
                    self.runner.copy_blocks(copies)
                    child.num_computed_tokens = parent.num_computed_tokens
                    plan.scheduled.append((child, num_new[parent]))
                    samplers.append(child)
                    row_starts.append(parent_row)
                self.scheduler.add_fork(parent, child)
        return samplers, row_starts

    def _drain_inbox(self, timeout: float) -> None:
        """Take every queued item, waiting up to `timeout` seconds for the first (0: no wait)."""
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
            while True:
                if item is _FAULT:
                    self._fault_pending = True
                elif isinstance(item, _AbortAll):
                    self._fail_all(item.message)
                elif isinstance(item, _Unpin):
                    self.block_manager.unpin(item.key)
                elif isinstance(item, Request):
                    if item.params.continues:
                        # Using a stored conversation keeps its KV for another full period.
                        self.block_manager.extend_pin(
                            item.params.continues, time.monotonic() + self.config.pinned_kv_seconds
                        )
                    self.scheduler.add(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _reap_cancelled(self) -> None:
        for request in self.scheduler.requests():
            if request.channel.cancelled:
                self.scheduler.free(request)
                self.output.end(request, RequestStatus.FINISHED_CANCELLED)

    def _fail_all(self, message: str) -> None:
        """End every request the scheduler holds with an error and free its KV blocks."""
        for request in self.scheduler.requests():
            self.scheduler.free(request)
            self.output.end(request, RequestStatus.FINISHED_ERROR, message)

    def _snapshot(self, alive: bool) -> EngineStats:
        return EngineStats(
            alive=alive,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_paused=self._num_paused,
            kv_blocks_used=self.block_manager.num_used,
            kv_blocks_total=self.block_manager.num_blocks,
            num_steps=self._num_steps,
            num_preemptions=self.scheduler.num_preemptions,
            num_draft_tokens=self._num_draft_tokens,
            num_accepted_tokens=self._num_accepted_tokens,
            kv_blocks_cached=self.block_manager.num_cached,
            kv_blocks_pinned=self.block_manager.num_pinned,
            num_prefix_query_tokens=self.block_manager.num_prefix_queries,
            num_prefix_hit_tokens=self.block_manager.num_prefix_hits,
        )


def _trim(proposal: Proposal, length: int) -> Proposal:
    """The first `length` proposed tokens (the scheduler may have had budget for fewer)."""
    if length == len(proposal.token_ids):
        return proposal
    probs = proposal.draft_probs[:length] if proposal.draft_probs is not None else None
    return Proposal(proposal.token_ids[:length], probs)
