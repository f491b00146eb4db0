"""Engine: the one thread that owns the model; submit() in, chunks out through each StreamChannel."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from engine.channel import StreamChannel
from engine.config import EngineConfig, EngineStats
from engine.future_tokens import FutureTokens
from engine.images import ImageInput
from engine.inbox import AbortAll, Inbox, Unpin
from engine.kv_window import block_manager_for
from engine.model.causal_lm import HeadOutput, PagedCausalLM
from engine.model.loader import LoadedModel
from engine.model.runner import ModelRunner
from engine.output import OutputProcessor
from engine.request import Request, RequestStatus
from engine.sampling.grammar import GrammarCompiler
from engine.sampling.masks import MaskComputer
from engine.sampling.sampler import Sampler, device_kernel
from engine.scheduler import Scheduler, StepPlan
from engine.step.forking import Choices
from engine.step.overlapped import OverlappedSteps
from engine.step.plain import Outputs, PlainStep
from engine.step.speculation import Speculation
from engine.types import SamplingParams

logger = logging.getLogger(__name__)

_SHUTDOWN_MESSAGE = "the engine is shutting down"
_EMPTY_PROMPT_MESSAGE = "the prompt has no tokens"


class Engine:
    """Continuous batching on one thread; every submitted request gets exactly one terminal chunk."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, draft_model: PagedCausalLM | None = None) -> None:
        vision = loaded.model.vision
        if vision is not None and config.max_num_batched_tokens < vision.longest_image_block:
            raise ValueError(
                f"max_num_batched_tokens={config.max_num_batched_tokens} is less than an image's "
                f"{vision.longest_image_block} tokens, which this model computes in one step (they attend to "
                "each other both ways)"
            )
        self.config = config
        self.token_bytes = loaded.token_bytes
        draft_windows = draft_model.windows if draft_model is not None else None
        self.block_manager = block_manager_for(config, loaded.model.windows, draft_windows)
        # vLLM's max_num_encoder_input_tokens, as it defaults: the step's token budget.
        encoder_budget = config.max_num_batched_tokens
        self.runner = ModelRunner(loaded.model, config.num_kv_blocks, config.block_size, encoder_budget)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_ids=loaded.eos_token_ids,
            max_unread_tokens=config.max_unread_tokens,
            pin_seconds=config.pinned_kv_seconds,
            whole_images=vision is not None and vision.bidirectional_images,
            encoder_cache=self.runner.images.cache if self.runner.images is not None else None,
            max_num_encoder_input_tokens=encoder_budget,
        )
        self.output = OutputProcessor(self.scheduler)
        self.sampler = Sampler(loaded.cpu_kernels, device_kernel(loaded.model.device))
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.model.vocab_size, loaded.eos_token_ids)
        self.masks = MaskComputer(self.grammars, loaded.model.vocab_size, loaded.model.device)
        self.inbox = Inbox()
        self.speculation = Speculation(config, self.scheduler, self.block_manager, draft_model, loaded.cpu_kernels)
        self.choices = Choices(self.token_bytes, self.grammars, self.block_manager, self.runner, self.scheduler)
        self.plain = PlainStep(
            self._forward, self.scheduler, self.sampler, self.masks, self.choices, self.speculation, config.jump_forward
        )
        # Overlapped steps, where the forward runs apart from this thread: by default on a GPU. (On a CPU
        # the forward is this thread's own work, and there is nothing to overlap it with.)
        overlap = config.overlap_steps if config.overlap_steps is not None else loaded.model.device.type == "cuda"
        self.overlap: OverlappedSteps | None = None
        if overlap:
            future = FutureTokens(config.max_num_seqs, loaded.model.device)
            self.overlap = OverlappedSteps(future, self._forward, self.scheduler, self.sampler, self.block_manager)
            self.runner.placeholders = future.buffer
        if loaded.model.device.type == "cuda":
            self.runner.capture_decode_graphs(config.max_num_seqs, config.max_model_len, config.enforce_eager)
        self._thread: threading.Thread | None = None
        self._num_steps = 0
        self._num_paused = 0
        self._pins_checked = 0.0
        self._stats = self._snapshot(alive=False)

    # Any thread.

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
        self._loop()

    def start(self) -> None:
        """run() on a new thread, returning once the engine is alive (tests and benches)."""
        running = threading.Event()
        threading.Thread(target=self.run, args=(running.set,), name="sluice-engine", daemon=True).start()
        running.wait()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        channel: StreamChannel,
        images: tuple[ImageInput, ...] = (),
    ) -> None:
        """Queue a request without waiting; after shutdown it is ended at once with an error.

        With `params.n` > 1 the channel must expect n choices; they are forked off this
        request once its prompt is prefilled. `images` are the prompt's (a vision-language model's).
        """
        request = self.choices.new_request(request_id, prompt_token_ids, params, channel, index=0, images=images)
        # A step of no tokens would fail with every request in it (servers refuse these with a 400 first).
        refusal = _EMPTY_PROMPT_MESSAGE if not prompt_token_ids else None
        if refusal is None and not self.inbox.put_request(request):
            refusal = _SHUTDOWN_MESSAGE
        if refusal is not None:
            self.output.end(request, RequestStatus.FINISHED_ERROR, refusal)
            self.output.flush()

    def abort_all(self, message: str) -> None:
        """End every request the engine holds now, at its next step, with an error chunk (drain timeout)."""
        self.inbox.put(AbortAll(message))

    def unpin(self, key: str) -> None:
        """Release the KV blocks pinned under `key` (a deleted stored conversation), at the next step."""
        self.inbox.put(Unpin(key))

    def inject_fault(self) -> None:
        """Make the next step raise (for tests of the fault path)."""
        self.inbox.inject_fault()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread and end every request it still holds with an error chunk."""
        self.inbox.close()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("engine thread did not stop within %.0f s", timeout)
        # Requests submitted before the inbox closed may still sit in it.
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
        return self._thread is not None and self._thread.is_alive() and not self.inbox.closed

    # Engine thread.

    def _loop(self) -> None:
        worked = True
        while not self.inbox.closed:
            # Idle: sleep until a request comes. Every live request paused on its reader:
            # look again soon rather than spin.
            self._drain_inbox(timeout=0 if worked else 0.005 if self.scheduler.has_unfinished else 0.5)
            if self.inbox.closed:
                break
            try:
                worked = self.step()
            except Exception as exc:  # noqa: BLE001 - any step failure must end streams, not the engine
                logger.exception("engine step failed; ending all live requests")
                if self.overlap is not None:
                    self.overlap.in_flight = None
                self._fail_all(f"engine step failed: {exc}")
            self.output.flush()
            self._stats = self._snapshot(alive=True)
            self.speculation.log_acceptance()
            self._expire_pins()

    def step(self) -> bool:
        """Observe cancels, propose, schedule, forward, sample or verify, then push at most one
        chunk per choice. Returns whether anything was computed.

        With overlapped steps (a GPU), a step of plain requests is launched and left in flight: the
        next call schedules and launches the step after it first, then streams this one's tokens."""
        self._reap_cancelled()
        overlap = self.overlap
        in_flight = overlap is not None and overlap.in_flight is not None
        if in_flight and not overlap.can_follow(self.speculation.active, self.inbox.fault_pending):
            self._emit(overlap.complete())
            in_flight = False
        proposals = self.speculation.propose() if not in_flight else {}
        plan = self.scheduler.schedule({r: p.token_ids for r, p in proposals.items()})
        self._num_paused = plan.num_paused
        if plan.is_empty:
            if in_flight:
                self._emit(overlap.complete())
            return in_flight
        if overlap is not None and overlap.takes(plan):
            self._emit(overlap.launch(plan))
        else:
            self._emit(*self.plain.run(plan, proposals))
        return True

    def _forward(self, plan: StepPlan, resolve: Callable | None) -> tuple[list[Request], HeadOutput]:
        """The step's forward, and then the one place an injected fault is raised."""
        result = self.runner.execute(plan, resolve)
        self.inbox.raise_injected_fault()
        return result

    def _emit(self, kept: list[tuple[Request, list[int]]] | None, outputs: Outputs | None = None) -> None:
        """Stream a step's kept tokens (with their logprobs from `outputs`); None: no step's tokens came back."""
        if kept is None:
            return
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
        self._num_steps += 1

    def _drain_inbox(self, timeout: float) -> None:
        """Take every queued item, waiting up to `timeout` seconds for the first (0: no wait)."""
        for item in self.inbox.take(timeout):
            if isinstance(item, Request):
                if item.params.continues:
                    # Using a stored conversation keeps its KV for another full period.
                    self.block_manager.extend_pin(
                        item.params.continues, time.monotonic() + self.config.pinned_kv_seconds
                    )
                self.scheduler.add(item)
            elif isinstance(item, AbortAll):
                self._fail_all(item.message)
            elif isinstance(item, Unpin):
                self.block_manager.unpin(item.key)

    def _expire_pins(self) -> None:
        """At most once a second: release the pins whose conversations went unused too long."""
        now = time.monotonic()
        if now >= self._pins_checked + 1.0:
            self._pins_checked = now
            self.block_manager.expire_pins(now)

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
        stats = EngineStats(
            alive=alive,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_paused=self._num_paused,
            kv_blocks_used=self.block_manager.num_used,
            kv_blocks_total=self.block_manager.num_blocks,
            num_steps=self._num_steps,
            num_preemptions=self.scheduler.num_preemptions,
            num_draft_tokens=self.speculation.num_draft_tokens,
            num_accepted_tokens=self.speculation.num_accepted_tokens,
            kv_blocks_cached=self.block_manager.num_cached,
            kv_blocks_pinned=self.block_manager.num_pinned,
            num_prefix_query_tokens=self.block_manager.num_prefix_queries,
            num_prefix_hit_tokens=self.block_manager.num_prefix_hits,
        )
        images = self.runner.images
        if images is None:
            return stats
        return replace(
            stats,
            num_image_queries=images.cache.num_queries,
            num_image_hits=images.cache.num_hits,
            vision_seconds=images.seconds,
        )
