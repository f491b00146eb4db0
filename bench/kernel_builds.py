"""The builds of the CPU kernels a kernel benchmark compares: each variant this CPU runs, and other builds given
as library files (`--library NAME=PATH`: another checkout's, say)."""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np
import torch

from engine.kernels.cpu.invariant import BLOCK_BYTES, BLOCK_WEIGHTS, FLOAT_DTYPES, SCALE_BYTES, PackedLinear, WeightForm
from engine.kernels.cpu.native import bind, load_library, runnable_variants


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--library", nargs="*", default=[], help="NAME=PATH: another build of the kernels")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "sluice"))


def kernel_builds(args: argparse.Namespace) -> dict[str, ctypes.CDLL]:
    """Name → library: this CPU's variants (built into --cache-dir where missing), then each --library."""
    builds = {v.name: load_library(Path(args.cache_dir), v) for v in runnable_variants()}
    for spec in args.library:
        name, path = spec.split("=", 1)
        builds[name] = bind(ctypes.CDLL(path))
    return builds


def random_source(form: WeightForm, out_features: int, in_features: int) -> torch.Tensor:
    """What sl_pack packs into `form`: a random float32, bfloat16 or float16 weight [N, K], or rows of GGUF blocks
    (random fp16 scales and offsets over random quantized bytes) as uint8."""
    if form in FLOAT_DTYPES:
        weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
        return weight.to(FLOAT_DTYPES[form])
    generator = np.random.default_rng(0)
    count = in_features // BLOCK_WEIGHTS[form]
    blocks = generator.integers(0, 256, (out_features, count, BLOCK_BYTES[form]), dtype=np.uint8)
    if form in (WeightForm.Q8_F32, WeightForm.Q8_F32_16):
        scales = (generator.standard_normal((out_features, count, 1)) * 0.05).astype(np.float32)
        blocks[..., :4] = scales.view(np.uint8)
    else:
        where = SCALE_BYTES[form]
        halves = (where.stop - where.start) // 2
        scales = (generator.standard_normal((out_features, count, halves)) * 0.05).astype(np.float16)
        blocks[..., where] = scales.view(np.uint8)
    return torch.from_numpy(blocks.reshape(out_features, -1))


def random_packed(library: ctypes.CDLL, form: WeightForm, out_features: int, in_features: int) -> PackedLinear:
    """random_source's weight packed by `library`."""
    source = random_source(form, out_features, in_features)
    if form in FLOAT_DTYPES:
        return PackedLinear.pack(library, source)
    return PackedLinear.pack_blocks(library, form, source, out_features, in_features)


def print_table_head(columns: list[str], builds: dict[str, ctypes.CDLL], unit: str) -> None:
    """The command line and threads, then a markdown table's head: `columns`, then each build's `unit`."""
    print(f"\n`python {' '.join(sys.argv)}`, {torch.get_num_threads()} threads\n")
    print(f"| {' | '.join(columns)} | {' | '.join(f'{name} {unit}' for name in builds)} |")
    print("|" + "---|" * (len(columns) + len(builds)))
