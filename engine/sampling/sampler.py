"""Sampler: logits → tokens (penalties, logit bias, temperature, top-k/p, min-p) and their logprobs.

What a row costs follows what it asks for. Greedy rows take an argmax and nothing
else. Sampled rows take one pass of exp over the vocabulary and an inverse-CDF draw
in two levels (the block of 256 tokens, then the token inside it), never a sort of
the vocabulary: top-k cuts at the k-th largest weight (`topk`), min-p at a floor, and
top-p by rejection: a token drawn from the row is kept if the mass heavier than it
is below top_p, otherwise the floor rises past it and the row draws again. Every
path is exact.

Each draw is a counter-based uniform keyed by the request and the token's position
(engine/sampling/draws.py), and every per-row reduction runs in an order fixed by the row
alone, so a seeded request gives the same tokens whoever shares its batch.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Tokens per block of the two-level draw: the kernels' block, so the output head's block maxima fit it.
from engine.kernels.cpu.invariant import BLOCK
from engine.kernels.cpu.sampling import log_softmax_on_cpu, row_settings, sample_on_cpu
from engine.request import Request
from engine.sampling.draws import MAX_REJECTION_ROUNDS, uniforms
from engine.sampling.masks import RowMask
from engine.types import TokenLogprob


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # One entry per row; None where the request did not ask for logprobs.
    logprobs: list[TokenLogprob | None]


# A kernel that draws every row of a step at once: (float32 logits [R, V], the rows' packed settings, draw
# keys and positions, the largest top_k) → tokens [R].
DeviceKernel = Callable[[torch.Tensor, bytes, Sequence[int], Sequence[int], int], torch.Tensor]


def device_kernel(device: torch.device) -> DeviceKernel | None:
    """The GPU's sampling kernel where it runs: a CUDA device, with Triton (it ships with CUDA
    PyTorch); None elsewhere."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from engine.kernels.gpu.sampling import sample_on_device

    return sample_on_device


