"""The AArch64 (neon) build's linear kernel, per weight form and row count: AArch64 instructions a call, counted
under qemu-aarch64 with no ARM machine at hand. Instructions are not time (an ARM core runs several a cycle,
some slower than others), but where one build runs far fewer for the same work it is the faster one.

    python bench/arm_instructions.py                                  # this checkout, 1 and 6 rows, 128x1024
    python bench/arm_instructions.py --tree before=/tmp/before --rows 1 --forms Q4_1 Q8_0

Each tree's engine/kernels/cpu/*.cpp are built as the neon variant with tests/unit/kernel_driver.cpp (a cross
compiler and qemu-user, as tests/unit/test_kernels_on_arm.py needs), the weights packed by this machine's build
(the panels' layout is the same on every variant). qemu runs the driver one instruction a block, logging each
(`-singlestep -d nochain,exec`), over a manifest of one call and of three: half the difference is one call's
count, without start-up (with the driver's reading of the call's line and files: about 30,000 in every build).
One thread (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_builds import random_packed  # noqa: E402
from engine.kernels.cpu.invariant import WeightForm  # noqa: E402
from engine.kernels.cpu.native import VARIANTS, load_library, runnable_variants, variant_flags  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMPILER = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"


def build(tree: Path, target: Path) -> None:
    """The tree's kernels and this checkout's driver, as the neon variant, into the executable `target`."""
    neon = next(v for v in VARIANTS if v.name == "neon")
    flags = variant_flags(neon)
    if flags is None:
        sys.exit("SIMDe's headers are missing: pip install simde-py")
    # The library's flags make an executable here: the driver links the sources in.
    flags = [flag for flag in flags if flag not in ("-shared", "-fPIC", "-Wl,-Bsymbolic")]
    sources = sorted((tree / "engine/kernels/cpu").glob("*.cpp")) + [ROOT / "tests/unit/kernel_driver.cpp"]
    subprocess.run([COMPILER, *flags, *map(str, sources), "-o", str(target)], check=True)


@functools.cache
def one_instruction_a_block() -> str:
    """qemu's flag for one instruction a translated block: qemu 8.1 renamed -singlestep (removed in 9.0)."""
    help_text = subprocess.run([QEMU, "--help"], capture_output=True, text=True).stdout
    return "-one-insn-per-tb" if "one-insn-per-tb" in help_text else "-singlestep"


def instructions(driver: Path, manifest: Path) -> int:
    """AArch64 instructions the driver runs over `manifest`, start-up and exit included."""
    qemu = f"{QEMU} -L {SYSROOT} {one_instruction_a_block()} -d nochain,exec -D /dev/stdout"
    command = f"{qemu} {driver} {manifest} | grep -c '^Trace'"
    # pipefail: a driver that fails (or a qemu that logs nothing, which grep -c answers with 1) stops the bench.
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if result.returncode != 0:
        sys.exit(f"{command} failed ({result.returncode}): {result.stderr[-2000:]}")
    return int(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", nargs="*", default=[], help="NAME=PATH: another checkout's kernels")
    parser.add_argument(
        "--forms",
        nargs="*",
        default=[form.name for form in WeightForm],
        help="weight forms to count (every one by default; a --tree older than a form aborts on it: name the rest)",
    )
    parser.add_argument("--rows", nargs="*", type=int, default=[1, 6])
    parser.add_argument("--shape", default="128x1024", help="N x K of the weight")
    args = parser.parse_args()
    out_features, in_features = map(int, args.shape.split("x"))
    trees = {"this": ROOT, **{name: Path(path) for name, path in (spec.split("=", 1) for spec in args.tree)}}
    variants = runnable_variants()
    host = load_library(Path.home() / ".cache" / "sluice", variants[0]) if variants else None
    if host is None:
        sys.exit("this machine's own build of the kernels is needed to pack the weights")
    with tempfile.TemporaryDirectory(prefix="arm-instructions-") as scratch:
        folder = Path(scratch)
        drivers = {}
        for name, tree in trees.items():
            drivers[name] = folder / f"driver-{name}"
            build(tree, drivers[name])

        print(f"\n`python {' '.join(sys.argv)}`: AArch64 instructions a call, {out_features}x{in_features} weight\n")
        print(f"| form | rows | {' | '.join(trees)} |")
        print("|" + "---|" * (2 + len(trees)))
        for form_name in args.forms:
            packed = random_packed(host, WeightForm[form_name], out_features, in_features)
            (folder / "panels").write_bytes(packed.panels.numpy().tobytes())
            for rows in args.rows:
                x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
                (folder / "x").write_bytes(x.numpy().tobytes())
                call = (
                    f"sl_linear i:{int(packed.form)} i:0 in:{folder / 'x'} i:{rows} i:{in_features} "
                    f"in:{folder / 'panels'} i:{out_features} out:{rows * out_features * 4}:{folder / 'y'} null"
                )
                counts = []
                for name, driver in drivers.items():
                    once, thrice = folder / "once", folder / "thrice"
                    once.write_text(call + "\n")
                    thrice.write_text((call + "\n") * 3)
                    counts.append((instructions(driver, thrice) - instructions(driver, once)) // 2)
                print(f"| {form_name} | {rows} | {' | '.join(f'{count:,}' for count in counts)} |", flush=True)


if __name__ == "__main__":
    main()
