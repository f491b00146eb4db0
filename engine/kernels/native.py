"""Builds invariant.cpp once per machine with the system C++ compiler and loads it with ctypes.

A plain shared library keeps the build to a second or two (no torch headers, no ninja) and
the calls to a few microseconds each. The library is cached under the cache folder by a
hash of its source and flags, and written by rename so concurrent servers never load half a file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("invariant.cpp")
# -ffp-contract=off: the compiler may not fuse or split what the source says, so the
# arithmetic is the source's on every build.
_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC")

_P = ctypes.c_void_p
_I = ctypes.c_int64


def kernels_supported() -> bool:
    """The kernels need an x86-64 CPU with AVX2 and FMA, and torch to say it runs AVX2 code."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    return torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512", "AMX"))


def load_library(cache_dir: Path) -> ctypes.CDLL | None:
    """The compiled kernels, building them first if this machine has none yet; None (with a
    warning saying why) where they cannot run or cannot be built."""
    if not kernels_supported():
        logger.warning("batch-invariant kernels need an x86-64 CPU with AVX2 and FMA; using torch's kernels")
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        logger.warning("no C++ compiler (c++ or g++) found to build the batch-invariant kernels; using torch's")
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = cache_dir / "kernels" / f"invariant-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_suffix(f".{os.getpid()}.partial")
        command = [compiler, *_FLAGS, str(_SOURCE), "-o", str(staging)]
        logger.info("building the batch-invariant kernels: %s", " ".join(command))
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("building the batch-invariant kernels failed; using torch's:\n%s", result.stderr[-2000:])
            staging.unlink(missing_ok=True)
            return None
        staging.replace(target)
    library = ctypes.CDLL(str(target))
    library.sl_linear.argtypes = [_P, _I, _I, _P, _I, _P]
    library.sl_linear.restype = None
    library.sl_pack_weight.argtypes = [_P, _I, _I, _P]
    library.sl_pack_weight.restype = None
    library.sl_paged_attention.argtypes = [_P, _I, _I, _I, _P, _P, _I, _P, _I, _I, _P, _P, ctypes.c_float, _P]
    library.sl_paged_attention.restype = None
    return library
