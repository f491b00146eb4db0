"""Prometheus metrics for GET /metrics, named as vLLM names them under a `sluice:` prefix.

A vLLM dashboard ports by renaming `vllm:` to `sluice:`. Engine gauges and counters
are read from the stats the engine thread publishes, at scrape time only: nothing
is added to an engine step. Per-request histograms and counters are observed on
the event loop from each choice's terminal timings; inter-token latency once per
streamed chunk, into a histogram of plain counts that only the loop touches.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.config import EngineStats
from engine.engine_client import ReplicaSet
from engine.types import Timings

# vLLM's buckets, so the same dashboard panels and alerts apply.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineCollector(Collector):
    """Engine state at scrape time, from its last published stats; in a cluster's ingress, each replica's,
    labelled with its replica id, and the router's decisions."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats], replicas: ReplicaSet | None) -> None:
        self._model_name = model_name
        self._stats = stats
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        if self._replicas is None:
            yield from self._engine_metrics(["model_name"], [([self._model_name], self._stats())])
            return
        replicas = self._replicas.replica_stats()
        yield from self._engine_metrics(
            ["model_name", "replica"], [([self._model_name, replica], stats) for replica, stats in replicas.items()]
        )
        decisions = CounterMetricFamily(
            "sluice:routing_decisions",
            "Generation requests this ingress routed, by decision: to the replica it sent the prompt's prefix "
            "(affinity), to the replica an unseen prefix hashes to (home), to a stored response's pinned KV "
            "(pinned), to the least-loaded because the one of affinity or home was too busy (fallback), or "
            "because the prompt is shorter than a block (least_loaded).",
            labels=["model_name", "decision"],
        )
        for decision, count in self._replicas.routing_decisions().items():
            decisions.add_metric([self._model_name, decision], count)
        yield decisions

    @staticmethod
    def _engine_metrics(labels: list[str], engines: list[tuple[list[str], EngineStats]]) -> Iterator[Metric]:
        for family, name, doc, value in _ENGINE_METRICS:
            metric = family(f"sluice:{name}", doc, labels=labels)
            for label, stats in engines:
                metric.add_metric(label, value(stats))
            yield metric


# An engine's gauges and counters: its stats at scrape time.
_ENGINE_METRICS: tuple[tuple[type[Metric], str, str, Callable[[EngineStats], float]], ...] = (
    (GaugeMetricFamily, "num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    (GaugeMetricFamily, "num_requests_paused", "Running requests paused for a slow reader.", lambda s: s.num_paused),
    (
        GaugeMetricFamily,
        "kv_cache_usage_perc",
        "Fraction of KV-cache blocks in use.",
        lambda s: s.kv_blocks_used / max(1, s.kv_blocks_total),
    ),
    (
        GaugeMetricFamily,
        "kv_cache_pinned_perc",
        "Fraction of KV-cache blocks pinned for stored responses (Sluice's own; in kv_cache_usage_perc too).",
        lambda s: s.kv_blocks_pinned / max(1, s.kv_blocks_total),
    ),
    (
        CounterMetricFamily,
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        lambda s: s.num_prefix_query_tokens,
    ),
    (
        CounterMetricFamily,
        "prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
        lambda s: s.num_prefix_hit_tokens,
    ),
    (
        CounterMetricFamily,
        "mm_cache_queries",
        "Images looked up in the encoder cache (a vision-language model's).",
        lambda s: s.num_image_queries,
    ),
    (CounterMetricFamily, "mm_cache_hits", "Images found in the encoder cache.", lambda s: s.num_image_hits),
    (
        CounterMetricFamily,
        "vision_tower_seconds",
        "Seconds the vision tower ran on the engine thread (Sluice's own).",
        lambda s: s.vision_seconds,
    ),
    (CounterMetricFamily, "num_preemptions", "Requests preempted to free KV blocks.", lambda s: s.num_preemptions),
    (
        CounterMetricFamily,
        "spec_decode_num_draft_tokens",
        "Speculative tokens proposed.",
        lambda s: s.num_draft_tokens,
    ),
    (
        CounterMetricFamily,
        "spec_decode_num_accepted_tokens",
        "Speculative tokens accepted.",
        lambda s: s.num_accepted_tokens,
    ),
)


class LoopHistogram(Collector):
    """A histogram observed once per streamed chunk, on the event loop only, so it needs no lock:
    prometheus-client's takes one per observation, which is most of a chunk's metrics cost."""

    def __init__(self, name: str, doc: str, model_name: str, buckets: tuple[float, ...]) -> None:
        self._name, self._doc, self._model_name = name, doc, model_name
        self._bounds = buckets
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def collect(self) -> Iterator[Metric]:
        counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip((*self._bounds, float("inf")), counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        family = HistogramMetricFamily(self._name, self._doc, labels=["model_name"])
        family.add_metric([self._model_name], buckets, total)
        yield family


class Metrics:
    """Every collector of one server, in a registry of its own (several servers can share a process in tests)."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats], replicas: ReplicaSet | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"sluice:{name}", doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"sluice:{name}", doc, labels, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished choices.").labels(
            model_name
        )
        self._request_success = counter("request_success", "Finished choices by finish reason.", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS).labels(model_name)
        self.itl = LoopHistogram(
            "sluice:inter_token_latency_seconds", "Time between streamed chunks.", model_name, _ITL_BUCKETS
        )
        self.registry.register(self.itl)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS).labels(
            model_name
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time waiting to be scheduled.", _REQUEST_BUCKETS
        ).labels(model_name)
        self._http = Counter(
            "sluice:http_requests",
            "HTTP responses by method, route and status.",
            ["method", "handler", "status"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(model_name, stats, replicas))

    def request_started(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def choice_finished(self, finish_reason: str, timings: Timings | None) -> None:
        """One choice's terminal chunk: its reason, its tokens and where its time went."""
        self._request_success.labels(self.model_name, finish_reason).inc()
        if timings is None:
            return
        self.generation_tokens.inc(timings.completion_tokens)
        self.queue_time.observe(timings.queue_ms / 1000)
        if timings.completion_tokens:
            self.ttft.observe(timings.ttft_ms / 1000)
            self.e2e.observe((timings.ttft_ms + timings.decode_ms) / 1000)

    def http_response(self, method: str, handler: str, status: int) -> None:
        self._http.labels(method, handler, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
