"""Prometheus metrics of the service (``GET /metrics``, prometheus-client's text format).

One registry per application, so two apps in one process (tests) never share counts:

- ``numaov_requests_total{endpoint, status}`` and ``numaov_request_seconds{endpoint}``
  (a histogram): every HTTP request, by route (unknown paths count as "other");
- ``numaov_time_to_first_token_seconds{endpoint}``: from the request's arrival to its first
  generated token;
- ``numaov_generated_tokens_total``; ``numaov_tokens_per_second{rank}`` (over the engine's
  recent steps); ``numaov_queue_depth``; ``numaov_running_sequences{rank}``;
  ``numaov_cache_used_tokens{rank}`` / ``numaov_cache_capacity_tokens{rank}``;
  ``numaov_prompt_tokens_total{rank}`` / ``numaov_cached_prompt_tokens_total{rank}`` (prompt
  tokens admitted, and of them the ones read from the prefix cache: their ratio is the hit
  rate), ``numaov_prefix_cache_hit_rate{rank}`` (that ratio since the start, 0 before any
  prompt) and ``numaov_prefix_cache_tokens{rank}`` (tokens the prefix cache holds);
  ``numaov_worker_busy_seconds_total{rank}``; ``numaov_worker_restarts_total``;
  ``numaov_worker_up{rank}``; read from the engine when scraped;
- ``numaov_video_jobs_total{endpoint, status}`` and ``numaov_video_queue_depth`` when a Wan
  pipeline is served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

# Latency buckets from a few ms (a health check) to minutes (a video).
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class ServiceMetrics:
    """The service's metrics; ``engine`` (an LMEngine or None) and ``video`` (a callable
    giving the video queue's depth, or None) are read at every scrape."""

    def __init__(self, engine: Any = None, video_depth: Callable[[], int] | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("numaov_requests", "HTTP requests by route and status",
                                ("endpoint", "status"), registry=self.registry)
        self.latency = Histogram("numaov_request_seconds", "HTTP request latency (to the "
                                 "last byte of the answer)", ("endpoint",), buckets=_SECONDS,
                                 registry=self.registry)
        self.first_token = Histogram("numaov_time_to_first_token_seconds", "from the "
                                     "request's arrival to its first generated token",
                                     ("endpoint",), buckets=_SECONDS, registry=self.registry)
        self.video_jobs = Counter("numaov_video_jobs", "image and video generations by "
                                  "outcome", ("endpoint", "status"), registry=self.registry)
        self._engine = engine
        self._video_depth = video_depth
        self.registry.register(_EngineCollector(self))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """Engine and worker gauges, read when scraped (never stale, nothing to update)."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Any]:
        return []  # collected on demand; auto_describe must not call collect() at register

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        video = self._metrics._video_depth
        if video is not None:
            yield GaugeMetricFamily("numaov_video_queue_depth", "image and video requests "
                                    "waiting or running", value=video())
        engine = self._metrics._engine
        if engine is None:
            return
        stats = engine.stats()
        health = engine.health()
        yield GaugeMetricFamily("numaov_queue_depth", "requests waiting for a place in the "
                                "batch", value=stats.queue_depth)
        yield CounterMetricFamily("numaov_generated_tokens", "tokens generated",
                                  value=stats.generated_tokens)
        yield CounterMetricFamily("numaov_worker_restarts", "rank worker group restarts",
                                  value=stats.restarts)
        per_rank = [
            ("numaov_running_sequences", "sequences in the batch", stats.running, GaugeMetricFamily),
            ("numaov_cache_used_tokens", "KV cache slots in use", stats.cache_used_tokens,
             GaugeMetricFamily),
            ("numaov_cache_capacity_tokens", "KV cache slots", stats.cache_capacity_tokens,
             GaugeMetricFamily),
            ("numaov_tokens_per_second", "tokens generated per second over the recent steps",
             stats.tokens_per_second, GaugeMetricFamily),
            ("numaov_worker_busy_seconds", "seconds the rank's worker spent running steps",
             stats.busy_seconds, CounterMetricFamily),
            ("numaov_prompt_tokens", "prompt tokens admitted", stats.prompt_tokens,
             CounterMetricFamily),
            ("numaov_cached_prompt_tokens", "prompt tokens read from the prefix cache",
             stats.cached_prompt_tokens, CounterMetricFamily),
            ("numaov_prefix_cache_hit_rate", "share of admitted prompt tokens read from the "
             "prefix cache", [c / p if p else 0.0 for c, p in zip(
                 stats.cached_prompt_tokens, stats.prompt_tokens, strict=True)],
             GaugeMetricFamily),
            ("numaov_prefix_cache_tokens", "tokens the prefix cache holds",
             stats.prefix_cache_tokens, GaugeMetricFamily),
            ("numaov_worker_up", "1 while the rank's worker process runs",
             [1 if w["alive"] else 0 for w in health.workers], GaugeMetricFamily),
        ]
        for name, doc, values, family in per_rank:
            metric = family(name, doc, labels=("rank",))
            for rank, value in enumerate(values):
                metric.add_metric((str(rank),), value)
            yield metric

