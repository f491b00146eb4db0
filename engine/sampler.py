"""Sampler: greedy, temperature, top-k and top-p over a batch, each request with its own generator."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request


def sample(requests: Sequence[Request], logits: torch.Tensor) -> list[int]:
    """One token per row of `logits` [R, V]; seeded requests draw only from their own generator."""
    greedy = logits.argmax(dim=-1).tolist()
    rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if not rows:
        return greedy
    sampled_requests = [requests[i] for i in rows]
    probs = _probabilities(logits[rows], sampled_requests)
    # Inverse-CDF sampling: one uniform per request from its own generator keeps a seeded
    # request's draws independent of whoever else shares the batch.
    uniforms = torch.cat([torch.rand(1, generator=r.generator) for r in sampled_requests]).to(probs.device)
    cdf = probs.cumsum(dim=-1)
    # cdf[-1] can fall a hair short of 1; clamp so u never lands past the last token.
    choice = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1).to(cdf.dtype)).squeeze(1)
    choice = choice.clamp_(max=logits.shape[1] - 1).tolist()
    for row, token_id in zip(rows, choice):
        greedy[row] = token_id
    return greedy


def _probabilities(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Softmax after temperature, top-k and top-p, per row."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in requests], device=device).unsqueeze(1)
    logits = logits / temperature
    top_k = [r.params.top_k for r in requests]
    top_p = [r.params.top_p for r in requests]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=device).unsqueeze(1)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        drop = ranks >= k
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= torch.tensor(top_p, device=device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits.softmax(dim=-1)
