"""Ray Serve's own floor under a cluster's TTFT: one deployment calling another's streaming method through a
DeploymentHandle, as a cluster's ingress calls an engine replica, with nothing of Sluice on either side.

    python bench/ray_handle.py                      # first item at once, and after a 20 ms wait
    python bench/ray_handle.py --delay-ms 0 2 20 --calls 200

The called method waits `--delay-ms` (as an engine replica waits for its step), then yields three small
items; the caller times each call from `.remote()` to its first item, less the wait. Ray runs with the
environment `sluice cluster` gives it (app/cluster/serve.py: gRPC between the deployments, user code and
routers on each replica's main loop). What bench/cluster.py's TTFT through a cluster adds over a plain server,
less this, is what Sluice's ingress, relay and HAProxy add.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.cluster.serve import HAPROXY_ENV  # noqa: E402

# Read by Ray Serve in each process it starts, which inherit this one's environment. HAProxy aside: it fronts
# HTTP, which these calls do not pass through.
for name, value in {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", **HAPROXY_ENV}.items():
    if name != "RAY_SERVE_ENABLE_HA_PROXY":
        os.environ.setdefault(name, value)

import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.handle import DeploymentHandle  # noqa: E402


@serve.deployment
class Callee:
    async def generate(self, prompt_token_ids: list[int], delay_s: float):
        await asyncio.sleep(delay_s)
        for index in range(3):
            yield index


@serve.deployment
class Caller:
    def __init__(self, callee: DeploymentHandle) -> None:
        self.callee = callee.options(stream=True)

    async def __call__(self, calls: int, delay_s: float) -> list[float]:
        """Seconds from each call to its first item, less the callee's wait."""
        firsts = []
        for _ in range(calls):
            start = time.perf_counter()
            items = self.callee.generate.remote(list(range(64)), delay_s)
            async for _ in items:
                firsts.append(time.perf_counter() - start - delay_s)
                break
            async for _ in items:
                pass
        return firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, nargs="+", default=[0.0, 20.0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--warm-up", type=int, default=10, help="calls first, not counted")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        caller = serve.run(Caller.bind(Callee.bind()), name="ray-handle", route_prefix=None)
        print(f"`python bench/ray_handle.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
        print("\n| callee's wait | first item p50 ms | p95 ms | min ms |\n|---|---|---|---|")
        for delay_ms in args.delay_ms:
            caller.remote(args.warm_up, delay_ms / 1000).result()
            firsts = sorted(caller.remote(args.calls, delay_ms / 1000).result())
            p95 = firsts[int(0.95 * (len(firsts) - 1))]
            print(
                f"| {delay_ms:g} ms | {statistics.median(firsts) * 1000:.2f} | {p95 * 1000:.2f} "
                f"| {firsts[0] * 1000:.2f} |"
            )
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
