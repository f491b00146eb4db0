"""Counter-based random draws: a uniform in [0, 1) for (key, position, lane), computed on the spot.

A request's draws depend only on its key (from its seed, or random when it has none),
the position of the token being drawn and the lane (which use of randomness at that
position), never on what shares its batch, how often it was preempted or how many
draws other rows took. No generator state is kept, so nothing has to be rolled back
when speculative tokens are rejected.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

_MASK = (1 << 64) - 1

# Lanes: the sampler's draws at a position use lanes 0, 1, 2, ... (one per round of its
# top-p rejection loop); speculative decoding keeps clear of them.
# Rounds of the samplers' top-p rejection loop (lanes 0 to this) before the rows still undecided (rare)
# are cut another way; sampling.cpp's kMaxRounds is the same.
MAX_REJECTION_ROUNDS = 16
LANE_ACCEPT = 1 << 20
LANE_RESIDUAL = 2 << 20
LANE_DRAFT = 3 << 20


def _mix(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that scatters every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def request_key(seed: int | None, index: int) -> int:
    """The key of choice `index` of a request: from its seed, so a repeat draws the same; random otherwise."""
    if seed is None:
        return random.getrandbits(64)
    return _mix((seed + index) & _MASK)


def uniform(key: int, position: int, lane: int = 0) -> float:
    x = _mix((key + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK)
    x = _mix(x ^ ((lane + 1) * 0xD1B54A32D192ED03 & _MASK))
    return (x >> 11) * 2.0**-53


def uniforms(keys: Sequence[int], positions: Sequence[int], lane: int = 0) -> torch.Tensor:
    """One uniform per row, as float64."""
    return torch.tensor([uniform(k, p, lane) for k, p in zip(keys, positions)], dtype=torch.float64)
