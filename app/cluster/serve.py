"""`sluice cluster`: Sluice on Ray Serve, an ingress serving the same app over N engine replicas.

    client ─HTTP─► Serve proxy ─► SluiceIngress (create_app: routes, tokenizer, renderer, stream registry)
                                     │ ReplicaPool.submit ─ DeploymentHandle(stream=True), CacheAwareRouter
                                     ▼
                            EngineReplica × N (one Engine each) ─► chunks back, one per engine step

`build_app(settings)` is the Serve application, for `serve.run` or a Serve config's `import_path`
(deploy/ray/serve.yaml); `main()` starts a local Ray cluster with it on this machine.
"""

from __future__ import annotations

import logging
import signal
import threading

import ray
from pydantic import Field
from pydantic_settings import CliApp, SettingsConfigDict
from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from app.cluster.pool import ReplicaPool
from app.cluster.replica import EngineReplica
from app.cluster.router import CacheAwareRouter
from app.server import create_app
from app.settings import Settings
from app.state import ServerState, serve_state
from engine.model.loader import load_model

logger = logging.getLogger(__name__)

INGRESS, REPLICA = "SluiceIngress", "EngineReplica"


class ClusterSettings(Settings):
    """Settings plus the cluster's shape; the engine flags apply to every replica."""

    model_config = SettingsConfigDict(**{**Settings.model_config, "cli_prog_name": "sluice cluster"})

    replicas: int = Field(2, ge=1)
    """Engine replicas, each one Sluice engine (on one GPU each with --device cuda)."""
    replica_cpus: float = Field(1.0, gt=0)
    """CPUs Ray reserves for each replica."""
    route_imbalance: int = Field(4, ge=0)
    """A prompt goes to the replica holding its prefix unless that one holds this many more requests than
    the least-loaded replica."""


class SluiceIngress:
    """The ingress: Sluice's FastAPI app, its engine the replicas behind `replicas`."""

    def __init__(self, settings: ClusterSettings, replicas: DeploymentHandle) -> None:
        self.settings = settings
        self.replicas = replicas

    def __serve_build_asgi_app__(self):
        return create_app(self.settings, start=self._start)

    async def _start(self, settings: Settings) -> ServerState:
        # The tokenizer, chat template and grammar compiler run here; the model's weights come along
        # with load_model (see docs/scaling.md).
        loaded = load_model(
            settings.model, settings.cache_dir, "cpu", "float32", batch_invariant=settings.batch_invariant
        )
        config = await self.replicas.config.remote()
        pool = ReplicaPool(self.replicas, config, loaded)
        return serve_state(settings, loaded, pool, num_replicas=self.settings.replicas)


def build_app(settings: ClusterSettings) -> Application:
    """The Serve application: one ingress over `settings.replicas` engine replicas."""
    max_ongoing = 4 * (settings.max_num_seqs or 256)
    replica = serve.deployment(EngineReplica, name=REPLICA).options(
        num_replicas=settings.replicas,
        ray_actor_options={"num_cpus": settings.replica_cpus, "num_gpus": 1 if settings.device == "cuda" else 0},
        max_ongoing_requests=max_ongoing,
        request_router_config=RequestRouterConfig(
            request_router_class=CacheAwareRouter,
            request_router_kwargs={"block_size": settings.block_size, "imbalance": settings.route_imbalance},
            request_routing_stats_period_s=1,
            request_routing_stats_timeout_s=1,
        ),
    )
    ingress = serve.deployment(serve.ingress()(SluiceIngress), name=INGRESS).options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=max_ongoing
    )
    return ingress.bind(settings, replica.bind(settings))


def main(args: list[str]) -> None:
    settings = CliApp.run(ClusterSettings, cli_args=args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ray.init(
        num_cpus=settings.replicas * settings.replica_cpus,
        include_dashboard=False,
        logging_level=settings.log_level.upper(),
        log_to_driver=settings.log_level == "debug",
    )
    # After ray.init, which installs handlers of its own that end the process at once.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options=HTTPOptions(host=settings.host, port=settings.port))
        serve.run(build_app(settings), name="sluice", route_prefix="/")
        logger.info("serving on http://%s:%d with %d replicas", settings.host, settings.port, settings.replicas)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
