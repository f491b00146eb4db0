"""The cluster's application as its configs build it (deploy/ray/serve.yaml, deploy/kuberay.yaml, `sluice cluster`
flags), and the router's home of a prefix: without starting Ray (tests/e2e/test_cluster.py runs a cluster)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve", reason="the cluster needs the `ray` extra")

from pydantic import ValidationError  # noqa: E402
from pydantic_settings import CliApp  # noqa: E402
from ray.serve.config import AutoscalingConfig  # noqa: E402
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from app.cluster.router import block_hashes, engine_stats, home_of, routing_stats  # noqa: E402
from app.cluster.serve import HAPROXY_ENV, INGRESS, REPLICA, ClusterSettings, app_builder, build_app  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def replica_deployment(application):
    """The engine replicas' deployment in `application`: the ingress deployment's second argument."""
    return application._bound_deployment.init_args[1]._bound_deployment


def serve_configs() -> list[ServeDeploySchema]:
    kuberay = yaml.safe_load((DEPLOY / "kuberay.yaml").read_text())
    return [
        ServeDeploySchema(**yaml.safe_load((DEPLOY / "ray" / "serve.yaml").read_text())),
        ServeDeploySchema(**yaml.safe_load(kuberay["spec"]["serveConfigV2"])),
    ]


@pytest.mark.parametrize("config", serve_configs(), ids=["serve.yaml", "kuberay.yaml"])
def test_the_deploy_configs_build_the_application_their_args_describe(config):
    (application,) = config.applications
    assert application.import_path == "app.cluster.serve:app_builder"
    args = application.args
    application = app_builder(args)
    ingress, replica = application._bound_deployment, replica_deployment(application)
    assert (ingress.name, replica.name) == (INGRESS, REPLICA)
    assert ingress.num_replicas == args["ingress_replicas"]
    assert ingress._deployment_config.request_router_config.request_router_class.endswith("IngressRouter")
    scaling = replica._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (
        args["min_replicas"],
        args["replicas"],
        args["max_replicas"],
    )
    assert scaling.target_ongoing_requests == args["target_ongoing_requests"]
    assert replica._deployment_config.graceful_shutdown_timeout_s == args["shutdown_timeout"]
    assert replica.ray_actor_options["num_gpus"] == 1


@pytest.fixture
def environment(monkeypatch) -> pytest.MonkeyPatch:
    """This process's environment, which `sluice cluster`'s main() sets for the Ray it starts, as it was after
    the test: each variable main() sets is set here first, so that the undo restores it."""
    for name in ("RAY_SERVE_USE_GRPC_BY_DEFAULT", *HAPROXY_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def environments_at_ray_init(monkeypatch: pytest.MonkeyPatch, *runs: list[str]) -> list[dict[str, str]]:
    """The cluster's environment as ray.init would see it, for each run of main() with these flags."""
    import app.cluster.serve as cluster_serve

    seen: list[dict[str, str]] = []

    def init(**_) -> None:
        seen.append(dict(os.environ))
        raise RuntimeError("no Ray here")

    monkeypatch.setattr(cluster_serve.ray, "init", init)
    for flags in runs:
        with pytest.raises(RuntimeError, match="no Ray here"):
            cluster_serve.main(flags)
    return seen


def test_the_cluster_s_ray_passes_requests_between_deployments_over_grpc(environment):
    """`sluice cluster` sets Ray Serve's gRPC transport in the environment the Ray it starts inherits, unless
    the operator chose; KubeRay's pods set it for their Ray."""
    for chosen, expected in ((None, "1"), ("0", "0")):
        if chosen is None:
            environment.delenv("RAY_SERVE_USE_GRPC_BY_DEFAULT", raising=False)
        else:
            environment.setenv("RAY_SERVE_USE_GRPC_BY_DEFAULT", chosen)
        (seen_at_init,) = environments_at_ray_init(environment, ["--replicas", "1"])
        assert seen_at_init.get("RAY_SERVE_USE_GRPC_BY_DEFAULT") == expected
    kuberay = yaml.safe_load((DEPLOY / "kuberay.yaml").read_text())["spec"]["rayClusterConfig"]
    pods = [kuberay["headGroupSpec"], *kuberay["workerGroupSpecs"]]
    for pod in pods:
        (container,) = pod["template"]["spec"]["containers"]
        assert {"name": "RAY_SERVE_USE_GRPC_BY_DEFAULT", "value": "1"} in container["env"]


def ingress_has_its_router(settings: ClusterSettings) -> bool:
    router = build_app(settings)._bound_deployment._deployment_config.request_router_config
    return not router.is_default_request_router() and router.request_router_class.endswith(".IngressRouter")


