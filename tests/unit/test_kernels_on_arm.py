"""The neon variant of the CPU kernels (AArch64: the linear tiles in NEON, the rest x86's intrinsics through
SIMDe) gives the host's bits: the same calls, on the same inputs, run in the host's build and in an AArch64 build
of the kernels under qemu-aarch64 (tests/unit/kernel_driver.cpp replays them), and every output compared byte for
byte.

Needs a cross compiler and qemu-user (`make test` installs them on Debian as root: crossbuild-essential-arm64,
qemu-user) and SIMDe's headers (simde-py, a dev dependency); skips without them."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine.kernels.cpu import native
from engine.kernels.cpu.invariant import BLOCK_WEIGHTS, CACHE_DTYPES, WeightForm
from engine.kernels.cpu.native import SOURCES, VARIANTS, load_library, variant_flags
from engine.kernels.cpu.sampling import row_settings
from engine.types import SamplingParams
from tests.conftest import CACHE_DIR
from tests.unit.gguf_files import random_weight_source

COMPILER = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")
NEON = next(v for v in VARIANTS if v.name == "neon")
HOST = load_library(CACHE_DIR)

needs_cross = pytest.mark.skipif(
    HOST is None or shutil.which(COMPILER) is None or shutil.which(QEMU) is None or variant_flags(NEON) is None,
    reason=f"needs the host's kernels, {COMPILER} and {QEMU} (Debian: crossbuild-essential-arm64, qemu-user) and "
    "SIMDe's headers (simde-py)",
)


@dataclass(frozen=True)
class Out:
    """A recorded call's output buffer (any other tensor is an input): the host's run writes into it."""

    tensor: torch.Tensor


@dataclass
class Calls:
    """Kernel calls run in the host's library as they are recorded, and written as a manifest for the driver."""

    folder: Path
    lines: list[str] = field(default_factory=list)
    # Each output's file, with the host's bytes and the call that wrote them.
    outputs: dict[Path, tuple[bytes, str]] = field(default_factory=dict)

    def __call__(self, name: str, *args: object) -> None:
        words, host_args = [], []
        for arg in args:
            if isinstance(arg, Out):
                path = self.folder / f"out{len(self.outputs)}"
                words.append(f"out:{arg.tensor.nbytes}:{path}")
                host_args.append(arg.tensor.data_ptr())
            elif isinstance(arg, torch.Tensor):
                path = self.folder / f"in{len(self.lines)}-{len(words)}"
                path.write_bytes(_bytes(arg))
                words.append(f"in:{path}")
                host_args.append(arg.data_ptr())
            elif isinstance(arg, float):
                words.append(f"f:{struct.unpack('<I', struct.pack('<f', arg))[0]:08x}")
                host_args.append(arg)
            elif arg is None:
                words.append("null")
                host_args.append(None)
            else:
                words.append(f"i:{int(arg)}")
                host_args.append(int(arg))
        getattr(HOST, name)(*host_args)
        line = " ".join([name, *words])
        for arg, word in zip(args, words):
            if isinstance(arg, Out):
                self.outputs[Path(word.split(":", 2)[2])] = (_bytes(arg.tensor), line)
        self.lines.append(line)


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    """tests/unit/kernel_driver.cpp and the kernels' sources, built for AArch64 as the neon variant."""
    target = tmp_path_factory.mktemp("arm") / "kernel_driver"
    # The library's flags make an executable here: the driver links the sources in.
    flags = [flag for flag in variant_flags(NEON) if flag not in ("-shared", "-fPIC", "-Wl,-Bsymbolic")]
    sources = [*map(str, SOURCES), str(Path(__file__).with_name("kernel_driver.cpp"))]
    result = subprocess.run([COMPILER, *flags, *sources, "-o", str(target)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return target


def _replay(driver: Path, calls: Calls) -> None:
    manifest = calls.folder / "manifest"
    manifest.write_text("\n".join(calls.lines) + "\n")
    environment = {**os.environ, "OMP_NUM_THREADS": "2"}
    result = subprocess.run(
        [QEMU, "-L", str(SYSROOT), str(driver), str(manifest)], capture_output=True, text=True, env=environment
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for path, (expected, line) in calls.outputs.items():
        assert path.read_bytes() == expected, f"{path.name} of {line}"


@needs_cross
@pytest.mark.parametrize("form", list(WeightForm), ids=lambda form: form.name)
def test_the_neon_build_packs_and_multiplies_every_weight_form_with_the_hosts_bits(driver, tmp_path, form):
    out_features, in_features = (96, 512) if BLOCK_WEIGHTS.get(form) == 256 else (80, 160)
    calls = Calls(tmp_path)
    panels = torch.zeros(HOST.sl_packed_bytes(form, out_features, in_features), dtype=torch.uint8)
    source = random_weight_source(form, out_features, in_features)
    calls("sl_pack", form, source, out_features, in_features, Out(panels))
    x = torch.randn(40, in_features, generator=torch.Generator().manual_seed(out_features))
    blocks = (out_features + 255) // 256
    # Rows across the tile shapes (NEON's differ from x86's: 1 row in 1, 2 or 4 panels by form, 2 rows in 1 or 2):
    # one, two, a short tile, past a tile, and past the strips' 16.
    for rows in (1, 2, 3, 7, 17, 40):
        y = torch.zeros(rows, out_features)
        maxima = torch.zeros(rows, blocks)
        calls("sl_linear", form, 0, x[:rows], rows, in_features, panels, out_features, Out(y), Out(maxima))
    calls("sl_linear", form, 1, x[:3], 3, in_features, panels, out_features, Out(torch.zeros(3, out_features)), None)
    counts = torch.tensor([3, 0, 9], dtype=torch.int64)
    experts = torch.cat([panels, panels.flip(0), panels])
    calls(
        "sl_grouped_linear",
        form,
        0,
        x[:12],
        in_features,
        counts,
        3,
        experts,
        panels.numel(),
        out_features,
        Out(torch.zeros(12, out_features)),
    )
    _replay(driver, calls)


@needs_cross
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_neon_build_attends_with_the_hosts_bits(driver, tmp_path, cache_dtype):
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block_size, slots = 4, 2, 64, 16, 160
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=generator).to(cache_dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=generator).to(cache_dtype)
    block_tables = torch.tensor([[3, 1, 7, 0, 0], [2, 5, 4, 6, 9]], dtype=torch.int64)
    table_rows = torch.tensor([0, 0, 1], dtype=torch.int64)
    context_lens = torch.tensor([33, 41, 70], dtype=torch.int64)
    q = torch.randn(3, heads, head_dim, generator=generator)
    sinks = torch.randn(heads, generator=generator)
    calls = Calls(tmp_path)
    for window, softcap, with_sinks in ((0, 0.0, False), (24, 30.0, False), (0, 0.0, True)):
        calls(
            "sl_paged_attention",
            q,
            3,
            heads,
            head_dim,
            CACHE_DTYPES[cache_dtype],
            k_cache,
            v_cache,
            kv_heads,
            block_tables,
            block_tables.shape[1],
            block_size,
            table_rows,
            context_lens,
            None,
            0.125,
            window,
            softcap,
            sinks if with_sinks else None,
            Out(torch.zeros_like(q)),
        )
    _replay(driver, calls)


@needs_cross
def test_the_neon_build_samples_and_takes_log_softmax_with_the_hosts_bits(driver, tmp_path):
    generator = torch.Generator().manual_seed(11)
    rows, vocab = 4, 1000
    logits = torch.randn(rows, vocab, generator=generator) * 4
    settings = b"".join(
        row_settings(params)
        for params in (
            SamplingParams(max_tokens=16, temperature=0.0),
            SamplingParams(max_tokens=16, temperature=0.8),
            SamplingParams(max_tokens=16, temperature=1.0, top_k=20, top_p=0.9),
            SamplingParams(max_tokens=16, temperature=1.3, min_p=0.05),
        )
    )
    calls = Calls(tmp_path)
    for position in range(3):
        calls(
            "sl_sample",
            logits,
            rows,
            vocab,
            vocab,
            torch.frombuffer(bytearray(settings), dtype=torch.uint8),
            torch.tensor([5, 6, 7, 8], dtype=torch.int64),
            torch.full((rows,), position, dtype=torch.int64),
            None,
            None,
            Out(torch.zeros(rows, dtype=torch.int64)),
        )
    calls("sl_log_softmax", logits, rows, vocab, vocab, Out(torch.zeros(rows, vocab)))
    _replay(driver, calls)


def test_aarch64_linux_runs_the_neon_variant_and_other_systems_none(monkeypatch):
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
    assert native.runnable_variants() == (NEON,)
    assert native.choose_variant() == NEON
    monkeypatch.setattr(native.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(native.platform, "machine", lambda: "arm64")
    assert native.runnable_variants() == ()
