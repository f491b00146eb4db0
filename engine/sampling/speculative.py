"""Speculative decoding: proposers guess a request's next tokens, the verifier keeps what the
target model agrees with.

The target scores a request's last token and its k proposals in one forward (k + 1
logits rows). Greedy requests keep the longest prefix of proposals that matches the
target's argmax plus one token from the target, so output is token for token what
decoding one at a time gives. Sampled requests use rejection sampling (Leviathan et
al., 2023): proposal i is kept with probability min(1, p_i(d) / q_i(d)); the first
rejected one is replaced by a draw from the residual max(0, p_i - q_i). The output
then follows the target distribution exactly, whatever the proposer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.kv_cache import BlockManager
from engine.model.causal_lm import PagedCausalLM
from engine.model.runner import Logits, ModelRunner, Segment
from engine.request import Request
from engine.sampling.draws import LANE_ACCEPT, LANE_DRAFT, LANE_RESIDUAL, uniform, uniforms
from engine.sampling.masks import RowMask
from engine.sampling.sampler import apply_penalties, draw, probabilities, token_logprobs
from engine.types import TokenLogprob


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    # [k, V] probabilities the draft sampled each proposal from; None: proposed deterministically
    # (a point mass, q(d) = 1), as the n-gram proposer and greedy drafts do.
    draft_probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[Proposal]:
        """Up to num_tokens[i] proposed continuations of requests[i]'s tokens."""
        ...


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the request's last n tokens
    (longest n first) in its own prompt and output, and propose what followed it."""

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[Proposal]:
        return [Proposal(self._lookup(r.token_ids, k)) for r, k in zip(requests, num_tokens)]

    def _lookup(self, token_ids: list[int], k: int) -> list[int]:
        if k < 1:
            return []
        tokens = torch.tensor(token_ids)
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            # Every earlier window of n tokens (the suffix itself excluded) against the suffix.
            windows = tokens[:-1].unfold(0, n, 1)
            hits = (windows == tokens[-n:]).all(dim=1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n
                return token_ids[start : start + k]
        return []


class DraftProposer:
    """A smaller causal LM (or the target's own first layers) proposes by decoding ahead.

    Its K/V live in a cache of their own, addressed through the target's block tables,
    so the target's allocation, sharing and rollback cover it too; the request's
    `num_draft_computed` says how far it is valid. Greedy requests take the draft's
    argmax; sampled ones draw from the draft's distribution after the request's own
    sampling parameters, which the verifier then corrects toward the target's.
    """

    def __init__(self, model: PagedCausalLM, block_manager: BlockManager, num_blocks: int, block_size: int) -> None:
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.block_manager = block_manager

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[Proposal]:
        drafts: dict[Request, list[int]] = {r: [] for r in requests}
        probs: dict[Request, list[torch.Tensor]] = {r: [] for r in requests}
        wanted = {r: k for r, k in zip(requests, num_tokens) if k > 0 and self._reserve(r, k)}
        # First the tokens the draft has not seen (prompt, accepted tokens), then one at a time.
        segments = [
            Segment(r, r.num_draft_computed, r.token_ids[r.num_draft_computed :], Logits.LAST)
            for r in requests
            if r in wanted
        ]
        while segments:
            segments.sort(key=lambda s: len(s.token_ids) > 1)
            logits = self.runner.run(segments).logits
            active = [s.request for s in segments]
            processed = apply_penalties(active, logits, [drafts[r] for r in active])
            chosen = processed.argmax(dim=-1).tolist()
            sampled = [i for i, r in enumerate(active) if not r.params.greedy]
            if sampled:
                drawing = [active[i] for i in sampled]
                q = probabilities(processed[sampled], drawing)
                u = uniforms([r.rng_key for r in drawing], [r.num_tokens + len(drafts[r]) for r in drawing], LANE_DRAFT)
                for j, (i, token_id) in enumerate(zip(sampled, draw(q, u).tolist())):
                    chosen[i] = token_id
                    probs[active[i]].append(q[j])
            next_segments = []
            for segment, token_id in zip(segments, chosen):
                request = segment.request
                request.num_draft_computed = segment.start + len(segment.token_ids)
                drafts[request].append(token_id)
                if len(drafts[request]) < wanted[request]:
                    next_segments.append(Segment(request, request.num_draft_computed, [token_id], Logits.LAST))
            segments = next_segments
        for request in requests:
            # The draft's K/V past the request's real tokens hold proposals, valid only if
            # accepted; recomputing the few accepted ones next step is cheaper than tracking them.
            request.num_draft_computed = min(request.num_draft_computed, request.num_tokens)
        return [Proposal(drafts[r], torch.stack(probs[r]) if probs[r] else None) for r in requests]

    def _reserve(self, request: Request, k: int) -> bool:
        """Blocks for the draft's writes and the target's verification; False when none are free."""
        num_new = request.num_tokens - request.num_computed_tokens + k
        if not self.block_manager.can_allocate(self.block_manager.num_blocks_needed(request, num_new)):
            return False
        self.block_manager.allocate(request, num_new)
        return True


@dataclass(frozen=True)
class Verified:
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    num_accepted: int


def verify(
    requests: Sequence[Request],
    proposals: Sequence[Proposal],
    logits: torch.Tensor,
    mask: RowMask | None = None,
    kernels: ctypes.CDLL | None = None,
) -> list[Verified]:
    """Accept or reject each request's proposals against the target's `logits`.

    `logits` holds len(proposal) + 1 rows per request, in order: the target's scores
    after the request's last token and after each proposal. `mask` holds the grammar's
    allowed tokens at each constrained position, so a rejected proposal is replaced by
    a token the grammar allows. `kernels`: the CPU kernels, for the logprobs (token_logprobs).
    """
    rows = [r for r, p in zip(requests, proposals) for _ in range(len(p.token_ids) + 1)]
    drafts = [p.token_ids[:i] for p in proposals for i in range(len(p.token_ids) + 1)]
    processed = apply_penalties(rows, logits, drafts)
    if mask is not None:
        processed = mask.apply(processed)
    targets = processed.argmax(dim=-1).tolist()
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    probs = probabilities(processed[sampled], [rows[i] for i in sampled]) if sampled else None
    prob_row = {row: j for j, row in enumerate(sampled)}

    results: list[Verified] = []
    first = 0
    for request, proposal in zip(requests, proposals):
        kept: list[int] = []
        for i, token_id in enumerate(proposal.token_ids):
            row = first + i
            if request.params.greedy:
                kept.append(token_id if targets[row] == token_id else targets[row])
            else:
                kept.append(_accept_or_resample(probs[prob_row[row]], token_id, proposal, i, request))
            if kept[-1] != token_id:
                break
        else:
            row = first + len(proposal.token_ids)
            bonus = targets[row] if request.params.greedy else _draw_one(probs[prob_row[row]], request, row - first, 0)
            kept.append(bonus)
        num_accepted = len(kept) - 1
        used = range(first, first + len(kept))
        logprobs = token_logprobs([rows[i] for i in used], logits[first : first + len(kept)], kept, kernels)
        results.append(Verified(kept, [lp for lp in logprobs if lp is not None], num_accepted))
        first += len(proposal.token_ids) + 1
    return results


def _accept_or_resample(target: torch.Tensor, token_id: int, proposal: Proposal, i: int, request: Request) -> int:
    """`token_id` if kept (probability min(1, p/q)), else a draw from the residual distribution."""
    draft = proposal.draft_probs[i] if proposal.draft_probs is not None else None
    q = float(draft[token_id]) if draft is not None else 1.0
    p = float(target[token_id])
    if uniform(request.rng_key, request.num_tokens + i, LANE_ACCEPT) * q < p:
        return token_id
    if draft is None:
        residual = target.clone()
        residual[token_id] = 0.0
    else:
        residual = (target - draft).clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:
        residual = target
    return _draw_one(residual, request, i, LANE_RESIDUAL)


def _draw_one(probs: torch.Tensor, request: Request, offset: int, lane: int) -> int:
    """A draw from `probs` for the token `offset` places past the request's last one."""
    return int(draw(probs[None], uniforms([request.rng_key], [request.num_tokens + offset], lane))[0])
