"""Per-request accounting on the event loop: metrics as chunks arrive, one audit line at the end.

A CompletionRenderer hands every chunk it reads to its Accounting and closes it on every
exit path, so finished, failed, cancelled and abandoned requests are all counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from app.operations.audit import AuditLog, AuditRecord
from app.operations.metrics import Metrics
from engine.types import Chunk, FinishReason


@dataclass
class RequestContext:
    """Who sent a request and how, as the HTTP layer saw it."""

    request_id: str
    client: str | None
    api_key_id: str | None
    endpoint: str
    streamed: bool


class Accounting:
    def __init__(
        self,
        metrics: Metrics | None,
        audit: AuditLog | None,
        context: RequestContext,
        model: str,
        completion_id: str,
        num_prompt_tokens: int,
        num_choices: int,
        prompt: Callable[[], object],
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        self._metrics = metrics
        self._on_close = on_close
        self._audit = audit
        self._start = time.monotonic()
        self._last_chunk: float | None = None
        self._outputs = [[] for _ in range(num_choices)] if audit and audit.with_content else None
        self.record = AuditRecord(
            request_id=context.request_id,
            client=context.client,
            api_key_id=context.api_key_id,
            model=model,
            endpoint=context.endpoint,
            completion_id=completion_id,
            prompt_tokens=num_prompt_tokens,
            streamed=context.streamed,
            prompt=prompt() if self._outputs is not None else None,
        )
        if metrics is not None:
            metrics.request_started(num_prompt_tokens)

    def on_chunk(self, chunk: Chunk) -> None:
        record = self.record
        record.completion_tokens += len(chunk.token_ids)
        if self._outputs is not None:
            self._outputs[chunk.index].append(chunk.text)
        if self._metrics is not None and chunk.token_ids:
            now = time.monotonic()
            if self._last_chunk is not None:
                self._metrics.itl.observe(now - self._last_chunk)
            self._last_chunk = now
        if chunk.is_terminal:
            record.finish_reasons.append(chunk.finish_reason.value)
            record.cancelled |= chunk.finish_reason == FinishReason.CANCELLED
            if chunk.timings is not None:
                record.cached_tokens = max(record.cached_tokens, chunk.timings.cached_tokens)
                record.paused |= chunk.timings.paused
                if record.ttft_ms is None or chunk.timings.ttft_ms < record.ttft_ms:
                    record.ttft_ms = round(chunk.timings.ttft_ms, 3)
            if self._metrics is not None:
                self._metrics.choice_finished(chunk.finish_reason.value, chunk.timings)

    def resumed(self) -> None:
        self.record.resumed += 1

    def close(self, abandoned: bool) -> None:
        """The request is over: `abandoned` when its reader left before the last terminal chunk."""
        self._on_close()
        self.record.cancelled |= abandoned
        self.record.duration_ms = round((time.monotonic() - self._start) * 1000, 3)
        if self._outputs is not None:
            self.record.output = ["".join(parts) for parts in self._outputs]
        if self._audit is not None:
            self._audit.write(self.record)
