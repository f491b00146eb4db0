"""glibc's malloc told to keep freed memory, so each step's large tensors reuse pages instead of faulting in new ones.

glibc serves an allocation above its mmap threshold (32 MiB at most) with a fresh
mmap and unmaps it on free, so every step's vocabulary-sized tensors (logits at 256
rows: 50 MB) page-fault their way in again. Measured here on an engine-like thread,
an `exp` over 256 x 49,152 floats took 50 ms that way and 12.5 ms with mmap off and
a high trim threshold, which keep freed blocks in the heap for the next step.
PyTorch's CPU tuning guide preloads jemalloc or tcmalloc for the same reason; this
needs no extra library. The price: the process keeps its peak heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Turn off glibc's mmap for large blocks and its heap trimming; False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    done = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    if not done:
        logger.warning("could not tune malloc: large tensors will page-fault on every step")
    return done
