"""The builds of the CPU kernels a kernel benchmark compares: each variant this CPU runs, and other builds given
as library files (`--library NAME=PATH`: another checkout's, say)."""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

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


def print_table_head(columns: list[str], builds: dict[str, ctypes.CDLL], unit: str) -> None:
    """The command line and threads, then a markdown table's head: `columns`, then each build's `unit`."""
    print(f"\n`python {' '.join(sys.argv)}`, {torch.get_num_threads()} threads\n")
    print(f"| {' | '.join(columns)} | {' | '.join(f'{name} {unit}' for name in builds)} |")
    print("|" + "---|" * (len(columns) + len(builds)))
