"""Host → GPU copies that do not make the engine thread wait for the GPU.

PyTorch's blocking host → device copy synchronizes the stream: the thread waits until the GPU has run
everything queued before the copy. With a step in flight (engine/future_tokens.py) the next step's
inputs would then wait for the whole forward before them, and the steps would not overlap at all.
From pinned memory the copy is queued like a kernel and the thread goes on; PyTorch's pinned-memory
cache keeps each staging buffer until the copy that reads it has run.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`; on a GPU, queued without waiting."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def long_tensor(values: Iterable[int], device: torch.device) -> torch.Tensor:
    """A long tensor on `device`. Built from an array's buffer: torch.tensor reads a list one Python
    int at a time, several times slower, and a step makes several of these per forward."""
    if not isinstance(values, array):
        values = array("q", values)
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    return upload(torch.frombuffer(values, dtype=torch.long), device)
