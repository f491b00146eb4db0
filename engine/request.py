"""Engine-side request state: counters, status and the latched finish reason."""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from engine.reasoning import ChannelSplit, ReasoningSplit, split_of
from engine.sampling.draws import request_key
from engine.types import FinishReason, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from engine.channel import StreamChannel
    from engine.detokenizer import IncrementalDetokenizer, StopMatcher
    from engine.images import ImageInput
    from engine.rope_positions import RopePositions
    from engine.sampling.grammar import Constraint


class RequestStatus(IntEnum):
    """Ordered: every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_CANCELLED = 5
    FINISHED_ERROR = 6
    FINISHED_REJECTED = 7


# Every status after this one is a finished one. Request.is_finished compares with it directly: it is
# asked several times per request per step, and a property on the enum (its attribute lookups) cost
# 5x the compare.
_LAST_UNFINISHED = RequestStatus.PREEMPTED

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_CANCELLED: FinishReason.CANCELLED,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_REJECTED: FinishReason.REJECTED,
}


@dataclass(eq=False)
class Request:
    """One generation; owned by the engine thread from submit() until its terminal chunk."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    channel: StreamChannel
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopMatcher
    # Which of the n choices this is; choices of one request share the channel.
    index: int = 0
    # The prompt's images, by position (a vision-language model's): their embeddings fill their tokens'.
    images: tuple[ImageInput, ...] = ()
    # Where a model's image tokens attend to each other both ways (Gemma 3): the prompt ranges [start, end)
    # that do (engine/images.py image_blocks). The scheduler never ends a chunk inside one, so each is
    # computed seeing all of itself; empty for every other model.
    image_blocks: tuple[tuple[int, int], ...] = ()
    # Where a model rotates tokens by their place in their image's grid (M-RoPE: Qwen2.5-VL) and the prompt has
    # images: each token's rotary positions (engine/rope_positions.py). None: its index.
    rope_positions: RopePositions | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Prompt followed by every sampled token; what the KV cache must eventually hold.
    token_ids: list[int] = field(init=False)
    # Tokens whose K/V are in the cache; prefill, chunked prefill and decode all advance it.
    num_computed_tokens: int = 0
    # An array rather than a list: every step copies each decode's table into the forward's inputs,
    # and an array's is copied whole where a list's ints are converted one at a time (at 256 streams
    # of 2,000-token contexts, 1.2 ms a step against 0.03).
    block_table: array = field(default_factory=lambda: array("q"))
    # Where every layer slides a window (engine/kv_window.py): the first this many entries of block_table
    # were handed back, no future query reading their keys; each names the first block still held.
    num_released_blocks: int = 0
    # Prefix caching: hashes of the full blocks of token_ids so far, how many of the request's
    # blocks are registered in the cache, and how many prompt tokens the cache held at admission.
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    # An error message, set only with FINISHED_ERROR.
    error: str | None = None
    # Keys this choice's random draws (engine/sampling/draws.py): from the seed, or random without one.
    rng_key: int = field(init=False, default=0)
    # Choices still to be forked off this one once its prompt is prefilled (n > 1).
    num_pending_forks: int = field(init=False, default=0)
    # Output produced but not yet pushed (stream_interval > 1, or held for a stop string).
    pending_token_ids: list[int] = field(default_factory=list)
    pending_text: list[str] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_reasoning: list[str] = field(default_factory=list)
    # Where the output stands against its reasoning while that may still go on; None once the answer
    # has begun (or for a request without reasoning), so later steps take the plain path.
    reasoning: ReasoningSplit | ChannelSplit | None = field(init=False, default=None)
    num_reasoning_tokens: int = 0
    # Speculative decoding: tokens proposed for and accepted by this request so far.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Tokens whose K/V the draft model holds (its cache shares this request's block table).
    num_draft_computed: int = 0
    # Whether the scheduler ever paused this request for its reader (back-pressure).
    was_paused: bool = False
    # Where this choice stands in params.grammar; None for free text.
    constraint: Constraint | None = None
    # Overlapped steps (engine/future_tokens.py): how many of token_ids' last entries are placeholders for
    # tokens still on the device, and whether this request may take part at all: its sampling reads
    # nothing of its output on the host (no grammar, penalties or logprobs) and it forks no choices.
    num_pending: int = field(init=False, default=0)
    overlappable: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.index == 0:
            self.num_pending_forks = self.params.n - 1
        if not self.params.greedy:
            # Each choice of a seeded request gets its own reproducible draws.
            self.rng_key = request_key(self.params.seed, self.index)
        params = self.params
        if params.reasoning is not None:
            self.reasoning = split_of(params.reasoning)
        self.overlappable = (
            self.constraint is None and not params.penalized and params.logprobs is None and params.n == 1
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status > _LAST_UNFINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def finish(self, status: RequestStatus, error: str | None = None) -> bool:
        """Latch a finished status; the first writer wins and later calls change nothing."""
        if self.is_finished:
            return False
        self.status = status
        self.error = error
        return True
