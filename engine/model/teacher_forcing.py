"""Teacher-forced logits of a token sequence through the paged forward: how a quantized model's accuracy
is measured against the unquantized one (bench/quantize.py, tests/unit/test_quantize.py)."""

from __future__ import annotations

import torch

from engine.detokenizer import IncrementalDetokenizer, StopMatcher
from engine.engine import Engine
from engine.model.runner import Logits, Segment
from engine.request import Request
from engine.types import SamplingParams


def teacher_forced_logits(engine: Engine, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [len(token_ids), V]: row i predicts token i + 1, from one forward of the whole
    sequence on an engine that is not running (its runner and KV cache are borrowed, then given back)."""
    request = Request(
        request_id="teacher-forced",
        prompt_token_ids=list(token_ids),
        params=SamplingParams(max_tokens=1, temperature=0.0),
        channel=None,
        detokenizer=IncrementalDetokenizer(engine.token_bytes),
        stop_matcher=StopMatcher(()),
    )
    engine.block_manager.allocate(request, len(token_ids))
    try:
        return engine.runner.run([Segment(request, 0, request.token_ids, Logits.ALL)]).logits.clone()
    finally:
        engine.block_manager.deallocate(request)


def agreement_and_perplexity(
    logits: torch.Tensor, reference: torch.Tensor, token_ids: list[int]
) -> tuple[float, float]:
    """How often `logits` pick the same top token as `reference`, and the perplexity of `logits` on the
    text itself (each row scored on the token that follows it)."""
    agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    targets = torch.tensor(token_ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), targets)
    return agreement, nll.exp().item()
