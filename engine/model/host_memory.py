"""The host heap kept off the step's path: glibc's malloc keeps freed memory, and Python's cyclic
collector leaves what start-up built alone. Figures: docs/performance.md ("Figures behind the
code's choices") and docs/design/host-path.md ("The host's memory").

- Freed memory stays in the heap. glibc serves an allocation above its mmap threshold (32 MiB at most)
  with a fresh mmap and unmaps it on free, so every step's vocabulary-sized tensors (the logits) would
  page-fault their way in again. With mmap off and a high trim threshold they reuse the last step's
  blocks (PyTorch's CPU tuning guide preloads jemalloc or tcmalloc for the same reason; this needs no
  extra library). The price: the process keeps its peak heap.
- One arena. A thread's own glibc arena grows in heaps of at most 64 MiB, so with mmap off a larger
  tensor could not be kept there; every thread allocates from the main heap instead. The limit binds
  only threads that have not allocated yet, so this must run before the engine thread starts.
- Start-up's garbage handed back. Loading builds every weight in float32 before the kernels pack it into
  the form it ships in (a GGUF's 4-bit blocks take an eighth of that); with trimming off, the freed
  float32 copies would stay resident for the life of the process. One malloc_trim once the model is
  loaded returns the free pages to the system; steps later reuse what they free as before.
- Start-up's objects out of the collector's sight. A full pass of Python's cyclic collector walks
  every tracked object, hundreds of thousands once the model, tokenizer and app are loaded, holding
  the GIL (the engine thread and every stream stop meanwhile). Start-up's objects live as long as the
  process, so they are frozen once built (`gc.freeze`, as vLLM does once its model is loaded);
  refcounting still frees them, and the collector still finds cycles among everything made later.
- Passes spaced out. Each streamed response holds about 200 tracked objects; with Python's default
  thresholds a loaded server runs young collections constantly. Larger thresholds find cycles in
  larger batches, at the price of that much more young garbage kept between passes.
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


def return_freed_memory() -> None:
    """Give the heap's free pages back to the system, once: after loading, before serving."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        logger.info("no malloc_trim here: start-up's freed memory stays resident")


def tune_collector() -> None:
    """Collect start-up's garbage, exempt every object left from the collector's passes and space
    the passes out; call once the model and tokenizer are loaded."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*COLLECTOR_THRESHOLDS)