def test_one_ingress_replica_is_fronted_by_haproxy_and_several_by_serve_s_proxy_and_router(environment):
    """With one ingress replica `sluice cluster` asks Ray for HAProxy and runs user code and routers on each
    replica's main loop, unless the operator chose otherwise; with several it leaves Serve's proxy, which
    honours the IngressRouter that forwards ids to their holder, and HAProxy is refused."""
    several, one = environments_at_ray_init(environment, ["--ingress-replicas", "2"], ["--ingress-replicas", "1"])
    assert not set(HAPROXY_ENV) & set(several)
    assert {name: one.get(name) for name in HAPROXY_ENV} == HAPROXY_ENV
    for name in HAPROXY_ENV:
        environment.delenv(name)
    assert ingress_has_its_router(ClusterSettings(ingress_replicas=2))
    assert ingress_has_its_router(ClusterSettings(ingress_replicas=1))

    environment.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    (chosen,) = environments_at_ray_init(environment, ["--ingress-replicas", "1"])
    assert chosen["RAY_SERVE_ENABLE_HA_PROXY"] == "0"

    environment.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    assert not ingress_has_its_router(ClusterSettings(ingress_replicas=1))
    with pytest.raises(ValueError, match="--ingress-replicas 2 needs Ray Serve's own proxy"):
        build_app(ClusterSettings(ingress_replicas=2))


def test_without_an_haproxy_binary_serve_s_proxy_fronts_one_ingress_replica(environment):
    import app.cluster.serve as cluster_serve

    environment.setattr(cluster_serve.importlib.util, "find_spec", lambda name: None)
    environment.setattr(cluster_serve.shutil, "which", lambda name: None)
    (seen,) = environments_at_ray_init(environment, ["--ingress-replicas", "1"])
    assert not set(HAPROXY_ENV) & set(seen)


def test_fixed_replicas_without_autoscaling_and_bounds_checked():
    replica = replica_deployment(build_app(ClusterSettings(replicas=3)))
    assert replica.num_replicas == 3 and replica._deployment_config.autoscaling_config is None
    router = replica._deployment_config.request_router_config
    assert router.request_router_class.endswith(".CacheAwareRouter")
    with pytest.raises(ValidationError, match="between --min-replicas 1 and --max-replicas 2"):
        ClusterSettings(replicas=3, max_replicas=2)
    power_of_two = replica_deployment(build_app(ClusterSettings(request_router="power-of-two")))
    assert power_of_two._deployment_config.request_router_config.request_router_class.endswith(".PowerOfTwoRouter")


def test_the_autoscaling_flags_reach_ray_serve_s_autoscaling_config():
    flags = ["--max-replicas", "3", "--target-ongoing-requests", "2", "--upscale-delay-s", "1"]
    settings = CliApp.run(ClusterSettings, cli_args=[*flags, "--downscale-delay-s", "5"])
    scaling = replica_deployment(build_app(settings))._deployment_config.autoscaling_config
    assert (scaling.max_replicas, scaling.target_ongoing_requests) == (3, 2)
    assert (scaling.upscale_delay_s, scaling.downscale_delay_s) == (1, 5)
    # Unset, they are Ray Serve's own defaults.
    default = AutoscalingConfig()
    scaling = replica_deployment(build_app(ClusterSettings(max_replicas=3)))._deployment_config.autoscaling_config
    assert (scaling.upscale_delay_s, scaling.downscale_delay_s) == (default.upscale_delay_s, default.downscale_delay_s)


def test_a_prefix_home_is_the_same_everywhere_and_only_a_leaving_replica_s_move():
    replicas = ["aaaa1111", "bbbb2222", "cccc3333"]
    firsts = [block_hashes(list(range(n, n + 16)), 16)[0] for n in range(200)]
    homes = {first: home_of(first, replicas) for first in firsts}
    assert homes == {first: home_of(first, list(reversed(replicas))) for first in firsts}
    assert all(list(homes.values()).count(replica) > 40 for replica in replicas)
    remaining = replicas[1:]
    for first, home in homes.items():
        if home != replicas[0]:
            assert home_of(first, remaining) == home


def test_block_hashes_chain_over_whole_blocks_only():
    assert block_hashes(list(range(15)), 16) == []
    two = block_hashes(list(range(40)), 16)
    assert len(two) == 2 and block_hashes(list(range(32)), 16) == two
    assert block_hashes([99, *range(1, 40)], 16)[1] != two[1]  # the second block's hash covers the first


def test_a_replica_s_stats_survive_the_routing_stats_they_travel_as():
    published = engine_stats({})
    assert published.alive and published.num_running == 0  # a replica Ray runs, before it first published
    stats = replace(published, num_running=3, kv_blocks_used=7, vision_seconds=1.5, alive=False)
    assert engine_stats(routing_stats(stats, {"ingress-1": 2})) == stats
