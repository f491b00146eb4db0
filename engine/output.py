"""OutputProcessor: a request's new tokens → the chunks its reader gets.

Detokenizes, splits off the reasoning, cuts the answer at stop strings and stop tokens, groups `stream_interval` tokens
per chunk, and puts the timings on the terminal chunk. Runs on the engine thread;
the StreamChannel carries the result across.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.channel import Outbox
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.types import Chunk, FinishReason, Timings, TokenLogprob


class OutputProcessor:
    """Turns what each step produced for a request into at most one chunk (two: see emit)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.outbox = Outbox()

    def emit(self, request: Request, token_ids: list[int], logprobs: list[TokenLogprob]) -> None:
        """Detokenize, cut at a stop string, and push once `stream_interval` tokens are pending
        or the request has finished. A burst of several tokens goes out as one chunk (two where answer text
        comes before a later reasoning's, which a chunk would show first)."""
        if (
            not request.params.stop
            and request.reasoning is None
            and not request.pending_token_ids
            and len(token_ids) >= request.params.stream_interval
            and not request.is_finished
        ):
            # Most calls of a step: a running request with nothing held back, whose tokens go out now.
            self.outbox.stage(
                request.channel,
                Chunk(tuple(token_ids), request.detokenizer.decode(token_ids), request.index, tuple(logprobs)),
            )
            return
        shown = token_ids
        if request.finish_reason == FinishReason.STOP and self.scheduler.is_stop_token(request, token_ids[-1]):
            # The stop token is counted but neither shown nor scored, like a stop string.
            shown, logprobs = token_ids[:-1], logprobs[: len(token_ids) - 1]
        split = request.reasoning
        was_answering = split is None or split.answering
        # engine/reasoning.py's Parts, unpacked (a plain tuple where there is no reasoning: every stop string's path).
        parts: Sequence[tuple[bool, list[int], int]] = (
            [(False, shown, len(shown))] if split is None else split.feed(shown)
        )
        # How many of these tokens went out already, in a chunk ahead of a later reasoning's.
        taken = 0
        matched = False
        for index, (thinking, part_ids, end) in enumerate(parts):
            if thinking:
                if any(request.pending_text):
                    # A chunk's reasoning comes before its text: answer text waiting goes out first, with
                    # the tokens before this reasoning (a harmony analysis after a preamble).
                    taken = self._release(request, token_ids, logprobs, taken, end - len(part_ids))
                request.pending_reasoning.append(request.detokenizer.decode(part_ids))
                request.num_reasoning_tokens += len(part_ids)
                continue
            if index or not was_answering:
                # A character the reasoning left unfinished is the reasoning's, not the answer's.
                request.pending_reasoning.append(request.detokenizer.flush())
            count = self._answer(request, part_ids, end)
            if count is not None:
                matched = True
                if count < len(token_ids):
                    del request.token_ids[count - len(token_ids) :]
                    token_ids, logprobs = token_ids[:count], logprobs[:count]
                    if request.is_finished:
                        # A later token of this burst finished it, but the stop string came first;
                        # nothing of this step has gone out yet, so the reason is still ours to set.
                        request.status = RequestStatus.FINISHED_STOPPED
                break
        if split is not None:
            if request.is_finished and not split.answering and not matched:
                request.pending_reasoning.append(request.detokenizer.flush())
            if split.answering and split.answer_is_final:
                request.reasoning = None
        if request.is_finished and not matched:
            text, matched = request.stop_matcher.feed(request.detokenizer.flush())
            request.pending_text += [text, "" if matched else request.stop_matcher.flush()]
        if matched:
            request.finish(RequestStatus.FINISHED_STOPPED)
            self.scheduler.free(request)
        request.pending_token_ids += token_ids[taken:] if taken else token_ids
        request.pending_logprobs += logprobs[taken:] if taken else logprobs
        if request.is_finished or len(request.pending_token_ids) >= request.params.stream_interval:
            self._push(request)

    @staticmethod
    def _answer(request: Request, token_ids: list[int], end: int) -> int | None:
        """Detokenize an answer's Part (its tokens, ending at `end` of the call's) into the pending text, cut
        at a stop string (unseen by the reasoning); returns how many of the call's tokens come up to the
        match, None without one. With stop strings, one token at a time: a match inside a burst ends it at
        that token."""
        if not request.params.stop:
            request.pending_text.append(request.detokenizer.decode(token_ids))
            return None
        # The Part's first tokens may be a header held from earlier calls: they count as none of this call's.
        first = end - len(token_ids)
        for offset, token_id in enumerate(token_ids, start=1):
            text, matched = request.stop_matcher.feed(request.detokenizer.decode([token_id]))
            request.pending_text.append(text)
            if matched:
                return max(0, first + offset)
        return None

    def _release(
        self, request: Request, token_ids: list[int], logprobs: list[TokenLogprob], taken: int, upto: int
    ) -> int:
        """Push what is pending with this call's tokens [taken, upto); returns `upto`, now taken."""
        request.pending_token_ids += token_ids[taken:upto]
        request.pending_logprobs += logprobs[taken:upto]
        self._push(request, terminal=False)
        return upto

    def flush(self) -> None:
        """Deliver every chunk staged since the last flush (once per step)."""
        self.outbox.flush()

    def end(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """Latch `status` and send the terminal chunk with whatever output was held back."""
        request.finish(status, error)
        tail = request.detokenizer.flush()
        if request.reasoning is not None and not request.reasoning.answering:
            request.pending_reasoning.append(tail)
            tail = ""
        # A harmony answer that ended its message before a later reasoning may still hold a stop string's start.
        request.pending_text += [tail, request.stop_matcher.flush()]
        self._push(request)

    def _push(self, request: Request, terminal: bool = True) -> None:
        """Send what is pending as one chunk; a finished request's (unless not `terminal`: more of its
        output follows) ends the stream and carries the timings."""
        terminal = terminal and request.is_finished
        self.outbox.stage(
            request.channel,
            Chunk(
                token_ids=tuple(request.pending_token_ids),
                text="".join(request.pending_text),
                index=request.index,
                logprobs=tuple(request.pending_logprobs),
                finish_reason=request.finish_reason if terminal else None,
                error=request.error if terminal else None,
                timings=self._timings(request) if terminal else None,
                reasoning="".join(request.pending_reasoning),
            ),
        )
        request.pending_token_ids, request.pending_text, request.pending_logprobs = [], [], []
        request.pending_reasoning = []

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
            draft_tokens=request.num_draft_tokens,
            accepted_tokens=request.num_accepted_tokens,
            cached_tokens=request.num_cached_tokens or 0,
            paused=request.was_paused,
            reasoning_tokens=request.num_reasoning_tokens,
        )
