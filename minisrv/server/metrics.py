"""``GET /metrics``: the server's state and latencies in Prometheus' text format.

Names follow SGLang's (``sglang:num_running_reqs`` ...) with the ``minisrv:`` prefix, so a
dashboard built for one reads the other. Gauges are read from the latest engine snapshot
when Prometheus scrapes; counters and latency histograms are updated by the front end as
tokens reach it, so they measure what a client sees (queueing and HTTP included).
Every server owns its registry, so several servers (or tests) in one process never share
counts.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)


class ServerMetrics:
    """The collectors of one server; ``snapshot()`` returns the engine gauges' values."""

    def __init__(self, snapshot: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        gauges = {
            "num_running_reqs": ("requests running (holding KV memory)", "running"),
            "num_queue_reqs": ("requests waiting to be admitted", "queued"),
            "token_usage": ("share of KV slots held by requests", "token_usage"),
            "cache_hit_rate": ("prompt tokens found in the prefix cache / prompt tokens",
                               "hit_rate"),
            "num_workers_up": ("engine workers serving now", "workers_up"),
            "host_cache_tokens": ("token slots of the KV host tier (all workers)",
                                  "host_tokens"),
            "host_cache_used_tokens": ("host-tier slots holding a prefix's copy",
                                       "host_used"),
            "host_cache_hit_tokens": ("prompt tokens matched in the host tier so far",
                                      "host_hit_tokens"),
        }
        for name, (doc, key) in gauges.items():
            gauge = Gauge(f"minisrv:{name}", doc, registry=reg)
            gauge.set_function(lambda key=key: snapshot().get(key, 0.0))
        self.prompt_tokens = Counter("minisrv:prompt_tokens", "prompt tokens received",
                                     registry=reg)
        self.generation_tokens = Counter("minisrv:generation_tokens", "tokens generated",
                                         registry=reg)
        self.requests = Counter("minisrv:num_requests", "requests submitted to the engine",
                                registry=reg)
        self.aborted = Counter("minisrv:num_aborted_reqs",
                               "requests aborted because their client went away", registry=reg)
        self.failed = Counter("minisrv:num_failed_reqs",
                              "requests ended by an error (a step that raised, a worker that "
                              "died, a shutdown)", registry=reg)
        self.ttft = Histogram("minisrv:time_to_first_token_seconds",
                              "time from receiving a request to its first token",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("minisrv:inter_token_latency_seconds",
                             "time between consecutive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("minisrv:e2e_request_latency_seconds",
                             "time from receiving a request to its last token",
                             buckets=_LATENCY_BUCKETS, registry=reg)

    def render(self) -> bytes:
        """The text exposition format, version 0.0.4."""
        return generate_latest(self.registry)
