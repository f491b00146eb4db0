"""The CPU's batch-invariant linear kernel alone (sl_linear), per weight form and shape, on each variant of the
kernels this CPU runs, and on other builds given as library files (another checkout's, say): GFMA/s.

    python bench/cpu_linear.py                                     # the default model's shapes, 1 row
    python bench/cpu_linear.py --rows 1 4 16 --library main=/path/to/invariant-....so
    OMP_NUM_THREADS=1 python bench/cpu_linear.py                   # one core

Weights are random in each form (GGUF blocks with random scales); 576x576, 1536x576 and 576x1536 fit in a
core's L2 cache on most CPUs, the 49152x576 output head does not. The builds take turns, each timed `--trials`
times for about 10 million multiply-adds; the best trial counts, so a busy machine's slow moments drop out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_builds import add_build_arguments, kernel_builds, print_table_head, random_packed  # noqa: E402
from engine.kernels.cpu.invariant import WeightForm  # noqa: E402

SHAPES = ("576x576:Q4_1", "1536x576:Q4_1", "576x1536:Q4_1", "49152x576:Q8_0", "1536x576:BF16", "1536x576:F32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="OUTxIN:FORM")
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--trials", type=int, default=20)
    add_build_arguments(parser)
    args = parser.parse_args()
    builds = kernel_builds(args)
    print_table_head(["shape", "form", "rows"], builds, "GFMA/s")
    for spec in args.shapes:
        shape, form_name = spec.split(":")
        out_features, in_features = map(int, shape.split("x"))
        form = WeightForm[form_name]
        layers = {name: random_packed(library, form, out_features, in_features) for name, library in builds.items()}
        for rows in args.rows:
            x = torch.randn(rows, in_features)
            calls = max(2, int(1e7 // (out_features * in_features * rows)))
            best = dict.fromkeys(layers, float("inf"))
            for _ in range(args.trials):
                for name, layer in layers.items():
                    started = time.perf_counter()
                    for _ in range(calls):
                        layer(x)
                    best[name] = min(best[name], (time.perf_counter() - started) / calls)
            rates = [f"{out_features * in_features * rows / best[name] / 1e9:.1f}" for name in layers]
            print(f"| {shape} | {form_name} | {rows} | {' | '.join(rates)} |", flush=True)


if __name__ == "__main__":
    main()
