"""Sampler: logits → tokens (penalties, logit bias, temperature, top-k/p, min-p) and their logprobs.

Each request draws from its own generator, so a seeded request gives the same
tokens whoever shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import Request


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability under the model, and the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # One entry per row; None where the request did not ask for logprobs.
    logprobs: list[TokenLogprob | None]


def sample(requests: Sequence[Request], logits: torch.Tensor) -> SamplerOutput:
    """One token per row of float32 `logits` [R, V], row i belonging to requests[i]."""
    processed = apply_penalties(requests, logits)
    token_ids = processed.argmax(dim=-1).tolist()
    rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if rows:
        sampled_requests = [requests[i] for i in rows]
        probs = probabilities(processed[rows], sampled_requests)
        for row, token_id in zip(rows, draw(probs, [r.generator for r in sampled_requests])):
            token_ids[row] = token_id
    return SamplerOutput(token_ids, token_logprobs(requests, logits, token_ids))


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> list[int]:
    """One token per row of `probs` (not necessarily normalized) by inverse CDF.

    One uniform per row from that row's own generator keeps a seeded request's draws
    independent of whoever else shares the batch.
    """
    uniforms = torch.cat([torch.rand(1, generator=g) for g in generators]).to(probs.device)
    cdf = probs.cumsum(dim=-1)
    # Scale u to the row's total so rounding never lands past the last token.
    choice = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1).to(cdf.dtype)).squeeze(1)
    return choice.clamp_(max=probs.shape[1] - 1).tolist()


def apply_penalties(
    requests: Sequence[Request], logits: torch.Tensor, drafts: Sequence[Sequence[int]] | None = None
) -> torch.Tensor:
    """Presence, frequency and repetition penalties and logit bias; a copy when any applies.

    `drafts[i]`, when given, are tokens row i scores as if already generated (speculative
    verification scores each position after the proposals before it).
    """
    rows = [i for i, r in enumerate(requests) if r.params.penalized]
    if not rows:
        return logits
    logits = logits.clone()
    device = logits.device
    for row in rows:
        request = requests[row]
        params = request.params
        values = logits[row]
        draft = list(drafts[row]) if drafts else []
        if params.presence_penalty or params.frequency_penalty:
            output = torch.tensor(request.output_token_ids + draft, dtype=torch.long, device=device)
            counts = torch.zeros_like(values).scatter_add_(0, output, torch.ones_like(output, dtype=values.dtype))
            values -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        if params.repetition_penalty != 1.0:
            # As in CTRL and Hugging Face: over prompt and output, shrink toward less likely.
            seen = torch.tensor(sorted({*request.token_ids, *draft}), dtype=torch.long, device=device)
            scores = values[seen]
            values[seen] = torch.where(
                scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty
            )
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias)
            values[list(ids)] += torch.tensor(biases, dtype=values.dtype, device=device)
    return logits


def probabilities(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Softmax after temperature, top-k, top-p and min-p, per row."""
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
    probs = logits.softmax(dim=-1)
    min_p = [r.params.min_p for r in requests]
    if any(min_p):
        floor = torch.tensor(min_p, device=device).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs /= probs.sum(dim=-1, keepdim=True)
    return probs


def token_logprobs(
    requests: Sequence[Request], logits: torch.Tensor, token_ids: Sequence[int]
) -> list[TokenLogprob | None]:
    """Log-probabilities under the model's own distribution (before penalties and temperature),
    as OpenAI and vLLM report them."""
    result: list[TokenLogprob | None] = [None] * len(requests)
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return result
    logprobs = logits[rows].log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor([token_ids[i] for i in rows], device=logits.device).unsqueeze(1))
    k = max(requests[i].params.logprobs for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    for j, row in enumerate(rows):
        want = requests[row].params.logprobs
        # Ties in token id order, as argmax breaks them, so a greedy token heads its own list.
        top = tuple(sorted(zip(top_ids[j, :want].tolist(), top_values[j, :want].tolist()), key=lambda e: (-e[1], e[0])))
        result[row] = TokenLogprob(token_ids[row], chosen[j, 0].item(), top)
    return result
