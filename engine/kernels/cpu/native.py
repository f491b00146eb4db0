"""Builds the kernels (invariant.cpp, decoder.cpp, moe.cpp, sampling.cpp, logprobs.cpp) once per machine with
the system C++ compiler into one library, and loads it with ctypes; `build_shared_library` builds any other such library
the same way (app/operations/sends.cpp).

A plain shared library keeps the build to a second or two (no torch headers, no ninja) and
the calls to a few microseconds each. The library is cached under the cache folder by a
hash of its source and flags, and written by rename so concurrent servers never load half a file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_FOLDER = Path(__file__).parent
SOURCES = tuple(_FOLDER / name for name in ("invariant.cpp", "decoder.cpp", "moe.cpp", "sampling.cpp", "logprobs.cpp"))
_HEADERS = tuple(
    _FOLDER / name for name in ("invariant.h", "lanes.h", "vector_math.h", "torch_math.h", "barrier.h", "intrinsics.h")
)
# -ffp-contract=off: the compiler may not fuse or split what the source says, so the
# arithmetic is the source's on every build. -Bsymbolic: a library's calls between its own files stay
# in it, so two variants loaded in one process (the tests compare them) never call into each other.
_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-Wl,-Bsymbolic")

_P = ctypes.c_void_p
_I = ctypes.c_int64


@dataclass(frozen=True)
class KernelVariant:
    """One build of the kernels for one instruction set: its flags, the machines (platform.machine()) and
    torch's CPU capabilities there (torch.backends.cpu.get_cpu_capability; none named: any) it runs on, and
    whether it reads x86's intrinsics through SIMDe's headers. Every variant gives the same bits (each output is
    the same chain of roundings; a variant only takes more lanes at once); a faster one goes first in
    VARIANTS."""

    name: str
    flags: tuple[str, ...]
    machines: tuple[str, ...]
    capabilities: tuple[str, ...] = ()
    simde: bool = False


_X86 = ("x86_64", "AMD64")
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
# torch's AVX512 capability is AVX-512 F, BW, VL and DQ; the linear kernel's tiles hold a panel in one register.
# AArch64's baseline has NEON and its fused multiply-add: the neon build's linear tiles are NEON's own (lanes.h),
# the rest reads the x86 intrinsics through SIMDe.
VARIANTS = (
    KernelVariant("avx512", (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"), _X86, ("AVX512", "AMX")),
    KernelVariant("avx2-fma", _AVX2, _X86, ("AVX2", "AVX512", "AMX")),
    KernelVariant("neon", (), ("aarch64",), simde=True),
)


def runnable_variants() -> tuple[KernelVariant, ...]:
    """The variants this CPU runs, in VARIANTS' order (none off Linux: the decoder's barrier waits on futexes)."""
    if platform.system() != "Linux":
        return ()
    capability = torch.backends.cpu.get_cpu_capability()
    return tuple(
        v
        for v in VARIANTS
        if platform.machine() in v.machines and (not v.capabilities or capability.startswith(v.capabilities))
    )


def simde_include() -> str | None:
    """The folder holding SIMDe's headers (the simde-py package, a dependency on ARM), or None without it."""
    try:
        import simde_py
    except ImportError:
        return None
    return simde_py.get_include()


def variant_flags(variant: KernelVariant) -> tuple[str, ...] | None:
    """The compiler flags that build `variant`, or None where what it needs (SIMDe's headers) is missing."""
    flags = (*_FLAGS, *variant.flags, f'-DSL_VARIANT="{variant.name}"')
    if not variant.simde:
        return flags
    include = simde_include()
    return None if include is None else (*flags, f"-I{include}")


def choose_variant() -> KernelVariant | None:
    """The variant to run here: the first this CPU runs. On AMD's Zen 4, which runs each 512-bit instruction
    as two halves, avx512 too: its decode step is 0.90x avx2-fma's (docs/performance.md)."""
    return next(iter(runnable_variants()), None)


def kernels_supported() -> bool:
    """Whether some variant of the kernels runs on this CPU (x86-64 with AVX2 and FMA, or AArch64, on Linux)."""
    return choose_variant() is not None


