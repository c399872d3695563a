"""`/metrics` in Prometheus text format (the `prometheus-client` package), one registry per app.

Engine state (KV cache, running / waiting / preempted requests, prefix-cache hits, steps) is
read from the engine's snapshot at each scrape; per-request latencies (time to first token,
between tokens, end to end, as the server sees them) and token counts are recorded by
`ServerMetrics` as requests stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from localllm.engine.metrics import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_ITL = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        gauges = (
            ("localllm_kv_cache_utilization", "Fraction of KV blocks held by live requests",
             s.kv_utilization),
            ("localllm_kv_cache_blocks_used", "KV blocks held by live requests", s.used_blocks),
            ("localllm_kv_cache_blocks", "KV blocks in the pool", s.num_blocks),
            ("localllm_requests_running", "Requests being computed", s.num_running),
            ("localllm_requests_waiting", "Requests queued, preempted ones included",
             s.num_waiting),
            ("localllm_requests_preempted", "Waiting requests that were preempted",
             s.num_preempted),
            ("localllm_prefix_cache_hit_rate", "Prompt tokens reused / looked up",
             s.prefix_hit_rate),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = (
            ("localllm_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache",
             s.prefix_queries),
            ("localllm_prefix_cache_hits_tokens", "Prompt tokens whose K/V were reused",
             s.prefix_hits),
            ("localllm_preemptions", "Requests preempted", s.preemptions),
            ("localllm_engine_steps", "Engine steps", s.steps),
            ("localllm_engine_tokens", "Tokens computed (prompt and generated)", s.tokens),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot))
        r = self.registry
        self.ttft = Histogram("localllm_time_to_first_token_seconds",
                              "From a request's arrival to its first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("localllm_inter_token_latency_seconds",
                             "Between consecutive tokens of a request", buckets=_ITL, registry=r)
        self.e2e = Histogram("localllm_e2e_request_latency_seconds",
                             "From a request's arrival to its last token", buckets=_LATENCY,
                             registry=r)
        self.prompt_tokens = Counter("localllm_prompt_tokens", "Prompt tokens of requests",
                                     registry=r)
        self.generation_tokens = Counter("localllm_generation_tokens", "Tokens generated",
                                         registry=r)
        self.finished = Counter("localllm_requests_finished", "Generations ended, by reason",
                                ["reason"], registry=r)
        self.http = Counter("localllm_http_requests", "HTTP requests answered, by route and status",
                            ["route", "status"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
