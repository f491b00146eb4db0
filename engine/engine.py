"""Engine: the one thread that owns the model; submit() in, chunks out through each StreamChannel."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from engine.channel import Chunk, StreamChannel, Timings
from engine.detokenizer import IncrementalDetokenizer, StopMatcher
from engine.kv_cache import BlockManager, KVCache
from engine.loader import LoadedModel
from engine.model_runner import ModelRunner
from engine.request import FinishReason, Request, RequestStatus, SamplingParams
from engine.sampler import TokenLogprob, sample
from engine.scheduler import Scheduler, StepPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    # A request whose reader is this many tokens behind is paused until it catches up.
    max_unread_tokens: int = 256


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


class _InjectedFault(RuntimeError):
    pass


_FAULT = object()
_SHUTDOWN_MESSAGE = "the engine is shutting down"


class Engine:
    """Continuous batching on one thread; every submitted request gets exactly one terminal chunk."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.token_bytes = loaded.token_bytes
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_ids=loaded.eos_token_ids,
            max_unread_tokens=config.max_unread_tokens,
        )
        self.runner = ModelRunner(loaded.model, config.num_kv_blocks, config.block_size)
        self._inbox: queue.SimpleQueue[Request | object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopping = False
        self._fault_pending = False
        self._num_steps = 0
        self._num_paused = 0
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._stats = self._snapshot(alive=False)

    # Event loop side (any thread).

    def start(self) -> None:
        self._thread.start()
        self._stats = self._snapshot(alive=True)

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
        self._end(request, RequestStatus.FINISHED_ERROR, _SHUTDOWN_MESSAGE)

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
                self._fail_all(f"engine step failed: {exc}")
            self._stats = self._snapshot(alive=True)

    def step(self) -> bool:
        """Observe cancels, schedule, forward, sample, then push at most one chunk per choice.

        Returns whether anything was computed.
        """
        self._reap_cancelled()
        plan = self.scheduler.schedule()
        self._num_paused = plan.num_paused
        if plan.is_empty:
            return False
        samplers, logits = self.runner.execute(plan)
        if self._fault_pending:
            self._fault_pending = False
            raise _InjectedFault("injected fault")
        samplers, logits = self._fork_choices(plan, samplers, logits)
        output = sample(samplers, logits)
        logprobs = {id(r): lp for r, lp in zip(samplers, output.logprobs)}
        kept = self.scheduler.postprocess(plan, {id(r): [t] for r, t in zip(samplers, output.token_ids)})
        now = time.monotonic()
        for request, token_ids in kept:
            if request.first_token_time is None:
                request.first_token_time = now
            token_logprob = logprobs[id(request)]
            self._emit(request, token_ids, [token_logprob] if token_logprob else [])
        self._num_steps += 1
        return True

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
        )

    def _fork_choices(
        self, plan: StepPlan, samplers: list[Request], logits: torch.Tensor
    ) -> tuple[list[Request], torch.Tensor]:
        """Fork the other n-1 choices off each request whose prompt just finished prefilling.

        They share its full KV blocks, get copies of its last partial one and sample
        their first token from its logits row. A choice that finds no free block
        waits and prefills the prompt itself.
        """
        rows = list(range(len(samplers)))
        num_new = {id(r): n for r, n in plan.scheduled}
        for row, parent in enumerate(list(samplers)):
            if not parent.num_pending_forks:
                continue
            parent.num_pending_forks = 0
            for index in range(1, parent.params.n):
                child = self._new_request(
                    parent.request_id, parent.prompt_token_ids, parent.params, parent.channel, index
                )
                child.arrival_time, child.first_scheduled_time = parent.arrival_time, parent.first_scheduled_time
                copies = self.block_manager.fork(parent, child, parent.num_tokens)
                if copies is not None:
                    self.runner.copy_blocks(copies)
                    child.num_computed_tokens = parent.num_computed_tokens
                    plan.scheduled.append((child, num_new[id(parent)]))
                    samplers.append(child)
                    rows.append(row)
                self.scheduler.add_fork(parent, child)
        if len(rows) == len(samplers) and len(rows) == logits.shape[0]:
            return samplers, logits
        return samplers, logits[rows]

    def _drain_inbox(self, timeout: float) -> None:
        """Take every queued item, waiting up to `timeout` seconds for the first (0: no wait)."""
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
            while True:
                if item is _FAULT:
                    self._fault_pending = True
                elif isinstance(item, Request):
                    self.scheduler.add(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _reap_cancelled(self) -> None:
        for request in self.scheduler.requests():
            if request.channel.cancelled:
                self.scheduler.free(request)
                self._end(request, RequestStatus.FINISHED_CANCELLED)

    def _emit(self, request: Request, token_ids: list[int], logprobs: list[TokenLogprob]) -> None:
        """Detokenize, cut at a stop string, and push once `stream_interval` tokens are pending
        or the request has finished."""
        visible = token_ids
        if request.finish_reason == FinishReason.STOP and self.scheduler.is_stop_token(request, token_ids[-1]):
            # The stop token is counted but neither shown nor scored, like a stop string.
            visible, logprobs = token_ids[:-1], logprobs[: len(token_ids) - 1]
        text = request.detokenizer.decode(visible)
        if request.is_finished:
            text += request.detokenizer.flush()
        released, matched = request.stop_matcher.feed(text)
        if matched and request.finish(RequestStatus.FINISHED_STOPPED):
            self.scheduler.free(request)
        elif request.is_finished:
            released += request.stop_matcher.flush()
        request.pending_token_ids += token_ids
        request.pending_text.append(released)
        request.pending_logprobs += logprobs
        if request.is_finished or len(request.pending_token_ids) >= request.params.stream_interval:
            self._push(request)

    def _end(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """Latch `status` and send the terminal chunk with whatever output was held back."""
        request.finish(status, error)
        request.pending_text += [request.detokenizer.flush(), request.stop_matcher.flush()]
        self._push(request)

    def _push(self, request: Request) -> None:
        """Send what is pending as one chunk; the terminal one carries the timings."""
        request.channel.push(
            Chunk(
                token_ids=tuple(request.pending_token_ids),
                text="".join(request.pending_text),
                index=request.index,
                logprobs=tuple(request.pending_logprobs),
                finish_reason=request.finish_reason,
                error=request.error,
                timings=self._timings(request) if request.is_finished else None,
            )
        )
        request.pending_token_ids, request.pending_text, request.pending_logprobs = [], [], []

    @staticmethod
    def _timings(request: Request) -> Timings:
        now = time.monotonic()
        scheduled = request.first_scheduled_time or now
        first_token = request.first_token_time or now
        return Timings(
            queue_ms=(scheduled - request.arrival_time) * 1000,
            prompt_ms=(first_token - scheduled) * 1000,
            ttft_ms=(first_token - request.arrival_time) * 1000,
            decode_ms=(now - first_token) * 1000,
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_output_tokens,
        )

    def _fail_all(self, message: str) -> None:
        """End every request the scheduler holds with an error and free its KV blocks."""
        for request in self.scheduler.requests():
            self.scheduler.free(request)
            self._end(request, RequestStatus.FINISHED_ERROR, message)

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
        )


def num_kv_blocks_for(memory_gib: float, loaded: LoadedModel, block_size: int) -> int:
    """How many blocks of `block_size` tokens fit in `memory_gib` for this model's K/V."""
    model = loaded.model
    per_token = KVCache.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype)
    return max(1, int(memory_gib * 2**30) // (per_token * block_size))
