"""Engine: the one thread that owns the model; submit() in, chunks out through each StreamChannel."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from engine.channel import Chunk, StreamChannel
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import BlockManager, KVCache
from engine.loader import LoadedModel
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus, SamplingParams
from engine.sampler import sample
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every step; readers never touch live state."""

    alive: bool
    num_running: int
    num_waiting: int
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
        )
        self.runner = ModelRunner(loaded.model, config.num_kv_blocks, config.block_size)
        self._inbox: queue.SimpleQueue[Request | object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopping = False
        self._fault_pending = False
        self._num_steps = 0
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._stats = self._snapshot(alive=False)

    # Event loop side (any thread).

    def start(self) -> None:
        self._thread.start()
        self._stats = self._snapshot(alive=True)

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, channel: StreamChannel
    ) -> None:
        """Queue a request without waiting; after shutdown it is ended at once with an error."""
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            channel=channel,
            detokenizer=IncrementalDetokenizer(self.token_bytes),
        )
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
        self._drain_inbox(block=False)
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
        while not self._stopping:
            self._drain_inbox(block=not self.scheduler.has_unfinished)
            if self._stopping:
                break
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - any step failure must end streams, not the engine
                logger.exception("engine step failed; ending all live requests")
                self._fail_all(f"engine step failed: {exc}")
            self._stats = self._snapshot(alive=True)

    def step(self) -> None:
        """Observe cancels, schedule, forward, sample, then push one chunk per request."""
        self._reap_cancelled()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return
        samplers, logits = self.runner.execute(plan)
        if self._fault_pending:
            self._fault_pending = False
            raise _InjectedFault("injected fault")
        token_ids = sample(samplers, logits)
        self.scheduler.postprocess(plan, {id(r): t for r, t in zip(samplers, token_ids)})
        for request, token_id in zip(samplers, token_ids):
            self._emit(request, (token_id,))
        self._num_steps += 1

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
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

    def _emit(self, request: Request, token_ids: tuple[int, ...]) -> None:
        text = request.detokenizer.decode(token_ids)
        if request.is_finished:
            text += request.detokenizer.flush()
        request.channel.push(Chunk(token_ids, text, request.finish_reason, request.error))

    def _end(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """Latch `status` and send the terminal chunk with whatever text was held back."""
        request.finish(status, error)
        request.channel.push(
            Chunk((), request.detokenizer.flush(), request.finish_reason, request.error)
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