def kernel_variant(library: ctypes.CDLL) -> str:
    """The variant `library` was built as."""
    return library.sl_variant().decode()


def build_shared_library(
    cache_dir: Path, label: str, sources: tuple[Path, ...], headers: tuple[Path, ...], flags: tuple[str, ...]
) -> Path | None:
    """`sources` built with the system C++ compiler into a shared library cached under `cache_dir` by
    a hash of its source and flags; None (with a warning naming `label`) where it cannot be built."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        logger.warning("no C++ compiler (c++ or g++) found to build %s", label)
        return None
    source = b"".join(path.read_bytes() for path in (*sources, *headers))
    key = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_dir / "kernels" / f"{sources[0].stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_suffix(f".{os.getpid()}.partial")
        command = [compiler, *flags, *map(str, sources), "-o", str(staging)]
        logger.info("building %s: %s", label, " ".join(command))
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("building %s failed:\n%s", label, result.stderr[-2000:])
            staging.unlink(missing_ok=True)
            return None
        staging.replace(target)
    return target


@functools.cache
def load_library(cache_dir: Path, variant: KernelVariant | None = None) -> ctypes.CDLL | None:
    """The compiled kernels (`variant`, else this CPU's fastest), building them first if this machine has none
    yet; None (with a warning saying why, once) where they cannot run or cannot be built."""
    variant = variant or choose_variant()
    if variant is None:
        logger.warning(
            "Sluice's CPU kernels need Linux on an x86-64 CPU with AVX2 and FMA or on AArch64; using torch's"
        )
        return None
    flags = variant_flags(variant)
    if flags is None:
        logger.warning("Sluice's %s kernels need SIMDe's headers (pip install simde-py); using torch's", variant.name)
        return None
    target = build_shared_library(cache_dir, "Sluice's CPU kernels (using torch's)", SOURCES, _HEADERS, flags)
    if target is None:
        return None
    library = bind(ctypes.CDLL(str(target)))
    runnable = ", ".join(v.name for v in runnable_variants())
    logger.info("Sluice's CPU kernels: the %s variant (this CPU runs %s)", variant.name, runnable)
    return library


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """`library` (a build of the kernels) with its functions' argument and result types declared."""
    library.sl_variant.argtypes = []
    library.sl_variant.restype = ctypes.c_char_p
    library.sl_linear.argtypes = [_I, _I, _P, _I, _I, _P, _I, _P, _P]
    library.sl_linear.restype = None
    library.sl_packed_bytes.argtypes = [_I, _I, _I]
    library.sl_packed_bytes.restype = _I
    library.sl_pack.argtypes = [_I, _P, _I, _I, _P]
    library.sl_pack.restype = None
    library.sl_unpack.argtypes = [_I, _P, _I, _I, _P]
    library.sl_unpack.restype = None
    library.sl_unpack_rows.argtypes = [_I, _P, _I, _I, _P, _I, _P]
    library.sl_unpack_rows.restype = _I
    library.sl_grouped_linear.argtypes = [_I, _I, _P, _I, _P, _I, _P, _I, _I, _P]
    library.sl_grouped_linear.restype = None
    library.sl_moe_route.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P]
    library.sl_moe_route.restype = None
    library.sl_moe_combine.argtypes = [_P, _P, _P, _I, _I, _I, _P]
    library.sl_moe_combine.restype = None
    library.sl_paged_attention.argtypes = [
        _P,
        _I,
        _I,
        _I,
        _I,
        _P,
        _P,
        _I,
        _P,
        _I,
        _I,
        _P,
        _P,
        _P,
        ctypes.c_float,
        _I,
        ctypes.c_float,
        _P,
        _P,
    ]
    library.sl_paged_attention.restype = None
    library.sl_sample.argtypes = [_P, _I, _I, _I, _P, _P, _P, _P, _P, _P]
    library.sl_sample.restype = None
    library.sl_log_softmax.argtypes = [_P, _I, _I, _I, _P]
    library.sl_log_softmax.restype = None
    library.sl_decoder_layers.argtypes = [_P, _I, _P, _P]
    library.sl_decoder_layers.restype = None
    return library
