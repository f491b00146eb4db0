"""Overlapped steps: a step's sampled tokens stay on the device while the next step is built and run.

On a GPU the engine thread's own work per step (scheduling, building inputs, detokenizing, streaming)
takes as long as the forward of a small model or a large batch. Waiting for each step's tokens before
building the next leaves the GPU idle through all of it. Instead, once a step is launched its tokens
are published to a device buffer and each request gets a placeholder in `token_ids`: a negative id
naming the buffer's entry. The next step is scheduled and launched at once (its input ids resolved
from the buffer on the device), and only then does the thread wait for the earlier step's tokens,
which the GPU has long finished, and stream them while the GPU computes.

At most one step is in flight: its tokens are resolved before the step after the next is launched,
so the buffer's two halves, used in turn, never overwrite a token a launched step still reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.scheduler import StepPlan


@dataclass(slots=True)
class InFlightStep:
    """A launched step whose tokens the host has not read yet."""

    plan: StepPlan
    # The requests that sample, with the index of each one's placeholder in its token_ids.
    sampling_requests: list[Request]
    positions: list[int]
    # The tokens, copied to the host as the device finishes them; `ready` marks the copy done (GPU).
    host_tokens: torch.Tensor
    ready: torch.cuda.Event | None


class FutureTokens:
    """The device buffer that launched steps publish their tokens to, and their placeholders."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.buffer = torch.zeros(2 * capacity, dtype=torch.long, device=device)
        self._half = 0

    def publish(self, tokens: torch.Tensor) -> list[int]:
        """Copy a step's tokens [n] into the next half of the buffer (on the device, in stream order);
        the placeholder of each: -(entry + 1)."""
        base = self._half * self.capacity
        self._half ^= 1
        count = tokens.shape[0]
        self.buffer[base : base + count].copy_(tokens)
        return list(range(-base - 1, -base - count - 1, -1))

    def resolve(self, token_ids: torch.Tensor) -> None:
        """Replace, in place, every placeholder of `token_ids` (a device tensor) by its token."""
        token_ids.copy_(resolved(token_ids, self.buffer))

    def to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start the tokens' copy to the host without waiting for it (pinned memory on a GPU)."""
        if tokens.device.type != "cuda":
            # A copy: the sampler may reuse the tensor for the next step's tokens before these are read.
            return tokens.clone(), None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    @staticmethod
    def read(step: InFlightStep) -> list[int]:
        """The step's tokens on the host, waiting (with the GIL released) for the device if it must."""
        if step.ready is not None:
            step.ready.synchronize()
        return step.host_tokens.tolist()


def resolved(token_ids: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """`token_ids` with each placeholder replaced by its token from `buffer`, on the device: no wait,
    and the same few kernels whatever the ids, so it can be captured in a CUDA graph."""
    return torch.where(token_ids < 0, buffer[token_ids.neg().sub(1).clamp(min=0)], token_ids)