class Sampler:
    """Samples a step's rows; owns a workspace reused across steps, so a step allocates no
    vocabulary-sized buffer (on a CPU each new one costs its page faults).

    Given the CPU kernels' library, float32 CPU rows are drawn there instead, in one call
    (engine/kernels/cpu/sampling.py): the same distributions without torch's full-vocabulary passes.
    Given a device kernel (engine/kernels/gpu/sampling.py on a GPU), a step with any sampled row is
    drawn by it in one launch, where torch's path takes dozens of kernels and waits on the device in
    each top-p round.
    """

    def __init__(self, kernels: ctypes.CDLL | None = None, device: DeviceKernel | None = None) -> None:
        self.kernels = kernels
        self.device = device
        self._workspace = torch.empty(0)
        # Each request's parameters packed for the kernels, once (they never change): packing them anew
        # for every row of every step cost more than a greedy row's sampling.
        self._settings: dict[Request, bytes] = {}

    def sample(
        self,
        requests: Sequence[Request],
        logits: torch.Tensor,
        mask: RowMask | None = None,
        block_max: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """One token per row of float32 `logits` [R, V], row i belonging to requests[i]; the
        token of row i takes position requests[i].num_tokens. `mask` limits constrained rows
        to the tokens their grammar allows (logprobs still describe the model's own scores).
        `block_max`, the largest logit of each BLOCK-token block per row as the output head's
        kernel found it, spares the CPU kernel its pass for each row's max."""
        # The one device → host copy of the step's tokens.
        ids = self.tokens(requests, logits, mask, block_max).tolist()
        return SamplerOutput(ids, token_logprobs(requests, logits, ids, self.kernels))

    def tokens(
        self,
        requests: Sequence[Request],
        logits: torch.Tensor,
        mask: RowMask | None = None,
        block_max: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sample()'s tokens [R] as a tensor where the logits are, without waiting for them on a GPU."""
        processed = apply_penalties(requests, logits)
        if mask is not None:
            processed = mask.apply(processed)
        if self.kernels is not None and processed.device.type == "cpu" and processed.dtype == torch.float32:
            maxima_rows = None
            if block_max is not None and processed is not logits:
                # Rows that penalties or a grammar changed no longer have the head's maxima.
                changed = {i for i, r in enumerate(requests) if r.params.penalized} | set(mask.rows if mask else ())
                maxima_rows = [-1 if i in changed else i for i in range(len(requests))]
            token_ids = sample_on_cpu(
                self.kernels,
                processed,
                self._kernel_settings(requests),
                [r.rng_key for r in requests],
                [r.num_tokens for r in requests],
                block_max,
                maxima_rows,
            )
        elif (
            self.device is not None and processed.dtype == torch.float32 and any(not r.params.greedy for r in requests)
        ):
            token_ids = self.device(
                processed,
                self._kernel_settings(requests),
                [r.rng_key for r in requests],
                [r.num_tokens for r in requests],
                max(r.params.top_k for r in requests),
            )
        else:
            token_ids = self._sample_with_torch(requests, processed)
        return token_ids

    def _kernel_settings(self, requests: Sequence[Request]) -> bytes:
        """The rows' packed settings, joined. Past twice a step's requests (and 64), the cache keeps only
        this step's, so it never holds many more than are running."""
        settings = self._settings
        if len(settings) > 2 * len(requests) + 64:
            settings = self._settings = {r: settings[r] for r in requests if r in settings}
        try:
            return b"".join([settings[r] for r in requests])
        except KeyError:
            for request in requests:
                if request not in settings:
                    settings[request] = row_settings(request.params)
            return b"".join([settings[r] for r in requests])

    def _sample_with_torch(self, requests: Sequence[Request], processed: torch.Tensor) -> torch.Tensor:
        """The step's tokens on torch's kernels: an argmax for greedy rows, sample_rows for the rest."""
        rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not rows:
            return processed.argmax(dim=-1)
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        sampled = [requests[i] for i in rows]
        chosen = sample_rows(
            processed if not greedy else processed[rows],
            sampled,
            [r.num_tokens for r in sampled],
            out=self._buffer(len(rows), processed.shape[1], processed.device),
        )
        if not greedy:
            return chosen
        token_ids = torch.empty(len(requests), dtype=torch.long, device=processed.device)
        token_ids[greedy] = processed[greedy].argmax(dim=-1)
        token_ids[rows] = chosen
        return token_ids

    def _buffer(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        if self._workspace.numel() < rows * vocab or self._workspace.device != device:
            self._workspace = torch.empty(rows * vocab, device=device)
        return self._workspace[: rows * vocab].view(rows, vocab)


def sample_rows(
    logits: torch.Tensor, requests: Sequence[Request], positions: Sequence[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """A token per row drawn from its truncated distribution; the draws are keyed by (request, position)."""
    keys = [r.rng_key for r in requests]
    weights = _weights(logits, requests, out)
    nucleus_rows, targets = truncate(weights, requests)
    tokens = draw(weights, uniforms(keys, positions))
    if nucleus_rows:
        every_row = len(nucleus_rows) == len(requests)
        tokens[nucleus_rows] = _nucleus_by_rejection(
            weights if every_row else weights[nucleus_rows],
            targets,
            tokens if every_row else tokens[nucleus_rows],
            [keys[i] for i in nucleus_rows],
            [positions[i] for i in nucleus_rows],
        )
    return tokens


def probabilities(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Normalized probabilities after temperature, top-k, top-p and min-p, per row (for
    speculative decoding, which needs whole distributions)."""
    weights = _weights(logits, requests)
    nucleus_rows, targets = truncate(weights, requests)
    if nucleus_rows:
        weights[nucleus_rows] = _cut_by_sort(weights[nucleus_rows], targets)
    return weights / weights.sum(dim=-1, keepdim=True)


def _weights(logits: torch.Tensor, requests: Sequence[Request], out: torch.Tensor | None = None) -> torch.Tensor:
    """exp((logits - max) / temperature) per row: unnormalized probabilities whose largest is exactly 1.

    The max is subtracted before the temperature divides, not folded into one multiply-add: a
    fused multiply-add leaves the best token a rounding error away from 0, and min_p = 1 (keep
    weights >= 1) would then keep nothing."""
    device = logits.device
    inverse_t = torch.tensor([1.0 / r.params.temperature for r in requests], device=device).unsqueeze(1)
    largest = logits.amax(dim=-1, keepdim=True)
    weights = torch.sub(logits, largest, out=out) if out is not None else logits - largest
    return weights.mul_(inverse_t).exp_()


def truncate(weights: torch.Tensor, requests: Sequence[Request]) -> tuple[list[int], torch.Tensor]:
    """Zero, in place, the tokens that top-k and min-p drop, and return the top-p rows with the
    mass their nucleus must reach (top_p x their mass after top-k).

    Top-k cuts at the k-th largest weight (`topk` of the largest k asked for). Top-p is
    left to the caller, who finds each row's nucleus by rejection (or by sorting), since
    a nucleus can hold most of the vocabulary. The order is vLLM's: top-k, top-p, min-p;
    min-p's floor (min_p of the best token's weight, which is 1) only removes tokens
    lighter than every token a nucleus decision looks at, so it is applied here at once.
    """
    params = [r.params for r in requests]
    num_rows, vocab = weights.shape
    device = weights.device
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
    k_rows = [i for i in range(num_rows) if top_k[i]]
    if k_rows:
        selected = weights if len(k_rows) == num_rows else weights[k_rows]
        largest = selected.topk(max(top_k), dim=-1).values
        kth = torch.zeros(num_rows, device=device)
        kth[k_rows] = largest[torch.arange(len(k_rows), device=device), [top_k[i] - 1 for i in k_rows]]
        weights.masked_fill_(weights < kth.unsqueeze(1), 0.0)
    nucleus_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    targets = torch.empty(0, device=device, dtype=torch.float64)
    if nucleus_rows:
        selected = weights if len(nucleus_rows) == num_rows else weights[nucleus_rows]
        top_p = torch.tensor([params[i].top_p for i in nucleus_rows], device=device, dtype=torch.float64)
        targets = block_sums(selected).sum(dim=-1) * top_p
    if any(p.min_p > 0 for p in params):
        floors = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        weights.masked_fill_(weights < floors, 0.0)
    return nucleus_rows, targets


def block_sums(weights: torch.Tensor) -> torch.Tensor:
    """Sums of consecutive BLOCK-token blocks of each row (the last may be shorter), as float64.

    Each block is reduced on its own, so a row's sums never depend on the other rows. A block
    is summed in float32 (256 terms: ample) and only the sums are widened: summing with
    dtype=float64 directly runs 15x slower on a CPU."""
    num_rows, vocab = weights.shape
    num_full = vocab // BLOCK
    parts = []
    if num_full:
        parts.append(weights[:, : num_full * BLOCK].view(num_rows, num_full, BLOCK).sum(dim=-1))
    if vocab % BLOCK:
        parts.append(weights[:, num_full * BLOCK :].sum(dim=-1, keepdim=True))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).double()


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of non-negative `weights` (not normalized), by inverse CDF at `u` (float64 in [0, 1)).

    Two levels: the block whose cumulative mass passes u × total, then the token inside it,
    so only the block sums and one block per row are ever accumulated.
    """
    num_rows, vocab = weights.shape
    device = weights.device
    cdf = block_sums(weights).cumsum(dim=-1)
    target = (u.to(device) * cdf[:, -1]).unsqueeze(1)
    block = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * BLOCK + torch.arange(BLOCK, device=device)
    inside = weights.gather(1, columns.clamp(max=vocab - 1)).double().masked_fill_(columns >= vocab, 0.0)
    pick = torch.searchsorted(inside.cumsum(dim=-1), target - before, right=True).clamp_(max=BLOCK - 1)
    # Rounding at a block's end can land past its last token: take the last one with weight.
    last = ((inside > 0) * torch.arange(1, BLOCK + 1, device=device)).argmax(dim=-1, keepdim=True)
    pick = torch.where(inside.gather(1, pick) > 0, pick, last)
    return columns.gather(1, pick).squeeze(1)


def _nucleus_by_rejection(
    weights: torch.Tensor, targets: torch.Tensor, tokens: torch.Tensor, keys: list[int], positions: list[int]
) -> torch.Tensor:
    """Top-p without sorting: `tokens` were drawn from the rows' whole (top-k, min-p) weights.

    A token is in the nucleus when the mass of the tokens heavier than it is below the
    target. A drawn token inside is kept; otherwise every token as light as it (all
    outside the nucleus) is zeroed and the row draws again. What is kept follows the
    nucleus distribution exactly, the first draw is inside with probability at least
    top_p, and each later round only sees the rows still undecided. (FlashInfer's
    sorting-free top-p sampling works the same way.)
    """
    result = tokens.clone()
    active = torch.arange(len(tokens), device=weights.device)
    for lane in range(1, MAX_REJECTION_ROUNDS + 1):
        drawn = weights.gather(1, tokens.unsqueeze(1))
        # (a float mask multiplied in place: half the time of a bool mask's promoting multiply)
        heavier = block_sums((weights > drawn).to(weights.dtype).mul_(weights)).sum(dim=-1)
        inside = heavier < targets
        result[active[inside]] = tokens[inside]
        outside = ~inside
        if not bool(outside.any()):
            return result
        active, weights, targets, drawn = active[outside], weights[outside], targets[outside], drawn[outside]
        weights.masked_fill_(weights <= drawn, 0.0)
        left = active.tolist()
        tokens = draw(weights, uniforms([keys[i] for i in left], [positions[i] for i in left], lane))
    left = active.tolist()
    cut = _cut_by_sort(weights, targets)
    result[active] = draw(cut, uniforms([keys[i] for i in left], [positions[i] for i in left], lane + 1))
    return result


def _cut_by_sort(weights: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Rows of `weights` with the tokens outside their top-p nucleus zeroed, found by a full sort."""
    ordered = weights.sort(dim=-1, descending=True).values
    cumulative = ordered.double().cumsum(dim=-1)
    crossing = (cumulative < targets.unsqueeze(1)).sum(dim=-1).clamp_(max=weights.shape[1] - 1)
    thresholds = ordered.gather(1, crossing.unsqueeze(1))
    return weights.masked_fill(weights < thresholds, 0.0)


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


def token_logprobs(
    requests: Sequence[Request],
    logits: torch.Tensor,
    token_ids: Sequence[int],
    kernels: ctypes.CDLL | None = None,
) -> list[TokenLogprob | None]:
    """Log-probabilities under the model's own distribution (before penalties and temperature),
    as OpenAI and vLLM report them. Given the CPU kernels, float32 CPU rows take their log-softmax, whose
    bits do not depend on the CPU's vector width as torch's do."""
    result: list[TokenLogprob | None] = [None] * len(requests)
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return result
    if kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        logprobs = log_softmax_on_cpu(kernels, logits[rows])
    else:
        logprobs = logits[rows].log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor([token_ids[i] for i in rows], device=logits.device).unsqueeze(1))
    k = max(requests[i].params.logprobs for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    # Each to the host in one copy: per row, on a GPU, every copy would wait on the device.
    chosen_values, top_values, top_ids = chosen[:, 0].tolist(), top_values.tolist(), top_ids.tolist()
    for j, row in enumerate(rows):
        want = requests[row].params.logprobs
        # Ties in token id order, as argmax breaks them, so a greedy token heads its own list.
        top = tuple(sorted(zip(top_ids[j][:want], top_values[j][:want]), key=lambda e: (-e[1], e[0])))
        result[row] = TokenLogprob(token_ids[row], chosen_values[j], top)
    return result
