"""OutputProcessor: a request's new tokens → the chunks its reader gets.

Detokenizes, splits off the reasoning, cuts the answer at stop strings and stop tokens, groups `stream_interval` tokens
per chunk, and puts the timings on the terminal chunk. Runs on the engine thread;
the StreamChannel carries the result across.
"""

from __future__ import annotations

import time

from engine.channel import Outbox
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.types import Chunk, FinishReason, Timings, TokenLogprob


class OutputProcessor:
    """Turns what each step produced for a request into at most one chunk."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.outbox = Outbox()

    def emit(self, request: Request, token_ids: list[int], logprobs: list[TokenLogprob]) -> None:
        """Detokenize, cut at a stop string, and push once `stream_interval` tokens are pending
        or the request has finished. A burst of several tokens goes out as one chunk."""
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
        thought, held = 0, []
        if request.reasoning is not None:
            held, answer = self._think(request, shown)
            thought, shown = len(shown) - len(answer), answer
        # With stop strings, one token at a time: a match inside a burst ends it at that token. Answer
        # tokens the reasoning held from earlier steps come first, as one piece.
        pieces = [[t] for t in shown] if request.params.stop else [shown]
        if held:
            pieces.insert(0, held)
        released, matched = [], False
        for count, piece in enumerate(pieces, start=thought + 1 - bool(held)):
            text, matched = request.stop_matcher.feed(request.detokenizer.decode(piece))
            released.append(text)
            if matched:
                if count < len(token_ids):
                    del request.token_ids[count - len(token_ids) :]
                    token_ids, logprobs = token_ids[:count], logprobs[:count]
                    if request.is_finished:
                        # A later token of this burst finished it, but the stop string came first;
                        # nothing of this step has gone out yet, so the reason is still ours to set.
                        request.status = RequestStatus.FINISHED_STOPPED
                break
        if request.is_finished and not matched:
            text, matched = request.stop_matcher.feed(request.detokenizer.flush())
            released += [text, "" if matched else request.stop_matcher.flush()]
        if matched:
            request.finish(RequestStatus.FINISHED_STOPPED)
            self.scheduler.free(request)
        request.pending_token_ids += token_ids
        request.pending_text += released
        request.pending_logprobs += logprobs
        if request.is_finished or len(request.pending_token_ids) >= request.params.stream_interval:
            self._push(request)

    def _think(self, request: Request, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Take the reasoning's part of these tokens (they lead the list) into its own text, unseen by
        stop strings; returns the answer's tokens: those the reasoning held from earlier steps (a harmony
        header's), and these tokens' last ones. The tags' text is not shown."""
        split = request.reasoning
        was_answering = split.answering
        thinking, held, answer = split.feed(token_ids)
        text = request.detokenizer.decode(thinking) if thinking else ""
        if not was_answering and (split.answering or request.is_finished):
            # A character the reasoning left unfinished is the reasoning's, not the answer's (whose own
            # unfinished one, in a harmony answer that goes on, stays in the decoder).
            text += request.detokenizer.flush()
        if split.answering and split.answer_is_final:
            request.reasoning = None
        request.pending_reasoning.append(text)
        request.num_reasoning_tokens += len(thinking)
        return held, answer

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

    def _push(self, request: Request) -> None:
        """Send what is pending as one chunk; the terminal one carries the timings."""
        self.outbox.stage(
            request.channel,
            Chunk(
                token_ids=tuple(request.pending_token_ids),
                text="".join(request.pending_text),
                index=request.index,
                logprobs=tuple(request.pending_logprobs),
                finish_reason=request.finish_reason,
                error=request.error,
                timings=self._timings(request) if request.is_finished else None,
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
