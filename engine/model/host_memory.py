"""The host heap kept off the step's path: glibc's malloc keeps freed memory, and Python's cyclic
collector leaves what start-up built alone.

glibc serves an allocation above its mmap threshold (32 MiB at most) with a fresh
mmap and unmaps it on free, so every step's vocabulary-sized tensors (logits at 256
rows: 50 MB) page-fault their way in again. Measured here on an engine-like thread,
an `exp` over 256 x 49,152 floats took 50 ms that way and 12.5 ms with mmap off and
a high trim threshold, which keep freed blocks in the heap for the next step.
PyTorch's CPU tuning guide preloads jemalloc or tcmalloc for the same reason; this
needs no extra library. The price: the process keeps its peak heap.

Every thread also allocates from the main heap. A thread's own glibc arena grows in heaps
of at most 64 MiB, so with mmap off a larger tensor (the logits of 512 rows: 100 MB) cannot
be kept there and each step's went the slow way: the raw forward of the tiny benchmark model
at 512 rows ran at 3,600-3,800 tok/s with per-thread arenas and 6,000-7,900 with one (four
runs each, `MALLOC_ARENA_MAX`). The arena limit binds only threads that have not allocated
yet, so this runs before the engine thread starts.

Python's cyclic collector, once enough objects have outlived two younger collections, walks
every tracked object in the process: about 420,000 once the model, tokenizer, transformers and
the app are loaded. Each such pass took 0.23 to 0.49 s on this machine, holding the GIL, so the
engine thread and every stream stopped for that long a few times a minute under load. Start-up's
objects live as long as the process, so they are taken out of the collector's sight once built
(`gc.freeze`, as vLLM does once its model is loaded and warmed up); refcounting still frees them,
and the collector still finds cycles among everything made later.

Under load the rest is still many: each streamed response holds about 200 tracked objects
(coroutines, closures, anyio events), 100,000 at 512 streams, and with Python's default thresholds
(a young collection every 700 allocations) a 512-stream server ran 1,790 young, 165 middle and 15
full collections in 45 s of streaming, 2.4 s with the GIL held, the full ones about 0.1 s each.
With a young collection every 20,000 allocations, 20 of them per middle one and 50 middle per
full one, the same load ran 17 collections in all (0.09 s). Cycles are still found, in larger
batches; the price is that much more young garbage kept between passes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# Allocations per young collection; young collections per middle one; middle per full one.
COLLECTOR_THRESHOLDS = (20_000, 20, 50)


def keep_freed_memory() -> bool:
    """Turn off glibc's mmap for large blocks and its heap trimming, and give every thread started
    from now on the main heap; False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    options = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 1 << 30), (_M_ARENA_MAX, 1))
    done = all(mallopt(option, value) for option, value in options)
    if not done:
        logger.warning("could not tune malloc: large tensors will page-fault on every step")
    return done


def tune_collector() -> None:
    """Collect start-up's garbage, exempt every object left from the collector's passes and space
    the passes out; call once the model and tokenizer are loaded."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*COLLECTOR_THRESHOLDS)
